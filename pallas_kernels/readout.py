"""Fused KVM readout: one pass of flash-style online softmax over [state rows ; exact window].

For one query chunk, every program (batch b, KV head h) holds the G·Tq queries of its head group
(row ``g·Tq + i``) and streams

* the readout state rows (``LN_s`` keys, radius-normalized values, float32) in blocks, scaled by
  the state temperature, invalid rows masked by an additive bias;
* the exact window (previous ``window_chunks - 1`` chunks and the causal current chunk), scaled by
  the window temperature, masked by an additive ``[Tq, W]`` bias;

keeping a running max, sum and float32 accumulator, so the ``[state ; window]`` concatenation is
never materialized. It writes the output and the log-sum-exp. The backward pass (``custom_vjp``)
recomputes the probabilities from the saved log-sum-exp — flash attention's backward, in XLA —
and returns gradients for the queries, state keys/values, window keys/values and both
temperatures; nothing of size ``[Tq, R + W]`` is stored between the passes.

Layout is head-major, ``[B, Hkv, rows, dim]``: the last two block dimensions are whole array
dimensions (legal for TPU (8, 128) tiling), and the kernel has no data-dependent shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvm_jax.kernels import backend
from kvm_jax.kernels.sharding import per_shard
from kvm_jax.ops.common import MASKED

TPU_LANES = 128  # the lane width of a TPU vector register: Mosaic's unit of dynamic lane slices


@dataclasses.dataclass(frozen=True)
class ReadoutBlocks:
  """Tile sizes of the readout: ``queries`` rows per program, ``state`` rows and ``window`` slots
  per loop step, and the padded sizes the wrapper allocates (multiples of the tiles)."""

  queries: int
  state: int
  window: int
  queries_padded: int
  state_padded: int
  window_padded: int


def readout_blocks(GT: int, R: int, W: int, platform: str, interpret: bool = False
                   ) -> ReadoutBlocks:
  """Tiles for ``GT = G·Tq`` query rows per KV head against ``R`` state and ``W`` window rows.

  GPU (Triton): 64 x 64 tiles, power-of-two sizes (a [64, 128] bf16 operand is 16 KiB; with the
  score tile and a float32 accumulator a program holds well under 100 KiB).

  TPU (Mosaic, compiled or interpreted): each loop step slices the ``[1, R]`` state bias and the
  ``[rows, W]`` window bias along their last (lane) dimension at a dynamic offset, and Mosaic
  accepts such a slice only where it can prove the offset a multiple of 128 (error E2003
  otherwise): the state and window steps are exactly 128 rows, and R and W are padded to whole
  steps (a 1-row state is read as one masked 128-row step). Query rows: at most 128 per program,
  a multiple of 8 sublanes, or all of them.

  Interpreted elsewhere (CPU): steps of at most 128 rows, multiples of 8, the fewest padded rows."""
  pow2 = lambda n: max(16, 1 << (max(n, 1) - 1).bit_length())
  if platform == "gpu" and not interpret:
    return ReadoutBlocks(min(64, pow2(GT)), min(64, pow2(R)), min(64, pow2(W)), pow2(GT),
                         pow2(R), pow2(W))
  up = lambda n, m: -(-n // m) * m
  queries = min(128, up(GT, 8))
  if platform == "tpu":
    state = window = TPU_LANES
  else:
    state, window = (min(128, up(n, 8)) for n in (R, W))
  return ReadoutBlocks(queries, state, window, up(GT, queries), up(R, state), up(W, window))


def readout_working_set(GT, R, W, D, Dv, dtype, platform) -> backend.WorkingSet:
  """The readout (``kvm_jax.kernels.readout``) for G·Tq query rows, R state, W window rows."""
  dense, stages = backend.nbytes, backend.GPU_STAGES
  WorkingSet = backend.WorkingSet
  b = readout_blocks(GT, R, W, platform)
  f32 = jnp.float32
  if platform == "gpu":
    step = max(b.state, b.window)
    shared = dense((b.queries, D), dtype) + stages * (
        dense((step, D), dtype) + dense((step, Dv), dtype) + dense((b.queries, step), f32))
    registers = (2 * dense((b.queries, step), f32) + dense((b.queries, Dv), f32)
                 + 4 * dense((b.queries, 1), f32))
    return WorkingSet("readout", shared=shared, registers=registers)
  blocks = [((b.queries, D), dtype), ((b.state_padded, D), dtype), ((b.state_padded, Dv), dtype),
            ((1, b.state_padded), f32), ((b.window_padded, D), dtype),
            ((b.window_padded, Dv), dtype), ((b.queries, b.window_padded), f32),
            ((b.queries, 1), f32), ((b.queries, 1), f32), ((b.queries, Dv), dtype),
            ((b.queries, 1), f32)]
  # score, probabilities, exp temporaries; accumulator; running max and sum
  scratch = [((b.queries, max(b.state, b.window)), f32)] * 3 + [((b.queries, Dv), f32)] + \
      [((b.queries, 1), f32)] * 2
  return WorkingSet("readout", vmem=backend.tpu_vmem(blocks, scratch))


def _readout_kernel(ranges_ref, q_ref, sk_ref, sv_ref, sbias_ref, wk_ref, wv_ref, wbias_ref,
                    st_ref, wt_ref, y_ref, lse_ref, *, state_block: int, window_block: int,
                    kc: backend.KernelConfig):
  qb = pl.program_id(2)
  q = q_ref[...]                                   # [query block, D] input dtype
  value_dtype = wv_ref.dtype
  rows = q.shape[0]
  precision = kc.matmul_precision(q.dtype)
  mm = kc.for_matmul
  st, wt = st_ref[...], wt_ref[...]                # [rows, 1] float32: temperature * 1/sqrt(D)

  def scores(k):
    return jax.lax.dot_general(mm(q), mm(k.astype(q.dtype)), (((1,), (1,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)

  def absorb(carry, s, v):
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * correction + jnp.dot(mm(p.astype(value_dtype)), mm(v.astype(value_dtype)),
                                     precision=precision, preferred_element_type=jnp.float32)
    return m_new, l, acc

  def state_step(j, carry):
    start = pl.multiple_of(j * state_block, state_block)
    k = sk_ref[pl.ds(start, state_block), :]
    s = scores(k) * st + sbias_ref[:, pl.ds(start, state_block)]
    return absorb(carry, s, sv_ref[pl.ds(start, state_block), :])

  def window_step(j, carry):
    start = pl.multiple_of(j * window_block, window_block)
    s = scores(wk_ref[pl.ds(start, window_block), :]) * wt
    return absorb(carry, s + wbias_ref[:, pl.ds(start, window_block)],
                  wv_ref[pl.ds(start, window_block), :])

  carry = (jnp.full((rows, 1), MASKED, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
           jnp.zeros((rows, y_ref.shape[-1]), jnp.float32))
  # Only the state rows some query may see (a dynamic bound: the valid rows), and only the window
  # blocks with a visible slot for this query block (the causal front's and the future's skipped).
  state_end = ranges_ref[qb, 0]
  carry = jax.lax.fori_loop(0, jax.lax.div(state_end + state_block - 1, state_block),
                            state_step, carry)
  carry = jax.lax.fori_loop(ranges_ref[qb, 1], ranges_ref[qb, 2], window_step, carry)
  m, l, acc = carry
  y_ref[...] = (acc / l).astype(y_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _block_ranges(state_bias, window_bias, blocks: ReadoutBlocks):
  """``[query blocks, 4]`` int32: the state row bound and the window block range each query
  block needs (from the masks: rows/slots with bias 0 are visible)."""
  n_q = blocks.queries_padded // blocks.queries
  # One bound for every batch row and head: the most rows any of them sees (the bias masks the
  # rest of a row with fewer).
  visible_state = jnp.any(state_bias > MASKED / 2, axis=(0, 1, 2))              # [Rp]
  state_end = jnp.max(jnp.where(visible_state, jnp.arange(visible_state.shape[0]) + 1, 0))
  n_k = window_bias.shape[1] // blocks.window
  seen = (window_bias > MASKED / 2).reshape(n_q, blocks.queries, n_k,
                                            blocks.window).any(axis=(1, 3))
  first = jnp.argmax(seen, axis=1)
  stop = n_k - jnp.argmax(seen[:, ::-1], axis=1)
  none = ~seen.any(axis=1)
  first, stop = jnp.where(none, 0, first), jnp.where(none, 0, stop)
  return jnp.stack([jnp.broadcast_to(state_end, (n_q,)), first, stop, jnp.zeros_like(first)],
                   axis=1).astype(jnp.int32)


def _forward_padded(q, state_keys, state_values, state_bias, window_keys, window_values,
                    window_bias, state_scale, window_scale, kc, blocks: ReadoutBlocks):
  """:func:`_forward` for sizes that are not whole tiles: pads to ``blocks``' sizes (state rows
  and window slots masked; extra query rows, whose outputs are dropped, see only masked slots,
  which the finite ``MASKED`` keeps finite) and drops the padding from the outputs."""
  GT, Wp = q.shape[2], blocks.window_padded
  pad = backend.pad_axis
  window_bias = pad(pad(window_bias, 1, Wp, MASKED), 0, blocks.queries_padded, MASKED)
  y, lse = _forward(
      pad(q, 2, blocks.queries_padded), pad(state_keys, 2, blocks.state_padded),
      pad(state_values, 2, blocks.state_padded),
      pad(state_bias, 3, blocks.state_padded, MASKED), pad(window_keys, 2, Wp),
      pad(window_values, 2, Wp), window_bias, pad(state_scale, 1, blocks.queries_padded, 1.0),
      pad(window_scale, 1, blocks.queries_padded, 1.0), kc)
  return y[:, :, :GT], lse[:, :, :GT]


def _forward(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
             state_scale, window_scale, kc):
  B, Hkv, GT, D = q.shape
  R, W, Dv = state_keys.shape[2], window_keys.shape[2], window_values.shape[3]
  blocks = readout_blocks(GT, R, W, kc.platform, kc.interpret)
  if (blocks.queries_padded, blocks.state_padded, blocks.window_padded) != (GT, R, W):
    return _forward_padded(q, state_keys, state_values, state_bias, window_keys, window_values,
                           window_bias, state_scale, window_scale, kc, blocks)
  BM = blocks.queries
  ranges = _block_ranges(state_bias, window_bias, blocks)
  per_head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b, h, i: (b, h, 0, 0))
  rows_of = lambda *tail: pl.BlockSpec((None, None, BM, *tail), lambda b, h, i: (b, h, i, 0))
  row_mask = pl.BlockSpec((BM, W), lambda b, h, i: (i, 0))
  row_scale = pl.BlockSpec((None, BM, 1), lambda b, h, i: (h, i, 0))
  kernel = functools.partial(_readout_kernel, state_block=blocks.state,
                             window_block=blocks.window, kc=kc)
  y, lse = pl.pallas_call(
      kernel,
      grid=(B, Hkv, GT // BM),
      in_specs=[backend.scalar_bounds_spec(kc, ranges.shape), rows_of(D), per_head(R, D),
                per_head(R, Dv), per_head(1, R), per_head(W, D), per_head(W, Dv), row_mask,
                row_scale, row_scale],
      out_specs=[rows_of(Dv), rows_of(1)],
      out_shape=[jax.ShapeDtypeStruct((B, Hkv, GT, Dv), q.dtype),
                 jax.ShapeDtypeStruct((B, Hkv, GT, 1), jnp.float32)],
      interpret=kc.interpret,
      compiler_params=kc.compiler_params(3, readout_working_set(
          GT, R, W, D, Dv, q.dtype, kc.platform)),
      name="kvm_fused_readout",
  )(ranges, q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
    state_scale, window_scale)
  return y, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def fused_readout(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
                  state_scale, window_scale, kc: backend.KernelConfig):
  """``y [B, Hkv, G·Tq, Dv]`` (q's dtype) and ``lse [B, Hkv, G·Tq, 1]`` (float32).

  Args:
    q: ``[B, Hkv, G·Tq, D]`` queries, row ``g·Tq + i``.
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout rows, float32.
    state_bias: ``[B, Hkv, 1, R]`` float32, 0 for the rows each batch row sees and ``MASKED``
      otherwise (a row count per batch row: packed documents).
    window_keys / window_values: ``[B, Hkv, W, D]`` / ``[B, Hkv, W, Dv]``.
    window_bias: ``[G·Tq, W]`` float32 additive mask (causal, in-sequence; the same for every
      head of a group).
    state_scale / window_scale: ``[Hkv, G·Tq, 1]`` float32 temperature · 1/sqrt(D) per row.
    kc: the :class:`backend.KernelConfig` (static).
  """
  return _forward(q, state_keys, state_values, state_bias, window_keys, window_values,
                  window_bias, state_scale, window_scale, kc)


def _fwd(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
         state_scale, window_scale, kc):
  y, lse = _forward(q, state_keys, state_values, state_bias, window_keys, window_values,
                    window_bias, state_scale, window_scale, kc)
  saved = (q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
           state_scale, window_scale, y, lse)
  return (y, lse), saved


def _bwd(kc, saved, cotangents):
  """Flash-attention backward from the saved log-sum-exp (the LSE's own cotangent is ignored:
  nothing downstream differentiates it)."""
  (q, state_keys, state_values, state_bias, window_keys, window_values, window_bias, state_scale,
   window_scale, y, lse) = saved
  dy = cotangents[0].astype(jnp.float32)
  precision = kc.matmul_precision(q.dtype)  # XLA einsums: float32 stays float32 (no TF32)
  value_dtype = window_values.dtype
  qf = q.astype(jnp.float32)
  # delta_i = sum_v dy_iv y_iv  (= sum_j p_ij dp_ij)
  delta = jnp.sum(dy * y.astype(jnp.float32), axis=-1, keepdims=True)
  dot = functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)

  def part(keys, values, scale, bias):
    raw = dot("bhqd,bhkd->bhqk", q, keys.astype(q.dtype))
    p = jnp.exp(raw * scale + bias - lse)                              # [B, Hkv, GT, K]
    dv = dot("bhqk,bhqv->bhkv", p.astype(value_dtype).astype(jnp.float32), dy)
    dp = dot("bhqv,bhkv->bhqk", dy, values.astype(value_dtype).astype(jnp.float32))
    ds = p * (dp - delta)                                              # d(score)
    dscale = jnp.sum(ds * raw, axis=(0, 3))[..., None]                 # [Hkv, GT, 1]
    ds = ds * scale
    dq = dot("bhqk,bhkd->bhqd", ds, keys.astype(jnp.float32))
    dk = dot("bhqk,bhqd->bhkd", ds, qf)
    return dq, dk, dv, dscale

  dq_s, dk_s, dv_s, dscale_s = part(state_keys, state_values, state_scale, state_bias)
  dq_w, dk_w, dv_w, dscale_w = part(window_keys, window_values, window_scale, window_bias)
  return ((dq_s + dq_w).astype(q.dtype), dk_s.astype(state_keys.dtype),
          dv_s.astype(state_values.dtype), jnp.zeros_like(state_bias),
          dk_w.astype(window_keys.dtype), dv_w.astype(window_values.dtype),
          jnp.zeros_like(window_bias), dscale_s, dscale_w)


fused_readout.defvjp(_fwd, _bwd)


def joint_attention_pallas(q, state_keys, state_values, state_valid, window_keys, window_values,
                           window_valid, state_temp, window_temp, *, kc: backend.KernelConfig):
  """Drop-in for :func:`kvm_jax.ops.common.joint_attention` (token-major): transposes around
  :func:`joint_attention_heads_pallas`. ``q [B, Tq, Hkv, G, D]`` -> ``[B, Tq, Hkv, G, Dv]``."""
  y = joint_attention_heads_pallas(
      jnp.transpose(q, (0, 2, 3, 1, 4)), state_keys, state_values, state_valid,
      jnp.transpose(window_keys, (0, 2, 1, 3)), jnp.transpose(window_values, (0, 2, 1, 3)),
      window_valid, state_temp, window_temp, kc=kc)
  return jnp.transpose(y, (0, 3, 1, 2, 4))


def joint_attention_heads_pallas(q, state_keys, state_values, state_valid, window_keys,
                                 window_values, window_valid, state_temp, window_temp, *,
                                 kc: backend.KernelConfig):
  """Drop-in for :func:`kvm_jax.ops.common.joint_attention_heads` (the scan's head-major
  layout, prepared once per sequence) that runs :func:`fused_readout`:
  ``q [B, Hkv, G, Tq, D]``, window ``[B, Hkv, W, ·]`` -> ``[B, Hkv, G, Tq, Dv]`` float32.

  The readout state enters in the dtypes the XLA readout multiplies in (keys in q's dtype, values
  in the window values' dtype), so a bfloat16 model's kernel reads half the bytes."""
  B, Hkv, G, Tq, D = q.shape
  R, W = state_keys.shape[2], window_keys.shape[2]
  if state_values.ndim == 5:
    raise ValueError("the fused readout needs one state value per KV head "
                     "(readout_value_dtype=None).")
  kc.check_sizes(head_dim=D, value_dim=window_values.shape[3])
  # query rows g·Tp + i; padded rows (i >= Tq) see nothing new and are dropped at the end.
  # The kernel pads the rest to its tiles itself (:func:`_forward_padded`).
  Tp = kc.padded_size(G * Tq) // G if kc.triton else Tq  # Triton: G·Tp a power of two
  pad = backend.pad_axis
  qh = pad(q, 3, Tp).reshape(B, Hkv, G * Tp, D)
  scale = 1.0 / np.sqrt(D)

  def rows(t):
    return jnp.repeat(t.astype(jnp.float32) * scale, Tp, axis=1)[..., None]   # [Hkv, G·Tp, 1]

  # One state mask per batch row: the queries of a row see the same rows (the rows of a packed
  # document's state differ from row to row, ``state_valid [B, 1, 1, ·, R]``).
  if np.ndim(state_valid) > 2:
    rows_seen = jnp.broadcast_to(state_valid, (B, 1, 1, Tq, R))[:, :, :, 0]     # [B, 1, 1, R]
  else:
    rows_seen = jnp.broadcast_to(state_valid, (Tq, R))[None, None, :1]          # [1, 1, 1, R]
  state_bias = jnp.broadcast_to(jnp.where(rows_seen, 0.0, MASKED), (B, Hkv, 1, R))
  window_bias = jnp.where(jnp.broadcast_to(window_valid, (Tq, W)), 0.0, MASKED)
  window_bias = jnp.tile(pad(window_bias, 0, Tp), (G, 1))                       # [G·Tp, W]
  args = (qh, state_keys.astype(q.dtype), state_values.astype(window_values.dtype),
          state_bias.astype(jnp.float32), window_keys, window_values,
          window_bias.astype(jnp.float32), rows(state_temp), rows(window_temp))
  y, _ = per_shard(lambda *a: fused_readout(*a, kc), args,
                   ("bh", "bh", "bh", "bh", "bh", "bh", "r", "h", "h"), ("bh", "bh"), B, Hkv,
                   kc.shard_axes)
  return y.reshape(B, Hkv, G, Tp, -1)[:, :, :, :Tq].astype(jnp.float32)
