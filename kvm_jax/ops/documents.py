"""Documents packed into rows: what ``segment_ids`` say about every token, and attention whose
window stays inside a document.

A row of ``segment_ids [B, T]`` (int, 0 = padding) holds documents: each maximal run of one
nonzero id is one document (ids need not be distinct across rows, nor even within a row: two runs
of id 3 separated by another id are two documents). Every computation on packed rows is defined by
one rule: **a document's outputs equal those of the document run alone**, as a row of its own
starting at position 0. Its positions restart at 0, its chunk grid starts at its first token, its
window never reaches into the previous document, and recurrent state starts empty.

Padding tokens are treated as documents of one token each: they attend only to themselves, so
their outputs are finite and no document ever sees them (the loss masks them out).

:func:`documents` turns ``segment_ids`` into per-token positions, starts and lengths (pure,
``jit``-able, no host sync). :func:`document_window_partials` is softmax attention restricted to a
document and to a window rule on document positions (full causal, sliding window, or KVM's and
BSWA's chunk-aligned window), returned as un-normalized partial sums, so that another set of keys
(KVM's state, BSWA's sinks) can join the same softmax (:func:`combine_partials`).

The recurrent document paths (KVM's state steps, OVQ's dictionary steps) share three helpers:
:func:`rows_of` gathers each row's slice at its own offset, :func:`select_rows` keeps a step's
result only in the rows it applies to, and :func:`scan_in_blocks` is a ``lax.scan`` whose backward
pass keeps the carry every ~sqrt(steps) steps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.common import MASKED, is_concrete, matmul_operand, precision_for, soft_capped

Array = jax.Array


class Documents(NamedTuple):
  """Per-token document structure of packed rows, all ``[B, T]``.

  Attributes:
    index: int32 number of the token's document within its row, counting from 0 (a padding token
      is a document of its own).
    start: int32 row index of the document's first token.
    position: int32 position within the document (``t - start``): RoPE positions and the chunk
      grid of a document run alone.
    length: int32 number of tokens of the document.
    valid: bool, False at padding (``segment_ids == 0``).
  """

  index: Array
  start: Array
  position: Array
  length: Array
  valid: Array

  def segment_ids(self) -> Array:
    """``[B, T]`` int32 ids that describe these documents again (each document's number in its
    row plus one, 0 on padding): what an op that takes ``segment_ids`` rebuilds them from."""
    return jnp.where(self.valid, self.index + 1, 0)


def check_segment_ids(segment_ids, shape: tuple[int, int], where: str) -> None:
  """A ValueError unless ``segment_ids`` is an integer ``[B, T]`` array of ``shape`` with no
  negative id (checked on the host when the values are concrete)."""
  if not hasattr(segment_ids, "shape") or tuple(segment_ids.shape) != tuple(shape):
    raise ValueError(f"{where}: segment_ids must have shape {tuple(shape)} [batch, time], got "
                     f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}.")
  if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
    raise ValueError(f"{where}: segment_ids must be integers (0 = padding, each run of one "
                     f"nonzero id = one document), got dtype {segment_ids.dtype}.")
  if is_concrete(segment_ids) and segment_ids.size:
    smallest = int(np.min(np.asarray(segment_ids)))
    if smallest < 0:
      raise ValueError(f"{where}: segment_ids must be >= 0 (0 = padding), found {smallest}.")


def documents(segment_ids: Array) -> Documents:
  """The :class:`Documents` of ``segment_ids [B, T]`` (0 = padding; each maximal run of one
  nonzero id is a document; each padding token a document of its own)."""
  seg = jnp.asarray(segment_ids).astype(jnp.int32)
  B, T = seg.shape
  t = jnp.arange(T, dtype=jnp.int32)
  valid = seg != 0
  previous = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), seg[:, :-1]], axis=1)
  begins = (~valid) | (seg != previous)                               # t = 0 always begins
  index = jnp.cumsum(begins, axis=1, dtype=jnp.int32) - 1
  start = jax.lax.cummax(jnp.where(begins, t, 0), axis=1)
  # The next document's first token (T after the last): a reverse running minimum of the starts
  # strictly after t.
  later = jnp.concatenate([jnp.where(begins, t, T)[:, 1:], jnp.full((B, 1), T, jnp.int32)], axis=1)
  end = jax.lax.cummin(later, axis=1, reverse=True)
  return Documents(index=index, start=start, position=t - start, length=end - start, valid=valid)


# ----------------------------------------------------------------------------------------------
# Window rules on document positions
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WindowRule:
  """Which earlier keys of its own document a query sees, by document positions.

  kind "causal": every key ``[0, p]``; "sliding": ``(p - window, p]``; "chunks": KVM's and BSWA's
  block window, the keys ``[max(0, (c - window_chunks + 1)·chunk), p]`` with ``c = p // chunk``
  (the query's own chunk of the document's grid and the ``window_chunks - 1`` before it).
  """

  kind: str
  window: int = 0
  chunk: int = 0
  window_chunks: int = 0

  def __post_init__(self):
    if self.kind not in ("causal", "sliding", "chunks"):
      raise ValueError(f"WindowRule.kind must be 'causal', 'sliding' or 'chunks', got "
                       f"{self.kind!r}.")
    if self.kind == "sliding" and self.window < 1:
      raise ValueError(f"a sliding WindowRule needs window >= 1, got {self.window}.")
    if self.kind == "chunks" and (self.chunk < 1 or self.window_chunks < 1):
      raise ValueError(f"a chunks WindowRule needs chunk >= 1 and window_chunks >= 1, got "
                       f"{self.chunk} and {self.window_chunks}.")

  @property
  def reach(self) -> Optional[int]:
    """How far back (in tokens) a key can be from its query: None for "causal" (to the
    document's start)."""
    if self.kind == "sliding":
      return self.window - 1
    if self.kind == "chunks":
      return self.window_chunks * self.chunk - 1
    return None

  def first_visible(self, query_position: Array) -> Array:
    """The earliest position the query at ``query_position`` (an int array) sees."""
    if self.kind == "sliding":
      return jnp.maximum(0, query_position - self.window + 1)
    if self.kind == "chunks":
      return jnp.maximum(0, (query_position // self.chunk - self.window_chunks + 1) * self.chunk)
    return jnp.zeros_like(query_position)

  def sees(self, query_position: Array, key_position: Array) -> Array:
    """Whether a key at document position ``key_position`` lies in the window of a query at
    ``query_position`` of the same document (both broadcastable int arrays; causality too)."""
    return (key_position <= query_position) & (key_position >= self.first_visible(query_position))

  def slots(self, max_len: int) -> int:
    """Tokens a decode ring must keep for sequences of up to ``max_len`` tokens: the window's
    span (the whole sequence for "causal")."""
    reach = self.reach
    return max_len if reach is None else min(reach + 1, max_len)


class Partials(NamedTuple):
  """Un-normalized softmax pieces of one set of keys, per query head (float32): the running max
  ``[B, T, Hkv, G]``, the sum of ``exp(score - max)`` ``[B, T, Hkv, G]`` and the weighted values
  ``[B, T, Hkv, G, Dv]``. A query that saw no key has max :data:`MASKED`, sum 0 and values 0."""

  max: Array
  sum: Array
  values: Array


def combine_partials(*parts: Partials) -> Array:
  """One softmax over the union of the keys behind ``parts``: ``[B, T, Hkv, G, Dv]`` float32.
  Every query must have seen at least one key in some part."""
  top = functools.reduce(jnp.maximum, [p.max for p in parts])
  scales = [jnp.exp(p.max - top) for p in parts]
  total = sum(p.sum * s for p, s in zip(parts, scales))
  values = sum(p.values * s[..., None] for p, s in zip(parts, scales))
  return values / total[..., None]


def _slab_partials(qb: Array, kb: Array, vb: Array, sees: Array, scale: Array, softcap
                   ) -> tuple[Array, Array, Array]:
  """One block's partials (running max, sum, unnormalised values) over its slab of keys:
  queries ``qb [B, bq, Hkv, G, D]``, keys ``kb [B, S, Hkv, D]`` scaled per query head by
  ``scale [Hkv, G]`` (in float32, cast back to the queries' dtype), values ``vb [B, S, Hkv,
  Dv]``, visibility ``sees [B, bq, S]``. Returns ``[B, bq, Hkv, G(, Dv)]`` float32 arrays."""
  dtype, precision = qb.dtype, precision_for(qb.dtype)
  keys = (kb.astype(jnp.float32)[:, :, :, None] * scale[None, None, :, :, None]).astype(dtype)
  s = jnp.einsum("bqhgd,bshgd->bhgqs", matmul_operand(qb), matmul_operand(keys),
                 precision=precision, preferred_element_type=jnp.float32)
  s = jnp.where(sees[:, None, None], soft_capped(s, softcap), MASKED)
  top = jax.lax.stop_gradient(jnp.max(s, axis=-1))
  p = jnp.exp(s - top[..., None])
  acc = jnp.einsum("bhgqs,bshv->bhgqv", matmul_operand(p.astype(vb.dtype)), matmul_operand(vb),
                   precision=precision, preferred_element_type=jnp.float32)
  # [B, Hkv, G, bq, ...] -> [B, bq, Hkv, G, ...]
  move = lambda x: jnp.moveaxis(x, 3, 1)  # noqa: E731
  return move(top), move(jnp.sum(p, axis=-1)), move(acc)


def document_window_partials(q: Array, k: Array, v: Array, docs: Documents, rule: WindowRule, *,
                             key_scale: Array | float = 1.0, block: int = 128,
                             queries: Optional[Array] = None, softcap=None) -> Partials:
  """Softmax attention of every query over the keys of its own document that ``rule`` lets it
  see, as :class:`Partials`.

  Args:
    q: ``[B, T, Hkv, G, D]`` queries (query head h = kv·G + g).
    k / v: ``[B, T, Hkv, D]`` / ``[B, T, Hkv, Dv]``.
    docs: :func:`documents` of the rows.
    rule: the window on document positions.
    key_scale: multiplies the keys per query head before scoring (``[Hkv, G]`` float32 or a
      scalar): the softmax scale, times KVM's window temperature. Keys are scaled in float32 and
      cast back to ``q``'s dtype, as the KVM readout does.
    block: queries per block. Each block scores a slab of ``block + reach`` keys (the whole row
      before it for the causal rule), so memory is ``O(T · (block + reach))`` scores at most and
      the backward pass recomputes each block (``jax.checkpoint``).
    queries: optional bool ``[B, T]``, the queries whose partials the caller reads (KVM: those
      before their document's state). A block of queries holding none of them, in any row, is
      skipped (``lax.cond``) and gives max ``MASKED``, sum 1 and values 0 there: finite, with
      zero gradients, for a caller that selects other outputs at those queries.
    softcap: None, or scaled scores become ``cap · tanh(score / cap)`` before the mask
      (:func:`kvm_jax.ops.common.soft_capped`).
  Returns:
    :class:`Partials` of shape ``[B, T, Hkv, G(, Dv)]``; every valid or padding query sees at
    least its own key.
  """
  B, T, Hkv, G, D = q.shape
  block = max(1, min(block, T))
  n = -(-T // block)
  reach = rule.reach
  # Keys a block may need before its first query: the rule's reach, or the whole row (causal),
  # rounded to whole blocks so slabs of one size tile the padded row.
  span = (n - 1) * block if reach is None else -(-reach // block) * block
  span = min(span, (n - 1) * block)
  slab = span + block
  pad_q = n * block - T
  pad_time = lambda x, front, back, fill=0: jnp.pad(  # noqa: E731
      x, [(0, 0), (front, back)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
  scale = jnp.broadcast_to(jnp.asarray(key_scale, jnp.float32), (Hkv, G))
  # The key side, padded in front by the slab's reach: index ``-1`` never matches a document.
  k_p, v_p = pad_time(k, span, pad_q), pad_time(v, span, pad_q)
  key_doc = pad_time(docs.index, span, pad_q, -1)
  key_pos = pad_time(docs.position, span, pad_q)
  q_p = pad_time(q, 0, pad_q)
  q_doc = pad_time(docs.index, 0, pad_q, -2)
  q_pos = pad_time(docs.position, 0, pad_q)

  def one_block(i):
    first = i * block
    qb = jax.lax.dynamic_slice_in_dim(q_p, first, block, 1)              # [B, bq, Hkv, G, D]
    kb = jax.lax.dynamic_slice_in_dim(k_p, first, slab, 1)               # [B, S, Hkv, D]
    vb = jax.lax.dynamic_slice_in_dim(v_p, first, slab, 1)
    sees = ((jax.lax.dynamic_slice_in_dim(q_doc, first, block, 1)[:, :, None]
             == jax.lax.dynamic_slice_in_dim(key_doc, first, slab, 1)[:, None, :])
            & rule.sees(jax.lax.dynamic_slice_in_dim(q_pos, first, block, 1)[:, :, None],
                        jax.lax.dynamic_slice_in_dim(key_pos, first, slab, 1)[:, None, :]))
    return _slab_partials(qb, kb, vb, sees, scale, softcap)

  def skipped(i):
    del i
    return (jnp.full((B, block, Hkv, G), MASKED, jnp.float32),
            jnp.ones((B, block, Hkv, G), jnp.float32),
            jnp.zeros((B, block, Hkv, G, v.shape[-1]), jnp.float32))

  body = one_block
  if queries is not None:
    wanted = jnp.any(pad_time(queries, 0, pad_q).reshape(B, n, block), axis=(0, 2))   # [n]
    body = lambda i: jax.lax.cond(wanted[i], one_block, skipped, i)  # noqa: E731
  top, total, acc = jax.lax.map(jax.checkpoint(body), jnp.arange(n, dtype=jnp.int32))
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n * block, *x.shape[3:])[:, :T]  # noqa: E731
  return Partials(unblock(top), unblock(total), unblock(acc))


def document_attention(q: Array, k: Array, v: Array, segment_ids: Array, rule: WindowRule, *,
                       scale: Optional[float] = None, block: int = 128,
                       softcap: Optional[float] = None) -> Array:
  """Softmax attention of ``q [B, T, H, D]`` over keys ``k [B, T, Hkv, D]`` / values
  ``[B, T, Hkv, Dv]`` of the query's own document within ``rule``'s window: ``[B, T, H, Dv]`` in
  ``q``'s dtype (``softcap``: soft-capped scores). Each document gets exactly what it would get
  run alone."""
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  check_segment_ids(segment_ids, (B, T), "document_attention")
  scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
  parts = document_window_partials(q.reshape(B, T, Hkv, H // Hkv, D), k, v,
                                   documents(segment_ids), rule, key_scale=scale, block=block,
                                   softcap=softcap)
  return combine_partials(parts).reshape(B, T, H, v.shape[-1]).astype(q.dtype)


def document_sink_partials(q: Array, k: Array, v: Array, docs: Documents, sink_rows: int,
                           chunk: int, window_chunks: int, *,
                           key_scale: Array | float = 1.0, softcap=None) -> Partials:
  """Block sliding-window attention's sinks on packed documents, as :class:`Partials`: every
  query also sees the first ``sink_rows`` tokens of its own document while they lie before its
  window (document position below ``(p // chunk - window_chunks + 1)·chunk``); inside the window
  they are window keys already.

  Shapes as in :func:`document_window_partials`; the sinks are gathered per query
  (``[B, T, sink_rows, Hkv, ·]``)."""
  B, T, Hkv, G, D = q.shape
  offsets = jnp.arange(sink_rows, dtype=jnp.int32)
  where = jnp.minimum(docs.start[..., None] + offsets, T - 1)                  # [B, T, S]
  gather = lambda x: jnp.take_along_axis(  # noqa: E731
      x[:, None], where.reshape(B, T, sink_rows, *([1] * (x.ndim - 2))), axis=2)
  sink_k, sink_v = gather(k), gather(v)                                       # [B, T, S, Hkv, ·]
  begin = (docs.position // chunk - window_chunks + 1) * chunk
  sees = (offsets < docs.length[..., None]) & (offsets < begin[..., None])  # [B, T, S]
  scale = jnp.broadcast_to(jnp.asarray(key_scale, jnp.float32), (Hkv, G))
  keys = (sink_k.astype(jnp.float32)[:, :, :, :, None] * scale[:, :, None]).astype(q.dtype)
  s = jnp.einsum("bqhgd,bqshgd->bqhgs", matmul_operand(q), matmul_operand(keys),
                 precision=precision_for(q.dtype), preferred_element_type=jnp.float32)
  s = jnp.where(sees[:, :, None, None], soft_capped(s, softcap), MASKED)
  top = jax.lax.stop_gradient(jnp.max(s, axis=-1))
  p = jnp.exp(s - top[..., None])
  acc = jnp.einsum("bqhgs,bqshv->bqhgv", matmul_operand(p.astype(v.dtype)), matmul_operand(sink_v),
                   precision=precision_for(q.dtype), preferred_element_type=jnp.float32)
  return Partials(top, jnp.sum(p, axis=-1), acc)


# ----------------------------------------------------------------------------------------------
# Scans over per-row steps (shared by the KVM and OVQ document paths)
# ----------------------------------------------------------------------------------------------


def rows_of(x: Array, first: Array, size: int) -> Array:
  """``x[b, first[b] : first[b] + size]`` for every row ``b`` (``x [B, T, ...]``, ``first [B]``;
  the caller pads ``x`` so the slices stay inside)."""
  return jax.vmap(lambda row, f: jax.lax.dynamic_slice_in_dim(row, f, size, 0))(x, first)


def select_rows(pick: Array, new, old):
  """Per batch row, ``new`` where ``pick [B]`` else ``old`` (pytrees of batch-first arrays)."""
  shaped = lambda a: pick.reshape(pick.shape + (1,) * (a.ndim - 1))  # noqa: E731
  return jax.tree_util.tree_map(lambda a, b: jnp.where(shaped(a), a, b), new, old)


def scan_in_blocks(step, carry, xs):
  """``lax.scan(step, carry, xs)`` whose backward pass keeps the carry only every ~sqrt(steps)
  steps: the steps are cut into blocks, each block one rematerialized inner scan (a trailing
  partial block is padded with steps past the row, which change nothing)."""
  n = xs.shape[0]
  block = max(1, math.isqrt(n - 1) + 1)
  blocks = -(-n // block)
  if blocks * block != n:
    # Padding steps point past every row (first >= T): no query, no fold, no reset.
    fill = jnp.iinfo(jnp.int32).max // 2
    xs = jnp.concatenate([xs, jnp.full((blocks * block - n, *xs.shape[1:]), fill, xs.dtype)])

  @jax.checkpoint
  def run_block(carry, block_xs):
    return jax.lax.scan(step, carry, block_xs)

  carry, ys = jax.lax.scan(run_block, carry, xs.reshape(blocks, block, *xs.shape[1:]))
  ys = jax.tree_util.tree_map(lambda y: y.reshape(blocks * block, *y.shape[2:])[:n], ys)
  return carry, ys


# ------------------------------------------------------------------------------------------------
# Packed rows from document lengths, and each document alone: what checks of the rule above
# compare (the tests, the device check).
# ------------------------------------------------------------------------------------------------


def segment_ids_from_lengths(layout, seq_len: int, reuse_ids: bool = False) -> np.ndarray:
  """``[len(layout), seq_len]`` int32 segment ids from per-row document lengths.

  ``layout``: one sequence per row of document lengths in order, a negative entry being that many
  padding tokens (id 0); each row must sum (in absolute value) to ``seq_len``. Documents are
  numbered 1, 2, ... in each row, or 1, 2, 1, 2, ... with ``reuse_ids`` (runs of one id are still
  separate documents wherever another id lies between them)."""
  seg = np.zeros((len(layout), seq_len), np.int32)
  for b, lengths in enumerate(layout):
    t = 0
    for i, n in enumerate(lengths):
      if n > 0:
        seg[b, t:t + n] = (1 + i % 2) if reuse_ids else 1 + i
      t += abs(n)
    if t != seq_len:
      raise ValueError(f"row {b} of the layout holds {t} tokens, not seq_len={seq_len}: "
                       f"{list(lengths)}")
  return seg


def document_spans(layout):
  """``(row, first token, length)`` of every document of ``layout`` (as in
  :func:`segment_ids_from_lengths`), row by row."""
  for b, lengths in enumerate(layout):
    t = 0
    for n in lengths:
      if n > 0:
        yield b, t, n
      t += abs(n)


def documents_alone(layout, *arrays, fills=None):
  """Every document of ``layout`` as a row of its own, from its first token, filled up to the
  longest document with ``fills`` (one value per array, default 0): ``(spans, [N, width, ...]
  per array)`` for ``arrays`` of ``[B, T, ...]``.

  A causal computation's outputs at a document's positions then depend only on its own tokens,
  so row i is document i run alone there (and, for a loss that reads only those positions, so is
  its gradient). One batch, so one compiled program serves every document length."""
  docs = list(document_spans(layout))
  width = max(n for _, _, n in docs)
  fills = fills or [0] * len(arrays)
  out = []
  for x, fill in zip(arrays, fills):
    x = np.asarray(x)
    rows = np.full((len(docs), width) + x.shape[2:], fill, x.dtype)
    for i, (b, t, n) in enumerate(docs):
      rows[i, :n] = x[b, t:t + n]
    out.append(jnp.asarray(rows))
  return docs, out
