"""Run the kernels per shard when the inputs are sharded over batch and KV heads.

A ``pallas_call`` is an opaque custom call to XLA's SPMD partitioner, which would gather its
operands onto every device. Every KVM program is independent per (batch row, KV head), so under a
mesh (``with jax.set_mesh(mesh):``) the kernels can run inside ``jax.shard_map``: the batch
dimension split over the mesh axes their caller names in :class:`ShardAxes` (those present in the
mesh that divide it), the KV-head dimension over the named head axis when it divides it, and
everything else (masks, LayerNorm weights, row counts) replicated. Without a mesh, without axis
names, or when no axis divides, the kernel is called directly.

The axis names always come from the caller, through the :func:`kernel_sharding` context (also
importable as ``kvm_jax.ops.kvm.kernel_sharding``): this module knows no mesh convention of its
own. The context lives here, below both kernel registries (the KVM op's and softmax
attention's), so that both read the same axes without one registry importing the other.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Callable, Iterator, Optional, Sequence, Union

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class ShardAxes:
  """Mesh axes a kernel may split over: ``batch`` (in order) for the batch dimension, ``heads``
  for the KV-head dimension. Empty: never split."""

  batch: tuple[str, ...] = ()
  heads: Optional[str] = None

  def may_split_heads(self) -> bool:
    """Whether arrays may arrive split over their heads: a head axis is named and the mesh set
    around the call (if any) gives it more than one device. Without a mesh the named axis may
    still split them (through ``jit``'s shardings), so the answer is yes."""
    if self.heads is None:
      return False
    mesh = _mesh()
    return mesh is None or dict(zip(mesh.axis_names, mesh.axis_sizes)).get(self.heads, 1) > 1


_SHARD_AXES: contextvars.ContextVar[ShardAxes] = contextvars.ContextVar(
    "kvm_kernel_shard_axes", default=ShardAxes())


@contextlib.contextmanager
def kernel_sharding(batch_axes: Sequence[str] = (), head_axis: Optional[str] = None
                    ) -> Iterator[ShardAxes]:
  """Inside this context, Pallas kernels called under a mesh (``jax.set_mesh``) run per shard:
  the batch split over ``batch_axes``, the KV heads over ``head_axis`` (each only where the axis
  exists and divides the dimension). Outside it they see whole arrays, which XLA's partitioner
  gathers for them. The names are the caller's: the trainer passes its own mesh axes. The KVM
  op's backend also records whether heads may be split (``KVMBackend.heads_split``): on TPU its
  scan then keeps heads whole in its layout pins, which otherwise merge time with heads.

  It is read when an op is *called* (traced) and fixed into the compiled program."""
  token = _SHARD_AXES.set(ShardAxes(batch=tuple(batch_axes), heads=head_axis))
  try:
    yield _SHARD_AXES.get()
  finally:
    _SHARD_AXES.reset(token)


def current_shard_axes() -> ShardAxes:
  """The axes of the enclosing :func:`kernel_sharding` (none outside it): what the backend
  resolvers of the KVM op and of softmax attention put into their decisions."""
  return _SHARD_AXES.get()


def _mesh():
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty else mesh


def layout(batch: int, kv_heads: int, axes: ShardAxes):
  """``(mesh, batch axes, head axis)`` to split over, or None when nothing is split."""
  mesh = _mesh()
  if mesh is None or (not axes.batch and axes.heads is None):
    return None
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  batch_axes = []
  for name in axes.batch:
    if sizes.get(name, 1) > 1 and batch % (int(np.prod([sizes[a] for a in batch_axes]))
                                           * sizes[name]) == 0:
      batch_axes.append(name)
  head_axis = axes.heads if (axes.heads is not None and sizes.get(axes.heads, 1) > 1
                             and kv_heads % sizes[axes.heads] == 0) else None
  if not batch_axes and head_axis is None:
    return None
  return mesh, tuple(batch_axes) or None, head_axis


def per_shard(fn: Callable, args: Sequence, kinds: Sequence[str],
              out_kinds: Union[str, Sequence[str]],
              batch: int, kv_heads: int, axes: ShardAxes):
  """Calls ``fn(*args)``, inside ``shard_map`` when a mesh splits batch or KV heads.

  ``kinds``/``out_kinds`` say how each argument / output is laid out: "bh" (``[B, Hkv, ...]``),
  "bth" (time-major ``[B, T, Hkv, ...]``, e.g. a decode ring), "h" (``[Hkv, ...]``) or "r"
  (replicated). ``out_kinds`` is a sequence for a function returning a tuple, or one kind for a
  function returning one array.
  """
  plan = layout(batch, kv_heads, axes)
  if plan is None:
    return fn(*args)
  mesh, batch_axes, head_axis = plan

  def spec(kind, ndim):
    if kind == "bh":
      return P(batch_axes, head_axis, *([None] * (ndim - 2)))
    if kind == "bth":
      return P(batch_axes, None, head_axis, *([None] * (ndim - 3)))
    if kind == "h":
      return P(head_axis, *([None] * (ndim - 1)))
    return P(*([None] * ndim))

  in_specs = tuple(spec(k, np.ndim(a)) for k, a in zip(kinds, args))
  out_shapes = jax.eval_shape(fn, *args)
  if isinstance(out_kinds, str):
    out_specs = spec(out_kinds, len(out_shapes.shape))
  else:
    out_specs = tuple(spec(k, len(o.shape)) for k, o in zip(out_kinds, out_shapes))
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)
