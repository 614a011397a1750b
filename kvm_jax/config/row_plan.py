"""Which documents fill which rows: a packing planned from document lengths alone.

:func:`plan_rows` lays documents of given lengths into rows of ``width`` tokens for the "pad" and
"documents" packings (:mod:`kvm_jax.tasks.packing` says what each means and builds the rows). It
is pure numpy and needs no data pipeline, so benchmarks and device checks that only need the
shape of a packing import it without grain.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PACKINGS = ("cram", "pad", "documents")


def check_packing(packing: str) -> None:
  if packing not in PACKINGS:
    raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}: 'cram' (the paper's "
                     "training rows), 'pad' (one document per row) or 'documents' (whole documents "
                     "with segment ids).")


@dataclasses.dataclass(frozen=True)
class RowPlan:
  """Which pieces of which documents fill each row. Piece ``j`` is tokens ``[start[j], start[j] +
  length[j])`` of document ``doc[j]`` and belongs to row ``row[j]``; pieces are in row order and
  ``first[r] : first[r + 1]`` are row ``r``'s. All int64 arrays."""

  width: int
  doc: np.ndarray
  start: np.ndarray
  length: np.ndarray
  row: np.ndarray
  first: np.ndarray

  def __len__(self) -> int:
    return len(self.first) - 1

  def real_tokens(self) -> int:
    """Tokens of documents in all rows (the rest is padding)."""
    return int(self.length.sum())


def plan_rows(lengths: np.ndarray, width: int, packing: str) -> RowPlan:
  """The rows of ``packing`` ("pad" or "documents") over documents of ``lengths`` tokens, each
  row ``width`` tokens. Empty documents are skipped."""
  check_packing(packing)
  if packing == "cram":
    raise ValueError("plan_rows plans 'pad' and 'documents'; 'cram' rows come from cram_pack.")
  if width < 2:
    raise ValueError(f"a row needs at least 2 tokens (seq_len >= 1), got width {width}.")
  lengths = np.asarray(lengths, np.int64)
  doc, start, length, row = [], [], [], []
  if packing == "pad":
    kept = np.flatnonzero(lengths > 0)
    doc, length = kept, np.minimum(lengths[kept], width)
    start, row = np.zeros(len(kept), np.int64), np.arange(len(kept), dtype=np.int64)
  else:
    r, fill = 0, 0
    for d, n in enumerate(lengths.tolist()):
      offset = 0
      while offset < n:
        take = min(n - offset, width)
        if take > width - fill:   # does not fit in the rest of this row
          r, fill = r + 1, 0
        doc.append(d), start.append(offset), length.append(take), row.append(r)
        fill += take
        offset += take
        if fill == width:
          r, fill = r + 1, 0
    doc, start, length, row = (np.asarray(x, np.int64) for x in (doc, start, length, row))
  rows = int(row[-1]) + 1 if len(row) else 0
  first = np.searchsorted(row, np.arange(rows + 1), side="left").astype(np.int64)
  return RowPlan(width=width, doc=np.asarray(doc, np.int64), start=np.asarray(start, np.int64),
                 length=np.asarray(length, np.int64), row=np.asarray(row, np.int64), first=first)
