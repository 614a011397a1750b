"""Pure building blocks shared by every attention op (KVM and the baselines): no Flax, no kernels.

* the platform programs are built for (:func:`current_platform`, from :mod:`kvm_jax.config.target`);
* byte counting of pytrees (:func:`tree_nbytes`);
* ring buffers of recent tokens (slot = position mod slots), shared by every decode cache;
* matmul helpers and a float32 LayerNorm;
* :func:`joint_attention`, one softmax over ``[extra rows ; exact window]``: the KVM readout
  (rows = state) and the block sliding window with sinks (rows = sink tokens);
* :func:`soft_capped`: scores squashed into ``(-cap, cap)`` (Gemma 2's attention soft-capping);
* chunking: a sequence cut into chunks, the exact window of each chunk, and its causal mask.

Token tensors use the public layout ``[batch, time, heads, dim]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.config import target

Array = jax.Array
#: A finite "minus infinity" for masked scores: a fully masked row gives zeros, never NaN
#: gradients. The Pallas readout uses the same constant, so both paths mask identically.
MASKED = -1e30


def soft_capped(scores: Array, cap) -> Array:
  """``cap · tanh(scores / cap)``, or ``scores`` when ``cap`` is None: the soft-capping of
  attention scores (Gemma 2's ``attn_logit_softcapping``) and of LM logits (its
  ``final_logit_softcapping``), applied after the softmax scale and before any mask."""
  if cap is None:
    return scores
  return jnp.tanh(scores / cap) * cap


def current_platform() -> str:
  """The platform programs are being built for: "cpu", "gpu" or "tpu" — this machine's, or inside
  ``kvm_jax.compile_target(...)`` the chip being compiled for (:mod:`kvm_jax.config.target`).

  Every backend decision takes its platform from here: the KVM and softmax-attention registries
  (``kvm_jax.ops.kvm.api.resolve_kvm_backend``, ``kvm_jax.ops.attention.api.
  resolve_attention_backend``), the kernels' interpret default, the scan's layouts and row update;
  the layers below them take the decided values as arguments."""
  return target.current_platform()


def import_tokamax(purpose: str):
  """The optional ``tokamax`` package, or an ImportError naming ``purpose`` and the install.

  tokamax reads its options from absl flags and, when the program never parsed them, parses
  ``sys.argv`` itself, which fails on any command line absl does not know (pytest's, the CLIs').
  They are marked parsed, so tokamax's options keep their defaults (a program that parses absl
  flags itself, e.g. under ``absl.app.run``, is unaffected)."""
  try:
    import tokamax
  except ImportError as e:
    raise ImportError(f"{purpose} needs the optional tokamax package: pip install "
                      "'kvm_jax[tokamax]' (or 'tokamax>=0.0.12').") from e
  from absl import flags  # a tokamax dependency
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


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
  """Writes the token at position ``t`` (``x_t [B, 1, ...]``) into its slot; ``t`` is one
  position for the batch (a scalar) or one per row (``[B]``: rows of a cache at different
  lengths)."""
  t = jnp.asarray(t)
  x_t = x_t.astype(ring.dtype)
  if t.ndim == 0:
    return jax.lax.dynamic_update_slice_in_dim(ring, x_t, t % ring.shape[1], 1)
  write_row = lambda r, x, i: jax.lax.dynamic_update_slice_in_dim(r, x, i, 0)
  return jax.vmap(write_row)(ring, x_t, t % ring.shape[1])


def ring_positions(t: Array, slots: int) -> Array:
  """Position held by each slot once token ``t`` is written (negative: never written):
  ``[slots]`` for one position, ``[B, slots]`` for one per row (``t [B]``)."""
  t = jnp.asarray(t)[..., None]
  return t - (t - jnp.arange(slots)) % slots


def read_ring_chunk(ring: Array, start: Array, size: int) -> Array:
  """``size`` consecutive slots of ``ring [B, slots, ...]`` from slot ``start`` (a scalar, or one
  per row ``[B]``) that does not wrap: ``[B, size, ...]``."""
  start = jnp.asarray(start)
  if start.ndim == 0:
    return jax.lax.dynamic_slice_in_dim(ring, start, size, axis=1)
  return jax.vmap(lambda r, i: jax.lax.dynamic_slice_in_dim(r, i, size, axis=0))(ring, start)


def batch_rows(length: Array, batch: int) -> Array:
  """A cache length (tokens seen) as one int32 per row ``[batch]``: a cache made before lengths
  were per row holds a scalar for every row."""
  return jnp.broadcast_to(jnp.asarray(length, jnp.int32), (batch,))


# ----------------------------------------------------------------------------------------------
# Matmuls and normalization
# ----------------------------------------------------------------------------------------------


def matmul_operand(x: Array) -> Array:
  """A bfloat16 matmul operand, widened to float32 on CPU only: XLA:CPU has no bfloat16 x
  bfloat16 -> float32 dot for larger operands, and the widening is exact (bfloat16 products are
  exact in float32, and the accumulation is float32 either way). Accelerators keep bfloat16."""
  if x.dtype == jnp.bfloat16 and current_platform() == "cpu":
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
                    state_temp: Array, window_temp: Array, softcap=None) -> Array:
  """One softmax over [state rows ; exact window], token-major (see :func:`joint_attention_heads`
  for the math).

  Args:
    q: ``[B, Tq, Hkv, G, D]`` queries (query head h = kv·G + g).
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout state (float32);
      values may also be per query head, ``[B, Hkv, G, R, Dv]``.
    state_valid: bool ``[Tq, R]`` (or broadcastable), which rows each query sees; or per batch
      row, ``[B, 1, 1, Tq | 1, R]`` (packed documents: each row's state has its own row count).
    window_keys / window_values: ``[B, W, Hkv, D]`` / ``[B, W, Hkv, Dv]``.
    window_valid: bool ``[Tq, W]`` (or broadcastable), the causal/window mask.
    state_temp / window_temp: float32 ``[Hkv, G]`` key temperatures.
    softcap: None, or every scaled score becomes ``cap · tanh(score / cap)`` before the mask
      (:func:`soft_capped`).
  Returns:
    ``[B, Tq, Hkv, G, Dv]`` float32.
  """
  y = joint_attention_heads(jnp.transpose(q, (0, 2, 3, 1, 4)), state_keys, state_values,
                            state_valid, jnp.transpose(window_keys, (0, 2, 1, 3)),
                            jnp.transpose(window_values, (0, 2, 1, 3)), window_valid, state_temp,
                            window_temp, softcap)
  return jnp.transpose(y, (0, 3, 1, 2, 4))


def joint_attention_heads(q: Array, state_keys: Array, state_values: Array, state_valid: Array,
                          window_keys: Array, window_values: Array, window_valid: Array,
                          state_temp: Array, window_temp: Array, softcap=None) -> Array:
  """:func:`joint_attention` in head-major layout: ``q [B, Hkv, G, Tq, D]``, window keys / values
  ``[B, Hkv, W, ·]`` -> ``[B, Hkv, G, Tq, Dv]`` float32 (the scan prepares this layout once per
  sequence instead of transposing every chunk).

  The temperatures and 1/√D multiply the *keys* (per query head), before the cast to the
  compute dtype, as in the authors' readout (docs/kvm-spec.md §6.1); one score matrix over the
  concatenated ``[state ; window]`` keys then takes one masked softmax. Scaling ``(R+W)·D`` keys
  instead of ``Tq·(R+W)`` scores, with one matmul per side instead of two, makes the XLA:CPU
  readout about twice as fast as scoring the two parts apart. For one query (a decode step) the
  scores are scaled instead, which moves fewer bytes there (the tests run both forms: chunks in
  the scan, single tokens in decode).
  """
  B, Hkv, G, Tq, D = q.shape
  if Tq == 1:  # a decode step: scaling scores is the cheaper side, and no concatenation
    return _joint_attention_one_query(q, state_keys, state_values, state_valid, window_keys,
                                      window_values, window_valid, state_temp, window_temp,
                                      softcap)
  dtype = q.dtype
  precision = precision_for(dtype)
  R, W = state_keys.shape[2], window_keys.shape[2]
  scale = 1.0 / np.sqrt(D)
  mm = matmul_operand
  f32 = jnp.float32
  per_head = lambda temp: (temp.astype(f32) * scale)[None, :, :, None, None]   # [1,Hkv,G,1,1]
  keys = jnp.concatenate([state_keys.astype(f32)[:, :, None] * per_head(state_temp),
                          window_keys.astype(f32)[:, :, None] * per_head(window_temp)],
                         axis=3).astype(dtype)                                 # [B,Hkv,G,R+W,D]
  s = soft_capped(jnp.einsum("bhgqd,bhgkd->bhgqk", mm(q), mm(keys), precision=precision,
                             preferred_element_type=f32), softcap)
  lead = np.broadcast_shapes(np.shape(state_valid)[:-2], np.shape(window_valid)[:-2])
  valid = jnp.concatenate([jnp.broadcast_to(state_valid, lead + (Tq, R)),
                           jnp.broadcast_to(window_valid, lead + (Tq, W))], axis=-1)
  s = jnp.where(valid, s, MASKED)
  p = jnp.exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
  denom = jnp.sum(p, axis=-1, keepdims=True)                                   # [B,Hkv,G,Tq,1]
  value_dtype = window_values.dtype
  if state_values.ndim == 5:  # one copy per query head (the authors' bf16 readout values)
    values = jnp.concatenate(
        [state_values.astype(value_dtype),
         jnp.broadcast_to(window_values[:, :, None], (B, Hkv, G, W, window_values.shape[3]))],
        axis=3)
    spec = "bhgqk,bhgkv->bhgqv"
  else:
    values = jnp.concatenate([state_values.astype(value_dtype), window_values], axis=2)
    spec = "bhgqk,bhkv->bhgqv"
  out = jnp.einsum(spec, mm(p.astype(value_dtype)), mm(values), precision=precision,
                   preferred_element_type=f32)
  return out / denom


def _joint_attention_one_query(q, state_keys, state_values, state_valid, window_keys,
                               window_values, window_valid, state_temp, window_temp,
                               softcap=None):
  """:func:`joint_attention_heads` for one query per head (a decode step): the temperatures
  multiply the ``Tq·(R+W)`` scores instead of the ``(R+W)·D`` keys, and the state and the window
  are scored apart, so a step reads the cache once and writes no scaled copy of it. Same math;
  float32 results agree with the key-scaled form to rounding."""
  dtype = q.dtype
  precision = precision_for(dtype)
  B, Hkv, G, Tq, D = q.shape
  R, W = state_keys.shape[2], window_keys.shape[2]
  mm = matmul_operand
  f32 = jnp.float32
  scale = lambda temp: (temp.astype(f32) / np.sqrt(D))[None, :, :, None, None]  # [1,Hkv,G,1,1]
  s_state = jnp.einsum("bhgqd,bhrd->bhgqr", mm(q), mm(state_keys.astype(dtype)),
                       precision=precision, preferred_element_type=f32) * scale(state_temp)
  s_window = jnp.einsum("bhgqd,bhwd->bhgqw", mm(q), mm(window_keys.astype(dtype)),
                        precision=precision, preferred_element_type=f32) * scale(window_temp)
  s_state, s_window = soft_capped(s_state, softcap), soft_capped(s_window, softcap)
  s_state = jnp.where(jnp.broadcast_to(state_valid, np.shape(state_valid)[:-2] + (Tq, R)),
                      s_state, MASKED)
  s_window = jnp.where(jnp.broadcast_to(window_valid, np.shape(window_valid)[:-2] + (Tq, W)),
                       s_window, MASKED)
  row_max = jax.lax.stop_gradient(jnp.maximum(jnp.max(s_state, axis=-1, keepdims=True),
                                              jnp.max(s_window, axis=-1, keepdims=True)))
  p_state, p_window = jnp.exp(s_state - row_max), jnp.exp(s_window - row_max)
  denom = jnp.sum(p_state, axis=-1, keepdims=True) + jnp.sum(p_window, axis=-1, keepdims=True)
  value_dtype = window_values.dtype
  spec = "bhgqr,bhgrv->bhgqv" if state_values.ndim == 5 else "bhgqr,bhrv->bhgqv"
  out = jnp.einsum(spec, mm(p_state.astype(value_dtype)), mm(state_values.astype(value_dtype)),
                   precision=precision, preferred_element_type=f32)
  out = out + jnp.einsum("bhgqw,bhwv->bhgqv", mm(p_window.astype(value_dtype)),
                         mm(window_values), precision=precision, preferred_element_type=f32)
  return out / denom


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
