"""Text for language modelling: documents from local files, a locally cached HuggingFace dataset or
the embedded corpus, packed the authors' "cram" way (docs/kvm-spec.md §8).

* **Embedded corpus**: the English reference text that ships with every CPython
  (``pydoc_data.topics``), so the default job needs no download.
* **Cram packing**: documents are tokenized, truncated to ``seq_len + 1`` tokens, concatenated into
  a buffer and cut into ``seq_len + 1`` windows; inputs = window[:-1], labels = window[1:], label
  -100 where the *input* token is EOS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import grain
import numpy as np

from kvm_jax.tasks.labels import IGNORE


def embedded_corpus() -> list[str]:
  """English documentation text shipped with CPython (no download): one document per topic."""
  from pydoc_data import topics
  return [topics.topics[name] for name in sorted(topics.topics)]


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
  """Documents from local ``.txt`` (one document per file) or ``.jsonl`` (one per line) files."""
  docs = []
  for p in paths:
    path = Path(p)
    if not path.exists():
      raise ValueError(f"data file {p!r} does not exist.")
    if path.suffix == ".jsonl":
      for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
          record = json.loads(line)
          if text_field not in record:
            raise ValueError(f"{p}:{line_no}: no field {text_field!r} in the JSON record.")
          docs.append(record[text_field])
    else:
      docs.append(path.read_text(encoding="utf-8"))
  return docs


def read_hf_documents(name: str, split: str = "train", field: str = "text") -> list[str]:
  """Documents of a HuggingFace dataset that is already on local disk (offline mode forced)."""
  import os
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  try:
    import datasets  # optional dependency
  except ImportError as e:
    raise ValueError("hf_dataset needs the `datasets` package: pip install datasets") from e
  ds = datasets.load_dataset(name, split=split)
  if field not in ds.column_names:
    raise ValueError(f"dataset {name!r} has no column {field!r}; columns: {ds.column_names}.")
  return list(ds[field])


def cram_pack(docs: Iterable[str], tokenizer, seq_len: int, append_eos: bool = True) -> np.ndarray:
  """The authors' "cram" packing into windows of ``seq_len + 1`` tokens ``[n, seq_len + 1]``.

  Each document is truncated to seq_len + 1 tokens; a document of exactly that length is a window
  on its own; shorter ones fill a buffer that is emitted once it reaches seq_len + 1 tokens (the
  remainder of the buffer is discarded, as theirs is).
  """
  width = seq_len + 1
  windows, buffer = [], []
  for doc in docs:
    ids = tokenizer.encode(doc)
    if append_eos:
      ids = ids + [tokenizer.eos_id]
    ids = ids[:width]
    if len(ids) == width:
      windows.append(ids)
      continue
    buffer.extend(ids)
    if len(buffer) >= width:
      windows.append(buffer[:width])
      buffer = []
  if not windows:
    raise ValueError(f"the corpus is too small for even one window of {width} tokens.")
  return np.asarray(windows, np.int32)


def lm_example(window: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
  """One packed window as ``inputs``/``labels``; no loss where the input token is EOS (no
  prediction across a document boundary)."""
  inputs, labels = window[:-1], window[1:].copy()
  labels[inputs == eos_id] = IGNORE
  return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


def text_dataset(windows: np.ndarray, eos_id: int, seed: int) -> grain.MapDataset:
  """Packed windows, shuffled per epoch by ``seed``, repeated forever."""
  return (grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
          .map(lambda w: lm_example(np.asarray(w), eos_id)))
