"""The OVQ dictionary (:class:`OVQState`) and the two per-chunk operations every fast path shares:
the readout of a block of queries (dictionary plus causal chunk, one softmax) and the fold of a
chunk's tokens into the dictionary (assignment, counts, running means).

Shapes are head-major, float32: queries ``[B, H, n, D]`` (already multiplied by ``beta·√D``),
keys ``[B, H, n, D]``, values ``[B, H, n, Dv]``; the dictionary holds ``R`` rows, of which the
first ``size`` exist (``size`` may be traced: the decode step serves every position with one
program; with packed documents one per batch row, ``[B]``). Rows at or past ``size`` are zero and
masked out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvm_jax.ops.kvm.state import per_row, row_adder, safe_l2_norm
from kvm_jax.ops.ovq.config import OVQConfig

Array = jax.Array
_HI = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class OVQState:
  """A dictionary of centroids per (batch, head).

  Attributes:
    keys: ``[B, H, R, D]`` float32 key centroids.
    values: ``[B, H, R, Dv]`` float32 value centroids.
    counts: ``[B, H, R]`` float32 tokens assigned to each centroid so far (0 for rows that do not
      exist yet).
  """

  keys: Array
  values: Array
  counts: Array


jax.tree_util.register_dataclass(OVQState, data_fields=["keys", "values", "counts"],
                                 meta_fields=[])


def empty_state(batch: int, heads: int, rows: int, key_dim: int, value_dim: int) -> OVQState:
  zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
  return OVQState(keys=zeros(batch, heads, rows, key_dim),
                  values=zeros(batch, heads, rows, value_dim), counts=zeros(batch, heads, rows))


def _masked_softmax_weights(scores: Array, mask: Array) -> Array:
  """softmax over the last axis restricted to ``mask``; a row with nothing visible gets zeros
  (and zero gradient) instead of NaN."""
  peak = jnp.max(jnp.where(mask, scores, -jnp.inf), axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  weights = jnp.where(mask, jnp.exp(jnp.where(mask, scores, peak) - peak), 0.0)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  return weights / jnp.where(total > 0, total, 1.0)


def dictionary_scores(queries: Array, state: OVQState, size, count_bias: bool):
  """Scores ``[B, H, n, R]`` of queries against the dictionary (plus ``log(count)`` when
  ``count_bias``) and the mask of the rows that exist ``[1, 1, 1, R]``."""
  R = state.keys.shape[2]
  scores = jnp.einsum("bhnd,bhrd->bhnr", queries, state.keys, precision=_HI)
  exists = jnp.arange(R) < per_row(size, 4)  # [R] (one size) or [B, 1, 1, R] (one per row)
  if count_bias:
    counts = state.counts[:, :, None, :]
    scores = scores + jnp.log(jnp.where(counts > 0, counts, 1.0))
    exists = exists & (counts > 0)
  return scores, exists


def _known_empty(size) -> bool:
  """Whether ``size`` is the Python int 0: a dictionary known empty when the call is traced (the
  scan's first chunk), whose scores need not be computed at all."""
  return isinstance(size, int) and size == 0


def readout(queries: Array, keys: Array, values: Array, state: OVQState, size,
            count_bias: bool, visible=None) -> Array:
  """One softmax over ``[dictionary rows < size ; the block's keys]``: ``[B, H, n, Dv]``.

  ``visible`` ``[n, m]`` (or per batch row, ``[B, 1, n, m]``: rows at different positions)
  says which of the ``m`` block keys each query sees (default: causal, ``n == m``)."""
  n, m = queries.shape[2], keys.shape[2]
  if visible is None:
    visible = jnp.arange(m)[None, :] <= jnp.arange(n)[:, None]
  if visible.ndim == 2:
    visible = visible[None, None]
  own = jnp.einsum("bhnd,bhmd->bhnm", queries, keys, precision=_HI)
  if _known_empty(size):  # the first chunk: nothing to score against (and nothing to fold away)
    p = _masked_softmax_weights(own, jnp.broadcast_to(visible, own.shape))
    return jnp.einsum("bhnm,bhmd->bhnd", p, values, precision=_HI)
  dict_scores, exists = dictionary_scores(queries, state, size, count_bias)
  scores = jnp.concatenate([dict_scores, own], axis=-1)
  mask = jnp.concatenate([jnp.broadcast_to(exists, dict_scores.shape),
                          jnp.broadcast_to(visible, own.shape)], axis=-1)
  p = _masked_softmax_weights(scores, mask)
  R = state.keys.shape[2]
  return (jnp.einsum("bhnr,bhrd->bhnd", p[..., :R], state.values, precision=_HI)
          + jnp.einsum("bhnm,bhmd->bhnd", p[..., R:], values, precision=_HI))


def assignments(keys: Array, state: OVQState, size, num_new) -> Array:
  """Centroid index of each of a chunk's tokens ``[B, H, n]`` int32 (no gradient).

  A token joins its most similar existing centroid (raw dot product, the first on ties). The
  ``num_new`` tokens whose best similarity is lowest open rows ``size, size + 1, …`` in that order
  (ties: the earlier token). With an empty dictionary (``size == 0``) the first token opens row 0,
  every other token joins it, and the ``num_new - 1`` tokens least similar to the first token open
  rows 1, 2, …"""
  keys = jax.lax.stop_gradient(keys)
  dict_keys = jax.lax.stop_gradient(state.keys)
  n, R = keys.shape[2], dict_keys.shape[2]
  if _known_empty(size):
    sim = jnp.full(keys.shape[:3] + (1,), -jnp.inf)
  else:
    sim = jnp.einsum("bhnd,bhrd->bhnr", keys, dict_keys, precision=_HI)
    sim = jnp.where(jnp.arange(R) < per_row(size, 4), sim, -jnp.inf)
  nearest = jnp.argmax(sim, axis=-1).astype(jnp.int32)
  best = jnp.max(sim, axis=-1)
  like_first = jnp.einsum("bhnd,bhd->bhn", keys, keys[:, :, 0], precision=_HI)
  like_first = jnp.where(jnp.arange(n) == 0, jnp.inf, like_first)
  size, num_new = per_row(size, 3), per_row(num_new, 3)
  empty = size == 0
  nearest = jnp.where(empty, 0, nearest)
  score = jnp.where(empty, like_first, best)
  first_new = jnp.where(empty, 1, size)
  opened = jnp.where(empty, num_new - 1, num_new)
  order = jnp.argsort(score, axis=-1, stable=True)
  rank = jnp.argsort(order, axis=-1).astype(jnp.int32)       # the inverse permutation
  return jnp.where(rank < opened, first_new + rank, nearest).astype(jnp.int32)


def _gather_rows(rows: Array, index: Array) -> Array:
  return jnp.take_along_axis(rows, index[..., None], axis=2)


def fold(state: OVQState, keys: Array, values: Array, scaled_keys: Array, size, num_new,
         cfg: OVQConfig, row_update: str = "auto") -> OVQState:
  """The dictionary after a chunk's tokens are assigned (:func:`assignments`) and folded in, as
  the authors' update computes it: counts first, then every token moves its centroid by
  ``-(centroid - token) / count`` (the running mean), summed over the chunk's tokens; with the
  delta rule the value centroid moves by ``(v - readout(k)) / count`` instead, ``readout`` being the
  dictionary alone scored with ``scaled_keys``. ``row_update``: how token rows are summed into
  centroid rows ("scatter", "onehot" or "auto", ``kvm_jax.ops.kvm.state.ROW_UPDATES``)."""
  add_rows = row_adder(row_update)
  index = assignments(keys, state, size, num_new)
  ones = jnp.ones(index.shape + (1,), jnp.float32)
  counts = add_rows(state.counts[..., None], index, ones)[..., 0]
  rate = 1.0 / _gather_rows(counts[..., None], index)                     # [B, H, n, 1]
  dict_keys = add_rows(state.keys, index, -rate * (_gather_rows(state.keys, index) - keys))
  if cfg.delta_rule:
    if _known_empty(size):
      predicted = jnp.zeros_like(values)
    else:
      scores, exists = dictionary_scores(scaled_keys, state, size, cfg.count_bias)
      p = _masked_softmax_weights(scores, exists)
      predicted = jnp.einsum("bhnr,bhrd->bhnd", p, state.values, precision=_HI)
    dict_values = add_rows(state.values, index, rate * (values - predicted))
  else:
    dict_values = add_rows(state.values, index,
                           -rate * (_gather_rows(state.values, index) - values))
  if cfg.normalize_centroids:
    # zero rows (not opened yet) get torch's zero gradient, not NaN
    unit = lambda x: x / jnp.maximum(safe_l2_norm(x)[..., None], 1e-12)
    dict_keys = unit(dict_keys)
    if not cfg.delta_rule:
      dict_values = unit(dict_values)
  return OVQState(keys=dict_keys, values=dict_values, counts=counts)


def validate_inputs(q: Array, k: Array, v: Array, beta: Array) -> None:
  """Shape checks of the public OVQ functions (``[B, T, H, ·]`` inputs, ``beta [H]``)."""
  if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
    raise ValueError(f"OVQ takes q, k [B, T, H, D] and v [B, T, H, Dv] with the same B, T, H; got "
                     f"q {q.shape}, k {k.shape}, v {v.shape}.")
  if beta.shape != (q.shape[2],):
    raise ValueError(f"beta must be [H] = [{q.shape[2]}], got {beta.shape}.")
