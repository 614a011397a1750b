"""Run the kernels per shard when the inputs are sharded over batch and KV heads.

A ``pallas_call`` is an opaque custom call to XLA's SPMD partitioner, which would gather its
operands onto every device. Every KVM program is independent per (batch row, KV head), so under a
mesh (``with jax.set_mesh(mesh):``, or the ``mesh`` argument) the kernels run inside
``jax.shard_map``: the batch dimension is split over the mesh axes named in ``BATCH_AXES`` that
are present and divide it, the KV-head dimension over ``HEAD_AXIS`` when it divides it, and
everything else (masks, LayerNorm weights, row counts) is replicated. Without a mesh, or when no
axis divides, the kernel is called directly.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

BATCH_AXES = ("data", "fsdp")   # train.sharding's batch axes
HEAD_AXIS = "tensor"


def _mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def layout(batch: int, kv_heads: int):
  """``(mesh, batch axes, head axis)`` to split over, or None when nothing is split."""
  mesh = _mesh()
  if mesh is None:
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batch_axes = []
  for name in BATCH_AXES:
    if sizes.get(name, 1) > 1 and batch % (int(np.prod([sizes[a] for a in batch_axes]))
                                           * sizes[name]) == 0:
      batch_axes.append(name)
  head_axis = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 and kv_heads % sizes[HEAD_AXIS] == 0 \
      else None
  if not batch_axes and head_axis is None:
    return None
  return mesh, tuple(batch_axes) or None, head_axis


def per_shard(fn: Callable, args: Sequence, kinds: Sequence[str], out_kinds: Sequence[str],
              batch: int, kv_heads: int):
  """Calls ``fn(*args)``, inside ``shard_map`` when a mesh splits batch or KV heads.

  ``kinds``/``out_kinds`` say how each argument / output is laid out: "bh" (``[B, Hkv, ...]``),
  "h" (``[Hkv, ...]``) or "r" (replicated).
  """
  plan = layout(batch, kv_heads)
  if plan is None:
    return fn(*args)
  mesh, batch_axes, head_axis = plan

  def spec(kind, ndim):
    if kind == "bh":
      return P(batch_axes, head_axis, *([None] * (ndim - 2)))
    if kind == "h":
      return P(head_axis, *([None] * (ndim - 1)))
    return P(*([None] * ndim))

  in_specs = tuple(spec(k, np.ndim(a)) for k, a in zip(kinds, args))
  out_shapes = jax.eval_shape(fn, *args)
  out_specs = tuple(spec(k, len(o.shape)) for k, o in zip(out_kinds, out_shapes))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)
