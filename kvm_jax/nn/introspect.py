"""Look inside one KVM layer: the attention map of a chunk and the anatomy of a state update.

For notebooks and debugging; everything is computed with the same functions the scan uses
(``state_readout``, ``update_state``), on the *visible* state of the chunk in question:

* :func:`state_before` — the state that query chunk ``c`` attends to (the scan over the prefix);
* :func:`chunk_attention` — the softmax probabilities of chunk ``c``'s queries over
  ``[state rows ; window slots]`` (the paper's Fig. 2) and the output they produce;
* :func:`update_anatomy` — for the fold after chunk ``c``: each token's novelty, which tokens are
  appended and where, which row every other token merges into, and the radii before and after.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp

from kvm_jax.config.budget import kvm_schedule
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import MASKED, layer_norm
from kvm_jax.ops.kvm.scan import kvm_attention_scan
from kvm_jax.ops.kvm.state import (KVMParams, KVMState, overflow_rows, pad_rows, state_readout,
                                   temperatures, update_state)

Array = jax.Array


def state_before(k: Array, v: Array, g: Array, params: KVMParams, cfg: KVMConfig,
                 chunk: int) -> KVMState:
  """The state visible to query chunk ``chunk`` (0-based; empty for chunk 0)."""
  C = cfg.chunk_size
  if chunk < 1:
    raise ValueError(f"chunk {chunk}: chunk 0 sees no state; pick a chunk >= 1.")
  # One token of chunk `chunk` makes the scan run the fold after chunk `chunk - 1` (a sequence's
  # last chunk is never folded: nothing would read it); that token itself changes no state.
  T = chunk * C + 1
  H = params.window_temperature.shape[0]
  q = jnp.zeros((k.shape[0], T, H, k.shape[3]), k.dtype)  # queries do not change the state
  _, state = kvm_attention_scan(q, k[:, :T], v[:, :T], g[:, :T], params, cfg=cfg)
  return state


def chunk_attention(q: Array, k: Array, v: Array, g: Array, params: KVMParams, cfg: KVMConfig,
                    chunk: int) -> dict:
  """Probabilities of chunk ``chunk``'s queries over ``[state rows ; window slots]``.

  Returns ``probs [B, H, C, R + W]`` (float32; masked entries are 0), ``state_rows`` (valid rows,
  0 when the state is not yet visible), ``window_positions [W]`` (token position of each window
  slot, negative before the sequence start), ``output [B, C, H, Dv]`` = probs @ values.
  """
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  G = H // Hkv
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched = kvm_schedule(cfg, T)
  if not 0 <= chunk < sched.num_chunks:
    raise ValueError(f"chunk {chunk} is outside [0, {sched.num_chunks}) for T={T}.")
  if chunk > 0:
    state = state_before(k, v, g, params, cfg, chunk)
  else:
    state = KVMState(keys=jnp.zeros((B, Hkv, 1, D)), values=jnp.zeros((B, Hkv, 1, v.shape[3])),
                     radius=jnp.zeros((B, Hkv, 1)), num_rows=jnp.asarray(0, jnp.int32))
  rows = int(state.num_rows) if sched.state_visible[chunk] else 0
  keys, values = state_readout(state, params, cfg)
  start = (chunk - nb + 1) * C
  positions = np.arange(start, start + nb * C)
  take = lambda x: jnp.take(x, np.clip(positions, 0, T - 1), axis=1)
  wk, wv = take(k), take(v)                                          # [B, W, Hkv, ·]
  qc = q[:, chunk * C:(chunk + 1) * C]
  Tq = qc.shape[1]
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  scale = 1.0 / np.sqrt(D)
  qg = qc.reshape(B, Tq, Hkv, G, D).astype(jnp.float32)
  s_state = jnp.einsum("bqhgd,bhrd->bhgqr", qg, keys) * (state_temp * scale)[None, :, :, None, None]
  s_window = (jnp.einsum("bqhgd,bwhd->bhgqw", qg, wk.astype(jnp.float32))
              * (window_temp * scale)[None, :, :, None, None])
  state_ok = np.arange(keys.shape[2]) < rows
  query_pos = chunk * C + np.arange(Tq)
  window_ok = (positions[None, :] >= 0) & (positions[None, :] <= query_pos[:, None])
  scores = jnp.concatenate([jnp.where(state_ok, s_state, MASKED),
                            jnp.where(window_ok, s_window, MASKED)], axis=-1)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(jnp.concatenate([jnp.broadcast_to(state_ok, (Tq, state_ok.size)),
                                     window_ok], axis=-1), probs, 0.0)
  all_values = jnp.concatenate([jnp.broadcast_to(values[:, :, None], (B, Hkv, G) + values.shape[2:]),
                                jnp.broadcast_to(jnp.swapaxes(wv, 1, 2)[:, :, None].astype(jnp.float32),
                                                 (B, Hkv, G, nb * C, v.shape[3]))], axis=3)
  out = jnp.einsum("bhgqk,bhgkv->bqhgv", probs, all_values).reshape(B, Tq, H, -1)
  return {"probs": probs.reshape(B, H, Tq, -1), "state_rows": rows, "capacity": keys.shape[2],
          "window_positions": positions, "output": out}


def update_anatomy(k: Array, v: Array, g: Array, params: KVMParams, cfg: KVMConfig,
                   chunk: int) -> dict:
  """The fold that runs after query chunk ``chunk`` (it must be one; see ``kvm_schedule``).

  Returns (per batch row and KV head): ``tokens [C]`` positions of the folded chunk,
  ``novelty [B, Hkv, C]`` (max similarity to the pre-append rows; lower = more novel),
  ``appended [B, Hkv, C]`` bool, ``dest`` (new row of appended tokens, -1 otherwise),
  ``target`` (row each other token merged into, -1 for appended tokens), ``rows_before``,
  ``rows_after``, ``sink_rows``, ``radius_before [B, Hkv, R]``, ``radius_after``.
  """
  T = k.shape[1]
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched = kvm_schedule(cfg, T)
  if not 0 <= chunk < sched.num_chunks or not sched.update_after[chunk]:
    fired = [c for c, u in enumerate(sched.update_after) if u]
    raise ValueError(f"no state update runs after chunk {chunk}; updates run after chunks "
                     f"{fired[:12]}{'…' if len(fired) > 12 else ''}.")
  # Updates run only at chunk ends, so the state just before this fold is the one chunk `chunk`
  # attended to: the scan over the first `chunk` chunks (an update never follows chunk 0).
  state = state_before(k, v, g, params, cfg, chunk)
  capacity = sched.final_rows
  state = pad_rows(state, capacity)
  start = (chunk - nb + 1) * C
  ov = slice(start, start + C)
  read = layer_norm(state.keys, params.ln_scale, params.ln_bias, cfg.ln_eps)
  k_bar = overflow_rows(k[:, ov], v[:, ov], g[:, ov], params, cfg).k_bar
  sim = jnp.einsum("bhcd,bhrd->bhcr", k_bar, read, precision=jax.lax.Precision.HIGHEST)
  valid = np.arange(capacity) < int(state.num_rows)
  novelty = jnp.max(jnp.where(valid, sim, -jnp.inf), axis=-1)
  new, (dest, target) = update_state(state, k[:, ov], v[:, ov], g[:, ov],
                                     sched.n_append[chunk], params, cfg, return_routing=True)
  appended = np.asarray(dest) < capacity
  return {"tokens": np.arange(start, start + C), "novelty": np.asarray(novelty),
          "appended": appended, "dest": np.where(appended, np.asarray(dest), -1),
          "target": np.where(np.asarray(target) < capacity, np.asarray(target), -1),
          "rows_before": int(state.num_rows), "rows_after": int(new.num_rows),
          "sink_rows": cfg.sink_rows, "radius_before": np.asarray(state.radius),
          "radius_after": np.asarray(new.radius)}
