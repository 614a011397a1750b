"""KVM reconstruction layers with *shared routing*
(``ModelConfig.kvm_kv_sharing="shared_routing"``).

Compressed states of different layers are row-aligned only if the same routing built them: which
tokens were appended as new rows and which row every other token merged into. With shared routing
every KVM source layer applies the routing of one leader layer (``update_state(routing=...)``), so
row ``r`` of each source summarizes the same tokens, and a reconstruction layer can fuse the
sources' *states* row by row, exactly as it fuses their per-token keys and values::

    state keys   = sum_j a_j ⊙ LN_s^{src_j}(S_K^{src_j})          (readout keys of each source)
    state values = sum_j b_j ⊙ normalize(S_V^{src_j}) · r^{src_j}  (readout values of each source)

The reconstruction layer then stores nothing: in decode it reads the sources' caches; in a
whole-sequence pass (prefill, training) it replays the sources' state updates chunk by chunk from
their per-token keys, values, gates and the shared decisions (scatter-adds only, no routing work),
so no per-chunk state is ever stored.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import batch_rows, joint_attention, window_stack
from kvm_jax.ops.kv_fusion import materialize
from kvm_jax.ops.kvm.decode import KVMCache, decode_attention
from kvm_jax.ops.kvm.scan import scan_inputs
from kvm_jax.ops.kvm.state import (KVMParams, initial_state, state_readout, temperatures,
                                   update_state)

Array = jax.Array


class SourceTrack(NamedTuple):
  """One source layer's per-token inputs to its state (``[B, T, Hkv, ·]``) and its parameters."""

  k: Array
  v: Array
  g: Array
  params: KVMParams


def _fused_state(states, track_params, key_weights, value_weights, key_tracks, value_tracks,
                 cfg):
  """Readout keys/values ``[B, Hkv, R, ·]`` of the fused state: each source's readout (its own
  LN_s and radius) combined row by row with the fusion weights."""
  reads = [state_readout(s, p, cfg) for s, p in zip(states, track_params)]
  return (materialize([reads[t][0] for t in key_tracks], key_weights, head_axis=1),
          materialize([reads[t][1] for t in value_tracks], value_weights, head_axis=1))


@functools.partial(jax.jit, static_argnames=("cfg", "key_tracks", "value_tracks", "remat"))
def kvm_attention_shared_state(q: Array, k: Array, v: Array, tracks: tuple, key_weights,
                               value_weights, params: KVMParams, routing, cfg: KVMConfig,
                               key_tracks: tuple, value_tracks: tuple, remat: bool = True) -> Array:
  """Whole-sequence KVM for a reconstruction layer whose state is fused from its sources'.

  Args:
    q: ``[B, T, H, D]`` this layer's queries; k / v: ``[B, T, Hkv, ·]`` its (fused) per-token keys
      and values, used for the exact window.
    tracks: :class:`SourceTrack` per source layer whose state is replayed.
    key_weights / value_weights: ``[S, Hkv, D]`` / ``[S, Hkv, Dv]`` fusion weights, or None (one
      source, weight 1); ``key_tracks[j]`` / ``value_tracks[j]`` name the track of source j.
    params: this layer's KVM parameters (its temperatures; LN_s belongs to the sources).
    routing: the leader's per-chunk ``(dest, target)``, each ``[num_chunks, B, Hkv, C]``.
  Returns:
    ``y [B, T, H, Dv]``.
  """
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[3]
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched, xs, pad_time, mask = scan_inputs(q, k, v, cfg)
  overflow = lambda x: window_stack(pad_time(x), sched.num_chunks, C, nb)[:, :, :C]
  xs["tracks"] = [(overflow(t.k), overflow(t.v), overflow(t.g)) for t in tracks]
  xs["routing"] = routing
  track_params = [t.params for t in tracks]
  states0 = tuple(initial_state(pad_time(t.k)[:, :C], pad_time(t.v)[:, :C], pad_time(t.g)[:, :C],
                                sched.initial_rows, sched.final_rows, t.params, cfg)
                  for t in tracks)
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  rows = jnp.arange(sched.final_rows)

  def step(states, x):
    state_keys, state_values = _fused_state(states, track_params, key_weights, value_weights,
                                            key_tracks, value_tracks, cfg)
    state_valid = ((rows < states[0].num_rows) & x["visible"])[None, :]
    y = joint_attention(x["q"], state_keys, state_values, state_valid, x["win_k"], x["win_v"],
                        mask(x["chunk"]), state_temp, window_temp, cfg.logit_softcap)

    # Every chunk replays: a chunk without a fold has decisions "no row" everywhere and
    # n_append = 0, an exact no-op, so no per-chunk conditional (a host round trip on GPU).
    states = tuple(update_state(s, ok, ov, og, x["n_append"], p, cfg, routing=x["routing"])
                   for s, (ok, ov, og), p in zip(states, x["tracks"], track_params))
    return states, y.astype(q.dtype)

  if remat:
    step = jax.checkpoint(step, prevent_cse=False)
  _, y = jax.lax.scan(step, states0, xs)
  return jnp.moveaxis(y, 0, 1).reshape(B, sched.num_chunks * C, H, Dv)[:, :T]


def kvm_decode_shared_state(q_t: Array, caches: Sequence[KVMCache], track_params, key_weights,
                            value_weights, key_tracks, value_tracks, params: KVMParams,
                            cfg: KVMConfig) -> Array:
  """One token of a reconstruction layer: ``caches`` are the source layers' caches *after* this
  token's step (state folded, token in the ring). Returns ``y [B, 1, H, Dv]``."""
  B, _, H, _ = q_t.shape
  Hkv = caches[0].window_keys.shape[2]
  states = [c.state for c in caches]
  state_keys, state_values = _fused_state(states, track_params, key_weights, value_weights,
                                          key_tracks, value_tracks, cfg)
  window_keys = materialize([caches[t].window_keys for t in key_tracks],
                            key_weights).astype(q_t.dtype)
  window_values = materialize([caches[t].window_values for t in value_tracks],
                              value_weights).astype(q_t.dtype)
  t = batch_rows(caches[0].length, B) - 1                  # each row's own position
  y = decode_attention(q_t, state_keys, state_values, states[0].num_rows, window_keys,
                       window_values, t, *temperatures(params, cfg, Hkv), cfg)
  y = jnp.where((t < caches[0].max_len)[:, None, None, None], y.reshape(B, 1, H, -1), jnp.nan)
  return y.astype(q_t.dtype)
