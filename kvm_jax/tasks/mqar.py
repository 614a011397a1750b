"""Multi-query associative recall (Zoology's ``multiquery_ar`` recipe) and its recall counting.

``num_pairs`` key-value pairs (keys from [1, V/2), values from [V/2, V)) are followed by a query
region where each key reappears once, at gaps drawn from a power law (a = 0.01); the loss is only on
the value that follows each queried key. Example ``i`` is a pure function of ``(seed, i)``. Recall
is split by where the queried key lives: still inside the exact window, or only reachable through a
compressed state.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from kvm_jax.tasks.labels import IGNORE


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


def mqar_dataset(seed: int, spec: MQARSpec) -> grain.MapDataset:
  """An unbounded-by-construction, index-addressable MQAR stream (use ``[:n]`` to bound it)."""
  return grain.MapDataset.range(2 ** 31 - 1).map(lambda i: mqar_example(seed, int(i), spec))


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
  """``recall``, ``recall_in_window`` and ``recall_state_only`` from :func:`recall_counts`."""
  ratio = lambda c: c[0] / c[1] if c[1] else float("nan")
  return {"recall": ratio(counts["all"]), "recall_in_window": ratio(counts["in_window"]),
          "recall_state_only": ratio(counts["state_only"])}
