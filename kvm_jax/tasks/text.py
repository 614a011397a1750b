"""Text for language modelling: documents from local files, a locally cached HuggingFace dataset or
the embedded corpus, packed the authors' "cram" way (docs/kvm-spec.md §8). Files and datasets are
read as streams (:func:`iter_documents`, :func:`iter_hf_documents`; ``kvm-data`` writes token
shards from them without holding the corpus); :func:`read_documents` lists them.

* **Embedded corpus**: the English reference text that ships with every CPython
  (``pydoc_data.topics``), so the default job needs no download.
* **Cram packing**: documents are tokenized, truncated to ``seq_len + 1`` tokens, concatenated into
  a buffer and cut into ``seq_len + 1`` windows; inputs = window[:-1], labels = window[1:], label
  -100 where the *input* token is EOS.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import grain
import numpy as np

from kvm_jax.tasks.labels import IGNORE


def embedded_corpus() -> list[str]:
  """English documentation text shipped with CPython (no download): one document per topic."""
  from pydoc_data import topics
  return [topics.topics[name] for name in sorted(topics.topics)]


def read_documents(paths: Sequence[str], text_field: str = "text") -> list[str]:
  """Documents from local ``.txt`` (one document per file) or ``.jsonl`` (one per line) files."""
  return list(iter_documents(paths, text_field))


def read_hf_documents(name: str, split: str = "train", field: str = "text") -> list[str]:
  """Documents of a HuggingFace dataset that is already on local disk (offline mode forced)."""
  return list(iter_hf_documents(name, split, field))


class DocumentStream:
  """An iterator of documents that can also say how many it yields (``len``, for a progress bar;
  computed on first use, which may mean one extra pass over the input files)."""

  def __init__(self, documents: Iterator[str], count: Callable[[], int]):
    self._documents, self._count, self._len = documents, count, None

  def __iter__(self) -> DocumentStream:
    return self

  def __next__(self) -> str:
    return next(self._documents)

  def __len__(self) -> int:
    if self._len is None:
      self._len = self._count()
    return self._len


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
  with open(path, encoding="utf-8") as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{line_no}: not a JSON record ({e}).") from None
      if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{path}:{line_no}: no field {text_field!r} in the JSON record.")
      if not isinstance(record[text_field], str):
        raise ValueError(f"{path}:{line_no}: field {text_field!r} is "
                         f"{type(record[text_field]).__name__}, not a string.")
      yield record[text_field]


def _count_jsonl(path: Path) -> int:
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


def iter_documents(paths: Sequence[str], text_field: str = "text") -> DocumentStream:
  """Streams the documents of local files, in order, as :func:`read_documents` returns them:
  a ``.jsonl`` file gives one document per non-blank line (its ``text_field``), any other file is
  one document. Every path is checked before the first document is read."""
  files = [Path(p) for p in paths]
  for p in files:
    if not p.exists():
      raise ValueError(f"data file {str(p)!r} does not exist.")
    if p.is_dir():
      raise ValueError(f"data file {str(p)!r} is a directory; give its files (e.g. {p}/*.jsonl).")

  def documents():
    for p in files:
      if p.suffix == ".jsonl":
        yield from _jsonl_documents(p, text_field)
      else:
        with open(p, encoding="utf-8") as f:
          yield f.read()

  return DocumentStream(documents(), lambda: sum(_count_jsonl(p) if p.suffix == ".jsonl" else 1
                                                 for p in files))


def iter_hf_documents(name: str, split: str = "train", field: str = "text",
                      batch_size: int = 1024) -> DocumentStream:
  """Streams column ``field`` of a HuggingFace dataset already in the local cache (offline mode:
  nothing is downloaded), as :func:`read_hf_documents` returns it, ``batch_size`` rows at a
  time from the memory-mapped Arrow files rather than as one list."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
  try:
    import datasets  # optional dependency
  except ImportError as e:
    raise ValueError("hf_dataset needs the `datasets` package: pip install datasets") from e
  try:
    ds = datasets.load_dataset(name, split=split)
  except Exception as e:  # the library's own errors vary by version and cause
    raise ValueError(f"cannot load dataset {name!r} split {split!r} from the local cache "
                     f"(offline mode, nothing is downloaded): {type(e).__name__}: {e}") from e
  if field not in ds.column_names:
    raise ValueError(f"dataset {name!r} has no column {field!r}; columns: {ds.column_names}.")
  ds = ds.select_columns([field])

  def documents():
    row = 0
    for batch in ds.iter(batch_size=batch_size):
      for text in batch[field]:
        if not isinstance(text, str):
          raise ValueError(f"dataset {name!r} row {row}: column {field!r} is "
                           f"{type(text).__name__}, not a string.")
        row += 1
        yield text

  return DocumentStream(documents(), lambda: len(ds))


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
