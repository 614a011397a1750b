"""Partial, interleaved rotary position embedding exactly as the authors' backbone
(docs/kvm-spec.md §5).

* frequencies ``f_i = (1/θ)^(i / (r/2 - 1))`` for i = 0..r/2-1 (``linspace(0, 1, r/2)``
  exponents: from 1 down to exactly 1/θ, not the usual θ^(-2i/r));
* channel pairs (2i, 2i+1) share f_i; channels >= r are not rotated (NoPE);
* ``out[2i] = cos·x[2i] + sin·x[2i+1]``, ``out[2i+1] = cos·x[2i+1] - sin·x[2i]`` (rotation by -a;
  the relative-position property is unchanged);
* angles in float32; the authors cast the cos/sin tables to bfloat16 — ``table_dtype="bfloat16"``
  reproduces that, the default keeps them float32 (docs/kvm-spec.md, decision 2).
"""

from __future__ import annotations

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
