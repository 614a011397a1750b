"""Language-model head and cross-entropy, whole or over slices of the sequence (pure functions).

At the paper's shapes the float32 logits ``[B, T, V]`` of one step are 13 GB (8 × 8192 × 50304),
and their gradient as much again. :func:`sliced_loss_sums` never forms them: it walks the sequence
in slices of ``slice_len`` tokens under ``lax.scan``, each slice's logits recomputed in the
backward pass (``jax.checkpoint``), so only ``[B, slice_len, V]`` exists at a time. The sums it
returns equal those of the whole logits up to float32 summation order.

Labels equal to :data:`IGNORE` carry no loss (the authors' ``ignore_index``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

Array = jax.Array

# Label of positions that carry no loss (prompt tokens, padding, tokens after a document's EOS).
IGNORE = -100


def head_logits(features: Array, kernel: Array, compute_dtype) -> Array:
  """``features [..., C] @ kernel [C, V]`` in ``compute_dtype``, returned as float32 (the LM head:
  a bias-free projection whose logits are float32 whatever the compute dtype)."""
  dt = jnp.dtype(compute_dtype)
  out = jax.lax.dot_general(features.astype(dt), kernel.astype(dt),
                            (((features.ndim - 1,), (0,)), ((), ())))
  return out.astype(jnp.float32)


def cross_entropy_sums(logits: Array, labels: Array) -> tuple[Array, Array]:
  """(sum of token cross-entropies, number of tokens) over labels that are not :data:`IGNORE`."""
  valid = labels != IGNORE
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid).astype(jnp.int32)


def sliced_loss_sums(features: Array, kernel: Array, labels: Array, *, compute_dtype,
                     slice_len: int = 0, predictions: bool = False
                     ) -> tuple[Array, Array, Optional[Array]]:
  """Cross-entropy sums of the LM head applied to ``features``, one sequence slice at a time.

  Args:
    features: ``[B, T, C]`` final hidden states (after the head LayerNorm).
    kernel: ``[C, V]`` LM-head weight.
    labels: ``[B, T]`` int, :data:`IGNORE` where no loss is taken.
    compute_dtype: dtype of the head matmul (logits are float32).
    slice_len: tokens per slice; 0 or >= T computes the whole logits at once. T need not be a
      multiple (the last slice is padded with ignored labels).
    predictions: also return the argmax token ``[B, T]`` (for recall metrics).
  Returns:
    ``(loss_sum float32, tokens int32, argmax [B, T] int32 or None)``.
  """
  B, T, C = features.shape
  if slice_len <= 0 or slice_len >= T:
    logits = head_logits(features, kernel, compute_dtype)
    loss, count = cross_entropy_sums(logits, labels)
    return loss, count, (jnp.argmax(logits, -1).astype(jnp.int32) if predictions else None)
  n = -(-T // slice_len)
  pad = n * slice_len - T
  feats = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
  labs = jnp.pad(labels, ((0, 0), (0, pad)), constant_values=IGNORE)
  feats = jnp.moveaxis(feats.reshape(B, n, slice_len, C), 1, 0)     # [n, B, s, C]
  labs = jnp.moveaxis(labs.reshape(B, n, slice_len), 1, 0)           # [n, B, s]

  @jax.checkpoint  # the backward pass recomputes a slice's logits instead of storing them
  def one_slice(f, lab):
    logits = head_logits(f, kernel, compute_dtype)
    loss, count = cross_entropy_sums(logits, lab)
    pred = jnp.argmax(logits, -1).astype(jnp.int32) if predictions else None
    return loss, count, pred

  def step(carry, xs):
    loss, count, pred = one_slice(*xs)
    return (carry[0] + loss, carry[1] + count), pred

  (loss, count), preds = jax.lax.scan(step, (jnp.zeros((), jnp.float32),
                                             jnp.zeros((), jnp.int32)), (feats, labs))
  if predictions:
    preds = jnp.moveaxis(preds, 0, 1).reshape(B, n * slice_len)[:, :T]
  return loss, count, preds
