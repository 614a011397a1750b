"""Batches from any task's random-access ``grain.MapDataset``, read by index arithmetic.

Global batch ``b`` is examples ``b·B … b·B + B - 1`` of the task's stream (every task is indexed
by example number). A :class:`BatchReader` reads only the rows of each global batch that its host
holds (``rows``), so on a pod no host builds or even touches another host's rows. Its state is one
number, the next batch, saved with checkpoints: a resumed run neither repeats nor skips a batch,
and every host agrees on it because it does not depend on which rows a host reads.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Optional, Sequence

import grain
import numpy as np


class BatchReader:
  """Rows ``rows`` of every global batch of ``batch_size`` examples of ``dataset``, in order.

  Args:
    dataset: a random-access ``grain.MapDataset`` of example dicts (numpy arrays).
    batch_size: examples per global batch (all hosts together).
    rows: sorted global row indices this host reads (default: all of them).
    prefetch: read the next batch on a background thread while the caller works on this one.

  ``next(reader)`` returns ``{key: [len(rows), ...]}``. ``wait_seconds`` accumulates the time
  ``next`` spent blocked on data (the data-wait time of a training step).
  """

  def __init__(self, dataset: grain.MapDataset, batch_size: int,
               rows: Optional[Sequence[int]] = None, *, prefetch: bool = True):
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    rows = np.arange(batch_size) if rows is None else np.asarray(rows, np.int64)
    if rows.ndim != 1 or len(rows) == 0 or np.any(np.diff(rows) <= 0) or rows[0] < 0 \
        or rows[-1] >= batch_size:
      raise ValueError(f"rows must be sorted, distinct indices in [0, {batch_size}), got "
                       f"{rows.tolist()}.")
    self.dataset, self.batch_size, self.rows = dataset, batch_size, rows
    self.next_batch = 0
    self.wait_seconds = 0.0
    self._pool = concurrent.futures.ThreadPoolExecutor(1) if prefetch else None
    self._pending: Optional[tuple[int, concurrent.futures.Future]] = None

  def read(self, index: int) -> dict[str, np.ndarray]:
    """This host's rows of global batch ``index`` (pure: the same every time)."""
    first = index * self.batch_size
    examples = [self.dataset[int(first + r)] for r in self.rows]
    return {k: np.stack([np.asarray(e[k]) for e in examples]) for k in examples[0]}

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    t0 = time.perf_counter()
    index = self.next_batch
    if self._pending is not None and self._pending[0] == index:
      batch = self._pending[1].result()
    else:
      batch = self.read(index)
    self.wait_seconds += time.perf_counter() - t0
    self.next_batch = index + 1
    self._pending = None
    if self._pool is not None:
      self._pending = (index + 1, self._pool.submit(self.read, index + 1))
    return batch

  def get_state(self) -> dict:
    """What a checkpoint stores: the index of the next global batch."""
    return {"next_batch": int(self.next_batch)}

  def set_state(self, state: dict) -> None:
    if "next_batch" not in state:
      raise ValueError(f"data state {state!r} has no 'next_batch'; it was written by another "
                       "version of kvm_jax's reader and cannot be continued exactly.")
    self.next_batch = int(state["next_batch"])
    self._pending = None

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None


def batched_iterator(dataset: grain.MapDataset, batch_size: int, *, shard_index: int = 0,
                     shard_count: int = 1, prefetch: bool = False) -> BatchReader:
  """A checkpointable iterator of batches; with ``shard_count > 1`` it yields the
  ``shard_index``-th contiguous block of ``batch_size / shard_count`` rows of every batch."""
  if shard_count < 1 or not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index={shard_index} must lie in [0, shard_count={shard_count}).")
  if batch_size % shard_count:
    raise ValueError(f"batch_size={batch_size} must divide evenly over {shard_count} hosts.")
  per_host = batch_size // shard_count
  rows = np.arange(shard_index * per_host, (shard_index + 1) * per_host)
  return BatchReader(dataset, batch_size, rows, prefetch=prefetch)
