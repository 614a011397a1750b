"""Tiled Pallas kernels for the KVM state update (docs/kvm-spec.md §6.7).

The update's heavy work is two ``[C, R]`` score reductions and the accumulation of token rows
into state rows. Here each is a kernel whose programs hold one tile at a time, so the working set
is bounded for any state size (R up to 4096 and beyond) on Triton, Mosaic TPU and in interpret
mode:

* :func:`max_scores` / :func:`first_argmax_rows` — per token, the max (novelty) or the
  first-index argmax (merge target) of ``x · rows`` over a row range ``[lo, hi)``. Grid
  ``(B, Hkv, token blocks)``; each program walks the row blocks that intersect ``[lo, hi)`` with a
  ``fori_loop`` (dynamic bounds: blocks past the valid rows are never read), keeping a running
  max (and the index of its first occurrence: a later block must be *strictly* better, so the
  lowest index wins ties, exactly as the XLA path's ``first_argmax``).
* :func:`add_rows` — ``rows[index[c]] += updates[c]`` as one-hot matmuls per ``[row block ×
  token block]`` tile, deterministic (no atomics), each product exact: the 0/1 operand is exact in
  bfloat16 and the updates are split into three bfloat16 parts (``backend.onehot_matmul``). Its
  VJP is a gather of the rows' cotangent.

Every float32 score is computed at HIGHEST precision (IEEE on Triton, fp32 on Mosaic): routing
decisions must equal the XLA path's. The O(C²) ranking of novelties, the LayerNorm of the
post-append rows and the bookkeeping stay in :func:`kvm_jax.ops.kvm.state.update_state`, which
these kernels plug into (:class:`~kvm_jax.ops.kvm.state.RoutingOps`), so gradients are XLA's.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvm_jax.kernels import backend
from kvm_jax.kernels.sharding import per_shard
from kvm_jax.ops.kvm.state import KVMState, RoutingOps, add_rows_scatter, update_state


@dataclasses.dataclass(frozen=True)
class RoutingBlocks:
  """Tile sizes of the update kernels: ``tokens`` per program, ``rows`` per loop step (both
  scoring kernels), ``acc_rows`` state rows per program and ``acc_tokens`` tokens per step of
  :func:`add_rows`; ``rows_padded``: the state capacity padded to whole row blocks."""

  tokens: int
  rows: int
  acc_rows: int
  acc_tokens: int
  rows_padded: int


def routing_blocks(C: int, R: int, platform: str, interpret: bool = False) -> RoutingBlocks:
  """Tile sizes for chunk ``C`` and state capacity ``R`` on ``platform`` ("gpu", "tpu", "cpu").

  GPU (Triton): 64 x 64 float32 tiles (a [64, 128] operand is 32 KiB), power-of-two sizes. TPU:
  128 tokens x 256 rows (MXU-shaped, sublane multiples of 8). Interpreted: larger tiles, fewer
  loop steps."""
  if platform == "gpu" and not interpret:
    tokens = min(64, C)
    rows_padded = max(16, 1 << (max(R, 1) - 1).bit_length())
    rows = min(64, rows_padded)
    return RoutingBlocks(tokens, rows, rows, min(64, C), rows_padded)
  if platform == "tpu" and not interpret:
    tokens, rows = min(128, C), 256
  else:
    tokens, rows = min(128, C), 128
  rows = min(rows, -(-R // 8) * 8)
  rows_padded = -(-R // rows) * rows
  return RoutingBlocks(tokens, rows, rows, tokens, rows_padded)


def route_working_set(C, R, D, platform) -> backend.WorkingSet:
  """Either routing-score kernel (``kvm_jax.kernels.update``)."""
  dense, stages = backend.nbytes, backend.GPU_STAGES
  WorkingSet = backend.WorkingSet
  b = routing_blocks(C, R, platform)
  f32, i32 = jnp.float32, jnp.int32
  if platform == "gpu":
    shared = dense((b.tokens, D), f32) + stages * dense((b.rows, D), f32)
    registers = 2 * dense((b.tokens, b.rows), f32) + 2 * dense((b.tokens, 1), f32)
    return WorkingSet("route", shared=shared, registers=registers)
  blocks = [((1, 2), i32), ((b.tokens, D), f32), ((b.rows_padded, D), f32), ((b.tokens, 1), f32)]
  scratch = [((b.tokens, b.rows), f32)] * 3 + [((b.tokens, 1), f32)] * 2
  return WorkingSet("route", vmem=backend.tpu_vmem(blocks, scratch))


def add_rows_working_set(C, R, X, platform) -> backend.WorkingSet:
  """The row accumulation (``kvm_jax.kernels.update.add_rows``) of width X."""
  dense, stages = backend.nbytes, backend.GPU_STAGES
  WorkingSet = backend.WorkingSet
  b = routing_blocks(C, R, platform)
  f32, bf16 = jnp.float32, jnp.bfloat16
  if platform == "gpu":
    # one-hot tile and the three bf16 parts of an update tile per step
    shared = stages * (dense((b.acc_rows, b.acc_tokens), bf16)
                           + 3 * dense((b.acc_tokens, X), bf16))
    registers = dense((b.acc_rows, X), f32) * 2 + dense((b.acc_tokens, X), f32)
    return WorkingSet("add_rows", shared=shared, registers=registers)
  blocks = [((1, C), jnp.int32), ((C, X), f32), ((b.acc_rows, X), f32), ((b.acc_rows, X), f32)]
  scratch = [((b.acc_rows, b.acc_tokens), f32), ((b.acc_rows, X), f32)] + \
      [((b.acc_tokens, X), bf16)] * 3
  return WorkingSet("add_rows", vmem=backend.tpu_vmem(blocks, scratch))


def _scores_kernel(bounds_ref, x_ref, rows_ref, out_ref, *, row_block: int, argmax: bool,
                   kc: backend.KernelConfig):
  if backend.bounds_in_scalar_memory(kc):  # one flat [b·h·2] array: this program's pair
    at = (pl.program_id(0) * pl.num_programs(1) + pl.program_id(1)) * 2
    lo, hi = bounds_ref[at], bounds_ref[at + 1]
  else:                    # this program's [1, 2] block
    lo, hi = bounds_ref[0, 0], bounds_ref[0, 1]
  x = x_ref[...].astype(jnp.float32)                          # [tokens, D]
  tokens = x.shape[0]
  precision = kc.matmul_precision(jnp.float32)

  def step(i, carry):
    best, arg = carry
    start = pl.multiple_of(i * row_block, row_block)
    rows = rows_ref[pl.ds(start, row_block), :].astype(jnp.float32)
    s = jax.lax.dot_general(x, rows, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)          # [tokens, row_block]
    index = start + jax.lax.broadcasted_iota(jnp.int32, (1, row_block), 1)
    s = jnp.where((index >= lo) & (index < hi), s, -jnp.inf)
    block_best = jnp.max(s, axis=1, keepdims=True)
    if not argmax:
      return jnp.maximum(best, block_best), arg
    block_arg = jnp.min(jnp.where(s == block_best, index, jnp.iinfo(jnp.int32).max), axis=1,
                        keepdims=True)
    better = block_best > best    # strictly: an earlier row keeps a tie
    return jnp.where(better, block_best, best), jnp.where(better, block_arg, arg)

  init = (jnp.full((tokens, 1), -jnp.inf, jnp.float32), jnp.zeros((tokens, 1), jnp.int32))
  # lax.div, not //: nonnegative operands, and jnp's floor division is a jitted helper
  # Mosaic cannot lower
  best, arg = jax.lax.fori_loop(jax.lax.div(lo, row_block),
                                jax.lax.div(hi + row_block - 1, row_block), step, init)
  out_ref[...] = arg if argmax else best


def _scores(x, rows, lo, hi, argmax: bool, kc: backend.KernelConfig):
  """``[B, Hkv, C]``: max or first argmax over rows ``[lo, hi)`` of ``x [B,Hkv,C,D] · rows
  [B,Hkv,R,D]`` (float32). ``lo`` / ``hi``: scalars, or ``[B]`` (one range per batch row: packed
  documents, whose states have their own row counts)."""
  B, Hkv, C, D = x.shape
  R = rows.shape[2]
  blocks = routing_blocks(C, R, kc.platform, kc.interpret)
  kc.check_sizes(chunk_size=C, head_dim=D)
  rows = backend.pad_axis(rows.astype(jnp.float32), 2, blocks.rows_padded)
  per_row = lambda x: jnp.broadcast_to(  # noqa: E731
      jnp.asarray(x, jnp.int32).reshape(-1, 1), (B, Hkv))
  bounds = jnp.stack([per_row(lo), per_row(hi)], axis=-1)                      # [B, Hkv, 2]
  kernel = functools.partial(_scores_kernel, row_block=blocks.rows, argmax=argmax, kc=kc)
  T = blocks.tokens

  def call(bounds, x, rows):
    b, h = x.shape[:2]
    if backend.bounds_in_scalar_memory(kc):
      from jax.experimental.pallas import tpu as pltpu
      bounds, bounds_spec = bounds.reshape(-1), pl.BlockSpec(memory_space=pltpu.SMEM)
    else:
      bounds = bounds[:, :, None]                                               # [b, h, 1, 2]
      bounds_spec = pl.BlockSpec((None, None, 1, 2), lambda b, h, i: (b, h, 0, 0))
    return pl.pallas_call(
        kernel,
        grid=(b, h, C // T),
        in_specs=[bounds_spec,
                  pl.BlockSpec((None, None, T, D), lambda b, h, i: (b, h, i, 0)),
                  pl.BlockSpec((None, None, blocks.rows_padded, D), lambda b, h, i: (b, h, 0, 0))],
        out_specs=pl.BlockSpec((None, None, T, 1), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, C, 1), jnp.int32 if argmax else jnp.float32),
        interpret=kc.interpret,
        compiler_params=kc.compiler_params(3, route_working_set(C, R, D, kc.platform)),
        name="kvm_route_argmax" if argmax else "kvm_route_novelty",
    )(bounds, x.astype(jnp.float32), rows)

  out = per_shard(call, (bounds, x, rows), ("bh", "bh", "bh"), "bh", B, Hkv, kc.shard_axes)
  return out[..., 0]


def max_scores(k_bar, read, num_rows, *, kc: backend.KernelConfig):
  """Kernel form of :func:`kvm_jax.ops.kvm.state.novelty_scores`."""
  return _scores(k_bar, read, 0, num_rows, False, kc)


def first_argmax_rows(k_gated, read, first_row, stop_row, *, kc: backend.KernelConfig):
  """Kernel form of :func:`kvm_jax.ops.kvm.state.merge_targets`."""
  return _scores(k_gated, read, first_row, stop_row, True, kc)


# ----------------------------------------------------------------------------------------------
# Accumulating token rows into state rows
# ----------------------------------------------------------------------------------------------


def _add_rows_kernel(index_ref, updates_ref, rows_ref, out_ref, *, token_block: int,
                     kc: backend.KernelConfig):
  row_block = rows_ref.shape[0]
  C = index_ref.shape[-1]
  first = pl.program_id(2) * row_block
  row_ids = first + jax.lax.broadcasted_iota(jnp.int32, (row_block, 1), 0)

  def step(j, acc):
    start = pl.multiple_of(j * token_block, token_block)
    index = index_ref[:, pl.ds(start, token_block)]                      # [1, token_block]
    onehot = (row_ids == index).astype(jnp.float32)                       # [row_block, tokens]
    return acc + backend.onehot_matmul(onehot, updates_ref[pl.ds(start, token_block), :], kc)

  acc = jax.lax.fori_loop(0, C // token_block, step,
                          jnp.zeros(rows_ref.shape, jnp.float32))
  out_ref[...] = rows_ref[...] + acc


def _add_rows_call(rows, index, updates, kc):
  B, Hkv, R, X = rows.shape
  C = index.shape[-1]
  blocks = routing_blocks(C, R, kc.platform, kc.interpret)
  Rp = blocks.rows_padded
  padded = backend.pad_axis(rows, 2, Rp)
  kernel = functools.partial(_add_rows_kernel, token_block=blocks.acc_tokens, kc=kc)
  BR = blocks.acc_rows

  def call(index, updates, rows):
    b, h = rows.shape[:2]
    return pl.pallas_call(
        kernel,
        grid=(b, h, Rp // BR),
        in_specs=[pl.BlockSpec((None, None, 1, C), lambda b, h, i: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, C, X), lambda b, h, i: (b, h, 0, 0)),
                  pl.BlockSpec((None, None, BR, X), lambda b, h, i: (b, h, i, 0))],
        out_specs=pl.BlockSpec((None, None, BR, X), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, h, Rp, X), jnp.float32),
        input_output_aliases={2: 0},   # rows are updated in place
        interpret=kc.interpret,
        compiler_params=kc.compiler_params(3, add_rows_working_set(C, R, X, kc.platform)),
        name="kvm_add_rows",
    )(index, updates, rows)

  out = per_shard(call, (index[:, :, None, :].astype(jnp.int32), updates.astype(jnp.float32),
                        padded.astype(jnp.float32)), ("bh", "bh", "bh"), "bh", B, Hkv,
                  kc.shard_axes)
  return out[:, :, :R]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_rows(rows, index, updates, kc):
  return _add_rows_call(rows, index, updates, kc)


def _add_rows_fwd(rows, index, updates, kc):
  return _add_rows_call(rows, index, updates, kc), index


def _add_rows_bwd(kc, index, cotangent):
  """The sum is linear: rows pass their cotangent through; token c gets row ``index[c]``'s
  (zero where ``index[c]`` is out of range: "no row")."""
  R = cotangent.shape[2]
  gathered = jnp.take_along_axis(cotangent, jnp.minimum(index, R - 1)[..., None], axis=2)
  return cotangent, None, jnp.where((index < R)[..., None], gathered, 0.0)


_add_rows.defvjp(_add_rows_fwd, _add_rows_bwd)


def add_rows(rows, index, updates, *, kc: backend.KernelConfig):
  """``rows [B,Hkv,R,X]`` plus ``updates [B,Hkv,C,X]`` at rows ``index [B,Hkv,C]`` (``R`` or
  more: dropped), float32. Narrow rows (X < 16: the radius) use XLA's scatter: each appended row
  receives one token, so the scatter is deterministic, and a matmul of width 1 is no work for a
  matrix unit."""
  if rows.shape[-1] < 16:
    return add_rows_scatter(rows, index, updates)
  return _add_rows(rows.astype(jnp.float32), index.astype(jnp.int32), updates, kc)


def routing_ops(kc: backend.KernelConfig) -> RoutingOps:
  """The update's score reductions and accumulation as the kernels of this module."""
  return RoutingOps(novelty=functools.partial(max_scores, kc=kc),
                    targets=functools.partial(first_argmax_rows, kc=kc),
                    add_rows=functools.partial(add_rows, kc=kc))


def update_state_pallas(state: KVMState, overflow_k, overflow_v, overflow_g, n_append, params,
                        cfg, row_update="auto", read_keys=None, routing=None,
                        return_routing=False, may_append=True, head_major=False,
                        rows_after=None, *, kc: backend.KernelConfig):
  """Drop-in for :func:`kvm_jax.ops.kvm.state.update_state` with the tiled kernels. Given
  decisions (shared routing, the backward's replay) need no scores; they are accumulated by
  :func:`add_rows` all the same."""
  del row_update
  kc.check_sizes(chunk_size=overflow_k.shape[2 if head_major else 1],
                 head_dim=overflow_k.shape[3], value_dim=overflow_v.shape[3])
  return update_state(state, overflow_k, overflow_v, overflow_g, n_append, params, cfg,
                      read_keys=read_keys, routing=routing, return_routing=return_routing,
                      may_append=may_append, routing_ops=routing_ops(kc),
                      head_major=head_major, rows_after=rows_after)
