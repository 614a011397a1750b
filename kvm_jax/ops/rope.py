"""Rotary position embeddings, both forms the model families use.

The interleaved, partial form of the authors' backbone (GPTAlpha-2; docs/kvm-spec.md §5):

* frequencies ``f_i = (1/θ)^(i / (r/2 - 1))`` for i = 0..r/2-1 (``linspace(0, 1, r/2)``
  exponents: from 1 down to exactly 1/θ, not the usual θ^(-2i/r));
* channel pairs (2i, 2i+1) share f_i; channels >= r are not rotated (NoPE);
* ``out[2i] = cos·x[2i] + sin·x[2i+1]``, ``out[2i+1] = cos·x[2i+1] - sin·x[2i]`` (rotation by -a;
  the relative-position property is unchanged);
* angles in float32; the authors cast the cos/sin tables to bfloat16 — ``table_dtype="bfloat16"``
  reproduces that, the default keeps them float32 (docs/kvm-spec.md, decision 2).

The "rotate half" form of the Llama and Gemma families, as transformers computes it: channel i
pairs with i + r/2, frequencies ``θ^(-2i/r)`` with the "linear" or "llama3" scaling rules
(:func:`rope_inverse_frequencies`, :func:`half_rope_tables`, :func:`apply_half_rope`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def linspace01(n: int) -> np.ndarray:
  """``torch.linspace(0, 1, n)`` in float32, bit for bit (the exponents of the authors' RoPE
  frequencies): the first half counts up from 0 and the second down from 1 in steps of
  1/(n-1), each value one multiply-add rounded once. numpy's ``linspace`` differs from it in the
  last bit of some entries, which bfloat16 RoPE tables then turn into flipped roundings."""
  i = np.arange(n)
  step = np.float64(np.float32(1.0) / np.float32(max(n - 1, 1)))
  out = np.where(i < n // 2, step * i, 1.0 - step * (n - 1 - i)).astype(np.float32)
  out[:1] = 0.0  # one step gives [start]
  return out


def rope_frequencies(head_dim: int, rope_dims: int, theta: float = 10000.0) -> np.ndarray:
  """Per-channel angular frequency ``[head_dim]`` float32 (0 on the NoPE channels)."""
  if rope_dims % 2 or not 0 <= rope_dims <= head_dim:
    raise ValueError(f"rope_dims must be even and in [0, head_dim={head_dim}], got {rope_dims}.")
  half = rope_dims // 2
  exponents = linspace01(half)
  # A float32 base, the power correctly rounded (torch's own powf is within one ulp of it).
  freqs = np.power(np.float64(np.float32(1.0 / theta)), exponents.astype(np.float64)).astype(
      np.float32)
  return np.concatenate([np.repeat(freqs, 2), np.zeros(head_dim - rope_dims, np.float32)])


def rope_tables(positions: Array, head_dim: int, rope_dims: int, theta: float = 10000.0,
                table_dtype=jnp.float32) -> tuple[Array, Array]:
  """``cos``, ``sin`` of shape ``[..., T, 1, head_dim]`` for integer ``positions [..., T]``.

  ``sin`` already carries the sign flip of the odd channels, so :func:`apply_rope` is
  ``x·cos + swap_pairs(x)·sin``.
  """
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(
      head_dim, rope_dims, theta))                                       # [..., T, D]
  sign = jnp.where(jnp.arange(head_dim) % 2 == 1, -1.0, 1.0)
  cos = jnp.cos(angle).astype(table_dtype)
  sin = (jnp.sin(angle).astype(table_dtype) * sign.astype(table_dtype))
  return cos[..., None, :], sin[..., None, :]


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates ``x [B, T, H, D]`` with tables from :func:`rope_tables` (broadcast over heads)."""
  swapped = jnp.flip(x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2), axis=-1).reshape(x.shape)
  dtype = jnp.result_type(x.dtype, cos.dtype)
  return (x.astype(dtype) * cos + swapped.astype(dtype) * sin).astype(x.dtype)


# -- the "rotate half" form (Llama, Gemma) --------------------------------------------------------


def rope_inverse_frequencies(options, rope_dims: int, theta: float) -> np.ndarray:
  """``[rope_dims / 2]`` float32 angular frequencies ``θ^(-2i/r)``, scaled by the rule of
  ``options`` (a family's RoPE fields: ``rope_scaling``, ``rope_factor``, ``rope_low_freq_factor``,
  ``rope_high_freq_factor``, ``rope_original_max_len``; e.g. ``LlamaOptions``)
  (as transformers' ``_compute_default/linear/llama3_rope_parameters`` compute them, in float32)."""
  exponents = np.arange(0, rope_dims, 2, dtype=np.float32) / np.float32(rope_dims)
  inv = (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)
  factor = np.float32(options.rope_factor)
  if options.rope_scaling == "linear":
    return (inv / factor).astype(np.float32)
  if options.rope_scaling == "llama3":
    old = options.rope_original_max_len
    low, high = options.rope_low_freq_factor, options.rope_high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > old / low, inv / factor, inv).astype(np.float32)
    smooth = ((old / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def half_rope_tables(positions: Array, rope_dims: int, inverse_frequencies: np.ndarray,
                     table_dtype=jnp.float32) -> tuple[Array, Array]:
  """``cos``, ``sin`` of shape ``[..., T, 1, rope_dims]`` for integer ``positions [..., T]``:
  channel i and i + r/2 share frequency i (the "rotate half" layout)."""
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies)
  angle = jnp.concatenate([angle, angle], axis=-1)                       # [..., T, r]
  return (jnp.cos(angle).astype(table_dtype)[..., None, :],
          jnp.sin(angle).astype(table_dtype)[..., None, :])


def apply_half_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates the first ``r`` channels of ``x [B, T, H, D]`` (``r`` the tables' width) in the
  "rotate half" layout, ``x·cos + rotate_half(x)·sin``; the rest pass through."""
  r = cos.shape[-1]
  rotary, rest = x[..., :r], x[..., r:]
  first, second = rotary[..., : r // 2], rotary[..., r // 2:]
  turned = jnp.concatenate([-second, first], axis=-1)
  dtype = jnp.result_type(x.dtype, cos.dtype)
  out = (rotary.astype(dtype) * cos + turned.astype(dtype) * sin).astype(x.dtype)
  return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def half_rope_pair_order(head_dim: int, rope_dims: int) -> np.ndarray:
  """The channel permutation ``[head_dim]`` that turns the "rotate half" layout (channel i pairs
  with i + r/2, frequency falling with i) into adjacent pairs, fastest first: ``[0, r/2, 1,
  r/2 + 1, ...]``, then the unrotated channels in place."""
  half = rope_dims // 2
  pairs = np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)
  return np.concatenate([pairs, np.arange(rope_dims, head_dim)]).astype(np.int32)
