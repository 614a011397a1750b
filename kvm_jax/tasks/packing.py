"""How documents become training rows: the authors' "cram", one document per row ("pad"), or
whole documents packed with segment ids ("documents").

A row holds ``width = seq_len + 1`` tokens (inputs are its first ``seq_len``, labels its last
``seq_len``). The three packings:

* ``"cram"`` (the paper's training data, :func:`kvm_jax.tasks.text.cram_pack`): each document cut
  to one row; shorter ones concatenated into a buffer emitted as a row once full, its remainder
  dropped. Rows are single sequences: a model's state runs from one document into the next.
* ``"pad"`` (the paper's validation data): one document per row from its first token, truncated
  to the row or padded after it. Every row starts a document; short documents waste the rest.
* ``"documents"``: whole documents in corpus order, each starting where the previous one ends,
  with ``segment_ids`` telling them apart (the model computes each as if alone). A document that
  does not fit in the rest of a row starts the next row (the rest is padding); a document longer
  than a row is cut into row-length pieces, **each piece a document of its own** (its positions
  and state start again), the last piece packed like any other document.

A packing is planned from document *lengths* alone (:func:`plan_rows`, in
:mod:`kvm_jax.config.row_plan`, which needs no data pipeline), so a corpus of token
shards is packed without reading its tokens, and any row is built from its plan on demand
(:class:`PackedRows`): a resumed run or another host reads exactly the same rows.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import grain
import numpy as np

from kvm_jax.config.row_plan import PACKINGS, RowPlan, check_packing, plan_rows  # noqa: F401
from kvm_jax.tasks.labels import IGNORE


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Rows of a :class:`RowPlan` built on demand from ``document(i) -> tokens``."""

  plan: RowPlan
  document: Callable[[int], np.ndarray]

  def __len__(self) -> int:
    return len(self.plan)

  def row(self, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ``k``: tokens and segment ids, int32 ``[width]`` each (ids 1, 2, ... per piece in the
    row; 0 and token 0 on padding)."""
    if not 0 <= k < len(self):
      raise IndexError(f"row {k} out of range [0, {len(self)}).")
    p = self.plan
    tokens = np.zeros(p.width, np.int32)
    segments = np.zeros(p.width, np.int32)
    at = 0
    for i, j in enumerate(range(int(p.first[k]), int(p.first[k + 1]))):
      n, s = int(p.length[j]), int(p.start[j])
      tokens[at:at + n] = self.document(int(p.doc[j]))[s:s + n]
      segments[at:at + n] = i + 1
      at += n
    return tokens, segments


def packed_example(tokens: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
  """A row ``[width]`` as ``inputs``, ``labels`` and ``segment_ids`` (``[width - 1]`` each): a
  position is labelled only when its next token belongs to the same document (no prediction
  across a boundary, none on padding)."""
  inputs, following = tokens[:-1], tokens[1:]
  same = (segments[1:] == segments[:-1]) & (segments[1:] != 0)
  labels = np.where(same, following, IGNORE)
  return {"inputs": inputs.astype(np.int32), "labels": labels.astype(np.int32),
          "segment_ids": segments[:-1].astype(np.int32)}


def packed_dataset(rows: PackedRows, seed: int, split: str) -> grain.MapDataset:
  """The stream of a packing: the first ``max(1, len // 20)`` rows are "eval", the rest "train";
  shuffled per epoch by ``seed``, repeated forever. Example ``i`` depends on ``i`` alone."""
  if split not in ("train", "eval"):
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}.")
  n_eval = max(1, len(rows) // 20)
  if len(rows) < 2:
    raise ValueError(f"the corpus packs into {len(rows)} row(s); it needs at least 2 (one for "
                     "evaluation).")
  numbers = np.arange(n_eval, len(rows)) if split == "train" else np.arange(n_eval)
  return (grain.MapDataset.source(numbers).shuffle(seed=seed).repeat()
          .map(lambda k: packed_example(*rows.row(int(k)))))
