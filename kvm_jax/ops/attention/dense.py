"""Baseline attention mixers of the paper, prefill and one-token decode (pure functions).

* ``full``: causal softmax attention over every previous token (GPTAlpha-2);
* ``swa``: token sliding window — query p sees keys (p - window, p] (the authors' SWA layers);
* ``bswa``: block sliding window — query p in chunk c sees keys of chunks c-nb+1..c (causal), plus
  ``sink_rows`` first tokens (the authors' ``gptalpha_bswa``: ``(sink | block window) & causal``).

Layout ``[batch, time, heads, dim]``; GQA by ``H % Hkv == 0``. Decode uses a ring buffer of keys and
values (``max_len`` slots for full attention, the window otherwise) with a traced position, so
each step compiles once.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.common import (MASKED, batch_rows, fill_ring, joint_attention, ring_positions,
                                soft_capped, to_chunks, tree_nbytes, window_mask, window_stack,
                                write_ring)
from kvm_jax.ops.documents import WindowRule

Array = jax.Array


def _dot_product_attention(q: Array, k: Array, v: Array, scale: Optional[float], **kwargs) -> Array:
  """``jax.nn.dot_product_attention``, also when the value head dim Dv differs from D (which it
  rejects): the narrower side is zero-padded to the wider width, which changes neither the scores
  (the zero channels add nothing, and the scale stays 1/sqrt(D)) nor the first Dv output
  channels."""
  D, Dv = q.shape[-1], v.shape[-1]
  if D == Dv:
    return jax.nn.dot_product_attention(q, k, v, scale=scale, **kwargs)
  width = max(D, Dv)
  pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[-1])])
  scale = 1.0 / np.sqrt(D) if scale is None else scale
  return jax.nn.dot_product_attention(pad(q), pad(k), pad(v), scale=scale, **kwargs)[..., :Dv]


def softcapped_attention(q: Array, k: Array, v: Array, window: Optional[int],
                         scale: Optional[float], softcap: float) -> Array:
  """Dense causal attention whose scaled scores are soft-capped (``cap · tanh(s / cap)``,
  Gemma 2) before the mask, which ``jax.nn.dot_product_attention`` cannot do: ``[T, T]`` float32
  scores, the yardstick of the chunked path. Shapes as :func:`full_attention`."""
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  scale = 1.0 / np.sqrt(D) if scale is None else scale
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(B, T, Hkv, H // Hkv, D), k,
                 preferred_element_type=jnp.float32) * scale
  position = np.arange(T)
  visible = position[None, :] <= position[:, None]
  if window is not None:
    visible &= position[None, :] > position[:, None] - window
  p = jax.nn.softmax(jnp.where(visible, soft_capped(s, softcap), MASKED), axis=-1)
  y = jnp.einsum("bhgqk,bkhv->bqhgv", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
  return y.reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def full_attention(q: Array, k: Array, v: Array, scale: Optional[float] = None,
                   implementation: Optional[str] = None, softcap: Optional[float] = None
                   ) -> Array:
  """Causal attention over all previous tokens (``jax.nn.dot_product_attention``; no dense mask
  built here).

  ``scale``: softmax scale (default ``1/sqrt(D)``; folded cross-layer fusion stacks sources along
  D and passes the scale of one source's head dim). ``implementation``: that function's "xla"
  (dense scores) or "cudnn"; None lets it choose. ``softcap``: soft-capped scores
  (:func:`softcapped_attention`, dense XLA only).
  """
  if softcap is not None:
    return softcapped_attention(q, k, v, None, scale, softcap)
  return _dot_product_attention(q, k, v, scale, is_causal=True, implementation=implementation)


def sliding_window_attention(q: Array, k: Array, v: Array, window: int,
                             scale: Optional[float] = None,
                             implementation: Optional[str] = None,
                             softcap: Optional[float] = None) -> Array:
  """Causal attention over the last ``window`` tokens (the query's own token included)."""
  if softcap is not None:
    return softcapped_attention(q, k, v, window, scale, softcap)
  return _dot_product_attention(q, k, v, scale, is_causal=True,
                                local_window_size=(window - 1, 0), implementation=implementation)


def _scale_as_temperature(scale: Optional[float], q: Array, Hkv: int) -> Array:
  """``joint_attention`` scales by ``1/sqrt(q dim)`` times a temperature: the temperature that
  turns that into ``scale``."""
  t = 1.0 if scale is None else scale * np.sqrt(q.shape[-1])
  return jnp.full((Hkv, q.shape[2] // Hkv), t, jnp.float32)


def block_sliding_window_attention(q: Array, k: Array, v: Array, chunk_size: int,
                                   window_chunks: int, sink_rows: int = 0,
                                   scale: Optional[float] = None,
                                   softcap: Optional[float] = None) -> Array:
  """Block sliding window with sinks; every chunk is independent, so no scan is needed."""
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  C, nb = chunk_size, window_chunks
  nC = -(-T // C)
  pad = [(0, 0), (0, nC * C - T), (0, 0), (0, 0)]
  q_p, k_p, v_p = (jnp.pad(x, pad) for x in (q, k, v))
  win_k = window_stack(k_p, nC, C, nb)                                    # [nC, B, nb*C, Hkv, D]
  win_v = window_stack(v_p, nC, C, nb)
  q_c = to_chunks(q_p, nC, C).reshape(nC, B, C, Hkv, H // Hkv, D)
  S = max(sink_rows, 1)  # a dummy (never valid) row when there are no sinks
  sink_k = jnp.swapaxes(k_p[:, :S], 1, 2)                                   # [B, Hkv, S, D]
  sink_v = jnp.swapaxes(v_p[:, :S], 1, 2)
  temp = _scale_as_temperature(scale, q, Hkv)

  def one_chunk(c, qc, wk, wv):
    begin = (c - nb + 1) * C
    sink_valid = (jnp.arange(S) < sink_rows) & (jnp.arange(S) < begin)  # not already in window
    return joint_attention(qc, sink_k, sink_v, sink_valid[None, :], wk, wv,
                           window_mask(c, C, nb), temp, temp, softcap)

  y = jax.vmap(one_chunk, out_axes=1)(jnp.arange(nC), q_c, win_k, win_v)
  return y.reshape(B, nC * C, H, -1)[:, :T].astype(q.dtype)


# ----------------------------------------------------------------------------------------------
# Decode: one ring-buffer cache for all three baselines
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RingCache:
  """Keys/values of recent tokens, slot = position mod ``slots``; sinks kept separately.

  The ring stores positions last (:func:`ring_store`; :func:`ring_view` reads it position-major):
  the layout a TPU gives such an array anyway (a head dim under 128 lanes would otherwise be
  padded), which a decode step's one-slot write then updates in place. Stored position-major,
  the write's operand layout differs from the array's, and XLA:TPU copies the whole ring (padded)
  around every write.

  Attributes:
    keys / values: ``[B, Hkv, D, slots]`` / ``[B, Hkv, Dv, slots]``.
    sink_keys / sink_values: ``[B, S, Hkv, ·]`` the first S tokens, kept while they lie before
      the window (block-SWA's sinks; S may be 0).
    length: ``[B]`` int32, tokens each row has seen (rows are independent sequences).
    rule: static, which earlier positions a query sees (:class:`WindowRule`, the same rule the
      layer's whole-sequence and packed-document paths follow).
    max_len: static, the longest sequence the cache was sized for.
  """

  keys: Array
  values: Array
  sink_keys: Array
  sink_values: Array
  length: Array
  rule: WindowRule
  max_len: int

  def nbytes(self) -> int:
    """Bytes of the cache arrays as allocated."""
    return tree_nbytes(self)


jax.tree_util.register_dataclass(
    RingCache, data_fields=["keys", "values", "sink_keys", "sink_values", "length"],
    meta_fields=["rule", "max_len"])


def init_ring_cache(rule: "WindowRule", *, batch: int, kv_heads: int, head_dim: int,
                    value_dim: int, max_len: int, sink_rows: int = 0,
                    dtype=jnp.float32) -> RingCache:
  """An empty decode cache for a softmax layer whose queries see the positions of ``rule`` (a
  :class:`WindowRule`): ``rule.slots(max_len)`` ring slots, ``sink_rows`` sinks."""
  if not isinstance(rule, WindowRule):
    raise TypeError(f"init_ring_cache: rule={rule!r} is not a WindowRule; pass the layer's rule "
                    "(e.g. WindowRule('sliding', window)).")
  slots = rule.slots(max_len)
  zeros = lambda n, d: jnp.zeros((batch, n, kv_heads, d), dtype)  # noqa: E731
  return RingCache(keys=ring_store(zeros(slots, head_dim)),
                   values=ring_store(zeros(slots, value_dim)),
                   sink_keys=zeros(sink_rows, head_dim), sink_values=zeros(sink_rows, value_dim),
                   length=jnp.zeros((batch,), jnp.int32), rule=rule, max_len=max_len)


def ring_store(x: Array) -> Array:
  """Position-major ``[B, slots, Hkv, D]`` -> the ring's storage ``[B, Hkv, D, slots]``."""
  return jnp.transpose(x, (0, 2, 3, 1))


def ring_view(ring: Array) -> Array:
  """The ring's storage ``[B, Hkv, D, slots]`` read position-major, ``[B, slots, Hkv, D]``."""
  return jnp.transpose(ring, (0, 3, 1, 2))


@jax.jit
def ring_prefill(k: Array, v: Array, cache: RingCache) -> RingCache:
  """Stores a prompt's keys/values (the outputs come from the prefill functions above)."""
  T = k.shape[1]
  S = cache.sink_keys.shape[1]
  n_sink = min(S, T)
  sink_k = cache.sink_keys.at[:, :n_sink].set(k[:, :n_sink].astype(cache.keys.dtype))
  sink_v = cache.sink_values.at[:, :n_sink].set(v[:, :n_sink].astype(cache.values.dtype))
  fill = lambda ring, x: ring_store(fill_ring(ring_view(ring), x))  # noqa: E731
  return dataclasses.replace(
      cache, keys=fill(cache.keys, k), values=fill(cache.values, v),
      sink_keys=sink_k, sink_values=sink_v, length=jnp.full((k.shape[0],), T, jnp.int32))


def _write_slot(ring: Array, x_t: Array, t: Array, active: Optional[Array]) -> Array:
  """``ring [B, Hkv, D, slots]`` with each row's token ``x_t [B, 1, Hkv, D]`` in the slot of its
  position ``t [B]``, on the rows ``active [B]`` names (None: every row); the others write back
  what the slot held. One dynamic-update-slice per row, in place."""
  slots = ring.shape[-1]
  x_t = x_t.astype(ring.dtype)

  def one(r, x, slot, on):
    old = jax.lax.dynamic_slice_in_dim(r, slot, 1, axis=2)                   # [Hkv, D, 1]
    new = jnp.where(on, jnp.transpose(x, (1, 2, 0)), old)
    return jax.lax.dynamic_update_slice_in_dim(r, new, slot, axis=2)

  on = jnp.ones(t.shape, bool) if active is None else active
  return jax.vmap(one)(ring, x_t, t % slots, on)


@jax.jit
def ring_decode_step(q_t: Array, k_t: Array, v_t: Array, cache: RingCache,
                     scale: Optional[float] = None, softcap: Optional[float] = None,
                     active: Optional[Array] = None) -> tuple[Array, RingCache]:
  """One token per row, each at its own position ``cache.length[b]``: ``q_t [B,1,H,D]``,
  ``k_t [B,1,Hkv,D]``, ``v_t [B,1,Hkv,Dv]`` -> ``y [B,1,H,Dv]`` (``softcap``: soft-capped
  scores, as in prefill). ``active [B]`` (bool; None: every row): the rows fed this token; the
  others' caches are left as they were (their outputs mean nothing)."""
  B, _, H, D = q_t.shape
  Hkv = k_t.shape[2]
  t = batch_rows(cache.length, B)                                             # [B]
  keys, values = _write_slot(cache.keys, k_t, t, active), _write_slot(cache.values, v_t, t, active)
  S = cache.sink_keys.shape[1]
  sink_keys, sink_values = cache.sink_keys, cache.sink_values
  if S:
    fed = t if active is None else jnp.where(active, t, -1)
    write = (jnp.arange(S)[None, :] == fed[:, None])[:, :, None, None]
    sink_keys = jnp.where(write, k_t.astype(sink_keys.dtype), sink_keys)
    sink_values = jnp.where(write, v_t.astype(sink_values.dtype), sink_values)
  position = ring_positions(t, keys.shape[-1])                                # [B, slots]
  lowest = cache.rule.first_visible(t)[:, None]
  window_valid = ((position >= lowest) & (position >= 0))[:, None, None, None, :]
  if S:
    state_k, state_v = jnp.swapaxes(sink_keys, 1, 2), jnp.swapaxes(sink_values, 1, 2)
    sinks = jnp.arange(S)[None, :]
    state_valid = ((sinks < lowest) & (sinks <= t[:, None]))[:, None, None, None, :]
  else:  # one never-valid dummy row keeps the shapes non-empty
    state_k = jnp.zeros((B, Hkv, 1, D), keys.dtype)
    state_v = jnp.zeros((B, Hkv, 1, values.shape[2]), values.dtype)
    state_valid = jnp.zeros((1, 1), bool)
  temp = _scale_as_temperature(scale, q_t, Hkv)
  y = joint_attention(q_t.reshape(B, 1, Hkv, H // Hkv, D), state_k, state_v, state_valid,
                      ring_view(keys), ring_view(values), window_valid, temp, temp, softcap)
  y = jnp.where((t < cache.max_len)[:, None, None, None], y.reshape(B, 1, H, -1), jnp.nan)
  length = t + 1 if active is None else jnp.where(active, t + 1, t)
  return y.astype(q_t.dtype), dataclasses.replace(cache, keys=keys, values=values,
                                                  sink_keys=sink_keys, sink_values=sink_values,
                                                  length=length)


@jax.jit
def ring_resume(q: Array, k: Array, v: Array, cache: RingCache,
                scale: Optional[float] = None, softcap: Optional[float] = None,
                counts: Optional[Array] = None) -> tuple[Array, RingCache]:
  """``W`` more tokens per row, in parallel, each row continuing from its own length
  ``cache.length[b]``: ``q [B,W,H,D]``, ``k [B,W,Hkv,D]``, ``v [B,W,Hkv,Dv]`` -> ``y [B,W,H,Dv]``
  and the cache after them. The same attention as ``W`` :func:`ring_decode_step` calls: each
  query sees the ring's earlier keys and the piece's keys up to itself, by the kind's rule.

  ``counts [B]`` (1 ≤ ``counts[b]`` ≤ ``W``; None: ``W``): row ``b`` takes only its first
  ``counts[b]`` tokens; the cache ends as after those (the padding is written nowhere, and no
  real query sees it: it lies after every real token)."""
  B, W, H, D = q.shape
  Hkv = k.shape[2]
  slots = cache.keys.shape[-1]
  start = batch_rows(cache.length, B)                                         # [B]
  count = jnp.full((B,), W, jnp.int32) if counts is None else counts.astype(jnp.int32)
  query_pos = start[:, None] + jnp.arange(W)                                  # [B, W]
  ring_pos = ring_positions(start - 1, slots)                                 # [B, slots]
  key_pos = jnp.concatenate([ring_pos, query_pos], axis=1)                    # [B, slots + W]
  keys = jnp.concatenate([ring_view(cache.keys), k.astype(cache.keys.dtype)], axis=1)
  values = jnp.concatenate([ring_view(cache.values), v.astype(cache.values.dtype)], axis=1)
  lowest = cache.rule.first_visible(query_pos)[..., None]                    # [B, W, 1]
  window_valid = ((key_pos[:, None, :] >= lowest) & (key_pos[:, None, :] >= 0)
                  & (key_pos[:, None, :] <= query_pos[..., None]))[:, None, None]
  S = cache.sink_keys.shape[1]
  sink_keys, sink_values = cache.sink_keys, cache.sink_values
  if S:
    # a sink is a prompt's first tokens: written when this piece holds them
    sink_index = jnp.arange(S)[None, :] - start[:, None]                     # [B, S]
    in_piece = (sink_index >= 0) & (sink_index < count[:, None])
    take = lambda x: jnp.take_along_axis(x, jnp.clip(sink_index, 0, W - 1)[..., None, None],
                                         axis=1)
    sink_keys = jnp.where(in_piece[..., None, None], take(k).astype(sink_keys.dtype), sink_keys)
    sink_values = jnp.where(in_piece[..., None, None], take(v).astype(sink_values.dtype),
                            sink_values)
    state_k, state_v = jnp.swapaxes(sink_keys, 1, 2), jnp.swapaxes(sink_values, 1, 2)
    sinks = jnp.arange(S)[None, None, :]
    state_valid = ((sinks < lowest) & (sinks <= query_pos[..., None]))[:, None, None]
  else:
    state_k = jnp.zeros((B, Hkv, 1, D), keys.dtype)
    state_v = jnp.zeros((B, Hkv, 1, values.shape[-1]), values.dtype)
    state_valid = jnp.zeros((1, 1), bool)
  temp = _scale_as_temperature(scale, q, Hkv)
  y = joint_attention(q.reshape(B, W, Hkv, H // Hkv, D), state_k, state_v, state_valid, keys,
                      values, window_valid, temp, temp, softcap)
  # Past max_len a real token has no place: its output is poisoned. Padding stays finite, since
  # the layers above read it (masked, and a masked NaN would still reach every output).
  real = jnp.arange(W)[None, :] < count[:, None]                              # [B, W]
  y = jnp.where(((query_pos < cache.max_len) | ~real)[..., None, None], y.reshape(B, W, H, -1),
                jnp.nan)
  # The ring keeps the last `slots` positions; only the real tokens among the piece's last
  # min(count, slots) can be among them (their slots are distinct), written over what they
  # replace; the others go to slot `slots`, which the write drops.
  index = jnp.arange(W)[None, :]
  kept = real & (index >= count[:, None] - slots)
  slot = jnp.where(kept, query_pos % slots, slots)
  write = lambda ring, x: jax.vmap(lambda r, i, xi: r.at[:, :, i].set(xi, mode="drop"))(
      ring, slot, ring_store(x.astype(ring.dtype)))
  return y.astype(q.dtype), dataclasses.replace(
      cache, keys=write(cache.keys, k), values=write(cache.values, v), sink_keys=sink_keys,
      sink_values=sink_values, length=start + count)
