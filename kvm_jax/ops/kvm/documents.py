"""KVM over packed documents: every document computed as if it were run alone (``segment_ids``).

A KVM layer's output depends on where each chunk starts (docs/kvm-spec.md §12): a document run
alone starts its own chunk grid at its first token, its budget counts its own tokens, its state
starts as its own first chunk, and its window never reaches into the previous document. With
documents packed at arbitrary offsets the chunk grids of a row's documents do not line up with
each other. Two paths make them line up (:func:`document_path_for` picks one):

* **aligned** (XLA, ``window_chunks >= 2``; :mod:`kvm_jax.ops.kvm.document_scan`): the rows are
  read through a layout in which every document longer than ``(window_chunks - 1)·C + 1``
  tokens starts at a chunk, and the plain scan's chunk loop runs on it, with its
  stored-decision backward pass. A chunk's masks and each row's fold or reset come from the
  documents' positions.
* **steps** (the Pallas kernels, whose window mask is one for the batch; and a one-chunk
  window, whose layout could need ``chunk_size / 2`` times the row): the queries split by
  document position ``p`` (``L = window_chunks · chunk_size``). Before ``L`` a query sees only its
  window, computed in the row's own layout
  (:func:`kvm_jax.ops.documents.document_window_partials`, skipping blocks of queries with no
  such query). From ``L`` on it also sees the document's state, which **state steps** build:
  one ``lax.scan`` over steps, each a query chunk of one document on that document's own grid
  (its first query at a multiple of ``chunk_size``, ``p >= L``), gathered from the row with its
  window. A row's steps come in row order, so a document's steps are consecutive: the first
  resets the state to the document's first chunk, each step is a chunk of the plain scan (one
  softmax over [state ; window], then the fold of the chunk leaving the window) through
  :class:`~kvm_jax.ops.kvm.scan.ChunkOps`, with each batch row's own state row count and its
  appends from the static schedule (which depends only on the chunk index within the
  document). Steps per row are at most ``ceil(T / chunk_size) - window_chunks``, so shapes stay
  static; the backward pass is autodiff, keeping the carry every ~sqrt(steps) steps.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvm_jax.config.budget import kvm_schedule
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import window_mask
from kvm_jax.ops.documents import (Documents, WindowRule, combine_partials,
                                   document_window_partials, documents, rows_of,
                                   scan_in_blocks, select_rows)
from kvm_jax.ops.kvm.document_scan import kvm_attention_scan_documents
from kvm_jax.ops.kvm.scan import XLA_OPS, ChunkOps
from kvm_jax.ops.kvm.state import (KVMParams, KVMState, state_readout, temperatures,
                                   token_rows)

Array = jax.Array


def state_steps(docs: Documents, cfg: KVMConfig, num_steps: int) -> Array:
  """The first query token (row index) of every state step, ``[B, num_steps]`` int32, in row
  order; ``T`` where a row has fewer steps. A step starts at each document position
  ``p >= window_chunks · chunk_size`` with ``p % chunk_size == 0``."""
  B, T = docs.position.shape
  C, L = cfg.chunk_size, cfg.chunk_size * cfg.window_chunks
  begins = docs.valid & (docs.position >= L) & (docs.position % C == 0)
  rank = jnp.where(begins, jnp.cumsum(begins, axis=1) - 1, num_steps)    # num_steps: dropped
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  return jnp.full((B, num_steps), T, jnp.int32).at[rows, rank].set(t, mode="drop")


def max_state_steps(seq_len: int, cfg: KVMConfig) -> int:
  """The most state steps a row of ``seq_len`` tokens can hold, whatever its documents: a
  document of length ``n > L`` (``L = window_chunks · chunk_size``) has ``ceil(n / C) - nb`` of
  them, and these sum to less than ``seq_len / C - nb + 1`` over documents sharing a row."""
  return max(0, -(-seq_len // cfg.chunk_size) - cfg.window_chunks)


#: How the document path runs: "aligned" (the plain scan on a chunk-aligned layout), "steps" (a
#: scan over each row's state steps) or "auto" (:func:`document_path_for`).
DOCUMENT_PATHS = ("auto", "aligned", "steps")


def document_path_for(cfg: KVMConfig, ops: ChunkOps) -> str:
  """"aligned" for the XLA operations with ``window_chunks >= 2``; "steps" for the kernels (their
  window mask is one causal mask for the batch, and the aligned layout needs one per row) and for
  a one-chunk window (where any document longer than one token would start at a chunk of the
  layout, which could then need ``chunk_size / 2`` times the row's slots)."""
  return "aligned" if ops.kernel is None and cfg.window_chunks >= 2 else "steps"


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "row_update", "remat", "path"))
def kvm_attention_documents(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                            segment_ids: Array, cfg: KVMConfig, ops: ChunkOps = XLA_OPS,
                            row_update: str = "auto", remat: bool = True, path: str = "auto"):
  """KVM over the documents of ``segment_ids [B, T]``; see :func:`kvm_jax.kvm_attention` for the
  other arguments (inputs are not re-validated here). ``ops``: the per-chunk readout and fold
  (:class:`~kvm_jax.ops.kvm.scan.ChunkOps`, time-major form), as the plain scan runs them.

  Returns ``y [B, T, H, Dv]`` in ``q``'s dtype (padding positions: each token attending to itself
  alone) and the state of each row's last document as run alone (:class:`KVMState` with
  ``num_rows`` per row, ``[B]``; capacity: the rows the schedule reaches at ``T``). ``remat``:
  the backward pass keeps the state every ~sqrt(steps) steps and recomputes the rest. ``path``:
  one of :data:`DOCUMENT_PATHS`; "aligned" needs ``ops`` without kernels.
  """
  docs = documents(segment_ids)
  if path not in DOCUMENT_PATHS:
    raise ValueError(f"path must be one of {DOCUMENT_PATHS}, got {path!r}.")
  if path == "auto":
    path = document_path_for(cfg, ops)
  if path == "aligned" and ops.kernel is not None:
    raise ValueError(f"path='aligned' needs the plain XLA operations (its window masks differ "
                     f"from batch row to batch row, a kernel's mask is one for the batch), but "
                     f"ops={ops.name!r} runs kernels; use path='steps' or 'auto'.")
  if path == "aligned":
    y, final = kvm_attention_scan_documents(q, k, v, merge_gate, params, docs, cfg, ops=ops,
                                            row_update=row_update)
    short = _last_document_start_state(k, v, merge_gate, docs, params, cfg, final.capacity)
    return y, select_rows(_last_document_length(docs) > cfg.window_len, final, short)
  return _kvm_attention_steps(q, k, v, merge_gate, params, docs, cfg, ops, row_update, remat)


def _kvm_attention_steps(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                         docs: Documents, cfg: KVMConfig, ops: ChunkOps, row_update: str,
                         remat: bool):
  """The "steps" path of :func:`kvm_attention_documents` (module docstring): the documents'
  fronts from their windows alone, every later query chunk from one state step. Returns as
  :func:`kvm_attention_documents`."""
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[-1]
  C, nb = cfg.chunk_size, cfg.window_chunks
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  scale = 1.0 / math.sqrt(D)
  q5 = q.reshape(B, T, Hkv, H // Hkv, D)
  # A step's readout is one softmax over [state ; window] (the plain scan's chunk), so the
  # window alone is needed only for the front (document position < L).
  front = docs.position < nb * C                    # padding too: a document of one token
  window = document_window_partials(q5, k, v, docs, WindowRule("chunks", chunk=C, window_chunks=nb),
                                    key_scale=window_temp * scale, block=min(C, 256),
                                    queries=front, softcap=cfg.logit_softcap)
  window_only = lambda: combine_partials(window).reshape(B, T, H, Dv).astype(q.dtype)  # noqa: E731
  sched = kvm_schedule(cfg, T)
  R = sched.final_rows
  num_steps = max_state_steps(T, cfg)
  state = _last_document_start_state(k, v, merge_gate, docs, params, cfg, R)
  if num_steps == 0:
    return window_only(), state

  step = _state_step(q5, k, v, merge_gate, params, docs, cfg, ops, row_update,
                     (state_temp, window_temp), q.dtype, sched)
  zero = empty_rows(B, Hkv, R, D, Dv)
  carry0 = ((zero.keys, zero.values, zero.radius), jnp.zeros((B,), jnp.int32))
  xs = jnp.moveaxis(state_steps(docs, cfg, num_steps), 1, 0)             # [num_steps, B]
  if remat:
    (final_arrays, final_rows), (outs, where) = scan_in_blocks(step, carry0, xs)
  else:
    (final_arrays, final_rows), (outs, where) = jax.lax.scan(step, carry0, xs)

  # Every query past its document's front is in exactly one step: the steps' outputs go over
  # the front's.
  rows = jnp.broadcast_to(jnp.arange(B)[None, :, None], where.shape)
  y = window_only().at[rows, where].set(outs, mode="drop")

  # The final state of each row's last document: what its last step left when it is long enough
  # to have steps, else its first rows (already in ``state``).
  last_is_long = _last_document_length(docs) > nb * C
  final = KVMState(*final_arrays, num_rows=final_rows)
  return y, select_rows(last_is_long, final, state)


def _state_step(q5: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                docs: Documents, cfg: KVMConfig, ops: ChunkOps, row_update: str,
                temps: tuple[Array, Array], out_dtype, sched):
  """The body of the state steps' scan: ``step((state arrays, num_rows [B]), first [B]) ->
  (carry, (out [B, C, H, Dv], where [B, C]))`` for the step whose first query token is
  ``first`` (``T``: no step), ``where`` the row index of each output (``T``: dropped);
  ``sched``: the budget's schedule at ``T`` (:func:`kvm_jax.config.budget.kvm_schedule`)."""
  B, T, Hkv, G, _ = q5.shape
  H, Dv = Hkv * G, v.shape[-1]
  C, nb = cfg.chunk_size, cfg.window_chunks
  state_temp, window_temp = temps
  R = sched.final_rows
  # Every gather below reads at most C rows past a position < T: pad C zeros once.
  pad = lambda x: jnp.pad(x, [(0, 0), (0, C)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  q_p, k_p, v_p, g_p = pad(q5), pad(k), pad(v), pad(merge_gate)
  start_p, length_p = pad(docs.start), pad(docs.length)
  n_append = jnp.asarray(sched.n_append, jnp.int32)
  # What the schedule fixes for every fold a step can make (chunk c in [nb, num_chunks - 1)):
  # whether any appends, and the row count after it when that is one number. The plain scan
  # specializes its runs the same way (no novelty ranking, no row mask).
  fold_chunks = range(nb, max(nb, sched.num_chunks - 1))
  may_append = any(sched.n_append[c] > 0 for c in fold_chunks)
  rows_after = {sched.rows_before[c] + sched.n_append[c] for c in fold_chunks}
  rows_after = rows_after.pop() if len(rows_after) == 1 else None
  causal = window_mask(nb, C, nb)                                        # [C, nb·C], static

  def step(carry, first):
    state_arrays, num_rows = carry
    exists = first < T
    at = jnp.minimum(first, T)
    doc_start = jnp.take_along_axis(start_p, at[:, None], 1)[:, 0]
    doc_len = jnp.take_along_axis(length_p, at[:, None], 1)[:, 0]
    c = jnp.where(exists, (at - doc_start) // C, nb)                      # chunk in the document
    # The document's first step: its state is its own first chunk (docs/kvm-spec.md §6.5).
    fresh = token_rows(rows_of(k_p, doc_start, C), rows_of(v_p, doc_start, C),
                       rows_of(g_p, doc_start, C), params, cfg)
    fresh = tuple(jnp.pad(x, [(0, 0), (0, 0), (0, R - C)] + [(0, 0)] * (x.ndim - 3))
                  for x in fresh)
    reset = exists & (c == nb)
    state_arrays = select_rows(reset, fresh, state_arrays)
    num_rows = jnp.where(reset, C, num_rows)
    state = KVMState(*state_arrays, num_rows=num_rows)
    read_keys, read_values = state_readout(state, params, cfg, G)
    # The window: the nb chunks ending with this one, inside the document since c >= nb; its
    # first chunk is the one that leaves the window after this step.
    leaving = jnp.maximum(at - (nb - 1) * C, 0)
    win_k, win_v = rows_of(k_p, leaving, nb * C), rows_of(v_p, leaving, nb * C)
    valid_rows = jnp.arange(R)[None, :] < num_rows[:, None]             # [B, R]
    y = ops.attend(rows_of(q_p, at, C), read_keys, read_values,
                   valid_rows[:, None, None, None, :], win_k, win_v, causal, state_temp,
                   window_temp, softcap=cfg.logit_softcap)             # [B, C, Hkv, G, Dv] f32
    out = y.reshape(B, C, H, Dv).astype(out_dtype)
    # Fold the document chunk leaving the window, if the document goes on past this chunk.
    folds = exists & ((c + 1) * C < doc_len)
    appended = jnp.where(folds, n_append[jnp.clip(c, 0, len(sched.n_append) - 1)], 0)
    new = ops.update(state, win_k[:, :C], win_v[:, :C], rows_of(g_p, leaving, C), appended,
                     params, cfg, row_update, read_keys, may_append=may_append,
                     rows_after=rows_after)
    state_arrays = select_rows(folds, (new.keys, new.values, new.radius), state_arrays)
    num_rows = jnp.where(folds, new.num_rows, num_rows)
    # Queries of this step: the chunk's tokens that belong to the document.
    in_doc = exists[:, None] & (at[:, None] + jnp.arange(C)[None] < doc_start[:, None]
                                + doc_len[:, None])
    where = jnp.where(in_doc, at[:, None] + jnp.arange(C)[None], T)     # T: dropped
    return (state_arrays, num_rows), (out, where)

  return step


def empty_rows(batch: int, kv_heads: int, rows: int, head_dim: int, value_dim: int) -> KVMState:
  """Zero state arrays with a zero row count per batch row."""
  return KVMState(keys=jnp.zeros((batch, kv_heads, rows, head_dim), jnp.float32),
                  values=jnp.zeros((batch, kv_heads, rows, value_dim), jnp.float32),
                  radius=jnp.zeros((batch, kv_heads, rows), jnp.float32),
                  num_rows=jnp.zeros((batch,), jnp.int32))


def _last_document_length(docs: Documents) -> Array:
  """``[B]`` length of each row's last document (0 for a row of padding only)."""
  T = docs.valid.shape[1]
  last = T - 1 - jnp.argmax(docs.valid[:, ::-1], axis=1)
  length = jnp.take_along_axis(docs.length, last[:, None], 1)[:, 0]
  return jnp.where(jnp.any(docs.valid, axis=1), length, 0)


def _last_document_start_state(k, v, g, docs: Documents, params, cfg: KVMConfig,
                               capacity: int) -> KVMState:
  """The state a row's last document has before any fold: its first ``min(n, chunk_size)``
  tokens as rows (zero rows past them), ``num_rows [B]``."""
  B, T = docs.valid.shape
  C = cfg.chunk_size
  n = _last_document_length(docs)
  last = T - 1 - jnp.argmax(docs.valid[:, ::-1], axis=1)
  first = jnp.take_along_axis(docs.start, last[:, None], 1)[:, 0]
  width = min(C, T, capacity)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, width)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  keys, values, radius = token_rows(rows_of(pad(k), first, width), rows_of(pad(v), first, width),
                                    rows_of(pad(g), first, width), params, cfg)
  rows = jnp.minimum(n, width)
  keep = jnp.arange(width)[None, None, :] < rows[:, None, None]
  keys, values = (jnp.where(keep[..., None], x, 0.0) for x in (keys, values))
  radius = jnp.where(keep, radius, 0.0)
  grow = lambda x: jnp.pad(  # noqa: E731
      x, [(0, 0), (0, 0), (0, capacity - width)] + [(0, 0)] * (x.ndim - 3))
  return KVMState(grow(keys), grow(values), grow(radius), num_rows=rows.astype(jnp.int32))
