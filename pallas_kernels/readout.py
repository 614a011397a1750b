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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kvm_jax.kernels import backend
from kvm_jax.kernels.sharding import per_shard
from kvm_jax.ops.common import MASKED


def _readout_kernel(q_ref, sk_ref, sv_ref, sbias_ref, wk_ref, wv_ref, wbias_ref, st_ref, wt_ref,
                    y_ref, lse_ref, *, state_block: int, window_block: int,
                    kc: backend.KernelConfig):
  q = q_ref[...]                                   # [query block, D] input dtype
  value_dtype = wv_ref.dtype
  rows = q.shape[0]
  precision = kc.matmul_precision(q.dtype)
  mm = kc.for_matmul
  st, wt = st_ref[...], wt_ref[...]                # [G*Tq, 1] float32: temperature * 1/sqrt(D)
  m = jnp.full((rows, 1), MASKED, jnp.float32)
  l = jnp.zeros((rows, 1), jnp.float32)
  acc = jnp.zeros((rows, y_ref.shape[-1]), jnp.float32)

  def absorb(carry, s, v):
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    correction = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    l = l * correction + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * correction + jnp.dot(mm(p.astype(value_dtype)), mm(v.astype(value_dtype)),
                                     precision=precision, preferred_element_type=jnp.float32)
    return m_new, l, acc

  carry = (m, l, acc)
  num_rows = sk_ref.shape[0]
  for start in range(0, num_rows, state_block):    # static: the state capacity is static
    k = sk_ref[pl.ds(start, state_block), :].astype(q.dtype)
    v = sv_ref[pl.ds(start, state_block), :]
    s = jax.lax.dot_general(mm(q), mm(k),
                            (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    s = s * st + sbias_ref[:, pl.ds(start, state_block)]
    carry = absorb(carry, s, v)
  for start in range(0, wk_ref.shape[0], window_block):
    k = wk_ref[pl.ds(start, window_block), :]
    v = wv_ref[pl.ds(start, window_block), :]
    s = jax.lax.dot_general(mm(q), mm(k.astype(q.dtype)),
                            (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    carry = absorb(carry, s * wt + wbias_ref[:, pl.ds(start, window_block)], v)
  m, l, acc = carry
  y_ref[...] = (acc / l).astype(y_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _block(n: int, size: int = 128) -> int:
  """Key/query rows handled at once: 128 (a TPU lane tile; a Triton-sized tile) when it divides."""
  return size if n % size == 0 else n


def _forward(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
             state_scale, window_scale, kc):
  B, Hkv, GT, D = q.shape
  R, W, Dv = state_keys.shape[2], window_keys.shape[2], window_values.shape[3]
  BM = _block(GT)  # query rows per program: rows are independent (online softmax per row)
  per_head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b, h, i: (b, h, 0, 0))
  rows_of = lambda *tail: pl.BlockSpec((None, None, BM, *tail), lambda b, h, i: (b, h, i, 0))
  whole = lambda *shape: pl.BlockSpec(shape, lambda b, h, i: (0,) * len(shape))
  row_mask = pl.BlockSpec((BM, W), lambda b, h, i: (i, 0))
  row_scale = pl.BlockSpec((None, BM, 1), lambda b, h, i: (h, i, 0))
  kernel = functools.partial(_readout_kernel, state_block=_block(R), window_block=_block(W),
                             kc=kc)
  y, lse = pl.pallas_call(
      kernel,
      grid=(B, Hkv, GT // BM),
      in_specs=[rows_of(D), per_head(R, D), per_head(R, Dv), whole(1, R), per_head(W, D),
                per_head(W, Dv), row_mask, row_scale, row_scale],
      out_specs=[rows_of(Dv), rows_of(1)],
      out_shape=[jax.ShapeDtypeStruct((B, Hkv, GT, Dv), q.dtype),
                 jax.ShapeDtypeStruct((B, Hkv, GT, 1), jnp.float32)],
      interpret=kc.interpret,
      compiler_params=kc.compiler_params(3),
      name="kvm_fused_readout",
  )(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
    state_scale, window_scale)
  return y, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def fused_readout(q, state_keys, state_values, state_bias, window_keys, window_values, window_bias,
                  state_scale, window_scale, kc: backend.KernelConfig):
  """``y [B, Hkv, G·Tq, Dv]`` (q's dtype) and ``lse [B, Hkv, G·Tq, 1]`` (float32).

  Args:
    q: ``[B, Hkv, G·Tq, D]`` queries, row ``g·Tq + i``.
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout rows, float32.
    state_bias: ``[1, R]`` float32, 0 for visible rows and ``MASKED`` otherwise.
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
  precision = kc.matmul_precision(q.dtype) if not kc.triton else None
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
  """Drop-in for :func:`kvm_jax.ops.common.joint_attention` (same shapes and semantics) that
  runs :func:`fused_readout`: ``q [B, Tq, Hkv, G, D]`` -> ``[B, Tq, Hkv, G, Dv]`` float32."""
  B, Tq, Hkv, G, D = q.shape
  R, W = state_keys.shape[2], window_keys.shape[1]
  if state_values.ndim == 5:
    raise ValueError("the fused readout needs float32 state values (readout_value_dtype=None).")
  kc.check_sizes(head_dim=D, value_dim=window_values.shape[3])
  # Triton: power-of-two sizes and matmul operands of at least 16 rows (no-ops elsewhere).
  Tp = kc.padded_size(G * Tq) // G if kc.triton else Tq
  Rp, Wp = kc.padded_size(R), kc.padded_size(W)
  pad = backend.pad_axis
  qh = pad(jnp.transpose(q, (0, 2, 3, 1, 4)), 3, Tp).reshape(B, Hkv, G * Tp, D)
  wk = pad(jnp.transpose(window_keys, (0, 2, 1, 3)), 2, Wp)
  wv = pad(jnp.transpose(window_values, (0, 2, 1, 3)), 2, Wp)
  scale = 1.0 / np.sqrt(D)
  rows = lambda t: jnp.repeat(t.astype(jnp.float32) * scale, Tp, axis=1)[..., None]
  state_bias = jnp.where(jnp.broadcast_to(state_valid, (Tq, R))[:1], 0.0, MASKED)
  window_bias = jnp.where(jnp.broadcast_to(window_valid, (Tq, W)), 0.0, MASKED)
  window_bias = pad(pad(window_bias, 0, Tp), 1, Wp, MASKED)
  args = (qh, pad(state_keys.astype(jnp.float32), 2, Rp),
          pad(state_values.astype(jnp.float32), 2, Rp),
          pad(state_bias.astype(jnp.float32), 1, Rp, MASKED), wk, wv,
          jnp.tile(window_bias.astype(jnp.float32), (G, 1)), rows(state_temp), rows(window_temp))
  y, _ = per_shard(lambda *a: fused_readout(*a, kc), args,
                   ("bh", "bh", "bh", "r", "bh", "bh", "r", "h", "h"), ("bh", "bh"), B, Hkv,
                   kc.shard_axes)
  y = y.reshape(B, Hkv, G, Tp, -1)[:, :, :, :Tq]
  return jnp.transpose(y, (0, 3, 1, 2, 4)).astype(jnp.float32)
