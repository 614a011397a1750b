"""The OVQ oracle: the layer written as plainly as docs/ovq-rwkv7.md puts it, chunk by chunk, in
Python.

It is the yardstick of the chunked scan and the decode step, so it shares none of their
arithmetic: it works in the authors' ``[batch, heads, time, dim]`` layout, loops over chunks in
Python, slices the dictionary to its current size (dynamic shapes), scores only the rows that
exist, and writes every centroid as the running mean of what was ever assigned to it, from one-hot
assignments. Slow by design: use small shapes. It is traceable by
``jax.grad`` (its control flow depends on positions only), so gradients are compared too.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.ops.ovq.state import OVQState

_HI = jax.lax.Precision.HIGHEST


def _attend(q, keys, values, bias):
  """softmax(q keysᵀ + bias) values, scale 1: ``q [B,H,n,D]``, ``keys [B,H,m,D]``,
  ``bias [B or 1, H or 1, n or 1, m]``."""
  s = jnp.einsum("bhnd,bhmd->bhnm", q, keys, precision=_HI) + bias
  return jnp.einsum("bhnm,bhmd->bhnd", jax.nn.softmax(s, axis=-1), values, precision=_HI)


def _norm(x):
  """‖x‖₂ over the last axis, keepdims, with torch's zero gradient at 0 (not NaN)."""
  sq = (x * x).sum(-1, keepdims=True)
  return jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)


def _log_counts(counts):
  return jnp.where(counts > 0, jnp.log(jnp.where(counts > 0, counts, 1.0)), -jnp.inf)


def _assignments(keys_c, dict_keys, num_new: int):
  """Centroid index of every token of a chunk ``[B, H, n]`` (int32). The ``num_new`` tokens least
  similar to their nearest centroid open new rows, the least similar first (ties: the earlier
  token); with an empty dictionary the first token opens row 0 and the ``num_new - 1`` tokens least
  like it open the next rows."""
  keys_c, dict_keys = jax.lax.stop_gradient(keys_c), jax.lax.stop_gradient(dict_keys)
  n, size = keys_c.shape[2], dict_keys.shape[2]
  if size == 0:
    sim = jnp.einsum("bhnd,bhd->bhn", keys_c, keys_c[:, :, 0], precision=_HI)
    sim = sim.at[:, :, 0].set(jnp.inf)
    best = jnp.zeros(sim.shape, jnp.int32)
    first_new, count = 1, num_new - 1
  else:
    sim_all = jnp.einsum("bhnd,bhmd->bhnm", keys_c, dict_keys, precision=_HI)
    best, sim = jnp.argmax(sim_all, -1).astype(jnp.int32), jnp.max(sim_all, -1)
    first_new, count = size, num_new
  if count <= 0:
    return best
  order = jnp.argsort(sim, axis=-1, stable=True)          # least similar first
  for rank in range(count):
    token = order[:, :, rank:rank + 1]                      # [B, H, 1]
    best = jnp.where(jnp.arange(n) == token, first_new + rank, best)
  return best


def _fold(state: OVQState, size: int, num_new: int, keys_c, values_c, scaled_keys_c,
          cfg: OVQConfig) -> OVQState:
  """The dictionary after one chunk's tokens ``[B, H, n, ·]`` are assigned and folded in: every
  centroid is the running mean of the keys (values) assigned to it, i.e. with count c before and
  m tokens now, ``(c·old + sum) / (c + m)``."""
  dk, dv, counts = state.keys, state.values, state.counts
  assign = _assignments(keys_c, dk[:, :, :size], num_new)
  onehot = jax.nn.one_hot(assign, dk.shape[2], dtype=jnp.float32)     # [B, H, n, R]
  added = onehot.sum(2)                                                # [B, H, R]
  new_counts = counts + added
  denominator = jnp.where(new_counts > 0, new_counts, 1.0)[..., None]
  key_sums = jnp.einsum("bhnr,bhnd->bhrd", onehot, keys_c, precision=_HI)
  dk = (counts[..., None] * dk + key_sums) / denominator
  if cfg.delta_rule:
    if size == 0:
      predicted = jnp.zeros_like(values_c)
    else:
      bias = (_log_counts(counts[:, :, :size])[:, :, None] if cfg.count_bias
              else jnp.zeros((1, 1, 1, size), jnp.float32))
      predicted = _attend(scaled_keys_c, state.keys[:, :, :size], state.values[:, :, :size],
                          bias)
    errors = jnp.einsum("bhnr,bhnd->bhrd", onehot, values_c - predicted, precision=_HI)
    dv = dv + errors / denominator
  else:
    value_sums = jnp.einsum("bhnr,bhnd->bhrd", onehot, values_c, precision=_HI)
    dv = (counts[..., None] * dv + value_sums) / denominator
  if cfg.normalize_centroids:
    unit = lambda x: x / jnp.maximum(_norm(x), 1e-12)
    dk = unit(dk)
    if not cfg.delta_rule:
      dv = unit(dv)
  return OVQState(keys=dk, values=dv, counts=new_counts)


def ovq_attention_reference(q, k, v, beta, cfg: OVQConfig):
  """Outputs ``[B, T, H, Dv]`` (the dtype of ``v``) and the final :class:`OVQState` (rows: the
  schedule's size after every chunk, the partial last one included).

  ``q``, ``k`` ``[B, T, H, D]`` are the L2-normalized queries and keys, ``v`` ``[B, T, H, Dv]``,
  ``beta`` ``[H]`` the per-head temperature: scores are ``beta·√D · q·k`` (softmax scale 1).
  """
  B, T, H, D = q.shape
  Dv = v.shape[-1]
  f32 = lambda x: jnp.swapaxes(x, 1, 2).astype(jnp.float32)   # [B, H, T, ·]
  qh, kh, vh = f32(q), f32(k), f32(v)
  scale = beta.astype(jnp.float32).reshape(1, H, 1, 1) * math.sqrt(D)
  qh = qh * scale
  sizes = cfg.dictionary_sizes(T)
  rows = max(1, sizes[-1])
  state = OVQState(keys=jnp.zeros((B, H, rows, D), jnp.float32),
                   values=jnp.zeros((B, H, rows, Dv), jnp.float32),
                   counts=jnp.zeros((B, H, rows), jnp.float32))
  C = cfg.chunk_size
  outs = []
  for c in range(len(sizes) - 1):
    s, e = c * C, min(T, (c + 1) * C)
    n, size = e - s, sizes[c]
    keys = jnp.concatenate([state.keys[:, :, :size], kh[:, :, s:e]], axis=2)
    values = jnp.concatenate([state.values[:, :, :size], vh[:, :, s:e]], axis=2)
    causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
    chunk_bias = jnp.where(causal, 0.0, -jnp.inf)[None, None]          # [1, 1, n, n]
    if cfg.count_bias:
      dict_bias = jnp.broadcast_to(_log_counts(state.counts[:, :, :size])[:, :, None],
                                   (B, H, n, size))
    else:
      dict_bias = jnp.zeros((B, H, n, size), jnp.float32)
    bias = jnp.concatenate([dict_bias, jnp.broadcast_to(chunk_bias, (B, H, n, n))], axis=-1)
    outs.append(_attend(qh[:, :, s:e], keys, values, bias))
    state = _fold(state, size, sizes[c + 1] - size, kh[:, :, s:e], vh[:, :, s:e],
                  kh[:, :, s:e] * scale, cfg)
  y = jnp.swapaxes(jnp.concatenate(outs, axis=2), 1, 2).astype(v.dtype)
  return y, state
