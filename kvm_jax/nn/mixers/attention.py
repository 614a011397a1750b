"""The attention front end shared by every mixer kind but RWKV-7.

:class:`AttentionFrontEnd` (docs/kvm-spec.md §4) owns the projections, the value residual, the token
shift of the projected q/k/v, QK-LayerNorm, RoPE and the output projection. Each mixer kind is one
subclass in its own module that adds what only it has (recurrentgemma's one-block-per-temporal-mixer
layout) and everything else the mixer protocol asks of a kind (:class:`kvm_jax.nn.mixers.mixer.MixerKind`:
among others its window, ``exact_window``, and what it keeps beyond it, ``beyond_window``, which
this class does not provide).

The kinds: :mod:`kvm_jax.nn.mixers.full`, :mod:`kvm_jax.nn.mixers.swa`, :mod:`kvm_jax.nn.mixers.bswa` (softmax attention
over a ring of raw keys/values, :class:`SoftmaxAttention`), :mod:`kvm_jax.nn.mixers.kvm` and
:mod:`kvm_jax.nn.mixers.ovq` (this front end without QK-LN and RoPE); :mod:`kvm_jax.nn.mixers.rwkv7` implements
the same protocol without this front end. The list of kinds is :mod:`kvm_jax.nn.registry`.

Parameters stay flat under the block's ``attn`` (``attn/c_q``, ``attn/ln_s``, ...), named like the
authors' state dict. A *reconstruction* layer of cross-layer KV sharing has only the query side;
how it mixes lives in :mod:`kvm_jax.nn.mixers.kv_sharing`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig, value_lora_width
from kvm_jax.nn.mixers import kv_sharing
from kvm_jax.nn.cache import is_resume, last_tokens, piece_counts, step_active
from kvm_jax.nn.families.family import family_of
from kvm_jax.nn.mixers.mixer import Mixed, MixerOutput
from kvm_jax.nn.layers import depth_ratio, float32_init, linear, token_shift, zeros_init
from kvm_jax.ops.attention import dense as attn_ops
from kvm_jax.ops.attention.dense import RingCache
from kvm_jax.ops.common import tree_nbytes
from kvm_jax.ops.documents import (Documents, WindowRule, combine_partials,
                                   document_window_partials)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class LayerCache:
  """Decode state of one layer: the mixer cache plus the token-shift history (the last projected
  q/k/v before the shift, and the last MLP input)."""

  mixer: Any
  last_q: Array
  last_k: Array
  last_v: Array
  last_mlp: Array


jax.tree_util.register_dataclass(
    LayerCache, data_fields=["mixer", "last_q", "last_k", "last_v", "last_mlp"], meta_fields=[])


def cache_bytes_from_shapes(cls, cfg: ModelConfig, layer: int, batch: int,
                            max_len: int) -> int:
  """Bytes of the decode cache of ``cls``'s layer ``layer`` for ``batch`` sequences of up to
  ``max_len`` tokens, from the cache's shapes (nothing is allocated); 0 for a layer that stores
  nothing. The default ``cache_bytes`` of a mixer kind."""
  module = nnx.eval_shape(lambda: cls(cfg, layer, rngs=nnx.Rngs(0)))
  return tree_nbytes(jax.eval_shape(lambda: module.init_cache(batch, max_len)))


class AttentionFrontEnd(nnx.Module):
  """Projections, value residual, token shift, QK-LN and RoPE, then the kind's mixer, then the
  output projection.

  A subclass (one mixer kind) sets ``Options`` and provides ``mix_own(x, q, k, v, mixer_cache,
  decode, shared, documents=None)`` (a layer with its own K/V) and ``mix_reconstructed(x, q,
  mixer_cache, decode, shared, documents=None)`` (a reconstruction layer), each returning a
  :class:`kvm_jax.nn.mixers.mixer.Mixed`, ``init_cache(batch, max_len)`` (its decode cache) and the classmethod
  ``keys_per_query(cfg, layer, seq_len)``: the keys one query of that layer attends to, averaged
  over the positions of a training sequence (the attention FLOPs of a step scale with it), and
  the classmethods ``exact_window`` and ``beyond_window`` (a class without one of the mixer
  protocol's members cannot be registered). ``self.kind``
  is the name the layer was registered under (``ModelConfig.layer_mixers[layer]``), so a subclass
  registered under a new name reads its own options.

  A *reconstruction* layer (``ModelConfig.kv_sources(layer)`` is not None) has only the query
  side: its keys and values come from source layers (:class:`kv_sharing.SharedKV`).
  """

  Options: type = type(None)
  # Logical axes of the 2-D parameters this class creates, by the name of the layer that owns
  # them (kvm_jax.train.sharding maps logical axes to mesh axes).
  LOGICAL_AXES: dict = {"c_q": ("embed", "heads"), "c_k": ("embed", "kv_heads"),
                        "c_v": ("embed", "kv_heads"), "c_proj": ("heads", "embed"),
                        "v_gate1": ("embed", "lora"), "v_gate2": ("lora", "kv_heads")}
  # μP/CompleteP group of a parameter, by its owner's name, where the default rule (a ``kernel``
  # is "matrix_params", everything else "scalars"; kvm_jax.train.completep) is not the authors'.
  PARAM_GROUPS: dict = {}
  # Per-head norms of q and k where the family has them (GPTAlpha-2's QK-LayerNorm, Qwen3's
  # RMSNorm); OVQ layers never have them.
  QK_NORM: bool = True
  # Whether ``mix_own`` takes packed documents (a ``documents=`` keyword, see
  # :meth:`kvm_jax.nn.model.LM.__call__`): a kind without it is refused with segment_ids.
  DOCUMENTS: bool = False
  # Whether the kind soft-caps its scores at ``self.softcap`` (a family's attention soft-cap,
  # Gemma 2): a kind without it is refused in such a family rather than computing another model.
  # False unless the kind's class says so, so a kind added from outside that never reads
  # ``self.softcap`` is refused there instead of silently leaving the cap out.
  SOFTCAP: bool = False

  @classmethod
  def mup_d_in_ratios(cls, cfg: ModelConfig) -> dict:
    """The μP width ratio of parameters whose input is not the model width, by owner name (the
    authors' ``mup_d_in_ratio``): the value-residual LoRA's output reads ``lora`` channels, so its
    ratio is lora / lora at the base width."""
    return {"v_gate2": value_lora_width(cfg.hidden_size) / value_lora_width(cfg.mup_base_dim)}

  cache_bytes = classmethod(cache_bytes_from_shapes)

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.layer = cfg, layer
    self.kind = cfg.layer_mixers[layer]
    self.options = cfg.options_of(self.kind)
    self.sources = cfg.kv_sources(layer)  # None: this layer computes and stores its own K/V
    self.fused = self.sources is not None and len(self.sources[0]) > 1
    C, H, Hkv, D, Dv = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.qk_head_dim, cfg.v_head_dim
    dq, dk, dv = H * D, Hkv * D, Hkv * Dv
    pd = cfg.jnp_param_dtype
    stores_kv = self.sources is None
    family = self.family = family_of(cfg)
    # Scores squashed to (-cap, cap) before the softmax (Gemma 2), or None; a kind that cannot
    # cap them (SOFTCAP False) is refused by the Block that builds it.
    self.softcap = family.attention_softcap(cfg)
    head_norm = lambda: family.head_norm(cfg, D, rngs) if self.QK_NORM else None
    # Creation order fixes which random key each parameter gets: keep it.
    self.c_q = family.projection(cfg, C, dq, rngs, "q")
    if (norm := head_norm()) is not None:
      self.ln_q = norm
    if stores_kv:
      self.c_k = family.projection(cfg, C, dk, rngs, "k")
      self.c_v = family.projection(cfg, C, dv, rngs, "v")
      if (norm := head_norm()) is not None:
        self.ln_k = norm
    self.c_proj = family.projection(cfg, H * Dv, C, rngs, "o")
    rho = depth_ratio(cfg, layer)
    if cfg.tokenshift_attention:
      ramp = lambda n, p: jnp.asarray(1.0 - np.power(np.arange(n) / n, p), pd)
      self.x_q = nnx.Param(ramp(dq, 0.2 * rho))
      if stores_kv:
        self.x_k = nnx.Param(ramp(dk, 0.7 * rho))
        self.x_v = nnx.Param(ramp(dv, 0.7 * rho))
    if self.fused:
      kv_sharing.add_fusion_weights(self)
    if cfg.value_residual and stores_kv:
      lora = cfg.value_lora_width
      ramp_v = np.arange(dv) / (dv - 1) - 0.5
      self.v_gate0 = nnx.Param(jnp.asarray(0.73 - 0.4 * ramp_v, pd))
      self.v_gate1 = linear(cfg, C, lora, rngs, init=zeros_init)
      self.v_gate2 = linear(cfg, lora, dv, rngs,
                            init=float32_init(jax.nn.initializers.orthogonal(scale=0.1)))

  # -- the front end -----------------------------------------------------------------------------
  def anchor_value(self, x_normed: Array, cache: Optional[LayerCache] = None,
                   documents=None) -> Array:
    """``v_first`` = c_v(ln_attn(x0)) when this is an anchor layer (``cache``: the layer's cache
    in a decode step, unused here; ``documents``: packed documents, nothing to do for a
    per-token projection)."""
    return self.c_v(x_normed)

  def init_tails(self, batch: int) -> tuple:
    """The token-shift history a decode cache starts with: the last projected q, k, v (zeros;
    None for what a reconstruction layer does not compute)."""
    cfg = self.cfg
    dt = cfg.jnp_compute_dtype
    stores = self.sources is None
    zeros = lambda width: jnp.zeros((batch, 1, width), dt)
    return (zeros(cfg.num_heads * cfg.qk_head_dim),
            zeros(cfg.kv_heads * cfg.qk_head_dim) if stores else None,
            zeros(cfg.kv_heads * cfg.v_head_dim) if stores else None)

  def _rotate(self, x: Array, positions: Array) -> Array:
    """The family's RoPE on ``x [B, T, heads, D]``; nothing to do for a layer without rotary
    channels."""
    if self.cfg.rope_dims_of(self.layer) == 0:
      return x
    return self.family.rotate(x, self.family.rope(self.cfg, self.layer, positions))

  def _scaled(self, q: Array) -> Array:
    """Rotated queries times the family's query scale (most families: unchanged)."""
    scale = self.family.query_scale(self.cfg)
    return q if scale == 1.0 else q * jnp.asarray(scale, q.dtype)

  def _head_norm(self, name: str, x: Array) -> Array:
    norm = getattr(self, name, None)
    return x if norm is None else norm(x)

  def _query_heads(self, q: Array, prev: Optional[LayerCache], dtype,
                   starts: Optional[Array] = None) -> Array:
    """Projected queries ``[B, T, H·D]`` -> token shift, heads, LN_q: ``[B, T, H, D]``
    (``starts``: documents' first tokens, where the shift restarts)."""
    cfg = self.cfg
    B, T, _ = q.shape
    if cfg.tokenshift_attention:
      q = token_shift(q, self.x_q[...], None if prev is None else prev.last_q, "first", starts)
    return self._head_norm("ln_q", q.reshape(B, T, cfg.num_heads, cfg.qk_head_dim)).astype(dtype)

  def queries(self, x: Array, positions: Array, prev: Optional[LayerCache],
              starts: Optional[Array] = None, counts: Optional[Array] = None):
    """Queries ``[B, T, H, D]`` and the token-shift tails of a reconstruction layer
    (``starts [B, T]``: packed documents' first tokens, where the shift restarts; ``counts
    [B]``: a piece's real tokens per row, whose last one the tails are)."""
    q = self.c_q(x)
    tails = (last_tokens(q, counts), None, None)
    q = self._rotate(self._query_heads(q, prev, x.dtype, starts), positions)
    return self._scaled(q), tails

  def qkv(self, x: Array, v_first: Optional[Array], positions: Array,
          prev: Optional[LayerCache], starts: Optional[Array] = None,
          counts: Optional[Array] = None):
    """``(q [B,T,H,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv], tails)`` of a layer with its own K/V:
    value residual, then token shift of the projected q/k/v, QK-LN, RoPE. ``tails`` are the last
    projected (pre-shift) q/k/v: the next decode step's z_{t-1} (of each row's last real token
    when ``counts [B]`` says how many a piece holds). ``starts [B, T]``: the first tokens of
    packed documents, where the token shift restarts."""
    cfg = self.cfg
    B, T, _ = x.shape
    q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
    if cfg.value_residual:
      gate = jax.nn.sigmoid(self.v_gate0[...].astype(jnp.float32)
                            + self.v_gate2(self.v_gate1(x)).astype(jnp.float32))
      v = v + (v_first.astype(v.dtype) - v) * gate.astype(v.dtype)
    tails = tuple(last_tokens(z, counts) for z in (q, k, v))
    q = self._query_heads(q, prev, x.dtype, starts)
    if cfg.tokenshift_attention:
      k = token_shift(k, self.x_k[...], None if prev is None else prev.last_k, "first", starts)
      v = token_shift(v, self.x_v[...], None if prev is None else prev.last_v, "first", starts)
    D, Dv = cfg.qk_head_dim, cfg.v_head_dim
    k = self._head_norm("ln_k", k.reshape(B, T, cfg.kv_heads, D)).astype(x.dtype)
    v = v.reshape(B, T, cfg.kv_heads, Dv)
    return self._scaled(self._rotate(q, positions)), self._rotate(k, positions), v, tails

  def __call__(self, x: Array, v_first: Optional[Array], positions: Array,
               cache: Optional[LayerCache] = None, decode: bool = False,
               shared: Optional[kv_sharing.SharedKV] = None, documents=None):
    """Whole sequence (``decode=False``; fills ``cache.mixer`` if a cache is given) or one token.

    Returns a :class:`MixerOutput`; its ``exports`` are what layers above may read (see
    :class:`kv_sharing.SharedKV`). ``documents``: packed documents
    (:class:`kvm_jax.ops.documents.Documents`; ``positions`` are then their own positions), for
    a whole sequence without a cache, in a layer with its own keys and values.
    """
    prev = cache if decode else None
    mixer_cache = None if cache is None else cache.mixer
    if documents is not None:
      if decode or cache is not None:
        raise ValueError("segment_ids: packed documents run as whole sequences without a cache; "
                         "prefill and decode take one sequence per row.")
      starts = documents.position == 0
      extra = {"documents": documents}
    else:
      # A row decoding its first token (an empty cache row: the engine fills a new request this
      # way) shifts from the token itself, as a prefill's first token does, not from the zeros
      # the cache starts with.
      starts = (positions == 0) if decode else None
      extra = {}
    counts = piece_counts(decode)
    if self.sources is None:
      q, k, v, tails = self.qkv(x, v_first, positions, prev, starts, counts)
      mixed = self.mix_own(x, q, k, v, mixer_cache, decode, shared, **extra)
    else:
      q, tails = self.queries(x, positions, prev, starts, counts)
      mixed = self.mix_reconstructed(x, q, mixer_cache, decode, shared, **extra)
    y, mixer_cache, exports = mixed
    B, T = x.shape[:2]
    return MixerOutput(self.c_proj(y.reshape(B, T, -1).astype(x.dtype)), mixer_cache, tails,
                       exports)

  # -- shared by the kinds ------------------------------------------------------------------
  def _cache_sizes(self, batch: int, max_len: int) -> dict:
    cfg = self.cfg
    return dict(batch=batch, kv_heads=cfg.kv_heads, head_dim=cfg.qk_head_dim,
                value_dim=cfg.v_head_dim, max_len=max_len, dtype=cfg.jnp_compute_dtype)




class SoftmaxAttention(AttentionFrontEnd):
  """Softmax attention over a window of raw keys/values, a
  :class:`~kvm_jax.ops.attention.dense.RingCache` (the baselines).
  Subclasses give the whole-sequence ``attend(q, k, v, scale=None)`` and the positions a query
  sees (``window_rule``), which the decode ring and packed documents follow too."""

  DOCUMENTS = True
  SOFTCAP = True

  @classmethod
  def resume_alignment(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """A ring continues from any position (1); a reconstruction layer of cross-layer KV sharing
    reads its sources' rings one token at a time only (None)."""
    return None if cfg.kv_sources(layer) is not None else 1

  def window_rule(self) -> WindowRule:
    """Which earlier positions (of its own document, with packed documents) a query sees: every
    one here; the decode ring keeps what this rule needs."""
    return WindowRule("causal")

  def sink_rows(self) -> int:
    """The first tokens a decode ring keeps apart while they lie before the window (none)."""
    return 0

  def attend_documents(self, q, k, v, documents: Documents, scale=None):
    """``attend`` on packed documents: each document as if alone (``scale``: the softmax
    scale, default ``D ** -0.5``)."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    parts = document_window_partials(q.reshape(B, T, Hkv, H // Hkv, D), k, v, documents,
                                     self.window_rule(),
                                     key_scale=D ** -0.5 if scale is None else scale,
                                     softcap=self.softcap)
    return combine_partials(parts).reshape(B, T, H, v.shape[-1]).astype(q.dtype)

  def init_cache(self, batch: int, max_len: int) -> Optional[RingCache]:
    if self.sources is not None:
      return None  # the source layers' caches hold everything this layer reads
    return attn_ops.init_ring_cache(self.window_rule(), sink_rows=self.sink_rows(),
                                    **self._cache_sizes(batch, max_len))

  def mix_own(self, x, q, k, v, mixer_cache, decode, shared, documents=None):
    if documents is not None:
      y = self.attend_documents(q, k, v, documents)
    elif is_resume(decode):
      y, mixer_cache = attn_ops.ring_resume(q, k, v, mixer_cache, softcap=self.softcap,
                                            counts=piece_counts(decode))
    elif decode:
      y, mixer_cache = attn_ops.ring_decode_step(q, k, v, mixer_cache, softcap=self.softcap,
                                                 active=step_active(decode))
    else:
      y = self.attend(q, k, v)
      if mixer_cache is not None:
        mixer_cache = attn_ops.ring_prefill(k, v, mixer_cache)
    return Mixed(y, mixer_cache, {"k": k, "v": v})

  def mix_reconstructed(self, x, q, mixer_cache, decode, shared, documents=None):
    return Mixed(kv_sharing.mix_folded(self, q, shared, decode, documents), None, {})
