"""Batches from any task's ``grain.MapDataset``, as a checkpointable iterator.

Every task stream is indexed by example number; the iterator's state (``get_state``) is saved with
checkpoints, so a resumed run neither repeats nor skips a batch.
"""

from __future__ import annotations

import grain


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
