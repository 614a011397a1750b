"""GPTAlpha-2 language model in Flax NNX (spec §4): modules own parameters and call ``kvm_jax.ops``.

Everything a layer computes on whole sequences or one token goes through pure functions: the KVM
core (``ops.kvm``), the baselines (``ops.attention``), RoPE (``ops.rope``). The only state that
decode needs besides the mixer caches is the token-shift history (last projected q/k/v and the
last MLP input), kept per layer in :class:`LayerCache`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.model_config import ModelConfig
from kvm_jax.ops import attention as attn_ops
from kvm_jax.ops import kv_fusion
from kvm_jax.ops.common import KVMParams, tree_nbytes
from kvm_jax.ops.kvm import kvm_attention
from kvm_jax.ops.kvm_decode import kvm_decode_step, kvm_init_cache, kvm_prefill
from kvm_jax.ops.kvm_shared import (SourceTrack, kvm_attention_shared_state,
                                    kvm_decode_shared_state)
from kvm_jax.ops.rope import apply_rope, rope_tables

Array = jax.Array


def _torch_linear_init(fan_in: int):
  """``nn.Linear``'s default U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, rngs, init=None) -> nnx.Linear:
  return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=cfg.jnp_param_dtype,
                    dtype=cfg.jnp_compute_dtype, kernel_init=init or _torch_linear_init(n_in),
                    rngs=rngs)


def _layer_norm(cfg: ModelConfig, n: int, rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(n, epsilon=1e-5, param_dtype=cfg.jnp_param_dtype, dtype=jnp.float32,
                       rngs=rngs)


def _zeros(key, shape, dtype):
  del key
  return jnp.zeros(shape, dtype)


def _token_shift(z: Array, mix: Array, prev: Optional[Array], fallback: str) -> Array:
  """``z + mix * (z_{t-1} - z_t)``; z_{-1} is ``prev`` (decode), else z_0 ("first") or 0 ("zero")."""
  if prev is None:
    prev = z[:, :1] if fallback == "first" else jnp.zeros_like(z[:, :1])
  shifted = jnp.concatenate([prev.astype(z.dtype), z[:, :-1]], axis=1)
  return z + mix.astype(z.dtype) * (shifted - z)


def _ratio(cfg: ModelConfig, layer: int) -> float:
  return 1.0 - layer / cfg.num_layers  # "ratio_1_to_almost0" of the authors' inits


@dataclasses.dataclass(frozen=True)
class LayerCache:
  """Decode state of one layer: the mixer cache plus token-shift history."""

  mixer: Any
  last_q: Array
  last_k: Array
  last_v: Array
  last_mlp: Array


jax.tree_util.register_dataclass(
    LayerCache, data_fields=["mixer", "last_q", "last_k", "last_v", "last_mlp"], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class SharedKV:
  """What a layer reads from the layers below it (cross-layer KV sharing).

  exports: per lower layer, what it computed in this call (``Attention.__call__``): ``k``/``v``
    (post-RoPE keys ``[B, T, Hkv, D]``, values), and for ``kvm`` layers the merge gates ``g``, its
    KVM ``params``, its ``cache`` after this call and, for the routing leader, ``routing``.
  old_caches: the layers' mixer caches as they were *before* this call (None without caches).
  """

  exports: dict
  old_caches: Optional[list] = None


def _without_window_kv(cache):
  """A KVM cache of a reconstruction layer stores no window keys/values (its sources hold them)."""
  return dataclasses.replace(cache, window_keys=None, window_values=None)


class Attention(nnx.Module):
  """Attention front-end (projections, value residual, token shift, QK-LN, RoPE) + one mixer.

  A *reconstruction* layer (cross-layer KV sharing, ``ModelConfig.kv_sharing``) has only the query
  side: its keys and values come from source layers (:class:`SharedKV`), fused on demand.
  """

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.layer, self.kind = cfg, layer, cfg.layer_mixers[layer]
    self.sources = cfg.kv_sources(layer)  # None: this layer computes and stores its own K/V
    self.fused = self.sources is not None and len(self.sources[0]) > 1
    self.shares_state = cfg.shares_state(layer)        # kvm: state fused from the sources' states
    self.routing_leader = cfg.routing_leader(layer)    # kvm: applies this layer's routing
    # kvm: a source of a fused-state layer, which replays this layer's state with its routing
    self.exports_routing = any(cfg.shares_state(i) and layer in sum(cfg.kv_sources(i), ())
                               for i in range(cfg.num_layers))
    C, H, Hkv, D, Dv = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.qk_head_dim, cfg.v_head_dim
    dq, dk, dv = H * D, Hkv * D, Hkv * Dv
    pd = cfg.jnp_param_dtype
    stores_kv = self.sources is None
    self.c_q = _linear(cfg, C, dq, rngs)
    self.ln_q = _layer_norm(cfg, D, rngs)
    if stores_kv:
      self.c_k = _linear(cfg, C, dk, rngs)
      self.c_v = _linear(cfg, C, dv, rngs)
      self.ln_k = _layer_norm(cfg, D, rngs)
    self.c_proj = _linear(cfg, H * Dv, C, rngs, init=_zeros)
    rho = _ratio(cfg, layer)
    if cfg.tokenshift_attention:
      ramp = lambda n, p: jnp.asarray(1.0 - np.power(np.arange(n) / n, p), pd)
      self.x_q = nnx.Param(ramp(dq, 0.2 * rho))
      if stores_kv:
        self.x_k = nnx.Param(ramp(dk, 0.7 * rho))
        self.x_v = nnx.Param(ramp(dv, 0.7 * rho))
    if self.fused:
      # Per source (layer 1, layer n): "lite" starts as K = K^n, V = V^1 exactly.
      a, b = ((0.0, 1.0), (1.0, 0.0)) if cfg.fusedkv_init == "lite" else ((0.5, 0.5), (0.5, 0.5))
      r = cfg.rope_dims_of(layer)
      per_source = lambda w, n: jnp.stack([jnp.full((Hkv, n), x, pd) for x in w])
      self.fuse_k_rotary = nnx.Param(per_source(a, r // 2))  # one weight per rotary pair
      self.fuse_k_free = nnx.Param(per_source(a, D - r))
      self.fuse_v = nnx.Param(per_source(b, Dv))
    if cfg.value_residual and stores_kv:
      lora = cfg.value_lora_width
      linear = np.arange(dv) / (dv - 1) - 0.5
      self.v_gate0 = nnx.Param(jnp.asarray(0.73 - 0.4 * linear, pd))
      self.v_gate1 = _linear(cfg, C, lora, rngs, init=_zeros)
      self.v_gate2 = _linear(cfg, lora, dv, rngs,
                             init=jax.nn.initializers.orthogonal(scale=0.1))
    if self.kind == "kvm":
      kc = cfg.kvm
      if not self.shares_state:  # a fused state is built by the sources' LN_s and gates
        self.ln_s = _layer_norm(cfg, D, rngs)
        if kc.uses_gate:
          self.key_weighting = _linear(cfg, C, Hkv, rngs)
      if kc.head_temperatures:
        self.window_temperature = nnx.Param(jnp.ones((H,), pd))
        self.state_temperature = nnx.Param(jnp.ones((H,), pd))

  # -- pieces ----------------------------------------------------------------------------------
  def anchor_value(self, x_normed: Array) -> Array:
    """``v_first`` = c_v(ln_attn(x0)) when this is an anchor layer."""
    return self.c_v(x_normed)

  def fusion_weights(self) -> tuple[Array, Array]:
    """FusedKV weights ``([S, Hkv, D] keys, [S, Hkv, Dv] values)``, rotary pairs tied."""
    return (kv_fusion.expand_key_weights(self.fuse_k_rotary[...], self.fuse_k_free[...]),
            self.fuse_v[...])

  def _q_only(self, x: Array, positions: Array, prev: Optional[LayerCache]):
    cfg = self.cfg
    B, T, _ = x.shape
    q = self.c_q(x)
    tails = (q[:, -1:], None, None)
    if cfg.tokenshift_attention:
      q = _token_shift(q, self.x_q[...], None if prev is None else prev.last_q, "first")
    q = self.ln_q(q.reshape(B, T, cfg.num_heads, cfg.qk_head_dim)).astype(x.dtype)
    cos, sin = rope_tables(positions, cfg.qk_head_dim, cfg.rope_dims_of(self.layer),
                           cfg.rope_theta, jnp.dtype(cfg.rope_table_dtype))
    return apply_rope(q, cos, sin), None, None, tails

  def _qkv(self, x: Array, v_first: Optional[Array], positions: Array, prev: Optional[LayerCache]):
    cfg = self.cfg
    if self.sources is not None:
      return self._q_only(x, positions, prev)
    B, T, _ = x.shape
    q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
    if cfg.value_residual:
      gate = jax.nn.sigmoid(self.v_gate0[...].astype(jnp.float32)
                            + self.v_gate2(self.v_gate1(x)).astype(jnp.float32))
      v = v + (v_first.astype(v.dtype) - v) * gate.astype(v.dtype)
    tails = (q[:, -1:], k[:, -1:], v[:, -1:])  # projected, pre-shift: next step's z_{t-1}
    if cfg.tokenshift_attention:
      q = _token_shift(q, self.x_q[...], None if prev is None else prev.last_q, "first")
      k = _token_shift(k, self.x_k[...], None if prev is None else prev.last_k, "first")
      v = _token_shift(v, self.x_v[...], None if prev is None else prev.last_v, "first")
    D, Dv = cfg.qk_head_dim, cfg.v_head_dim
    q = self.ln_q(q.reshape(B, T, cfg.num_heads, D)).astype(x.dtype)
    k = self.ln_k(k.reshape(B, T, cfg.kv_heads, D)).astype(x.dtype)
    v = v.reshape(B, T, cfg.kv_heads, Dv)
    cos, sin = rope_tables(positions, D, cfg.rope_dims_of(self.layer), cfg.rope_theta,
                           jnp.dtype(cfg.rope_table_dtype))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v, tails

  def kvm_params(self) -> KVMParams:
    """The layer's KVM parameters; temperatures are ones when the config disables them (a layer
    with a fused state has no LN_s of its own: identity placeholders)."""
    if self.cfg.kvm.head_temperatures:
      window_temp, state_temp = self.window_temperature[...], self.state_temperature[...]
    else:
      window_temp = state_temp = jnp.ones((self.cfg.num_heads,), jnp.float32)
    if self.shares_state:
      D = self.cfg.qk_head_dim
      ln_scale, ln_bias = jnp.ones((D,), jnp.float32), jnp.zeros((D,), jnp.float32)
    else:
      ln_scale, ln_bias = self.ln_s.scale[...], self.ln_s.bias[...]
    return KVMParams(ln_scale=ln_scale, ln_bias=ln_bias, window_temperature=window_temp,
                     state_temperature=state_temp)

  def merge_gate(self, x: Array) -> Array:
    if not self.cfg.kvm.uses_gate:
      return jnp.ones((*x.shape[:2], self.cfg.kv_heads), jnp.float32)
    return 1.0 + jax.nn.elu(self.key_weighting(x).astype(jnp.float32))

  def init_cache(self, batch: int, max_len: int) -> Any:
    cfg = self.cfg
    dtype = cfg.jnp_compute_dtype
    common = dict(batch=batch, kv_heads=cfg.kv_heads, head_dim=cfg.qk_head_dim,
                  value_dim=cfg.v_head_dim, max_len=max_len, dtype=dtype)
    if self.shares_state:
      return None  # reads the sources' states and windows
    if self.kind == "kvm":
      cache = kvm_init_cache(cfg.kvm, **common)
      return cache if self.sources is None else _without_window_kv(cache)
    if self.sources is not None:
      return None  # the source layers' caches hold everything this layer reads
    return attn_ops.init_ring_cache(self.kind, window=cfg.swa_window,
                                    chunk_size=cfg.bswa_chunk_size,
                                    window_chunks=cfg.bswa_window_chunks,
                                    sink_rows=cfg.bswa_sink_rows, **common)

  # -- calls -----------------------------------------------------------------------------------
  def __call__(self, x: Array, v_first: Optional[Array], positions: Array,
               cache: Optional[LayerCache] = None, decode: bool = False,
               shared: Optional[SharedKV] = None):
    """Whole sequence (``decode=False``; fills ``cache.mixer`` if a cache is given) or one token.

    Returns ``(output, new mixer cache, token-shift tails, exports)``; ``exports`` is what layers
    above may read (see :class:`SharedKV`).
    """
    q, k, v, tails = self._qkv(x, v_first, positions, cache if decode else None)
    mixer_cache = None if cache is None else cache.mixer
    exports = {}
    if self.sources is None:
      y, mixer_cache, exports = self._mix_own(x, q, k, v, mixer_cache, decode, shared)
    elif self.shares_state:
      y, mixer_cache = self._mix_kvm_shared_state(q, shared, decode), None
    elif self.kind == "kvm":
      y, mixer_cache = self._mix_kvm_window_fusion(x, q, shared, mixer_cache, decode)
    else:
      y, mixer_cache = self._mix_folded(q, shared, decode), None
    B, T = x.shape[:2]
    out = self.c_proj(y.reshape(B, T, -1).astype(x.dtype))
    return out, mixer_cache, tails, exports

  def _source_weights(self):
    """``(key sources, value sources, key weights or None, value weights or None)``."""
    key_w, value_w = self.fusion_weights() if self.fused else (None, None)
    return self.sources[0], self.sources[1], key_w, value_w

  def _mix_own(self, x, q, k, v, mixer_cache, decode, shared):
    """A storage layer: its own K/V (and, for kvm, its own state, possibly with shared routing)."""
    exports = {"k": k, "v": v}
    if self.kind != "kvm":
      y, mixer_cache = self._mix(x, q, k, v, mixer_cache, decode)
      return y, mixer_cache, exports
    routing = None
    if self.routing_leader is not None:
      routing = shared.exports[self.routing_leader]["routing"]
    y, mixer_cache, decisions = self._mix_kvm(x, q, k, v, mixer_cache, decode, routing,
                                              self.exports_routing)
    exports.update(g=self.merge_gate(x), params=self.kvm_params(), cache=mixer_cache)
    if self.exports_routing:
      exports["routing"] = decisions
    return y, mixer_cache, exports

  def _mix_kvm(self, x, q, k, v, mixer_cache, decode, routing=None, return_routing=False):
    """The KVM core over this layer's (or fused) keys and values: whole sequence, prefill into
    ``mixer_cache``, or one decode step. Returns ``(y, cache, decisions or None)``."""
    cfg = self.cfg
    g, params = self.merge_gate(x), self.kvm_params()
    kw = dict(routing=routing, return_routing=return_routing,
              implementation=cfg.kvm_implementation)
    if decode:
      out = kvm_decode_step(q, k, v, g, params, cfg.kvm, mixer_cache, **kw)
    elif mixer_cache is not None:
      out = kvm_prefill(q, k, v, g, params, cfg.kvm, mixer_cache, **kw)
    else:
      y, _, *decisions = kvm_attention(q, k, v, g, params, cfg.kvm, **kw)
      out = (y, None, *decisions)
    return out[0], out[1], (out[2] if return_routing else None)

  def _mix(self, x, q, k, v, mixer_cache, decode, scale=None):
    """This layer's mixer over its own (or stacked / fused) keys and values."""
    cfg, kind = self.cfg, self.kind
    if kind == "kvm":
      return self._mix_kvm(x, q, k, v, mixer_cache, decode)[:2]
    if decode:
      return attn_ops.ring_decode_step(q, k, v, mixer_cache, scale=scale)
    if kind == "full":
      y = attn_ops.full_attention(q, k, v, scale=scale)
    elif kind == "swa":
      y = attn_ops.sliding_window_attention(q, k, v, cfg.swa_window, scale=scale)
    else:
      y = attn_ops.block_sliding_window_attention(q, k, v, cfg.bswa_chunk_size,
                                                  cfg.bswa_window_chunks, cfg.bswa_sink_rows,
                                                  scale=scale)
    if mixer_cache is not None:
      mixer_cache = attn_ops.ring_prefill(k, v, mixer_cache)
    return y, mixer_cache

  def _mix_folded(self, q, shared: SharedKV, decode: bool):
    """full/swa/bswa reconstruction layer: one attention over the sources stacked along the head
    dim, queries folded with the key weights, value slices weighted after (never a fused K/V)."""
    ks, vs, key_w, value_w = self._source_weights()
    ex = shared.exports
    keys = kv_fusion.stack_sources([ex[j]["k"] for j in ks])
    values = kv_fusion.stack_sources([ex[j]["v"] for j in vs])
    scale = None
    if self.fused:
      q = kv_fusion.fold_queries(q, key_w)
      scale = 1.0 / math.sqrt(self.cfg.qk_head_dim)  # of one source, not of the stack
    view = None
    if decode:  # the sources' caches before this token, stacked the same way (a view, not kept)
      kc, vc = [shared.old_caches[j] for j in ks], [shared.old_caches[j] for j in vs]
      view = dataclasses.replace(
          kc[0], keys=kv_fusion.stack_sources([c.keys for c in kc]),
          values=kv_fusion.stack_sources([c.values for c in vc]),
          sink_keys=kv_fusion.stack_sources([c.sink_keys for c in kc]),
          sink_values=kv_fusion.stack_sources([c.sink_values for c in vc]))
    y, _ = self._mix(None, q, keys, values, view, decode, scale=scale)
    return kv_fusion.unfold_output(y, value_w) if self.fused else y

  def _mix_kvm_window_fusion(self, x, q, shared: SharedKV, mixer_cache, decode: bool):
    """kvm reconstruction layer, window-only fusion: the window keys/values are fused from the
    sources on demand; the compressed state is this layer's own, built from the fused per-token
    K/V with this layer's merge gates (states of different layers are not row-aligned)."""
    ks, vs, key_w, value_w = self._source_weights()
    ex, fuse = shared.exports, kv_fusion.materialize
    k, v = fuse([ex[j]["k"] for j in ks], key_w), fuse([ex[j]["v"] for j in vs], value_w)
    view = None
    if mixer_cache is not None:
      kc, vc = [shared.old_caches[j] for j in ks], [shared.old_caches[j] for j in vs]
      if decode:  # the sources' rings before this token: the fold may need the slot t overwrites
        ring_k = fuse([c.window_keys for c in kc], key_w)
        ring_v = fuse([c.window_values for c in vc], value_w)
      else:  # prefill replaces the contents: zeros of the right shape suffice
        ring_k, ring_v = jnp.zeros_like(kc[0].window_keys), jnp.zeros_like(vc[0].window_values)
      view = dataclasses.replace(mixer_cache, window_keys=ring_k, window_values=ring_v)
    y, new_cache = self._mix(x, q, k, v, view, decode)
    return y, (None if new_cache is None else _without_window_kv(new_cache))

  def _mix_kvm_shared_state(self, q, shared: SharedKV, decode: bool):
    """kvm reconstruction layer with shared routing: state and window fused from the sources."""
    ks, vs, key_w, value_w = self._source_weights()
    ex = shared.exports
    tracks = tuple(sorted(set(ks) | set(vs)))
    key_tracks = tuple(tracks.index(j) for j in ks)
    value_tracks = tuple(tracks.index(j) for j in vs)
    params = self.kvm_params()
    if decode:
      return kvm_decode_shared_state(q, [ex[j]["cache"] for j in tracks],
                                     [ex[j]["params"] for j in tracks], key_w, value_w,
                                     key_tracks, value_tracks, params, self.cfg.kvm)
    fuse = kv_fusion.materialize
    k, v = fuse([ex[j]["k"] for j in ks], key_w), fuse([ex[j]["v"] for j in vs], value_w)
    source_tracks = tuple(SourceTrack(ex[j]["k"], ex[j]["v"], ex[j]["g"], ex[j]["params"])
                          for j in tracks)
    return kvm_attention_shared_state(q, k, v, source_tracks, key_w, value_w, params,
                                      ex[tracks[0]]["routing"],  # = every track's (shared)
                                      cfg=self.cfg.kvm, key_tracks=key_tracks,
                                      value_tracks=value_tracks)


class MLP(nnx.Module):
  """Token-shifted squared-ReLU channel mixer (spec §4)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    C = cfg.hidden_size
    self.c_fc = _linear(cfg, C, cfg.mlp_width, rngs, init=jax.nn.initializers.orthogonal(1.0))
    self.c_proj = _linear(cfg, cfg.mlp_width, C, rngs, init=_zeros)
    if cfg.tokenshift_mlp:
      self.x_k = nnx.Param(jnp.asarray(1.0 - np.power(np.arange(C) / C, _ratio(cfg, layer) ** 4),
                                       cfg.jnp_param_dtype))

  def __call__(self, x: Array, prev: Optional[Array] = None) -> Array:
    if self.cfg.tokenshift_mlp:
      x = _token_shift(x, self.x_k[...], prev, "zero")
    return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x))))


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.ln_attn = _layer_norm(cfg, cfg.hidden_size, rngs)
    self.attn = Attention(cfg, layer, rngs=rngs)
    self.ln_mlp = _layer_norm(cfg, cfg.hidden_size, rngs)
    self.mlp = MLP(cfg, layer, rngs=rngs)

  def __call__(self, x, v_first, positions, cache: Optional[LayerCache] = None, decode=False,
               shared: Optional[SharedKV] = None):
    dtype = x.dtype
    h, mixer_cache, tails, exports = self.attn(self.ln_attn(x).astype(dtype), v_first, positions,
                                               cache, decode, shared)
    x = x + self.cfg.scale * h
    m_in = self.ln_mlp(x).astype(dtype)
    x = x + self.cfg.scale * self.mlp(m_in, cache.last_mlp if (decode and cache) else None)
    new_cache = None
    if cache is not None:
      new_cache = LayerCache(mixer=mixer_cache, last_q=tails[0], last_k=tails[1], last_v=tails[2],
                             last_mlp=m_in[:, -1:])
    return x, new_cache, exports


class LM(nnx.Module):
  """GPTAlpha-2 LM: embedding LN, blocks, head LN, untied LM head; logits in float32."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    C, V = cfg.hidden_size, cfg.vocab_size
    self.wte = nnx.Embed(V, C, param_dtype=cfg.jnp_param_dtype, dtype=cfg.jnp_compute_dtype,
                         embedding_init=lambda k, s, d: jax.random.uniform(k, s, d, -1e-4, 1e-4),
                         rngs=rngs)
    self.ln_emb = _layer_norm(cfg, C, rngs)
    self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
    self.ln_head = _layer_norm(cfg, C, rngs)
    self.lm_head = _linear(cfg, C, V, rngs,
                           init=jax.nn.initializers.orthogonal(scale=0.5 * math.sqrt(V / C)))

  def _check_tokens(self, tokens):
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [batch, time] int, got shape {tokens.shape}.")
    try:  # one device reduction and one transfer; skipped when traced
      low, top = (int(x) for x in jnp.stack([jnp.min(tokens), jnp.max(tokens)]))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return
    if low < 0 or top >= self.cfg.vocab_size:
      bad = low if low < 0 else top
      raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.cfg.vocab_size}).")

  def _run(self, tokens, positions, caches, decode):
    cfg = self.cfg
    x0 = self.ln_emb(self.wte(tokens)).astype(cfg.jnp_compute_dtype)
    anchors = {}
    for layer in sorted({cfg.value_anchor(i) for i in range(cfg.num_layers)}):
      block = self.blocks[layer]
      anchors[layer] = block.attn.anchor_value(block.ln_attn(x0).astype(x0.dtype))
    x, new_caches, exports = x0, [], {}
    old_caches = None if caches is None else [c.mixer for c in caches]
    sharing = cfg.kv_sharing != "none"
    for i, block in enumerate(self.blocks):
      shared = SharedKV(exports=exports, old_caches=old_caches) if sharing else None
      x, c, exports[i] = block(x, anchors[cfg.value_anchor(i)], positions,
                               None if caches is None else caches[i], decode, shared)
      new_caches.append(c)
    logits = self.lm_head(self.ln_head(x).astype(x.dtype)).astype(jnp.float32)
    return logits, (None if caches is None else new_caches)

  def __call__(self, tokens: Array) -> Array:
    """Logits ``[B, T, V]`` (float32) of a whole sequence."""
    self._check_tokens(tokens)
    positions = jnp.arange(tokens.shape[1])[None]
    return self._run(tokens, positions, None, False)[0]

  def init_cache(self, batch: int, max_len: int) -> list[LayerCache]:
    cfg = self.cfg
    dt = cfg.jnp_compute_dtype
    H, Hkv, D, Dv = cfg.num_heads, cfg.kv_heads, cfg.qk_head_dim, cfg.v_head_dim
    stores = lambda block, x: x if block.attn.sources is None else None
    return [LayerCache(mixer=block.attn.init_cache(batch, max_len),
                       last_q=jnp.zeros((batch, 1, H * D), dt),
                       last_k=stores(block, jnp.zeros((batch, 1, Hkv * D), dt)),
                       last_v=stores(block, jnp.zeros((batch, 1, Hkv * Dv), dt)),
                       last_mlp=jnp.zeros((batch, 1, cfg.hidden_size), dt))
            for block in self.blocks]

  @staticmethod
  def cache_bytes(caches: list[LayerCache]) -> list[int]:
    """Bytes of each layer's K/V cache (mixer cache: window, state, KV buffer), measured from the
    arrays; 0 for a reconstruction layer that reads its sources' caches."""
    return [tree_nbytes(c.mixer) for c in caches]

  def prefill(self, tokens: Array, caches: list[LayerCache]) -> tuple[Array, list[LayerCache]]:
    """Logits of a prompt and the caches filled for decoding from position T."""
    self._check_tokens(tokens)
    max_len = caches[0].mixer.max_len
    if tokens.shape[1] > max_len:
      raise ValueError(f"prompt of {tokens.shape[1]} tokens exceeds the cache max_len={max_len}.")
    positions = jnp.arange(tokens.shape[1])[None]
    return self._run(tokens, positions, caches, False)

  def decode_step(self, token: Array, caches: list[LayerCache]) -> tuple[Array, list[LayerCache]]:
    """Logits ``[B, 1, V]`` of one token at position ``caches[..].length``."""
    if token.ndim != 2 or token.shape[1] != 1:
      raise ValueError(f"decode_step takes tokens of shape [batch, 1], got {token.shape}.")
    position = caches[0].mixer.length
    return self._run(token, jnp.reshape(position, (1, 1)), caches, True)


def count_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts without allocating weights (``nnx.eval_shape``).

  ``total`` counts everything; ``non_embedding`` excludes the token embedding and the LM head (the
  convention of the paper's "120M"/"350M" names); ``without_lm_head`` = total - LM head.
  """
  model = nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
  total = sum(int(np.prod(p.shape)) for p in leaves)
  embed = cfg.vocab_size * cfg.hidden_size
  return {"total": total, "non_embedding": total - 2 * embed, "without_lm_head": total - embed,
          "embedding": embed, "lm_head": embed}
