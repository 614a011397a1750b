"""The KVM mixer (docs/kvm-spec.md §6): the attention front end plus LN_s, the merge-gate projection
W_g and the two key temperatures, over the KVM op of :mod:`kvm_jax.ops.kvm`; its decode cache is a
:class:`kvm_jax.KVMCache`."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.budget import average_visible_keys, state_rows_after
from kvm_jax.config import KVMConfig
from kvm_jax.model_config import ModelConfig
from kvm_jax.nn.authors_format import AuthorsMixer
from kvm_jax.nn import kv_sharing
from kvm_jax.nn.attention import AttentionFrontEnd
from kvm_jax.nn.cache import RESUME
from kvm_jax.nn.layers import layer_norm, linear
from kvm_jax.nn.mixer import Mixed
from kvm_jax.ops.kvm.api import (KVMBackend, kvm_attention, kvm_decode_step, kvm_prefill,
                                 kvm_resume, resolve_kvm_backend)
from kvm_jax.ops.kvm.decode import KVMCache, kvm_init_cache
from kvm_jax.ops.kvm.state import KVMParams

Array = jax.Array


class KVMAttention(AttentionFrontEnd):
  """Exact window + compressed state, one softmax over both.

  With cross-layer KV sharing a KVM layer may also be a source whose routing decisions another
  layer follows or replays (``ModelConfig.routing_leader``, ``shares_state``), or a reconstruction
  layer: window-only fusion (its own state) or a fused state (no LN_s, no W_g, nothing stored).
  """

  Options = KVMConfig
  AUTHORS = AuthorsMixer(("kvm", "kvm_triton"),
                         ("model.kvm_mixer.SequenceMixer", "model.kvm_triton_mixer.SequenceMixer",
                          "model.kvm_fp32_routing_reference.SequenceMixer"), "kvm")
  LOGICAL_AXES = {**AttentionFrontEnd.LOGICAL_AXES, "key_weighting": ("embed", "kv_heads")}
  # What a KVM layer adds to the attention front end (the "KVM-only" parameters of conversion and
  # distillation), and the values that leave a converted layer's in-window logits unchanged:
  # LN_s the identity, W_g = 0 (merge gate 1), both temperatures 1.
  CONVERSION_VALUES = {("ln_s", "scale"): 1.0, ("ln_s", "bias"): 0.0,
                       ("key_weighting", "kernel"): 0.0, ("window_temperature",): 1.0,
                       ("state_temperature",): 1.0}
  OWN_PARAMETERS = tuple(dict.fromkeys(path[0] for path in CONVERSION_VALUES))
  DOCUMENTS = True
  SOFTCAP = True  # the readout caps its scores over state and window alike

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Keys at distance below this are attended exactly: the window ``L = window_chunks ·
    chunk_size`` (beyond it, a key lives on only as part of a state row)."""
    return cfg.options_of(cfg.layer_mixers[layer]).window_len

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    """The state's rows after ``seq_len`` tokens (the budget's schedule)."""
    return f"{state_rows_after(cfg.options_of(cfg.layer_mixers[layer]), seq_len)} state rows"

  @classmethod
  def resume_alignment(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Pieces of whole chunks from a chunk boundary (``C``); not with cross-layer KV sharing
    (shared routing and fused windows are replayed one token at a time)."""
    return None if cfg.kv_sharing != "none" else cfg.options_of(cfg.layer_mixers[layer]).chunk_size

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """The exact window plus the state rows of the schedule at each chunk."""
    return average_visible_keys(cfg.options_of(cfg.layer_mixers[layer]), seq_len)

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    super().__init__(cfg, layer, rngs=rngs)
    self.shares_state = cfg.shares_state(layer)        # state fused from the sources' states
    self.routing_leader = cfg.routing_leader(layer)    # applies this layer's routing
    # a source of a fused-state layer, which replays this layer's state with its routing
    self.exports_routing = any(cfg.shares_state(i) and layer in sum(cfg.kv_sources(i), ())
                               for i in range(cfg.num_layers))
    if self.softcap is not None:  # the family's cap, so that the window equals its attention
      if self.options.logit_softcap not in (None, self.softcap):
        raise ValueError(f"layer {layer}: kvm.logit_softcap={self.options.logit_softcap} "
                         f"differs from the {cfg.family!r} family's attention soft-cap "
                         f"{self.softcap}; leave it None (the layer takes the family's).")
      self.options = dataclasses.replace(self.options, logit_softcap=self.softcap)
    kc = self.options
    # The op zeroes the leading state_zeroed_dims channels of state keys, counting rotary pairs
    # fastest first: a family whose RoPE pairs channels otherwise shows q and k to the op in that
    # order (scores do not depend on the order of channels, so nothing else changes). Zeroing all
    # rotary channels or none needs no order.
    self.channel_order = None
    if kc.state_zeroed_dims not in (0, kc.rope_dims):
      order = self.family.state_channel_order(cfg, layer)
      if order is not None and cfg.kv_sharing != "none":
        raise ValueError(f"kvm.state_rope_dims={kc.state_rope_dims} in the {cfg.family!r} "
                         "family reorders the KVM layers' q/k channels, which cross-layer KV "
                         f"sharing (kv_sharing={cfg.kv_sharing!r}) would mix with other layers' "
                         "order; use kv_sharing='none' or state_rope_dims=None.")
      self.channel_order = None if order is None else tuple(int(i) for i in order)
    if not self.shares_state:  # a fused state is built by the sources' LN_s and gates
      self.ln_s = layer_norm(cfg, cfg.qk_head_dim, rngs)
      if kc.uses_gate:
        self.key_weighting = linear(cfg, cfg.hidden_size, cfg.kv_heads, rngs)
    if kc.head_temperatures:
      self.window_temperature = nnx.Param(jnp.ones((cfg.num_heads,), cfg.jnp_param_dtype))
      self.state_temperature = nnx.Param(jnp.ones((cfg.num_heads,), cfg.jnp_param_dtype))

  def kvm_params(self) -> KVMParams:
    """The layer's KVM parameters; temperatures are ones when the config disables them (a layer
    with a fused state has no LN_s of its own: identity placeholders)."""
    if self.options.head_temperatures:
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
    """g = 1 + ELU(x W_g) ``[B, T, Hkv]`` float32 (ones when both gate flags are off)."""
    if not self.options.uses_gate:
      return jnp.ones((*x.shape[:2], self.cfg.kv_heads), jnp.float32)
    return 1.0 + jax.nn.elu(self.key_weighting(x).astype(jnp.float32))

  def init_cache(self, batch: int, max_len: int) -> Optional[KVMCache]:
    if self.shares_state:
      return None  # reads the sources' states and windows
    cache = kvm_init_cache(self.options, **self._cache_sizes(batch, max_len))
    return cache if self.sources is None else kv_sharing.without_window_kv(cache)

  def backend(self, readout: str = "auto") -> KVMBackend:
    """The op's backend for this layer, decided where it runs (the kernels' mesh axes are those
    of the enclosing ``kernel_sharding``): the model's ``kvm_implementation`` for its options."""
    return resolve_kvm_backend(self.options, implementation=self.cfg.kvm_implementation,
                               readout=readout)

  def kvm_core(self, q, k, v, g, params, mixer_cache, decode, routing=None,
               return_routing=False):
    """The KVM op over this layer's (or fused) keys and values with merge gates ``g`` and
    ``params``: whole sequence, prefill into ``mixer_cache``, or one decode step. Returns
    ``(y, cache, decisions or None)``."""
    if decode == RESUME:  # the XLA chunk scan, whatever the model's implementation
      y, cache = kvm_resume(q, k, v, g, params, self.options, mixer_cache)
      return y, cache, None
    kw = dict(routing=routing, return_routing=return_routing, backend=self.backend())
    if decode:
      out = kvm_decode_step(q, k, v, g, params, self.options, mixer_cache, **kw)
    elif mixer_cache is not None:
      out = kvm_prefill(q, k, v, g, params, self.options, mixer_cache, **kw)
    else:  # a whole sequence keeps no cache
      out = kvm_attention(q, k, v, g, params, self.options, **kw)._replace(state=None)
    return out.y, out.state, getattr(out, "routing", None)

  def kvm_documents(self, q, k, v, g, params, documents, routing=None):
    """The KVM op over packed documents (each as if alone): ``y [B, T, H, Dv]``."""
    # Each document's own id (its number in the row): the op rebuilds the same documents.
    segment_ids = documents.segment_ids()
    return kvm_attention(q, k, v, g, params, self.options, segment_ids=segment_ids,
                         backend=self.backend(readout="own"), routing=routing,
                         return_routing=self.exports_routing).y

  def mix_own(self, x, q, k, v, mixer_cache, decode, shared, documents=None):
    """A storage layer: its own K/V and state, possibly following a leader's routing."""
    routing = None
    if self.routing_leader is not None:
      routing = shared.exports[self.routing_leader]["routing"]
    g, params = self.merge_gate(x), self.kvm_params()
    if self.channel_order is not None:
      order = jnp.asarray(self.channel_order, jnp.int32)
      q, k = jnp.take(q, order, axis=-1), jnp.take(k, order, axis=-1)
    if documents is not None:
      return Mixed(self.kvm_documents(q, k, v, g, params, documents, routing), None, {
          "k": k, "v": v, "g": g, "params": params, "cache": None})
    y, mixer_cache, decisions = self.kvm_core(q, k, v, g, params, mixer_cache, decode, routing,
                                              self.exports_routing)
    exports = {"k": k, "v": v, "g": g, "params": params, "cache": mixer_cache}
    if self.exports_routing:
      exports["routing"] = decisions
    return Mixed(y, mixer_cache, exports)

  def mix_reconstructed(self, x, q, mixer_cache, decode, shared, documents=None):
    if self.shares_state:
      if documents is not None:
        raise ValueError("segment_ids: kvm_kv_sharing='shared_routing' replays one routing over "
                         "whole rows and cannot keep packed documents apart; use "
                         "kvm_kv_sharing='window' (or packing 'pad'/'cram').")
      return Mixed(kv_sharing.mix_kvm_shared_state(self, q, shared, decode), None, {})
    y, mixer_cache = kv_sharing.mix_kvm_window_fusion(self, x, q, shared, mixer_cache, decode,
                                                      documents)
    return Mixed(y, mixer_cache, {})
