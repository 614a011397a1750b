"""Incremental KVM: a cache pytree, a prefill that fills it, and a one-token decode step.

The cache holds the state (static capacity = rows the budget reaches at ``max_len``), a ring buffer
of the last L = nb·C tokens' keys, values and merge gates (slot = position mod L), and the number
of tokens seen. The decode step follows docs/kvm-spec.md §6.11 exactly: while the prompt is shorter
than one chunk the initial state grows token by token; when token t crosses a chunk boundary with
t >= L + C, the chunk [t - L, t - L + C) is folded into the state *before* t attends; the state is
visible only from t >= L. The position is traced, so one compiled step serves every position.

These functions do not validate their inputs: :func:`kvm_jax.kvm_prefill` and
:func:`kvm_jax.kvm_decode_step` (``api.py``) are the checked entry points.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.config.budget import kvm_schedule
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import (batch_rows, fill_ring, joint_attention, read_ring_chunk,
                                ring_positions, tree_nbytes, write_ring)
from kvm_jax.ops.kvm.scan import XLA_OPS, ChunkOps, kvm_attention_scan
from kvm_jax.ops.kvm.state import (KVMParams, KVMState, KVMStepOutput, RoutedKVMStepOutput,
                                   empty_state, initial_state, pad_rows, state_readout, temperatures,
                                   token_rows)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class KVMCache:
  """Decode cache of one KVM layer.

  Attributes:
    state: :class:`KVMState` with capacity = state rows reached at ``max_len``.
    readout_keys / readout_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` the state as a query
      reads it (LN_s keys, radius-normalized values), in the cache's dtype. Refreshed only when
      the state changes (a fold every C tokens, a new row while the prompt is shorter than a
      chunk), so a decode step reads these once instead of normalizing the float32 state.
    window_keys: ``[B, L, Hkv, D]`` ring buffer of the last L keys (slot = position mod L).
    window_values: ``[B, L, Hkv, Dv]`` likewise.
    window_gates: ``[B, L, Hkv]`` float32 merge gates (needed when their chunk overflows).
    length: ``[B]`` int32, tokens each row has processed (= the position of its next token):
      rows are independent sequences, at lengths of their own (the engine's slots).
      ``state.num_rows`` is per row too.
    max_len: static, the longest sequence this cache can hold.
  """

  state: KVMState
  readout_keys: Array
  readout_values: Array
  window_keys: Array
  window_values: Array
  window_gates: Array
  length: Array
  max_len: int

  def nbytes(self) -> dict[str, int]:
    """Bytes of the allocated arrays: state (with its readout cache), window ring and total."""
    state = self.state.nbytes() + tree_nbytes((self.readout_keys, self.readout_values))
    window = tree_nbytes((self.window_keys, self.window_values, self.window_gates))
    return {"state": state, "window": window, "total": state + window + tree_nbytes(self.length)}


jax.tree_util.register_dataclass(
    KVMCache, data_fields=["state", "readout_keys", "readout_values", "window_keys",
                           "window_values", "window_gates", "length"],
    meta_fields=["max_len"])


def readout_cache(state: KVMState, params: KVMParams, cfg: KVMConfig, dtype):
  """``(keys, values)`` of :func:`state_readout` for the cache, in ``dtype`` (one copy per KV
  head: the authors' per-query-head rounding, ``readout_value_dtype``, is applied when read)."""
  keys, values = state_readout(state, params, dataclasses.replace(cfg, readout_value_dtype=None))
  return keys.astype(dtype), values.astype(dtype)


def cached_readout(cache: KVMCache, cfg: KVMConfig, groups: int):
  """The readout a decode step attends to, from the cache (float32 where the cache is)."""
  values = cache.readout_values
  if cfg.readout_value_dtype is not None:
    rounded = values.astype(cfg.readout_value_dtype).astype(jnp.float32)
    values = jnp.broadcast_to(rounded[:, :, None], (*values.shape[:2], groups, *values.shape[2:]))
  return cache.readout_keys, values


def kvm_init_cache(cfg: KVMConfig, *, batch: int, kv_heads: int, head_dim: int, value_dim: int,
                   max_len: int, dtype=jnp.float32) -> KVMCache:
  """An empty cache for sequences of up to ``max_len`` tokens (window stored in ``dtype``)."""
  for name, value in (("batch", batch), ("kv_heads", kv_heads), ("head_dim", head_dim),
                      ("value_dim", value_dim), ("max_len", max_len)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"kvm_init_cache: {name} must be a positive int, got {value!r}.")
  cfg.validate_head_dim(head_dim)
  L = cfg.window_len
  capacity = kvm_schedule(cfg, max_len).final_rows
  return KVMCache(
      state=per_row_state(empty_state(batch, kv_heads, capacity, head_dim, value_dim), batch),
      readout_keys=jnp.zeros((batch, kv_heads, capacity, head_dim), dtype),
      readout_values=jnp.zeros((batch, kv_heads, capacity, value_dim), dtype),
      window_keys=jnp.zeros((batch, L, kv_heads, head_dim), dtype),
      window_values=jnp.zeros((batch, L, kv_heads, value_dim), dtype),
      window_gates=jnp.zeros((batch, L, kv_heads), jnp.float32),
      length=jnp.zeros((batch,), jnp.int32), max_len=max_len)


def check_against_cache(k, v, cache: KVMCache, where: str) -> None:
  """A clear error when ``k``/``v`` do not fit the sizes the cache was created with."""
  B, _, Hkv, D = k.shape
  want = cache.window_keys.shape
  if (B, Hkv, D) != (want[0], want[2], want[3]) or v.shape[3] != cache.window_values.shape[3]:
    raise ValueError(
        f"{where}: k {k.shape} / v {v.shape} do not match the cache (batch={want[0]}, "
        f"kv_heads={want[2]}, head_dim={want[3]}, value_dim={cache.window_values.shape[3]}); "
        "create the cache with kvm_init_cache using the same sizes.")


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "return_routing", "row_update",
                                             "source_layout"))
def prefill(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams, cfg: KVMConfig,
            cache: KVMCache, ops: ChunkOps = XLA_OPS, routing=None, return_routing: bool = False,
            row_update: str = "auto", source_layout: str = "auto"):
  """A prompt through the scan and the cache filled for decoding from position T:
  a :class:`KVMStepOutput` ``(y, cache)``, or a :class:`RoutedKVMStepOutput` with the routing decisions
  when ``return_routing``. ``ops``, ``row_update``
  and ``source_layout``: as in :func:`kvm_attention_scan` (the public ``kvm_prefill`` passes its
  backend resolver's decisions)."""
  B, T = q.shape[:2]
  y, state, *decisions = kvm_attention_scan(q, k, v, merge_gate, params, cfg=cfg, ops=ops,
                                            remat=False, routing=routing,
                                            return_routing=return_routing,
                                            row_update=row_update, source_layout=source_layout)
  state = per_row_state(pad_rows(state, cache.state.capacity), B)
  readout_keys, readout_values = readout_cache(state, params, cfg, cache.readout_keys.dtype)
  new = KVMCache(
      state=state, readout_keys=readout_keys, readout_values=readout_values,
      window_keys=fill_ring(cache.window_keys, k), window_values=fill_ring(cache.window_values, v),
      window_gates=fill_ring(cache.window_gates, merge_gate),
      length=jnp.full((B,), T, jnp.int32), max_len=cache.max_len)
  return RoutedKVMStepOutput(y, new, *decisions) if return_routing else KVMStepOutput(y, new)


@functools.lru_cache(maxsize=64)
def _rows_after_overflow(cfg: KVMConfig, max_len: int) -> np.ndarray:
  """rows[o] = state rows after folding overflow chunk o (at token t = (o + nb)·C), int32."""
  sched = kvm_schedule(cfg, max_len)
  rows = np.zeros(sched.num_chunks + 1, np.int32)
  for c, fired in enumerate(sched.update_after):
    if fired:
      rows[c - cfg.window_chunks + 1] = sched.rows_before[c] + sched.n_append[c]
  return rows


def per_row_state(state: KVMState, batch: int) -> KVMState:
  """``state`` with its row count held per batch row (``num_rows [B]``), as a cache keeps it."""
  return dataclasses.replace(state, num_rows=batch_rows(state.num_rows, batch))


def decode_attention(q_t: Array, state_keys: Array, state_values: Array, num_rows: Array,
                     window_keys: Array, window_values: Array, t: Array, state_temp: Array,
                     window_temp: Array, cfg: KVMConfig, attend=joint_attention) -> Array:
  """Token ``t`` attends to readout state rows (once ``t >= L``) and the window ring (positions
  ``[bswa_begin(t + 1), t]``): ``q_t [B,1,H,D]`` -> ``[B,1,Hkv,G,Dv]`` float32. ``t`` and
  ``num_rows`` are per row (``[B]``) or one for the batch. ``attend`` (the contract of
  :func:`kvm_jax.ops.common.joint_attention`) is called with ``softcap=cfg.logit_softcap``."""
  B, _, H, D = q_t.shape
  Hkv = window_keys.shape[2]
  C, L = cfg.chunk_size, cfg.window_len
  t, num_rows = batch_rows(t, B), batch_rows(num_rows, B)
  position = ring_positions(t, L)                                            # [B, L]
  window_begin = jnp.maximum(0, (t // C + 1) * C - L)
  window_valid = (position >= window_begin[:, None])[:, None, None, None, :]
  rows = jnp.arange(state_keys.shape[2])
  state_valid = ((rows < num_rows[:, None]) & (t >= L)[:, None])[:, None, None, None, :]
  return attend(q_t.reshape(B, 1, Hkv, H // Hkv, D), state_keys, state_values, state_valid,
                window_keys, window_values, window_valid, state_temp, window_temp,
                softcap=cfg.logit_softcap)


def _per_row_select(rows: Array, new, old):
  """``new`` where ``rows [B]`` holds, else ``old``: leaf by leaf over batch-first arrays."""
  pick = lambda a, b: jnp.where(rows.reshape(rows.shape + (1,) * (a.ndim - 1)), a, b)
  return jax.tree_util.tree_map(pick, new, old)


def _kernel_decode_attention(ops: ChunkOps, q_t, state_keys, state_values, num_rows, window_keys,
                             window_values, t, state_temp, window_temp, cfg: KVMConfig):
  """The kernel's one-token attention (its contract takes one position for the batch) mapped
  over rows, each at its own position: ``[B, 1, Hkv, G, Dv]``."""
  def one_row(q, sk, sv, n, wk, wv, position):
    return ops.decode_attend(q[None], sk[None], sv[None], n, wk[None], wv[None], position,
                             state_temp, window_temp, cfg)[0]
  return jax.vmap(one_row)(q_t, state_keys, state_values, num_rows, window_keys, window_values, t)


def _write_ring_rows(ring: Array, x_t: Array, t: Array, active: Optional[Array]) -> Array:
  """:func:`write_ring` on the rows ``active [B]`` names (None: every row); the others write
  back what the slot held (one dynamic-update-slice per row, in place)."""
  if active is None:
    return write_ring(ring, x_t, t)
  old = read_ring_chunk(ring, t % ring.shape[1], 1)
  pick = active.reshape((-1,) + (1,) * (ring.ndim - 1))
  return write_ring(ring, jnp.where(pick, x_t.astype(ring.dtype), old), t)


def _grow_state(state: KVMState, cache: KVMCache, k_t: Array, v_t: Array, g_t: Array,
                params: KVMParams, cfg: KVMConfig, t: Array, grow: Array):
  """``(state, (readout_keys, readout_values))`` with row ``t[b]`` made from the token (``k_t
  [B, 1, Hkv, D]`` ...) in the rows where ``grow [B]`` holds (a prompt shorter than one chunk),
  its readout row written too (LN_s and the value normalization act on each row alone)."""
  new_key, new_value, new_radius = token_rows(k_t, v_t, g_t, params, cfg)   # [B, Hkv, 1, ·]
  row = jnp.arange(state.capacity)
  write = (grow[:, None] & (row[None, :] == t[:, None]))[:, None, :]         # [B, 1, R]
  state = KVMState(keys=jnp.where(write[..., None], new_key, state.keys),
                   values=jnp.where(write[..., None], new_value, state.values),
                   radius=jnp.where(write, new_radius, state.radius),
                   num_rows=jnp.where(grow, t + 1, state.num_rows).astype(jnp.int32))
  row_keys, row_values = readout_cache(
      KVMState(new_key, new_value, new_radius, jnp.ones((), jnp.int32)), params, cfg,
      cache.readout_keys.dtype)
  return state, (jnp.where(write[..., None], row_keys, cache.readout_keys),
                 jnp.where(write[..., None], row_values, cache.readout_values))


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "return_routing", "row_update"))
def decode_step(q_t: Array, k_t: Array, v_t: Array, g_t: Array, params: KVMParams,
                cfg: KVMConfig, cache: KVMCache, ops: ChunkOps = XLA_OPS, routing=None,
                return_routing: bool = False, row_update: str = "auto",
                active: Optional[Array] = None):
  """One token per row, each at its own position ``cache.length[b]``: a
  :class:`KVMStepOutput` ``(y_t [B, 1, H, Dv], cache)``, or a :class:`RoutedKVMStepOutput` with this
  step's routing decisions (``(dest, target)`` ``[B, Hkv, C]``; all
  ``capacity`` in rows where no fold happens) when ``return_routing``. ``row_update``: how the
  fold accumulates rows (:func:`kvm_jax.ops.kvm.state.update_state`; the public
  ``kvm_decode_step`` passes its backend resolver's decision). ``active [B]`` (bool; None: every
  row): the rows fed this token; the others' caches stay as they were (no growth, no fold, no
  ring write; their outputs mean nothing)."""
  B, _, H, D = q_t.shape
  Hkv = k_t.shape[2]
  C, nb, L = cfg.chunk_size, cfg.window_chunks, cfg.window_len
  state = per_row_state(cache.state, B)
  R = state.capacity
  t = batch_rows(cache.length, B)                                            # [B]
  on = jnp.ones((B,), bool) if active is None else active
  cache_dtype = cache.readout_keys.dtype

  # 1) A row whose prompt is shorter than one chunk: its initial state grows by this token.
  state, readout = _grow_state(state, cache, k_t, v_t, g_t, params, cfg, t, (t < C) & on)

  # 2) A row crossing a chunk boundary past the window folds chunk [t-L, t-L+C) into its state.
  rows_table = jnp.asarray(_rows_after_overflow(cfg, cache.max_len))
  fire = (t % C == 0) & (t >= L + C) & (t < cache.max_len) & on             # [B]
  none = jnp.full((B, Hkv, C), R, jnp.int32)  # "no row": the decisions of a row without a fold

  def fold(s: KVMState, readout):
    start = t % L  # == (t - L) % L, a multiple of C: the chunk is contiguous in the ring
    ov_k, ov_v, ov_g = (read_ring_chunk(ring, start, C) for ring in
                        (cache.window_keys, cache.window_values, cache.window_gates))
    overflow_index = jnp.clip(t // C - nb, 0, rows_table.shape[0] - 1)
    n_append = jnp.where(fire, rows_table[overflow_index] - s.num_rows, 0)
    # routing reads the float32 LN_s keys of the state (update_state computes them), as prefill
    folded, decisions = ops.update(s, ov_k, ov_v, ov_g, n_append, params, cfg, row_update,
                                   routing=routing, return_routing=True)
    folded_readout = readout_cache(folded, params, cfg, cache_dtype)
    decisions = tuple(jnp.where(fire[:, None, None], d, none) for d in decisions)
    return (_per_row_select(fire, folded, s), _per_row_select(fire, folded_readout, readout),
            decisions)

  # A conditional per step (positions are traced: one compiled step serves every position);
  # the fold, with its full readout refresh, runs in a step where some row crosses a boundary
  # (every C steps when the rows are in phase) and changes only those rows.
  state, readout, decisions = jax.lax.cond(jnp.any(fire), fold,
                                           lambda s, r: (s, r, (none, none)), state, readout)

  # 3) The token enters the ring (after the fold, which may still need the slot it overwrites).
  window_keys = _write_ring_rows(cache.window_keys, k_t, t, active)
  window_values = _write_ring_rows(cache.window_values, v_t, t, active)
  window_gates = _write_ring_rows(cache.window_gates, g_t, t, active)

  # 4) Attend: state rows (once t >= L) and the window [bswa_begin(t + 1), t], from the caches.
  new = KVMCache(state=state, readout_keys=readout[0], readout_values=readout[1],
                 window_keys=window_keys, window_values=window_values,
                 window_gates=window_gates, length=jnp.where(on, t + 1, t),
                 max_len=cache.max_len)
  state_keys, state_values = cached_readout(new, cfg, H // Hkv)
  args = (q_t, state_keys, state_values, state.num_rows, window_keys, window_values, t,
          *temperatures(params, cfg, Hkv), cfg)
  if ops.decode_attend_fn is None:
    y = decode_attention(*args, attend=ops.attend)
  else:
    y = _kernel_decode_attention(ops, *args)
  # Past max_len the state has no room for the schedule: poison the row's output instead of
  # lying.
  y = jnp.where((t < cache.max_len)[:, None, None, None], y.reshape(B, 1, H, -1), jnp.nan)
  y = y.astype(q_t.dtype)
  return RoutedKVMStepOutput(y, new, decisions) if return_routing else KVMStepOutput(y, new)


def _begin_rows(state: KVMState, readout_keys: Array, readout_values: Array, begins: Array,
                k_chunk: Array, v_chunk: Array, g_chunk: Array, num_valid: Array,
                params: KVMParams, cfg: KVMConfig):
  """``(state, readout_keys, readout_values)`` where ``begins [B]``: state rows ``[0,
  num_valid[b])`` made from the chunk's first tokens (``k_chunk [B, C, Hkv, D]`` ...), as many
  decode steps of a prompt shorter than a chunk make them, the other rows as they were."""
  C, B = k_chunk.shape[1], begins.shape[0]
  initial = per_row_state(initial_state(k_chunk, v_chunk, g_chunk, C, state.capacity, params,
                                        cfg), B)
  keys, values = readout_cache(initial, params, cfg, readout_keys.dtype)
  made = begins[:, None] & (jnp.arange(state.capacity)[None, :] < num_valid[:, None])  # [B, R]
  pick = lambda new, old: jnp.where(made.reshape(made.shape[:1] + (1,) + made.shape[1:]
                                                 + (1,) * (new.ndim - 3)), new, old)
  began = KVMState(keys=pick(initial.keys, state.keys), values=pick(initial.values, state.values),
                   radius=pick(initial.radius, state.radius),
                   num_rows=jnp.where(begins, num_valid, state.num_rows).astype(jnp.int32))
  return began, pick(keys, readout_keys), pick(values, readout_values)


def _ring_in_order(ring: Array, start: Array, window: int) -> Array:
  """The ring's ``[B, window, ...]`` tokens at positions ``[start - window, start)`` per row,
  oldest first (slot ``position % window``)."""
  index = (start[:, None] - window + jnp.arange(window)) % window
  return jnp.take_along_axis(ring, index.reshape(index.shape + (1,) * (ring.ndim - 2)), axis=1)


def _ring_after_piece(extended: Array, end: Array, count: Array, window: int) -> Array:
  """The ring of ``window`` slots after a piece whose first ``count [B]`` tokens are real: the
  ``window`` tokens of ``extended [B, window + width, ...]`` (ring in order, then the piece)
  before each row's ``end [B]``, each in the slot of its position (so the slots that no real
  token replaced keep their ring token)."""
  slot_source = count[:, None] + (jnp.arange(window)[None, :] - end[:, None]) % window
  return jnp.take_along_axis(
      extended, slot_source.reshape(slot_source.shape + (1,) * (extended.ndim - 2)), axis=1)


def _state_for_chunk(carry, t: Array, remaining: Array, leaving: list, own: list,
                     rows_table: Array, params: KVMParams, cfg: KVMConfig, max_len: int,
                     ops: ChunkOps, row_update: str):
  """``(state, readout_keys, readout_values)`` as a chunk of :func:`resume` starting at ``t
  [B]`` attends to them, from ``carry`` (the same triple before it), where the decode step would
  change them: the chunk leaving the window (``leaving``: its keys, values and gates, each
  ``[B, C, ...]``) folded at a boundary past the window, or, for a row starting its sequence,
  the chunk's own (``own``) first ``remaining [B]`` tokens made its initial state rows (visible
  only from t >= L, so this chunk's attention does not read them). A row with no real token
  left in the piece (``remaining <= 0``) changes nothing."""
  state, readout_keys, readout_values = carry
  C, nb, L = cfg.chunk_size, cfg.window_chunks, cfg.window_len
  real = remaining > 0
  fire = (t >= L + C) & (t < max_len) & real
  n_append = jnp.where(fire, rows_table[jnp.clip(t // C - nb, 0, rows_table.shape[0] - 1)]
                       - state.num_rows, 0)
  folded = ops.update(state, *leaving, n_append, params, cfg, row_update)
  folded_keys, folded_values = readout_cache(folded, params, cfg, readout_keys.dtype)
  carry = (_per_row_select(fire, folded, state), _per_row_select(fire, folded_keys, readout_keys),
           _per_row_select(fire, folded_values, readout_values))
  begins = (t == 0) & real
  begin = functools.partial(_begin_rows, begins=begins, k_chunk=own[0], v_chunk=own[1],
                            g_chunk=own[2], num_valid=jnp.minimum(remaining, C), params=params,
                            cfg=cfg)
  return jax.lax.cond(jnp.any(begins), begin, lambda *carry: carry, *carry)


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "row_update"))
def resume(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams, cfg: KVMConfig,
           cache: KVMCache, ops: ChunkOps = XLA_OPS, row_update: str = "auto",
           counts: Optional[Array] = None):
  """``W`` more tokens per row in parallel, chunk by chunk, each row continuing from its own
  length: ``(y [B, W, H, Dv], cache)``, the same as ``W`` :func:`decode_step` calls.

  Every row's length and ``W`` must be multiples of ``C``; a row at length 0 starts a sequence
  (its first chunk's tokens become its initial state rows, as in :func:`prefill`), so rows
  starting and rows continuing go in one call. The keys a chunk sees
  are the ring's last ``L`` tokens followed by the piece's, so chunk ``j`` reads its window as
  one slice, and folds the chunk leaving the window (from the ring or the piece) first, exactly
  when the decode step would.

  ``counts [B]`` (None: ``W``): row ``b`` takes only its first ``counts[b]`` tokens (at least
  one), the same as that many decode steps: a chunk with no real token neither folds nor
  starts the state, a partial first chunk of a sequence makes only its real tokens state rows,
  and only real tokens enter the ring. The padding's outputs are finite and meaningless (no
  real query sees a padding key: they lie after every real token)."""
  B, W, H, D = q.shape
  Hkv = k.shape[2]
  C, L = cfg.chunk_size, cfg.window_len
  G = H // Hkv
  start = batch_rows(cache.length, B)                                        # [B]
  count = jnp.full((B,), W, jnp.int32) if counts is None else counts.astype(jnp.int32)
  state = per_row_state(cache.state, B)
  R = state.capacity
  dtype = cache.window_keys.dtype
  # The ring's last L tokens, oldest first, then the piece's: chunk j's window is one slice.
  ext_k, ext_v, ext_g = (
      jnp.concatenate([_ring_in_order(ring, start, L), x.astype(x_dtype)], axis=1)
      for ring, x, x_dtype in ((cache.window_keys, k, dtype), (cache.window_values, v, dtype),
                               (cache.window_gates, merge_gate, jnp.float32)))
  ext_pos = start[:, None] - L + jnp.arange(L + W)                           # [B, L + W]
  rows_table = jnp.asarray(_rows_after_overflow(cfg, cache.max_len))
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  qs = jnp.moveaxis(q.reshape(B, W // C, C, Hkv, G, D), 1, 0)

  def chunk(carry, xs):
    state, readout_keys, readout_values = carry
    j, q_chunk = xs
    t = start + j * C                                                        # [B]
    slice_at = lambda x, at: jax.lax.dynamic_slice_in_dim(x, at, C, axis=1)
    state, readout_keys, readout_values = _state_for_chunk(
        (state, readout_keys, readout_values), t, count - j * C,
        [slice_at(x, j * C) for x in (ext_k, ext_v, ext_g)],
        [slice_at(x, L + j * C) for x in (ext_k, ext_v, ext_g)], rows_table, params, cfg,
        cache.max_len, ops, row_update)
    # keys of this chunk's window: the previous nb - 1 chunks and this one, causal within it
    keys = jax.lax.dynamic_slice_in_dim(ext_k, (j + 1) * C, L, axis=1)
    values = jax.lax.dynamic_slice_in_dim(ext_v, (j + 1) * C, L, axis=1)
    key_pos = jax.lax.dynamic_slice_in_dim(ext_pos, (j + 1) * C, L, axis=1)  # [B, L]
    query_pos = t[:, None] + jnp.arange(C)                                   # [B, C]
    window_valid = ((key_pos[:, None, :] <= query_pos[..., None])
                    & (key_pos[:, None, :] >= 0))[:, None, None]
    state_valid = ((jnp.arange(R)[None, :] < state.num_rows[:, None])
                   & (t >= L)[:, None])[:, None, None, None, :]
    cached = KVMCache(state=state, readout_keys=readout_keys, readout_values=readout_values,
                      window_keys=keys, window_values=values, window_gates=None, length=t,
                      max_len=cache.max_len)
    state_keys, state_values = cached_readout(cached, cfg, G)
    y = ops.attend(q_chunk, state_keys, state_values, state_valid, keys, values, window_valid,
                   state_temp, window_temp, softcap=cfg.logit_softcap)
    return (state, readout_keys, readout_values), y

  carry = (state, cache.readout_keys, cache.readout_values)
  (state, readout_keys, readout_values), ys = jax.lax.scan(
      chunk, carry, (jnp.arange(W // C), qs))
  y = jnp.moveaxis(ys, 0, 1).reshape(B, W, H, -1)
  # Past max_len a real token has no room in the state: poisoned. Padding stays finite, since
  # the layers above read it (masked, and a masked NaN would still reach every output).
  past_end = ((start[:, None] + jnp.arange(W)) >= cache.max_len) & (jnp.arange(W) < count[:, None])
  y = jnp.where(past_end[..., None, None], jnp.nan, y)
  end = start + count
  tail = functools.partial(_ring_after_piece, end=end, count=count, window=L)
  new = KVMCache(state=state, readout_keys=readout_keys, readout_values=readout_values,
                 window_keys=tail(ext_k), window_values=tail(ext_v), window_gates=tail(ext_g),
                 length=end, max_len=cache.max_len)
  return KVMStepOutput(y.astype(q.dtype), new)
