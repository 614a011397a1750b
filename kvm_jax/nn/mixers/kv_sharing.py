"""Cross-layer KV sharing in the model (docs/fusedkv.md): what a layer reads from the layers below
it, the fusion weights of a reconstruction layer, and how each kind of reconstruction layer mixes.

With n = num_layers / 2 (``ModelConfig.kv_sources``), a *reconstruction* layer has only the query
side of the attention front end: no K/V projections, no K/V cache. It reads its keys and values
from source layers, fused on demand:

* full / swa / bswa — *folded*: queries scaled by each source's key weights, sources stacked along
  the head dim, value slices weighted after attention (:func:`mix_folded`); the fused K/V are never
  formed;
* kvm, window-only fusion — the exact window fused from the sources, the compressed state this
  layer's own (:func:`mix_kvm_window_fusion`);
* kvm, shared routing — state and window fused from the sources' (row-aligned) states; the layer
  stores nothing (:func:`mix_kvm_shared_state`).

The functions take the layer module (its kind-specific pieces: ``attend``, ``kvm_core``,
``merge_gate``, ``kvm_params``) rather than importing the layer classes, so the dependency runs one
way: the layer classes call into this module.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax.numpy as jnp
from flax import nnx

from kvm_jax.ops import kv_fusion
from kvm_jax.ops.attention.dense import ring_decode_step, ring_store, ring_view
from kvm_jax.ops.kvm.shared_routing import (SourceTrack, kvm_attention_shared_state,
                                            kvm_decode_shared_state)


@dataclasses.dataclass(frozen=True)
class SharedKV:
  """What a layer reads from the layers below it (cross-layer KV sharing).

  Attributes:
    exports: per lower layer, what it computed in this call: ``k``/``v`` (post-RoPE keys
      ``[B, T, Hkv, D]``, values), and for ``kvm`` layers the merge gates ``g``, its KVM
      ``params``, its ``cache`` after this call and, for a layer whose routing is shared,
      ``routing``.
    old_caches: the layers' mixer caches as they were *before* this call (None without caches).
  """

  exports: dict
  old_caches: Optional[list] = None


def add_fusion_weights(layer: nnx.Module) -> None:
  """Creates the FusedKV weights of a reconstruction layer with two sources (layer 1, layer n):
  ``fuse_k_rotary`` (one weight per rotary pair), ``fuse_k_free``, ``fuse_v``. "lite" starts as
  K = K^n, V = V^1 exactly; "mean" starts at 0.5 each."""
  cfg = layer.cfg
  a, b = ((0.0, 1.0), (1.0, 0.0)) if cfg.fusedkv_init == "lite" else ((0.5, 0.5), (0.5, 0.5))
  Hkv, D, Dv, r = cfg.kv_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.rope_dims_of(layer.layer)
  pd = cfg.jnp_param_dtype
  per_source = lambda w, n: jnp.stack([jnp.full((Hkv, n), x, pd) for x in w])
  layer.fuse_k_rotary = nnx.Param(per_source(a, r // 2))
  layer.fuse_k_free = nnx.Param(per_source(a, D - r))
  layer.fuse_v = nnx.Param(per_source(b, Dv))


def source_weights(layer):
  """``(key sources, value sources, key weights [S, Hkv, D] or None, value weights or None)``;
  the rotary pairs of the key weights are tied."""
  key_w = value_w = None
  if layer.fused:
    key_w = kv_fusion.expand_key_weights(layer.fuse_k_rotary[...], layer.fuse_k_free[...])
    value_w = layer.fuse_v[...]
  return layer.sources[0], layer.sources[1], key_w, value_w


def without_window_kv(cache):
  """A KVM cache of a reconstruction layer stores no window keys/values (its sources hold them)."""
  return dataclasses.replace(cache, window_keys=None, window_values=None)


def mix_folded(layer, q, shared: SharedKV, decode: bool, documents=None):
  """full/swa/bswa reconstruction layer: one attention over the sources stacked along the head
  dim, queries folded with the key weights, value slices weighted after (never a fused K/V);
  over packed ``documents``, each document's own keys (the layer's ``attend_documents``)."""
  ks, vs, key_w, value_w = source_weights(layer)
  ex = shared.exports
  keys = kv_fusion.stack_sources([ex[j]["k"] for j in ks])
  values = kv_fusion.stack_sources([ex[j]["v"] for j in vs])
  scale = None
  if layer.fused:
    q = kv_fusion.fold_queries(q, key_w)
    scale = 1.0 / math.sqrt(layer.cfg.qk_head_dim)  # of one source, not of the stack
  if decode:  # the sources' caches before this token, stacked the same way (a view, not kept)
    kc, vc = [shared.old_caches[j] for j in ks], [shared.old_caches[j] for j in vs]
    stack = lambda rings: ring_store(kv_fusion.stack_sources([ring_view(r) for r in rings]))
    view = dataclasses.replace(
        kc[0], keys=stack([c.keys for c in kc]), values=stack([c.values for c in vc]),
        sink_keys=kv_fusion.stack_sources([c.sink_keys for c in kc]),
        sink_values=kv_fusion.stack_sources([c.sink_values for c in vc]))
    y, _ = ring_decode_step(q, keys, values, view, scale=scale, softcap=layer.softcap)
  elif documents is not None:
    y = layer.attend_documents(q, keys, values, documents, scale=scale)
  else:
    y = layer.attend(q, keys, values, scale=scale)
  return kv_fusion.unfold_output(y, value_w) if layer.fused else y


def mix_kvm_window_fusion(layer, x, q, shared: SharedKV, mixer_cache, decode: bool,
                          documents=None):
  """kvm reconstruction layer, window-only fusion: the window keys/values are fused from the
  sources on demand; the compressed state is this layer's own, built from the fused per-token
  K/V with this layer's merge gates (states of different layers are not row-aligned). Over
  packed ``documents`` (no cache), each document as if alone."""
  ks, vs, key_w, value_w = source_weights(layer)
  ex, fuse = shared.exports, kv_fusion.materialize
  k, v = fuse([ex[j]["k"] for j in ks], key_w), fuse([ex[j]["v"] for j in vs], value_w)
  if documents is not None:
    return layer.kvm_documents(q, k, v, layer.merge_gate(x), layer.kvm_params(), documents), None
  view = None
  if mixer_cache is not None:
    kc, vc = [shared.old_caches[j] for j in ks], [shared.old_caches[j] for j in vs]
    if decode:  # the sources' rings before this token: the fold may need the slot t overwrites
      ring_k = fuse([c.window_keys for c in kc], key_w)
      ring_v = fuse([c.window_values for c in vc], value_w)
    else:  # prefill replaces the contents: zeros of the right shape suffice
      ring_k, ring_v = jnp.zeros_like(kc[0].window_keys), jnp.zeros_like(vc[0].window_values)
    view = dataclasses.replace(mixer_cache, window_keys=ring_k, window_values=ring_v)
  y, new_cache, _ = layer.kvm_core(q, k, v, layer.merge_gate(x), layer.kvm_params(), view,
                                   decode)
  return y, (None if new_cache is None else without_window_kv(new_cache))


def mix_kvm_shared_state(layer, q, shared: SharedKV, decode: bool):
  """kvm reconstruction layer with shared routing: state and window fused from the sources."""
  ks, vs, key_w, value_w = source_weights(layer)
  ex = shared.exports
  tracks = tuple(sorted(set(ks) | set(vs)))
  key_tracks = tuple(tracks.index(j) for j in ks)
  value_tracks = tuple(tracks.index(j) for j in vs)
  params = layer.kvm_params()
  if decode:
    return kvm_decode_shared_state(q, [ex[j]["cache"] for j in tracks],
                                   [ex[j]["params"] for j in tracks], key_w, value_w,
                                   key_tracks, value_tracks, params, layer.options)
  fuse = kv_fusion.materialize
  k, v = fuse([ex[j]["k"] for j in ks], key_w), fuse([ex[j]["v"] for j in vs], value_w)
  source_tracks = tuple(SourceTrack(ex[j]["k"], ex[j]["v"], ex[j]["g"], ex[j]["params"])
                        for j in tracks)
  return kvm_attention_shared_state(q, k, v, source_tracks, key_w, value_w, params,
                                    ex[tracks[0]]["routing"],  # = every track's (shared)
                                    cfg=layer.options, key_tracks=key_tracks,
                                    value_tracks=value_tracks)
