"""Deterministic, checkpointable input pipelines (grain).

* **MQAR** (Zoology's ``multiquery_ar`` recipe): ``num_pairs`` key-value pairs (keys from
  [1, V/2), values from [V/2, V)) followed by a query region where each key reappears once, at gaps
  drawn from a power law (a = 0.01); the loss is only on the value that follows each queried key.
  Example ``i`` is a pure function of ``(seed, i)``.
* **Packed text** (the authors' "cram" packing): documents are tokenized, truncated to
  ``seq_len + 1`` tokens, concatenated into a buffer and cut into ``seq_len + 1`` windows;
  inputs = window[:-1], labels = window[1:], label -100 where the *input* token is EOS.
* **Embedded corpus**: the English reference text that ships with every CPython
  (``pydoc_data.topics``), so the default job needs no download.
* **Byte tokenizer** by default (ids 0..255, EOS = 256, vocab 257 padded to 320).

Every pipeline is a ``grain.MapDataset`` indexed by example number; its iterator state
(``get_state``) is saved with checkpoints, so a resumed run neither repeats nor skips a batch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

import grain
import numpy as np

IGNORE = -100


# ----------------------------------------------------------------------------------------------
# MQAR
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MQARSpec:
  """One MQAR task: sequence length, vocabulary and number of key-value pairs."""

  seq_len: int = 256
  vocab_size: int = 256
  num_pairs: int = 16
  power_a: float = 0.01

  def __post_init__(self):
    if 2 * self.num_pairs + 2 * self.num_pairs > self.seq_len + 1:
      raise ValueError(f"MQAR: {self.num_pairs} pairs need seq_len >= {4 * self.num_pairs - 1}, "
                       f"got {self.seq_len}.")
    if self.num_pairs >= self.vocab_size // 2 - 1:
      raise ValueError(f"MQAR: num_pairs={self.num_pairs} needs more distinct keys than "
                       f"vocab_size={self.vocab_size} offers ({self.vocab_size // 2 - 1}).")


def mqar_example(seed: int, index: int, spec: MQARSpec) -> dict[str, np.ndarray]:
  """Example ``index`` of the MQAR stream ``seed``.

  Returns ``inputs``/``labels`` int32 ``[seq_len]`` and ``distance`` int32 ``[seq_len]``: for a
  label position, how many tokens back the queried key was given (0 elsewhere), used to split
  recall into "key still in the exact window" and "key only in the compressed state".
  """
  rng = np.random.default_rng([seed, index])
  n, V = spec.num_pairs, spec.vocab_size
  keys = rng.choice(np.arange(1, V // 2), size=n, replace=False)
  values = rng.choice(np.arange(V // 2, V), size=n, replace=True)
  context = np.empty(2 * n, np.int64)
  context[0::2], context[1::2] = keys, values
  total = spec.seq_len + 1
  space = (total - 2 * n) // 2  # query slots (a query key and the value after it)
  gaps = np.arange(1, space + 1, dtype=np.float64)
  p = spec.power_a * gaps ** (spec.power_a - 1)
  slots = rng.choice(space, size=n, replace=False, p=p / p.sum())
  tokens = np.zeros(total, np.int64)
  tokens[:2 * n] = context
  query_pos = 2 * n + 2 * slots
  tokens[query_pos] = keys
  tokens[query_pos + 1] = values
  labels = np.full(total, IGNORE, np.int64)
  labels[query_pos + 1] = values
  distance = np.zeros(total, np.int64)
  distance[query_pos + 1] = query_pos - 2 * np.arange(n)  # back to the key in the context
  return {"inputs": tokens[:-1].astype(np.int32), "labels": labels[1:].astype(np.int32),
          "distance": distance[1:].astype(np.int32)}


def recall_counts(pred: np.ndarray, labels: np.ndarray, distance: np.ndarray,
                  window: int) -> dict[str, np.ndarray]:
  """[hits, answers] at MQAR answer positions: all, key within the last ``window`` tokens
  ("in_window"), and key further back, reachable only through a compressed state ("state_only")."""
  valid = labels != IGNORE
  correct = (pred == labels) & valid
  near = valid & (distance < window)
  return {name: np.array([int((correct & mask).sum()), int(mask.sum())])
          for name, mask in (("all", valid), ("in_window", near), ("state_only", valid & ~near))}


def recall_ratios(counts: dict[str, np.ndarray]) -> dict[str, float]:
  ratio = lambda c: c[0] / c[1] if c[1] else float("nan")
  return {"recall": ratio(counts["all"]), "recall_in_window": ratio(counts["in_window"]),
          "recall_state_only": ratio(counts["state_only"])}


def mqar_dataset(seed: int, spec: MQARSpec) -> grain.MapDataset:
  """An unbounded-by-construction, index-addressable MQAR stream (use ``[:n]`` to bound it)."""
  return grain.MapDataset.range(2 ** 31 - 1).map(lambda i: mqar_example(seed, int(i), spec))


@dataclasses.dataclass(frozen=True)
class NIAHSpec:
  """Training stream of RULER-style needle-in-a-haystack examples (``eval.niah`` builds them).

  Each example is a prompt of ``min_len`` .. ``seq_len`` tokens (uniform, so the model sees many
  haystack sizes and needle depths) followed by the answer; loss only on the answer tokens.
  """

  seq_len: int = 512
  min_len: int = 0          # 0 = seq_len // 2
  task: str = "niah_single_1"
  tokenizer_file: str = ""  # "" = bytes

  def __post_init__(self):
    from eval import niah
    if self.task not in niah.TASKS:
      raise ValueError(f"NIAHSpec.task={self.task!r}; choose from {niah.TASKS}.")
    if not 0 <= self.min_len <= self.seq_len:
      raise ValueError(f"NIAHSpec.min_len={self.min_len} must lie in [0, seq_len={self.seq_len}].")


def niah_example(seed: int, index: int, spec: NIAHSpec, tok=None) -> dict[str, np.ndarray]:
  """Example ``index`` of the NIAH training stream ``seed``: ``inputs``/``labels`` ``[seq_len]``."""
  from eval import niah
  tok = tok or tokenizer(spec.tokenizer_file)
  rng = np.random.default_rng([seed, index, 77])
  answer_budget = 48 if spec.task == "niah_single_3" else 16  # " <value>." + EOS, with margin
  count = lambda t: len(tok.encode(t))
  lo = max(spec.min_len or spec.seq_len // 2, niah.shortest_length(spec.task, count, answer_budget))
  if lo > spec.seq_len:
    raise ValueError(f"NIAHSpec.seq_len={spec.seq_len} is too short for the {spec.task} template "
                     f"with this tokenizer; use seq_len >= {lo}.")
  length = int(rng.integers(lo, spec.seq_len + 1))
  ex = niah.make_example(spec.task, length, float(rng.choice(niah.DEPTHS)),
                         int(rng.integers(2 ** 31)), count,
                         generation_budget=answer_budget)
  prompt = tok.encode(ex.prompt)
  answer = tok.encode(f" {ex.answer}.") + [tok.eos_id]
  ids = (prompt + answer)[:spec.seq_len + 1]
  tokens = np.full(spec.seq_len + 1, tok.eos_id, np.int64)
  tokens[:len(ids)] = ids
  labels = np.full(spec.seq_len + 1, IGNORE, np.int64)
  labels[len(prompt):len(ids)] = tokens[len(prompt):len(ids)]
  return {"inputs": tokens[:-1].astype(np.int32), "labels": labels[1:].astype(np.int32)}


def niah_dataset(seed: int, spec: NIAHSpec) -> grain.MapDataset:
  tok = tokenizer(spec.tokenizer_file)
  return grain.MapDataset.range(2 ** 31 - 1).map(lambda i: niah_example(seed, int(i), spec, tok))


# ----------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------


class ByteTokenizer:
  """UTF-8 bytes as ids 0..255, EOS = 256. ``vocab_size`` is padded to a multiple of 64."""

  eos_id = 256
  vocab_size = 320

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """Any ``tokenizers``-format tokenizer file (``tokenizer.json``), loaded from local disk only."""

  def __init__(self, path: str, eos_token: Optional[str] = None):
    try:
      from tokenizers import Tokenizer  # optional dependency
    except ImportError as e:  # pragma: no cover - depends on the environment
      raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    self._tok = Tokenizer.from_file(path)
    self.vocab_size = self._tok.get_vocab_size()
    eos = eos_token or "<|endoftext|>"
    self.eos_id = self._tok.token_to_id(eos)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids: Iterable[int]) -> str:
    return self._tok.decode(list(int(i) for i in ids))


def tokenizer(tokenizer_file: str = ""):
  """The tokenizer of a run: a local ``tokenizer.json`` file, or bytes when ``""``."""
  return HFTokenizer(tokenizer_file) if tokenizer_file else ByteTokenizer()


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
  inputs, labels = window[:-1], window[1:].copy()
  labels[inputs == eos_id] = IGNORE
  return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32)}


def text_dataset(windows: np.ndarray, eos_id: int, seed: int) -> grain.MapDataset:
  """Packed windows, shuffled per epoch by ``seed``, repeated forever."""
  return (grain.MapDataset.source(windows).shuffle(seed=seed).repeat()
          .map(lambda w: lm_example(np.asarray(w), eos_id)))


def batched_iterator(dataset: grain.MapDataset, batch_size: int, *, shard_index: int = 0,
                     shard_count: int = 1):
  """A checkpointable iterator of batches; ``shard_index/count`` split batches across hosts."""
  if batch_size % shard_count:
    raise ValueError(f"batch_size={batch_size} must divide evenly over {shard_count} hosts.")
  per_host = batch_size // shard_count
  ds = dataset.batch(batch_size)
  if shard_count > 1:
    ds = ds.map(lambda b: {k: v[shard_index * per_host:(shard_index + 1) * per_host]
                           for k, v in b.items()})
  return iter(ds.to_iter_dataset())
