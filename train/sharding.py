"""Device mesh ``(data, fsdp, tensor)`` and ``NamedSharding`` rules for params, optimizer, batches.

* **data**: batch parallelism (parameters replicated along it);
* **fsdp**: batch parallelism *and* parameter sharding (ZeRO-3 style: each matrix is split along
  its model-width dimension, gathered by XLA when used);
* **tensor**: Megatron-style tensor parallelism — projections into heads / MLP hidden are split on
  their output dimension, projections back to the residual stream on their input dimension.

Every matrix carries logical axis names (``LOGICAL_AXES``: embed, heads, kv_heads, mlp, vocab,
lora) mapped to mesh axes by ``LOGICAL_RULES``; change the rules to change the strategy. A dimension
is sharded only when the axis size divides it; otherwise it is replicated, so every rule is valid
for every model. Batches are split over ``data × fsdp``. The same code runs on one CPU,
on 8 simulated CPU devices (tests) and on a pod (``--distributed`` in ``kvm-train``).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from kvm_jax.nn import registry
from kvm_jax.nn.families.family import family_logical_axes
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.roles import parameter_role

AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A mesh over all devices; one of the sizes may be -1 (the rest of the devices)."""
  devices = list(devices if devices is not None else jax.devices())
  n = len(devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} "
                     f"tensor={tensor}.")
  known = int(np.prod([s for s in sizes if s != -1]))
  # On a pod the devices are those of every process: say so, it is the usual surprise.
  where = (f" ({jax.process_count()} processes x {jax.local_device_count()} devices each)"
           if devices == jax.devices() and jax.process_count() > 1 else "")
  if any(s == 0 or s < -1 for s in sizes) or n % known:
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} does not divide the "
                     f"{n} available devices{where}; choose sizes whose product is {n}.")
  sizes = [n // known if s == -1 else s for s in sizes]
  if int(np.prod(sizes)) != n:
    raise ValueError(f"mesh {dict(zip(AXES, sizes))} uses {int(np.prod(sizes))} devices but "
                     f"{n} are available{where}; the product must equal the device count.")
  return jax.make_mesh(tuple(sizes), AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


# Logical axis names of the 2-D parameters outside the mixers (by the name of the layer that owns
# them); each mixer kind declares its own (``LOGICAL_AXES`` of its class, kvm_jax.nn.registry).
# The rules map logical axes to mesh axes (maxtext-style). Vectors have no logical axes
# (replicated).
LOGICAL_RULES = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
                 "mlp": "tensor", "lora": None}


def logical_axes(path, ndim: int) -> tuple:
  """Logical axis names of a parameter (empty for vectors)."""
  if ndim != 2:
    return ()
  role = parameter_role(path)
  table = (family_logical_axes(mlp=True) if role.part == "mlp"
           else {**registry.logical_axes(), **family_logical_axes(mlp=False)})
  owner = role.owner if role.owner in table else None
  if owner is None:
    raise ValueError(f"no logical axes for parameter {'/'.join(path_names(path))}; a mixer "
                     "declares its "
                     "parameters' axes in its class's LOGICAL_AXES (kvm_jax.nn.registry), a "
                     "backbone family those of its MLP, embedding and head (MLP_AXES, "
                     "LOGICAL_AXES; kvm_jax.nn.families.family).")
  return table[owner]


def param_spec(path, shape, mesh: Mesh) -> P:
  """PartitionSpec of one parameter: its logical axes mapped by ``LOGICAL_RULES``; a dimension
  stays replicated when the mesh axis does not divide it (so any model fits any mesh)."""
  size = dict(zip(mesh.axis_names, mesh.devices.shape))
  spec = []
  for dim, logical in zip(shape, logical_axes(path, len(shape))):
    axis = LOGICAL_RULES.get(logical)
    spec.append(axis if axis and size[axis] > 1 and dim % size[axis] == 0 else None)
  return P(*spec)


def param_shardings(params: Any, mesh: Mesh) -> Any:
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, mesh)), params)


def like_params_shardings(tree: Any, params_shardings: Any, mesh: Mesh) -> Any:
  """Shardings for an optimizer state: subtrees shaped like the params reuse theirs; scalars are
  replicated."""
  param_def = jax.tree_util.tree_structure(params_shardings)
  replicated = NamedSharding(mesh, P())

  def visit(node):
    try:
      if jax.tree_util.tree_structure(node) == param_def:
        return params_shardings
    except Exception:
      pass
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      return type(node)(*[visit(child) for child in node])
    if isinstance(node, (tuple, list)):
      return type(node)(visit(child) for child in node)
    if isinstance(node, dict):
      return {k: visit(v) for k, v in node.items()}
    return replicated

  return visit(tree)


def batch_axes(mesh: Mesh) -> tuple:
  """The mesh axes a batch is split over: data x fsdp on a trainer's mesh, every axis of any
  other mesh (e.g. the one-axis mesh that replicates loaded parameters over a pod)."""
  return BATCH if set(BATCH) <= set(mesh.axis_names) else tuple(mesh.axis_names)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P(batch_axes(mesh)))


def host_rows(batch_sharding: NamedSharding, batch_size: int) -> np.ndarray:
  """Sorted global row indices of a ``[batch_size, ...]`` batch that this process's devices hold
  under ``batch_sharding``: what this host reads, whatever order the mesh puts hosts in."""
  rows = set()
  for index in batch_sharding.addressable_devices_indices_map((batch_size,)).values():
    rows.update(range(*index[0].indices(batch_size)))
  return np.asarray(sorted(rows), np.int64)


def global_batch(local: dict, batch_sharding: NamedSharding, batch_size: int,
                 rows: np.ndarray) -> dict:
  """Host-local rows ``{key: [len(rows), ...]}`` (global row indices ``rows``) -> global
  ``[batch_size, ...]`` arrays placed by ``batch_sharding``. Each device gets its own rows; works
  on one host and on many, whatever order the mesh puts hosts in."""

  def make(v):
    v = np.asarray(v)
    if v.shape[0] != len(rows):
      raise ValueError(f"a host batch has {v.shape[0]} rows, expected {len(rows)}.")

    def shard(index):
      wanted = np.arange(batch_size)[index[0]]
      return v[np.searchsorted(rows, wanted)]

    return jax.make_array_from_callback((batch_size, *v.shape[1:]), batch_sharding, shard)

  return {k: make(v) for k, v in local.items()}


def check_processes(mesh: Mesh) -> None:
  """A clear error unless ``mesh`` uses every device of every process (a pod runs one program)."""
  used = {d.id for d in mesh.devices.flat}
  missing = [d for d in jax.devices() if d.id not in used]
  if missing:
    hosts = sorted({d.process_index for d in missing})
    raise ValueError(f"the mesh {dict(zip(mesh.axis_names, mesh.devices.shape))} leaves "
                     f"{len(missing)} of {jax.device_count()} devices unused (on processes "
                     f"{hosts}); every process must take part: make data x fsdp x tensor equal "
                     f"the global device count {jax.device_count()} "
                     f"({jax.process_count()} processes x {jax.local_device_count()} devices).")


def check_batch(batch_size: int, mesh: Mesh, grad_accum_steps: int = 1) -> None:
  """A clear error unless every micro-batch splits evenly over the batch axes of ``mesh``."""
  size = dict(zip(mesh.axis_names, mesh.devices.shape))
  axes = batch_axes(mesh)
  ways = int(np.prod([size[a] for a in axes]))
  if batch_size % (ways * grad_accum_steps):
    micro = f" / grad_accum_steps={grad_accum_steps}" if grad_accum_steps > 1 else ""
    split = " x ".join(f"{a}={size[a]}" for a in axes)
    hosts = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
    raise ValueError(f"batch_size={batch_size}{micro} is not divisible by the batch axes "
                     f"({split} = {ways} ways{hosts}); use a batch_size that is a multiple of "
                     f"{ways * grad_accum_steps}.")
