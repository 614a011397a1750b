"""OVQ decoding: a cache holding the dictionary and the current chunk's tokens, the prefill that
fills it, and the one-token step.

A token attends to the dictionary as it stood at the start of its chunk, to the earlier tokens of
its chunk and to itself; when it completes a chunk, the chunk is folded into the dictionary (the
step's one conditional, every ``chunk_size`` tokens). The position is traced, so one compiled step
serves every position.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.common import batch_rows
from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.ops.ovq.scan import heads_first, query_scale, run_chunks
from kvm_jax.ops.ovq.state import OVQState, empty_state, fold, readout, validate_inputs

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class OVQCache:
  """Decode state of one OVQ layer.

  Attributes:
    state: the dictionary (:class:`OVQState`, ``cfg.capacity(max_len)`` rows).
    pending_keys / pending_values: ``[B, H, C, D]`` / ``[B, H, C, Dv]`` float32, the tokens of the
      chunk being filled (slots ``[0, length % C)`` hold them).
    length: ``[B]`` int32, tokens each row has seen (rows are independent sequences).
    max_len: the longest sequence the cache was sized for (static).
  """

  state: OVQState
  pending_keys: Array
  pending_values: Array
  length: Array
  max_len: int


jax.tree_util.register_dataclass(
    OVQCache, data_fields=["state", "pending_keys", "pending_values", "length"],
    meta_fields=["max_len"])


def ovq_init_cache(cfg: OVQConfig, *, batch: int, heads: int, head_dim: int, value_dim: int,
                   max_len: int) -> OVQCache:
  """An empty cache for sequences of up to ``max_len`` tokens."""
  if max_len < 1:
    raise ValueError(f"max_len must be >= 1, got {max_len}.")
  C = cfg.chunk_size
  return OVQCache(state=empty_state(batch, heads, cfg.capacity(max_len), head_dim, value_dim),
                  pending_keys=jnp.zeros((batch, heads, C, head_dim), jnp.float32),
                  pending_values=jnp.zeros((batch, heads, C, value_dim), jnp.float32),
                  length=jnp.zeros((batch,), jnp.int32), max_len=max_len)


def _sizes_table(cfg: OVQConfig, max_len: int) -> np.ndarray:
  """Dictionary rows before chunk c, c = 0 … max_len // C + 1 (full chunks only)."""
  C = cfg.chunk_size
  return np.asarray([cfg.dictionary_size(c * C) for c in range(max_len // C + 2)], np.int32)


def ovq_prefill(q: Array, k: Array, v: Array, beta: Array, cfg: OVQConfig, cache: OVQCache,
                row_update: str = "auto") -> tuple[Array, OVQCache]:
  """Outputs of a prompt ``[B, T, H, Dv]`` and the cache filled for decoding from position T
  (the cache must be empty). ``row_update``: as in :func:`kvm_jax.ops.ovq.ovq_attention`."""
  validate_inputs(q, k, v, beta)
  T = q.shape[1]
  if T > cache.max_len:
    raise ValueError(f"prompt of {T} tokens exceeds the cache's max_len={cache.max_len}.")
  rows = cache.state.keys.shape[2]
  kh, vh = heads_first(k), heads_first(v)
  y, state = run_chunks(heads_first(q), kh, vh, beta, cfg, rows, fold_partial=False,
                        row_update=row_update)
  C = cfg.chunk_size
  tail = T % C
  pending_k, pending_v = cache.pending_keys, cache.pending_values
  if tail:
    pending_k = pending_k.at[:, :, :tail].set(kh[:, :, T - tail:])
    pending_v = pending_v.at[:, :, :tail].set(vh[:, :, T - tail:])
  cache = OVQCache(state=state, pending_keys=pending_k, pending_values=pending_v,
                   length=jnp.full((q.shape[0],), T, jnp.int32), max_len=cache.max_len)
  return jnp.swapaxes(y, 1, 2).astype(v.dtype), cache


def ovq_decode_step(q: Array, k: Array, v: Array, beta: Array, cfg: OVQConfig, cache: OVQCache,
                    row_update: str = "auto", active: Optional[Array] = None
                    ) -> tuple[Array, OVQCache]:
  """One token per row ``[B, 1, H, ·]``, each at its own position ``cache.length[b]``: its output
  ``[B, 1, H, Dv]`` and the cache after it. ``active [B]`` (bool; None: every row): the rows fed
  this token; the others keep their cache as it was (their outputs mean nothing)."""
  validate_inputs(q, k, v, beta)
  if q.shape[1] != 1:
    raise ValueError(f"ovq_decode_step takes one token, got {q.shape[1]}.")
  B = q.shape[0]
  C = cfg.chunk_size
  table = jnp.asarray(_sizes_table(cfg, cache.max_len))
  n = batch_rows(cache.length, B)                                            # [B]
  slot, chunk = n % C, n // C
  size = table[chunk]                                                        # [B]
  scale = query_scale(beta, q.shape[-1])
  kh, vh = heads_first(k), heads_first(v)
  write = lambda pending, x: jax.vmap(
      lambda p, xi, i: jax.lax.dynamic_update_slice_in_dim(p, xi, i, axis=1))(pending, x, slot)
  pending_k, pending_v = write(cache.pending_keys, kh), write(cache.pending_values, vh)
  on = jnp.ones((B,), bool) if active is None else active
  if active is not None:  # the chunk being filled is small: a select per row keeps it
    keep = lambda new, old: jnp.where(on[:, None, None, None], new, old)  # noqa: E731
    pending_k = keep(pending_k, cache.pending_keys)
    pending_v = keep(pending_v, cache.pending_values)
  visible = (jnp.arange(C)[None, :] <= slot[:, None])[:, None, None, :]      # [B, 1, 1, C]
  y = readout(heads_first(q) * scale, pending_k, pending_v, cache.state, size, cfg.count_bias,
              visible=visible)
  completes = (slot == C - 1) & on                                           # [B]

  def commit(state):
    folded = fold(state, pending_k, pending_v, pending_k * scale, size,
                  jnp.where(completes, table[chunk + 1] - size, 0), cfg, row_update)
    pick = lambda a, b: jnp.where(completes.reshape((B,) + (1,) * (a.ndim - 1)), a, b)
    return jax.tree_util.tree_map(pick, folded, state)

  # The fold runs in a step where some row completes a chunk, and changes only those rows.
  state = jax.lax.cond(jnp.any(completes), commit, lambda s: s, cache.state)
  cache = OVQCache(state=state, pending_keys=pending_k, pending_values=pending_v,
                   length=jnp.where(on, n + 1, n), max_len=cache.max_len)
  return jnp.swapaxes(y, 1, 2).astype(v.dtype), cache


def ovq_resume(q: Array, k: Array, v: Array, beta: Array, cfg: OVQConfig, cache: OVQCache,
               row_update: str = "auto", counts: Optional[Array] = None
               ) -> tuple[Array, OVQCache]:
  """``W`` more tokens per row in parallel, whole chunks, each row continuing from its own
  length (a multiple of ``C``, ``W`` one too): outputs ``[B, W, H, Dv]`` and the cache, the same
  as ``W`` :func:`ovq_decode_step` calls (each chunk reads the dictionary as it stood before
  the chunk, then is folded into it).

  ``counts [B]`` (1 ≤ ``counts[b]`` ≤ ``W``; None: ``W``): row ``b`` takes only its first
  ``counts[b]`` tokens, as that many decode steps: only chunks it completes fold, and its last
  chunk's real tokens wait in the pending slots (the padding's outputs are meaningless; a real
  query reads only earlier tokens of its chunk)."""
  validate_inputs(q, k, v, beta)
  B, W = q.shape[:2]
  C = cfg.chunk_size
  table = jnp.asarray(_sizes_table(cfg, cache.max_len))
  first = batch_rows(cache.length, B) // C                                   # [B]
  count = jnp.full((B,), W, jnp.int32) if counts is None else counts.astype(jnp.int32)
  scale = query_scale(beta, q.shape[-1])
  chunks = lambda x: jnp.moveaxis(heads_first(x).reshape(B, x.shape[2], W // C, C, -1), 2, 0)
  qs, ks, vs = chunks(q), chunks(k), chunks(v)

  def step(carry, xs):
    state, pending_k, pending_v = carry
    j, q_c, k_c, v_c = xs
    size = table[first + j]
    y = readout(q_c * scale, k_c, v_c, state, size, cfg.count_bias)
    completes = (j + 1) * C <= count                                         # [B]
    folded = fold(state, k_c, v_c, k_c * scale, size,
                  jnp.where(completes, table[first + j + 1] - size, 0), cfg, row_update)
    pick = lambda a, b: jnp.where(completes.reshape((B,) + (1,) * (a.ndim - 1)), a, b)
    # the chunk's real tokens pass through the pending slots, as the decode steps write them
    written = (jnp.arange(C)[None, :] < (count - j * C)[:, None])[:, None, :, None]  # [B,1,C,1]
    pending = (jnp.where(written, k_c, pending_k), jnp.where(written, v_c, pending_v))
    return (jax.tree_util.tree_map(pick, folded, state), *pending), y

  carry = (cache.state, cache.pending_keys, cache.pending_values)
  (state, pending_k, pending_v), ys = jax.lax.scan(step, carry, (jnp.arange(W // C), qs, ks, vs))
  y = jnp.moveaxis(ys, 0, 2).reshape(B, q.shape[2], W, -1)                   # [B, H, W, Dv]
  cache = OVQCache(state=state, pending_keys=pending_k, pending_values=pending_v,
                   length=first * C + count, max_len=cache.max_len)
  return jnp.swapaxes(y, 1, 2).astype(v.dtype), cache
