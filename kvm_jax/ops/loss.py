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

from kvm_jax.ops.common import soft_capped

Array = jax.Array

#: Label of positions that carry no loss (prompt tokens, padding, tokens after a document's EOS).
IGNORE = -100


def head_logits(features: Array, kernel: Array, compute_dtype, softcap=None) -> Array:
  """``features [..., C] @ kernel [C, V]`` in ``compute_dtype``, returned as float32 (the LM head:
  a bias-free projection whose logits are float32 whatever the compute dtype); ``softcap``: the
  float32 logits become ``cap · tanh(logits / cap)`` (Gemma 2's final soft-capping)."""
  dt = jnp.dtype(compute_dtype)
  out = jax.lax.dot_general(features.astype(dt), kernel.astype(dt),
                            (((features.ndim - 1,), (0,)), ((), ())))
  return soft_capped(out.astype(jnp.float32), softcap)


def cross_entropy_sums(logits: Array, labels: Array) -> tuple[Array, Array]:
  """(sum of token cross-entropies, number of tokens) over labels that are not :data:`IGNORE`."""
  valid = labels != IGNORE
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid).astype(jnp.int32)


def to_slices(x: Array, slice_len: int, fill=0) -> Array:
  """``[B, T, ...]`` -> ``[n, B, slice_len, ...]`` with n = ceil(T / slice_len), the sequence
  padded with ``fill`` (labels: :data:`IGNORE`, so the padding counts nowhere)."""
  B, T = x.shape[:2]
  n = -(-T // slice_len)
  pad = [(0, 0), (0, n * slice_len - T)] + [(0, 0)] * (x.ndim - 2)
  x = jnp.pad(x, pad, constant_values=fill)
  return jnp.moveaxis(x.reshape(B, n, slice_len, *x.shape[2:]), 1, 0)


def sliced_loss_sums(features: Array, kernel: Array, labels: Array, *, compute_dtype,
                     slice_len: int = 0, predictions: bool = False, softcap=None
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
    softcap: the head's logit soft-cap (:func:`head_logits`), or None.
  Returns:
    ``(loss_sum float32, tokens int32, argmax [B, T] int32 or None)``.
  """
  B, T, C = features.shape
  if slice_len <= 0 or slice_len >= T:
    logits = head_logits(features, kernel, compute_dtype, softcap)
    loss, count = cross_entropy_sums(logits, labels)
    return loss, count, (jnp.argmax(logits, -1).astype(jnp.int32) if predictions else None)
  n = -(-T // slice_len)
  feats = to_slices(features, slice_len)                           # [n, B, s, C]
  labs = to_slices(labels, slice_len, fill=IGNORE)                   # [n, B, s]

  @jax.checkpoint  # the backward pass recomputes a slice's logits instead of storing them
  def one_slice(f, lab):
    logits = head_logits(f, kernel, compute_dtype, softcap)
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


def kl_sums(student_logits: Array, teacher_logits: Array, labels: Array,
            temperature: float = 1.0) -> tuple[Array, Array]:
  """(sum over labelled positions of KL(teacher ‖ student), number of them), both distributions
  ``softmax(logits / temperature)`` over the last axis, in float32.

  ``KL = Σ_v p_t (log p_t − log p_s)``: exactly 0 where the two logits are equal (the same
  log-softmax of the same numbers). Its gradient with respect to the student's logits is
  ``(p_s − p_t) / temperature`` per position; the teacher's side is not differentiated."""
  valid = labels != IGNORE
  teacher = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32))
  log_t = jax.nn.log_softmax(teacher / temperature, axis=-1)
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
  return jnp.sum(jnp.where(valid, kl, 0.0)), jnp.sum(valid).astype(jnp.int32)


def sliced_distill_sums(student: tuple[Array, Array], teacher: tuple[Array, Array], labels: Array,
                        *, compute_dtype, teacher_compute_dtype, temperatures: tuple[float, ...],
                        slice_len: int = 0, softcap: Optional[float] = None,
                        teacher_softcap: Optional[float] = None) -> dict[str, Array]:
  """Cross-entropy and KL(teacher ‖ student) sums of two LM heads, one sequence slice at a time
  (as :func:`sliced_loss_sums`: only ``[B, slice_len, V]`` logits of each model exist at once).

  Args:
    student / teacher: ``(features [B, T, C], head kernel [C, V])`` of each model; both heads'
      vocabularies are the same. The teacher's side is constant (``stop_gradient``).
    labels: ``[B, T]`` int, :data:`IGNORE` where nothing is counted.
    temperatures: the temperatures at which KL sums are wanted.
    softcap / teacher_softcap: each head's logit soft-cap (:func:`head_logits`), or None.
  Returns:
    ``{"ce": student cross-entropy sum, "kl": (one KL sum per temperature, in order),
    "count": labelled tokens}``.
  """
  def sums(f_s, f_t, lab):
    logits_s = head_logits(f_s, student[1], compute_dtype, softcap)
    logits_t = head_logits(jax.lax.stop_gradient(f_t), jax.lax.stop_gradient(teacher[1]),
                           teacher_compute_dtype, teacher_softcap)
    ce, count = cross_entropy_sums(logits_s, lab)
    kls = tuple(kl_sums(logits_s, logits_t, lab, t)[0] for t in temperatures)
    return ce, kls, count

  f_s, f_t = student[0], teacher[0]
  T = f_s.shape[1]
  if slice_len <= 0 or slice_len >= T:
    ce, kls, count = sums(f_s, f_t, labels)
    return {"ce": ce, "kl": kls, "count": count}
  labs = to_slices(labels, slice_len, fill=IGNORE)
  one_slice = jax.checkpoint(sums)  # a slice's logits are recomputed in the backward pass

  def step(carry, xs):
    ce, kls, count = one_slice(*xs)
    return (carry[0] + ce, tuple(a + b for a, b in zip(carry[1], kls)), carry[2] + count), None

  zero = jnp.zeros((), jnp.float32)
  (ce, kls, count), _ = jax.lax.scan(
      step, (zero, tuple(zero for _ in temperatures), jnp.zeros((), jnp.int32)),
      (to_slices(f_s, slice_len), to_slices(f_t, slice_len), labs))
  return {"ce": ce, "kl": kls, "count": count}
