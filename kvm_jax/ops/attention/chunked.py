"""Causal (optionally sliding-window) softmax attention in plain XLA without ``[T, T]`` scores.

The forward pass walks key blocks with an online softmax (running max, normalizer, accumulator)
and keeps only the output and the log-sum-exp of every query row; the backward pass recomputes
each block's probabilities from them (the FlashAttention recipe, written with ``lax`` loops so it
runs on every backend). Peak memory is O(T·block) instead of O(T²), forward and backward.

Only the key blocks a query block can see are visited: ``[0, i]`` for causal attention, the few
blocks overlapping ``(p - window, p]`` for a sliding window, so the work is ~T²/2 (causal) or
~T·window (window) score entries.

Layout ``[batch, time, heads, dim]``; GQA by ``H % Hkv == 0`` (query heads grouped per KV head).
Scores, softmax statistics and accumulators are float32; matmul operands stay in the input dtype
(bf16 inputs: float32 accumulation, probabilities cast to the value dtype like XLA's dense path).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from kvm_jax.ops.common import soft_capped

Array = jax.Array

DEFAULT_BLOCK = 512
_NEG = -1e30  # finite "minus infinity": exp(_NEG - m) underflows to 0 without inf - inf NaNs


def chunked_attention(q: Array, k: Array, v: Array, *, window: Optional[int] = None,
                      scale: Optional[float] = None, block: int = DEFAULT_BLOCK,
                      softcap: Optional[float] = None) -> Array:
  """Causal attention; ``window`` = w restricts query p to keys (p - w, p] (None: all of [0, p]).

  Args:
    q: ``[B, T, H, D]``; k: ``[B, T, Hkv, D]``; v: ``[B, T, Hkv, Dv]``.
    window: sliding-window length in tokens (the query's own token included), or None.
    scale: softmax scale (default ``1/sqrt(D)``).
    block: query and key block length; sequences are padded to a multiple of it (a sequence no
      longer than ``block`` is one block).
    softcap: None, or scaled scores become ``cap · tanh(score / cap)`` (Gemma 2); the backward
      pass multiplies their gradients by the derivative ``1 - tanh²``.
  Returns:
    ``[B, T, H, Dv]`` in ``q.dtype``.
  """
  B, T, H, D = q.shape
  if k.shape[:2] != (B, T) or v.shape[:3] != k.shape[:3] or k.shape[-1] != D:
    raise ValueError(f"chunked_attention: q {q.shape}, k {k.shape}, v {v.shape} do not fit "
                     "[B, T, H, D], [B, T, Hkv, D], [B, T, Hkv, Dv].")
  if H % k.shape[2]:
    raise ValueError(f"chunked_attention: {H} query heads are not a multiple of {k.shape[2]} "
                     "KV heads.")
  if window is not None and window < 1:
    raise ValueError(f"chunked_attention: window must be >= 1, got {window}.")
  if block < 1:
    raise ValueError(f"chunked_attention: block must be >= 1, got {block}.")
  if softcap is not None and not softcap > 0:
    raise ValueError(f"chunked_attention: softcap must be positive or None, got {softcap}.")
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
  return _attention(q, k, v, window, (scale, None if softcap is None else float(softcap)),
                    min(block, T))


# -- layout helpers ----------------------------------------------------------------------------
def _blocked(x: Array, n: int, block: int) -> Array:
  """``[B, T, ...]`` -> ``[n, B, block, ...]`` (T padded with zeros to ``n · block``)."""
  pad = n * block - x.shape[1]
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  return jnp.moveaxis(x.reshape(x.shape[0], n, block, *x.shape[2:]), 1, 0)


def _unblocked(x: Array, T: int) -> Array:
  """``[n, B, block, ...]`` -> ``[B, T, ...]``."""
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :T]


def _key_range(i, block: int, window: Optional[int]):
  """Key blocks ``[lo, hi]`` that query block ``i`` can see (blocks of equal length)."""
  hi = i
  if window is None:
    return jnp.zeros_like(i), hi
  return jnp.maximum(0, (i * block - window + 1) // block), hi


def _query_range(j, n: int, block: int, window: Optional[int]):
  """Query blocks ``[lo, hi]`` that can see key block ``j``."""
  lo = j
  if window is None:
    return lo, jnp.full_like(j, n - 1)
  return lo, jnp.minimum(n - 1, (j * block + block - 1 + window - 1) // block)


def _mask(i, j, block: int, T: int, window: Optional[int]) -> Array:
  """``[block_q, block_k]``: key visible to query (causal, in the window, not padding)."""
  qp = i * block + jnp.arange(block)[:, None]
  kp = j * block + jnp.arange(block)[None, :]
  ok = (kp <= qp) & (kp < T)
  if window is not None:
    ok &= kp > qp - window
  return ok


def _scores(qb: Array, kb: Array, scaling) -> Array:
  """``qb [B, bq, Hkv, G, D]``, ``kb [B, bk, Hkv, D]`` -> ``[B, Hkv, G, bq, bk]`` float32,
  scaled and soft-capped (``scaling`` = (scale, softcap or None))."""
  scale, softcap = scaling
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
  return soft_capped(s, softcap)


# -- forward -----------------------------------------------------------------------------------
def _forward(q, k, v, window, scaling, block):
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[-1]
  G = H // Hkv
  n = -(-T // block)
  qs = _blocked(q.reshape(B, T, Hkv, G, D), n, block)          # [n, B, bq, Hkv, G, D]
  ks, vs = _blocked(k, n, block), _blocked(v, n, block)        # [n, B, bk, Hkv, D/Dv]

  def one_query_block(args):
    i, qb = args

    def visit(j, carry):
      m, l, acc = carry
      s = jnp.where(_mask(i, j, block, T, window), _scores(qb, ks[j], scaling), _NEG)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), vs[j],
                      preferred_element_type=jnp.float32)
      return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv

    lo, hi = _key_range(i, block, window)
    init = (jnp.full((B, Hkv, G, block), _NEG, jnp.float32),
            jnp.zeros((B, Hkv, G, block), jnp.float32),
            jnp.zeros((B, Hkv, G, block, Dv), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi + 1, visit, init)
    out = acc / l[..., None]                                    # every row sees its own key
    return jnp.einsum("bhgqd->bqhgd", out).astype(q.dtype), m + jnp.log(l)

  out, lse = jax.lax.map(one_query_block, (jnp.arange(n), qs))
  # out [n, B, bq, Hkv, G, Dv], lse [n, B, Hkv, G, bq]
  return _unblocked(out, T).reshape(B, T, H, Dv), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _attention(q, k, v, window, scaling, block):
  return _forward(q, k, v, window, scaling, block)[0]


def _attention_fwd(q, k, v, window, scaling, block):
  out, lse = _forward(q, k, v, window, scaling, block)
  return out, (q, k, v, out, lse)


# -- backward ----------------------------------------------------------------------------------
def _attention_bwd(window, scaling, block, residuals, d_out):
  q, k, v, out, lse = residuals
  scale, softcap = scaling
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[-1]
  G = H // Hkv
  n = -(-T // block)
  # delta_p = sum_d dO·O per query row: the softmax-gradient correction (FlashAttention-2).
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1)       # [B, T, H]
  qs = _blocked(q.reshape(B, T, Hkv, G, D), n, block)
  dos = _blocked(d_out.reshape(B, T, Hkv, G, Dv), n, block)
  deltas = jnp.einsum("nbqhg->nbhgq", _blocked(delta.reshape(B, T, Hkv, G), n, block))
  ks, vs = _blocked(k, n, block), _blocked(v, n, block)

  def block_grads(i, j):
    """Probabilities and score gradients of query block i against key block j."""
    capped = _scores(qs[i], ks[j], scaling)
    s = jnp.where(_mask(i, j, block, T, window), capped, _NEG)
    p = jnp.exp(s - lse[i][..., None])                                # [B, Hkv, G, bq, bk]
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dos[i], vs[j], preferred_element_type=jnp.float32)
    ds = p * (dp - deltas[i][..., None])
    if softcap is not None:  # d(cap·tanh(s/cap))/ds = 1 - tanh², and tanh = capped / cap
      ds = ds * (1.0 - jnp.square(capped / softcap))
    return p, ds

  def dq_block(i):
    def visit(j, dq):
      _, ds = block_grads(i, j)
      return dq + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(k.dtype), ks[j],
                             preferred_element_type=jnp.float32)
    lo, hi = _key_range(i, block, window)
    dq = jax.lax.fori_loop(lo, hi + 1, visit, jnp.zeros((B, block, Hkv, G, D), jnp.float32))
    return dq * scale

  def dkv_block(j):
    def visit(i, carry):
      dk, dv = carry
      p, ds = block_grads(i, j)
      dv = dv + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(d_out.dtype), dos[i],
                           preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(q.dtype), qs[i],
                           preferred_element_type=jnp.float32)
      return dk, dv
    lo, hi = _query_range(j, n, block, window)
    init = (jnp.zeros((B, block, Hkv, D), jnp.float32), jnp.zeros((B, block, Hkv, Dv), jnp.float32))
    dk, dv = jax.lax.fori_loop(lo, hi + 1, visit, init)
    return dk * scale, dv

  dq = jax.lax.map(dq_block, jnp.arange(n))
  dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
  dq = _unblocked(dq, T).reshape(B, T, H, D).astype(q.dtype)
  return dq, _unblocked(dk, T).astype(k.dtype), _unblocked(dv, T).astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)
