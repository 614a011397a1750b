"""Pure building blocks shared by every attention op (KVM and the baselines): no Flax, no kernels.

* byte counting of pytrees (:func:`tree_nbytes`);
* ring buffers of recent tokens (slot = position mod slots), shared by every decode cache;
* matmul helpers and a float32 LayerNorm;
* :func:`joint_attention`, one softmax over ``[extra rows ; exact window]``: the KVM readout
  (rows = state) and the block sliding window with sinks (rows = sink tokens);
* chunking: a sequence cut into chunks, the exact window of each chunk, and its causal mask.

Token tensors use the public layout ``[batch, time, heads, dim]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# A finite "minus infinity" for masked scores: a fully masked row gives zeros, never NaN
# gradients. The Pallas readout uses the same constant, so both paths mask identically.
MASKED = -1e30


def tree_nbytes(tree) -> int:
  """Bytes of every array in ``tree`` as allocated (measured from the arrays, not estimated)."""
  return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize
             for a in jax.tree_util.tree_leaves(tree))


def is_concrete(x) -> bool:
  """True unless ``x`` is a tracer (inside ``jit``/``grad``): its value can be read on the host."""
  return not isinstance(x, jax.core.Tracer)


# ----------------------------------------------------------------------------------------------
# Ring buffers of recent tokens (slot = position mod slots), shared by every decode cache
# ----------------------------------------------------------------------------------------------


def fill_ring(ring: Array, x: Array) -> Array:
  """A ring ``[B, slots, ...]`` holding the last ``min(T, slots)`` tokens of ``x [B, T, ...]``."""
  T, slots = x.shape[1], ring.shape[1]
  first = max(0, T - slots)
  return jnp.zeros_like(ring).at[:, np.arange(first, T) % slots].set(x[:, first:].astype(ring.dtype))


def write_ring(ring: Array, x_t: Array, t: Array) -> Array:
  """Writes the token at position ``t`` (``x_t [B, 1, ...]``) into its slot."""
  return jax.lax.dynamic_update_slice_in_dim(ring, x_t.astype(ring.dtype), t % ring.shape[1], 1)


def ring_positions(t: Array, slots: int) -> Array:
  """Position held by each slot once token ``t`` is written (negative: never written)."""
  return t - (t - jnp.arange(slots)) % slots


# ----------------------------------------------------------------------------------------------
# Matmuls and normalization
# ----------------------------------------------------------------------------------------------


def matmul_operand(x: Array) -> Array:
  """A bfloat16 matmul operand, widened to float32 on CPU only: XLA:CPU has no bfloat16 x
  bfloat16 -> float32 dot for larger operands, and the widening is exact (bfloat16 products are
  exact in float32, and the accumulation is float32 either way). Accelerators keep bfloat16."""
  if x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
    return x.astype(jnp.float32)
  return x


def precision_for(dtype) -> jax.lax.Precision:
  """float32 inputs get true float32 matmuls (no TF32/bf16 passes on GPU/TPU)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
  """LayerNorm over the last axis in float32 (biased variance, like ``torch.nn.LayerNorm``)."""
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# One softmax over [extra rows ; exact window]
# ----------------------------------------------------------------------------------------------


def joint_attention(q: Array, state_keys: Array, state_values: Array, state_valid: Array,
                    window_keys: Array, window_values: Array, window_valid: Array,
                    state_temp: Array, window_temp: Array) -> Array:
  """One softmax over [state rows ; exact window] without concatenating them.

  Args:
    q: ``[B, Tq, Hkv, G, D]`` queries (query head h = kv·G + g).
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout state (float32);
      values may also be per query head, ``[B, Hkv, G, R, Dv]``.
    state_valid: bool ``[Tq, R]`` (or broadcastable), which rows each query sees.
    window_keys / window_values: ``[B, W, Hkv, D]`` / ``[B, W, Hkv, Dv]``.
    window_valid: bool ``[Tq, W]`` (or broadcastable), the causal/window mask.
    state_temp / window_temp: float32 ``[Hkv, G]`` key temperatures.
  Returns:
    ``[B, Tq, Hkv, G, Dv]`` float32.
  """
  dtype = q.dtype
  precision = precision_for(dtype)
  scale = 1.0 / np.sqrt(q.shape[-1])
  mm = matmul_operand
  s_state = jnp.einsum("bqhgd,bhrd->bhgqr", mm(q), mm(state_keys.astype(dtype)),
                       precision=precision, preferred_element_type=jnp.float32)
  s_window = jnp.einsum("bqhgd,bwhd->bhgqw", mm(q), mm(window_keys.astype(dtype)),
                        precision=precision, preferred_element_type=jnp.float32)
  s_state = s_state * (state_temp * scale)[None, :, :, None, None]
  s_window = s_window * (window_temp * scale)[None, :, :, None, None]
  s_state = jnp.where(state_valid, s_state, MASKED)
  s_window = jnp.where(window_valid, s_window, MASKED)
  row_max = jax.lax.stop_gradient(
      jnp.maximum(jnp.max(s_state, axis=-1, keepdims=True), jnp.max(s_window, axis=-1, keepdims=True)))
  p_state = jnp.exp(s_state - row_max)
  p_window = jnp.exp(s_window - row_max)
  denom = jnp.sum(p_state, axis=-1) + jnp.sum(p_window, axis=-1)  # [B, Hkv, G, Tq]
  value_dtype = window_values.dtype
  per_head = "bhgrv" if state_values.ndim == 5 else "bhrv"
  out = jnp.einsum(f"bhgqr,{per_head}->bqhgv", mm(p_state.astype(value_dtype)),
                   mm(state_values.astype(value_dtype)), precision=precision,
                   preferred_element_type=jnp.float32)
  out = out + jnp.einsum("bhgqw,bwhv->bqhgv", mm(p_window.astype(value_dtype)),
                         mm(window_values), precision=precision,
                         preferred_element_type=jnp.float32)
  return out / jnp.transpose(denom, (0, 3, 1, 2))[..., None]


# ----------------------------------------------------------------------------------------------
# Chunks and the block-sliding exact window
# ----------------------------------------------------------------------------------------------


def to_chunks(x: Array, num_chunks: int, chunk: int) -> Array:
  """``[B, num_chunks·chunk, ...]`` -> ``[num_chunks, B, chunk, ...]`` (chunk-major, as a scan
  or ``vmap`` over chunks consumes it)."""
  b = x.shape[0]
  return jnp.moveaxis(x.reshape(b, num_chunks, chunk, *x.shape[2:]), 1, 0)


def window_stack(x: Array, num_chunks: int, chunk: int, window_chunks: int) -> Array:
  """Per query chunk c, the chunks ``c-nb+1 .. c`` side by side: ``[nC, B, nb·chunk, ...]``.

  ``x`` is ``[B, nC·chunk, ...]``. Chunks before the sequence start are zeros (masked by
  :func:`window_mask`). Feeding the window as scan inputs (instead of slicing a closed-over
  array) keeps the backward pass free of full-length cotangent accumulators.
  """
  front = [(0, 0), ((window_chunks - 1) * chunk, 0)] + [(0, 0)] * (x.ndim - 2)
  chunks = to_chunks(jnp.pad(x, front), num_chunks + window_chunks - 1, chunk)
  return jnp.concatenate([chunks[j:j + num_chunks] for j in range(window_chunks)], axis=2)


def window_mask(chunk_index, chunk: int, window_chunks: int) -> Array:
  """The ``[chunk, nb·chunk]`` mask of query chunk ``chunk_index`` (int or traced) over its
  window slots (:func:`window_stack`): query i sees slot s iff s is causal
  (``s <= (nb-1)·chunk + i``) and inside the sequence (the slot's chunk is not before chunk 0)."""
  slot = np.arange(window_chunks * chunk)
  causal = slot[None, :] <= (window_chunks - 1) * chunk + np.arange(chunk)[:, None]   # static
  return causal & ((chunk_index - (window_chunks - 1)) * chunk + slot >= 0)[None, :]
