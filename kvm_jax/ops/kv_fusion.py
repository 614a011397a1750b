"""Cross-layer KV fusion (FusedKV, ``docs/fusedkv.md``): weights, folding, materializing.

An upper (reconstruction) layer attends with keys and values built from S source layers::

    K = sum_s a_s ⊙ K_s        V = sum_s b_s ⊙ V_s        (a_s: [Hkv, D], b_s: [Hkv, Dv])

*Folded* (what the model runs): ``q·K = sum_s (q ⊙ a_s)·K_s`` and ``P V = sum_s b_s ⊙ (P V_s)``,
so the S sources are stacked along the head dimension — queries ``[q⊙a_1, …, q⊙a_S]``, keys
``[K_1, …, K_S]``, values ``[V_1, …, V_S]`` — one ordinary attention runs over them with the softmax
scale of the *original* head dim, and the S value slices of its output are weighted and summed.
The fused K and V are never formed, let alone cached. *Materialized* (the test oracle and the
per-token input of a KVM state update) forms them explicitly.

Keys are post-RoPE. With interleaved RoPE (pairs (2j, 2j+1) of the first ``rope_dims`` channels) a
channel-wise weight commutes with the rotation only if both channels of a pair share it, so the
rotary part of ``a_s`` is stored once per pair and repeated: ``a ⊙ R(p)k = R(p)(a ⊙ k)`` holds by
construction and attention logits keep depending only on relative positions.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array


def expand_key_weights(rotary_pairs: Array, free: Array) -> Array:
  """``[S, Hkv, r/2]`` per-pair + ``[S, Hkv, D - r]`` free weights -> ``[S, Hkv, D]``."""
  return jnp.concatenate([jnp.repeat(rotary_pairs, 2, axis=-1), free], axis=-1)


def fold_queries(q: Array, key_weights: Array) -> Array:
  """``q [B, T, H, D]``, weights ``[S, Hkv, D]`` -> ``[B, T, H, S·D]`` = ``[q⊙a_1, …, q⊙a_S]``."""
  S, Hkv, D = key_weights.shape
  B, T, H, _ = q.shape
  w = jnp.repeat(key_weights, H // Hkv, axis=1).astype(q.dtype)           # [S, H, D] per query head
  folded = q[:, :, :, None] * jnp.swapaxes(w, 0, 1)[None, None]          # [B, T, H, S, D]
  return folded.reshape(B, T, H, S * D)


def stack_sources(xs: Sequence[Array]) -> Array:
  """Source keys (or values) ``[B, T, Hkv, D]`` each -> ``[B, T, Hkv, S·D]``."""
  return xs[0] if len(xs) == 1 else jnp.concatenate(list(xs), axis=-1)


def unfold_output(y: Array, value_weights: Array) -> Array:
  """``y [B, T, H, S·Dv]`` (attention over stacked values), weights ``[S, Hkv, Dv]`` ->
  ``sum_s b_s ⊙ y_s`` ``[B, T, H, Dv]``."""
  S, Hkv, Dv = value_weights.shape
  B, T, H, _ = y.shape
  w = jnp.repeat(value_weights, H // Hkv, axis=1)                         # [S, H, Dv]
  parts = y.reshape(B, T, H, S, Dv).astype(jnp.float32)
  return jnp.einsum("bthsd,shd->bthd", parts, w.astype(jnp.float32)).astype(y.dtype)


def materialize(xs: Sequence[Array], weights: Optional[Array], head_axis: int = 2) -> Array:
  """``sum_s w_s ⊙ x_s`` for ``x_s`` with KV heads on ``head_axis`` and channels last, and
  ``weights [S, Hkv, X]``; ``weights=None`` is one source with weight 1 (Lite, YOCO, CLA)."""
  if weights is None:
    return xs[0]
  out = None
  for x, w in zip(xs, weights):
    w = jnp.expand_dims(w, tuple(range(head_axis))) if head_axis else w
    w = w.reshape(w.shape[:head_axis + 1] + (1,) * (x.ndim - head_axis - 2) + w.shape[-1:])
    term = x * w.astype(x.dtype)
    out = term if out is None else out + term
  return out
