"""KVM over packed documents as the plain chunk scan on a chunk-aligned layout.

A KVM layer's output depends on where each chunk starts (docs/kvm-spec.md §12): a document run
alone starts its own chunk grid at its first token. The rows' tokens are therefore read through
a **layout**: the same tokens in the same order, with fewer than ``chunk_size`` empty slots
inserted in front of every document longer than ``(window_chunks - 1)·C + 1`` tokens, so that it
starts at a chunk of the layout (:func:`aligned_layout`). Every document with a state (longer
than the window) is among them, so its chunks are layout chunks; a shorter document lies inside
one span of ``window_chunks`` layout chunks wherever it starts, so its window needs no grid. On
this layout the plain scan's chunk loop runs as it is (:mod:`kvm_jax.ops.kvm.scan`: blocks of
about sqrt(chunks) chunks, the backward pass replaying stored routing decisions), with one
different per-chunk function (``_document_chunk``): masks from document positions, and a
fold, a reset or nothing per batch row.

Nothing of the layout's size is materialized. Every layout chunk holds one contiguous run of a
row's tokens (the empty slots come after it), so a chunk is one slice of the row at a per-row
offset (:class:`DocumentLayout`), gathered when its block runs. The blocks past the last one
holding a token in any row are not run: the layout's capacity covers the worst case of
alignment padding (about twice the row for two window chunks), and a row uses only what its
documents need. A chunk of padding only is empty too, and a padding token's output is set to
its own value (what attending to itself alone gives).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.config.budget import kvm_schedule
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import current_platform
from kvm_jax.ops.documents import Documents
from kvm_jax.ops.kvm.scan import (XLA_OPS, ChunkOps, Run, ScanPlan, complete_block_rows,
                                  no_state_readout, plan_pins, scan_chunks, slice_time,
                                  window_slice)
from kvm_jax.ops.kvm.state import (KVMParams, KVMState, RoutedUpdate, state_readout, temperatures,
                                   token_rows)

Array = jax.Array


class DocumentLayout(NamedTuple):
  """Where the chunks of a chunk-aligned layout of packed rows come from.

  Chunk tables are ``[B, window_chunks - 1 + nC]`` int32: ``window_chunks - 1`` empty chunks in
  front (the window of the first chunks reaches there), then the layout's ``nC`` chunks. Token
  tables are ``[B, T]`` int32.

  Attributes:
    offset: the row's first token in each chunk (``T`` for an empty chunk: one with no slot
      filled, or with padding tokens only).
    count: the chunk's tokens (the rest of its slots are empty; 0 for an empty chunk).
    document: per token, its document's number in the row plus one.
    position: per token, its position in its document.
    length: per token, its document's length.
  """

  offset: Array
  count: Array
  document: Array
  position: Array
  length: Array


def aligned_threshold(cfg: KVMConfig) -> int:
  """Documents longer than this start at a chunk of the layout; a shorter one lies inside one
  span of ``window_chunks`` layout chunks wherever it starts (offset < C, length
  <= (nb-1)·C + 1)."""
  return (cfg.window_chunks - 1) * cfg.chunk_size + 1


def layout_chunks(seq_len: int, cfg: KVMConfig) -> int:
  """Chunks of the layout for rows of ``seq_len`` tokens: every token, plus fewer than
  ``chunk_size`` empty slots in front of each aligned document (at most
  ``seq_len // (threshold + 1)`` of them)."""
  C = cfg.chunk_size
  aligned = seq_len // (aligned_threshold(cfg) + 1)
  return -(-(seq_len + (C - 1) * aligned) // C)


def aligned_layout(docs: Documents, cfg: KVMConfig) -> DocumentLayout:
  """The :class:`DocumentLayout` of packed rows (``docs`` of ``[B, T]``; padding tokens are
  documents of one token, kept in place).

  A token's slot is its index plus the empty slots inserted before it. Where an aligned
  document lands depends only on where the previous aligned one started, so no sequential pass
  is needed: the padding in front of an aligned document starting at token ``t`` is
  ``(t_prev - t) mod C``, ``t_prev`` the previous aligned document's first token (0 for the
  first), and the slots are ``t`` plus the running sum of these."""
  B, T = docs.valid.shape
  C, nb = cfg.chunk_size, cfg.window_chunks
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  aligned = (docs.position == 0) & (docs.length > aligned_threshold(cfg))
  latest = jax.lax.cummax(jnp.where(aligned, t, 0), axis=1)
  previous = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), latest[:, :-1]], axis=1)
  slot = t + jnp.cumsum(jnp.where(aligned, (previous - t) % C, 0), axis=1)   # increasing
  starts = jnp.arange(layout_chunks(T, cfg) + 1, dtype=jnp.int32) * C
  bounds = jax.vmap(lambda s: jnp.searchsorted(s, starts, side="left"))(slot)
  bounds = bounds.astype(jnp.int32)                          # [B, nC + 1]: first token >= chunk
  # A chunk of padding only is left empty (its tokens' outputs are their own values, set by
  # kvm_attention_scan_documents): the padding after a row's last document costs no chunk.
  real_before = jnp.pad(jnp.cumsum(docs.valid, axis=1, dtype=jnp.int32), [(0, 0), (1, 0)])
  real = jnp.take_along_axis(real_before, bounds, axis=1)
  holds_document = real[:, 1:] > real[:, :-1]
  front = lambda x, fill: jnp.pad(x, [(0, 0), (nb - 1, 0)], constant_values=fill)  # noqa: E731
  tokens = lambda x: x.astype(jnp.int32)  # noqa: E731
  return DocumentLayout(offset=front(jnp.where(holds_document, bounds[:, :-1], T), T),
                        count=front(jnp.where(holds_document, bounds[:, 1:] - bounds[:, :-1], 0),
                                    0),
                        document=tokens(docs.index + 1), position=tokens(docs.position),
                        length=tokens(docs.length))


def _chunk_rows(x: Array, offsets: Array, C: int) -> Array:
  """``[B, n·C, ...]``: chunk ``i`` of row ``b`` is ``x[b, offsets[b, i] : + C]``, rows past the
  end of ``x`` reading its last row. Gathered row by row: a slice of ``C`` rows would be moved
  back inside ``x`` at its end, and padding ``x`` would copy it."""
  index = jnp.minimum(offsets[:, :, None] + jnp.arange(C, dtype=offsets.dtype),
                      x.shape[1] - 1).reshape(x.shape[0], -1)
  return jax.vmap(lambda row, i: jnp.take(row, i, axis=0, mode="clip"))(x, index)


def _slots_filled(counts: Array, C: int) -> Array:
  """``[B, n·C]`` bool: which slots of ``n`` chunks holding ``counts [B, n]`` tokens are filled."""
  return (jnp.arange(C)[None, None, :] < counts[:, :, None]).reshape(counts.shape[0], -1)


def _add_chunks(buffer: Array, rows: Array, offsets: Array, counts: Array, C: int) -> Array:
  """``buffer [B, T + C, ...]`` plus the filled slots of ``rows [B, n·C, ...]`` (chunk ``i`` at
  ``offsets[:, i]``), chunk by chunk (a chunk's empty tail overlaps the next chunk's tokens)."""
  filled = _slots_filled(counts, C).reshape(rows.shape[:2] + (1,) * (rows.ndim - 2))
  rows = jnp.where(filled, rows, 0).astype(buffer.dtype)

  def add(row, piece, o):
    return jax.lax.dynamic_update_slice_in_dim(
        row, jax.lax.dynamic_slice_in_dim(row, o, C, 0) + piece, o, 0)

  for i in range(offsets.shape[1]):
    buffer = jax.vmap(add)(buffer, rows[:, i * C:(i + 1) * C], offsets[:, i])
  return buffer


def _block_sources(plan: ScanPlan, first, count: int, sources, layout: DocumentLayout):
  """Chunks ``first .. first + count - 1`` of the layout gathered from the rows, placed as the
  scan's backward blocks are: queries ``[B, count·C, Hkv, G, D]`` from chunk ``first``, keys,
  values and gates ``[B, (count + nb - 1)·C, ...]`` and the slots' ``(document, position,
  length)`` from ``overlap`` slots before it (an empty slot: document 0). An empty slot holds a
  copy of some token: no query of a document sees it and no fold reads it."""
  C, nb = plan.cfg.chunk_size, plan.cfg.window_chunks
  q, k, v, g = sources
  table = lambda x: jax.lax.dynamic_slice_in_dim(x, first, count + nb - 1, 1)  # noqa: E731
  offsets, counts = table(layout.offset), table(layout.count)
  filled = _slots_filled(counts, C)
  numbers = tuple(jnp.where(filled, _chunk_rows(x, offsets, C), 0)
                  for x in (layout.document, layout.position, layout.length))
  blocks = (_chunk_rows(q, offsets[:, nb - 1:], C),) + tuple(
      _chunk_rows(x, offsets, C) for x in (k, v, g))
  return blocks, numbers


def _blocks_needed(plan: ScanPlan, layout: DocumentLayout, blocks: int) -> Array:
  """How many of the layout's ``blocks`` blocks (from chunk 0) the scan runs: through the block
  of the last chunk that holds a token in any row. The blocks after it hold no token (a block of
  empty chunks before it runs, and changes nothing)."""
  counts = layout.count[:, plan.cfg.window_chunks - 1:]
  last = jnp.max(jnp.where(jnp.any(counts > 0, axis=0), jnp.arange(counts.shape[1]), -1))
  return jnp.minimum(blocks, last // plan.block + 1).astype(jnp.int32)


def _whole_blocks(layout: DocumentLayout, chunks: int, seq_len: int, cfg: KVMConfig
                  ) -> DocumentLayout:
  """``layout`` with empty chunks after its last up to ``chunks`` layout chunks."""
  extra = chunks - (layout.offset.shape[1] - (cfg.window_chunks - 1))
  pad = lambda x, fill: jnp.pad(x, [(0, 0), (0, extra)], constant_values=fill)  # noqa: E731
  return layout._replace(offset=pad(layout.offset, seq_len), count=pad(layout.count, 0))


def _attend_chunk(plan: ScanPlan, params: KVMParams, num_rows: Array, q_c, win_k, win_v,
                  q_pos: Array, readout) -> Array:
  """One layout chunk's readout, ``[B, C, Hkv, G, Dv]`` float32: queries ``q_c`` at document
  positions ``q_pos [B, C]`` against their window ``win_k`` / ``win_v`` (``nb·C`` slots) and,
  where ``readout`` (the state's readout keys and values, ``num_rows [B]`` of them valid) is
  given, the state's rows from document position ``window_chunks·C`` on; with ``readout=None``
  no query reads the state."""
  cfg = plan.cfg
  C, nb, R = cfg.chunk_size, cfg.window_chunks, plan.capacity
  B, _, Hkv, G = plan.dims(q_c)
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  W = win_k.shape[1]
  q_slot = W - C + jnp.arange(C)                                               # [C]
  first_visible = q_slot[None] - q_pos + jnp.maximum(0, (q_pos // C - nb + 1) * C)   # [B, C]
  slot = jnp.arange(W)
  window_valid = ((slot[None, None, :] >= first_visible[:, :, None])
                  & (slot[None, :] <= q_slot[:, None])[None])                 # [B, C, W]
  if readout is not None:
    state_rows = jnp.where(q_pos >= C * nb, num_rows[:, None], 0)             # [B, C]
    keys, values = readout
    valid = (jnp.arange(R)[None, None, :] < state_rows[:, :, None])[:, None, None]
  else:
    # No query of this chunk reads the state, whose R columns would cost as much as the window's.
    keys, values = no_state_readout(params, cfg, B, Hkv, G, win_k.shape[-1], win_v.shape[-1])
    valid = np.zeros((1, 1), bool)
  return plan.ops.attend(q_c, keys, values, valid, win_k, win_v, window_valid[:, None, None],
                         state_temp, window_temp, softcap=plan.cfg.logit_softcap)


def _reads_state(plan: ScanPlan, q_pos: Array) -> Array:
  """Whether any query of the chunk, in any row, reads the state (document position >= L)."""
  return jnp.any(q_pos >= plan.cfg.chunk_size * plan.cfg.window_chunks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _state_skipping_readout(plan: ScanPlan, params, num_rows, q_c, win_k, win_v, q_pos, readout):
  """:func:`_attend_chunk`, with the state's columns left out where no query of the chunk reads
  them (a ``lax.cond``). Its backward pass is a conditional between the two branches' own VJPs:
  differentiating the conditional itself made the forward keep both branches' residuals and the
  backward transpose the conditional, which cost more than the skip saved (docs/kvm-spec.md
  §12)."""
  return jax.lax.cond(
      _reads_state(plan, q_pos),
      lambda: _attend_chunk(plan, params, num_rows, q_c, win_k, win_v, q_pos, readout),
      lambda: _attend_chunk(plan, params, num_rows, q_c, win_k, win_v, q_pos, None))


def _state_skipping_readout_fwd(plan, params, num_rows, q_c, win_k, win_v, q_pos, readout):
  y = _state_skipping_readout(plan, params, num_rows, q_c, win_k, win_v, q_pos, readout)
  return y, (params, num_rows, q_c, win_k, win_v, q_pos, readout)


def _state_skipping_readout_bwd(plan, residuals, dy):
  params, num_rows, q_c, win_k, win_v, q_pos, readout = residuals

  def with_state():
    attend = lambda p, q, k, v, r: _attend_chunk(plan, p, num_rows, q, k, v, q_pos, r)  # noqa: E731
    return jax.vjp(attend, params, q_c, win_k, win_v, readout)[1](dy)

  def without_state():
    attend = lambda p, q, k, v: _attend_chunk(plan, p, num_rows, q, k, v, q_pos, None)  # noqa: E731
    return (jax.vjp(attend, params, q_c, win_k, win_v)[1](dy)
            + (jax.tree_util.tree_map(jnp.zeros_like, readout),))

  d_params, d_q, d_k, d_v, d_readout = jax.lax.cond(_reads_state(plan, q_pos), with_state,
                                                    without_state)
  return d_params, None, d_q, d_k, d_v, None, d_readout


_state_skipping_readout.defvjp(_state_skipping_readout_fwd, _state_skipping_readout_bwd)


def _chunk_readout(plan: ScanPlan, params: KVMParams, state: KVMState, c, base, win_start,
                   q_src, k_src, v_src, q_pos: Array):
  """``(y, (leaving_k, leaving_v), readout)`` of layout chunk ``c``: its readout
  (:func:`_state_skipping_readout` where :func:`_skips_unseen_state`, else
  :func:`_attend_chunk`), the chunk
  leaving its window (the window's first ``C`` slots) and the state's readout keys and values
  (what the fold routes against). One window slice serves the readout and the fold: under
  autodiff a second slice of the block would transpose into a second block-sized zero buffer."""
  C, nb = plan.cfg.chunk_size, plan.cfg.window_chunks
  readout = state_readout(state, params, plan.cfg, plan.dims(q_src)[3])
  q_c = slice_time(q_src, (c - base) * C, C, 1)
  win_k, win_v = (window_slice(x, win_start, nb * C, 1)[0] for x in (k_src, v_src))
  attend = _state_skipping_readout if _skips_unseen_state() else _attend_chunk
  y = attend(plan, params, state.num_rows, q_c, win_k, win_v, q_pos, readout)
  return y, (win_k[:, :C], win_v[:, :C]), readout


def _document_chunk(plan: ScanPlan, run: Run, params: KVMParams, state: KVMState, c,
                    base: int | Array, k_lead: int, q_src, k_src, v_src, g_src, routing_c,
                    numbers):
  """Layout chunk ``c`` (the contract of :func:`kvm_jax.ops.kvm.scan._chunk`, time-major
  sources) with per-row document structure: ``numbers`` = the slots' ``(document, position,
  length)``, ``[B, ·]`` each, placed like ``k_src``. Where no query of the chunk in any row
  reads the state (every document's first ``window_chunks`` chunks), the readout may attend to
  the window alone (:func:`_chunk_readout`).

  A query sees the keys of its own document that the block-window rule on document positions
  allows (documents are contiguous, so that is one run of window slots: from its document's
  start or its block window's first chunk, to itself), and the state from document position
  ``window_chunks·C`` on. The chunk leaving the window decides each row's fold: the first chunk
  of a document longer than the window resets the state to its tokens (docs/kvm-spec.md §6.5);
  a later one is folded in, with the schedule's appends for that chunk of the document, if the
  document goes on past this chunk; otherwise the state stays."""
  cfg, ops = plan.cfg, plan.ops
  C, nb, R = cfg.chunk_size, cfg.window_chunks, plan.capacity
  L = C * nb
  B, _, Hkv, G = plan.dims(q_src)
  win_start = (c - base) * C + k_lead - plan.overlap
  document, pos, length = (window_slice(x, win_start, nb * C, 1)[0] for x in numbers)   # [B, W]
  q_pos = pos[:, -C:]
  y, (leaving_k, leaving_v), readout = _chunk_readout(
      plan, params, state, c, base, win_start, q_src, k_src, v_src, q_pos)
  y = y.reshape(B, C, Hkv * G, y.shape[-1]).astype(plan.out_dtype)
  none = jnp.full((B, Hkv, C), R, jnp.int32)
  if not run.update:
    return state, y, (none, none)
  # The chunk leaving the window: the first chunk of a long document, or a later one.
  leaving_pos, leaving_len = pos[:, 0], length[:, 0]
  long = (document[:, 0] > 0) & (leaving_pos % C == 0) & (leaving_len > L)
  reset = long & (leaving_pos == 0)
  folds = long & (leaving_pos >= C) & (leaving_pos + L < leaving_len)
  chunk = jnp.clip(leaving_pos // C + nb - 1, 0, len(plan.n_append) - 1)   # in the document
  n_append = jnp.where(folds, jnp.asarray(plan.n_append, jnp.int32)[chunk], 0)
  leaving_g = slice_time(g_src, win_start, C, 1)
  state_keys = readout[0]

  def fold():  # one pytree type in both branches, whatever tuple an update kernel returns
    new, routing = ops.update(state, leaving_k, leaving_v, leaving_g, n_append, params, cfg,
                              plan.row_update, state_keys, routing=routing_c,
                              return_routing=True, may_append=run.may_append,
                              rows_after=plan.rows_after)
    return RoutedUpdate(new, routing)

  # Most chunks of short documents fold nothing in any row: skipping the routing there took a
  # log-normal mix (median 600 tokens, T = 16384, CPU) from 1.39x / 1.48x the plain scan's time
  # to 1.13x / 1.28x (forward / forward + backward).
  new, decisions = jax.lax.cond(jnp.any(folds), fold, lambda: RoutedUpdate(state, (none, none)))
  fresh = token_rows(leaving_k, leaving_v, leaving_g, params, cfg)
  fresh = tuple(jnp.pad(x, [(0, 0), (0, 0), (0, R - C)] + [(0, 0)] * (x.ndim - 3))
                for x in fresh)

  def pick(where, a, b):
    return jnp.where(where.reshape(where.shape + (1,) * (a.ndim - 1)), a, b)

  arrays = tuple(pick(folds, n, pick(reset, f, o))
                 for n, f, o in zip((new.keys, new.values, new.radius), fresh,
                                    (state.keys, state.values, state.radius)))
  rows = jnp.where(folds, new.num_rows, jnp.where(reset, C, state.num_rows))
  return KVMState(*arrays, num_rows=rows), y, decisions


def document_block(num_chunks: int) -> int:
  """Chunks per block of the document scan for rows of ``num_chunks`` chunks (those a row's
  tokens fill, not the layout's capacity: a block is also the unit in which the empty end of the
  layout is skipped): about their square root (the backward pass keeps a state per block and
  replays one block at a time), and a divisor of ``num_chunks`` where one lies within a factor of
  1.5 of it, the nearest in ratio (the larger on a tie). The scan runs whole blocks, and a chunk
  past the rows' last token still runs its readout (only its fold is skipped), so a row filled by
  one document (or by documents that need no alignment) should fill whole blocks: with ``isqrt``
  alone, rows of 32 chunks (8192 tokens, C = 256) ran 36 in blocks of 6; in blocks of 8 the op
  took 0.85-0.97x that time (CPU, forward and backward)."""
  root = max(1, math.isqrt(num_chunks - 1) + 1)
  divisors = [d for d in range(1, num_chunks + 1)
              if num_chunks % d == 0 and abs(math.log(d * d / num_chunks)) <= 2 * math.log(1.5)]
  if not divisors:
    return root
  return min(divisors, key=lambda d: (abs(math.log(d * d / num_chunks)), -d))


def _state(arrays) -> KVMState:
  keys, values, radius, num_rows = arrays
  return KVMState(keys=keys, values=values, radius=radius, num_rows=num_rows)


def _arrays(state: KVMState) -> tuple:
  return (state.keys, state.values, state.radius, state.num_rows)


def _skips_unseen_state() -> bool:
  """Whether the readout skips the state where no query of a chunk reads it
  (:func:`_state_skipping_readout`): on CPU, where it took a log-normal mix (median 600 tokens)
  from 1.16-1.23x to 1.0-1.1x the plain op's time forward, and from 1.37x / 1.19x to 1.18x /
  1.07x forward + backward (T = 4096 / 16384); one document per row, whose first two chunks
  alone skip, pays for the conditionals (forward + backward 1.07x -> 1.13x at T = 16384, the
  same at 4096). Not on accelerators: an XLA:GPU conditional reads its predicate back to the
  host, and the fold already has one per chunk."""
  return current_platform() == "cpu"


@plan_pins
def _forward(plan: ScanPlan, params, state0, sources, layout: DocumentLayout):
  """The layout's chunks in blocks of ``plan.block`` (the layout is whole blocks), in a loop of
  as many blocks as the rows hold tokens for (a row uses a fraction of the layout's capacity),
  every block gathering its own chunks: ``((y [B, T + C, H, Dv] (rows past T: scrap), final
  state arrays with row counts, decisions), (block start states, blocks run))``. The states at
  the starts of blocks not run and their decisions stay at their initial values, which the
  backward pass, running the same blocks, never reads."""
  C, S, nb = plan.cfg.chunk_size, plan.block, plan.cfg.window_chunks
  (run,) = plan.runs
  blocks = run.length // S
  q = sources[0]
  B, _, Hkv, G = plan.dims(q)
  # C rows past the row: a chunk's empty tail is written there at the end of the row
  out = jnp.zeros((B, q.shape[1] + C, Hkv * G, sources[2].shape[-1]), plan.out_dtype)

  def block(j, carry):
    state, out, starts, d = carry
    starts = tuple(jax.lax.dynamic_update_index_in_dim(buf, x, j, 0)
                   for buf, x in zip(starts, _arrays(state)))
    first = j * S
    chunk_sources, numbers = _block_sources(plan, first, S, sources, layout)
    state, ys, d_j = scan_chunks(plan, run, params, state, first, S, first, plan.overlap,
                                 *chunk_sources, extra=numbers)
    y = jnp.moveaxis(ys, 0, 1).reshape(B, S * C, *ys.shape[3:])
    chunks = lambda x: jax.lax.dynamic_slice_in_dim(x, first + nb - 1, S, 1)  # noqa: E731
    out = _add_chunks(out, y, chunks(layout.offset), chunks(layout.count), C)
    d = tuple(jax.lax.dynamic_update_slice_in_dim(buf, x, first, 0) for buf, x in zip(d, d_j))
    return state, out, starts, d

  state = _state(state0 + (jnp.zeros((B,), jnp.int32),))      # no document has rows yet
  starts = tuple(jnp.zeros((blocks,) + x.shape, x.dtype) for x in _arrays(state))
  none = jnp.full((blocks * S, B, Hkv, C), plan.capacity, jnp.int32)
  needed = _blocks_needed(plan, layout, blocks)
  state, out, starts, decisions = jax.lax.fori_loop(0, needed, block,
                                                    (state, out, starts, (none, none)))
  return (out, _arrays(state), decisions), (starts, needed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _scan(plan: ScanPlan, params, state0, sources, layout: DocumentLayout):
  return _forward(plan, params, state0, sources, layout)[0][:2]


def _scan_fwd(plan, params, state0, sources, layout):
  (out, final, decisions), block_states = _forward(plan, params, state0, sources, layout)
  return (out, final), (params, sources, layout, block_states, decisions)


@plan_pins
def _scan_bwd(plan, residuals, cotangents):
  """Blocks in reverse, as the plain scan's backward pass (decisions replayed), each gathering
  its chunks and adding its tokens' gradients at their offsets; the blocks the forward pass did
  not run are not run here either."""
  params, sources, layout, block_states, decisions = residuals
  dy, d_final = cotangents
  cfg = plan.cfg
  C, S, nb, overlap = cfg.chunk_size, plan.block, cfg.window_chunks, plan.overlap
  f32 = jnp.float32
  q, k, v, g = sources
  heads0 = tuple(jnp.zeros((x.shape[0], overlap, *x.shape[2:]), f32) for x in (k, v, g))
  # Every token's gradient is complete when its block emits it and is added once to zeros, so
  # the buffers keep the inputs' dtype (C rows past the row take chunks' empty tails).
  grads0 = tuple(jnp.zeros((x.shape[0], x.shape[1] + C, *x.shape[2:]), x.dtype) for x in sources)
  carry = (tuple(x.astype(f32) for x in d_final[:3]), heads0,
           jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, f32), params), grads0)

  (run,) = plan.runs

  def block_grad(carry, first, state_in, given):
    d_state, heads, dparams, grads = carry
    chunks = lambda x: jax.lax.dynamic_slice_in_dim(x, first + nb - 1, S, 1)  # noqa: E731
    offsets, counts = chunks(layout.offset), chunks(layout.count)
    blocks, numbers = _block_sources(plan, first, S, sources, layout)
    # An empty slot's query sees only its own key, so the cotangent it reads here (another
    # token's) reaches only its own value row, which _add_chunks drops.
    dy_blk = _chunk_rows(dy, offsets, C)                                  # [B, S·C, H, Dv]
    B, _, H, Dv = dy_blk.shape
    num_rows = state_in[3]

    def f(state_arrays, params, *blocks):
      state, y, _ = scan_chunks(plan, run, params, _state(state_arrays + (num_rows,)), first, S,
                                first, overlap, *blocks, given, remat_chunks=True,
                                extra=numbers)
      return y, (state.keys, state.values, state.radius)

    _, vjp = jax.vjp(f, state_in[:3], params, *blocks)
    d_in, dp, dq_b, dk_b, dv_b, dg_b = vjp(
        (jnp.moveaxis(dy_blk.reshape(B, S, C, H, Dv), 1, 0), d_state))
    # A key row belongs to nb windows: the block's first overlap rows are carried into the
    # block before it, and its own rows are complete (plain scan's backward pass).
    own, new_heads = [dq_b], []
    for grad, head in zip((dk_b, dv_b, dg_b), heads):
      piece, head = complete_block_rows(grad, head, S * C, overlap, 1)
      own.append(piece)
      new_heads.append(head)
    dparams = jax.tree_util.tree_map(lambda a, b: a + b.astype(f32), dparams, dp)
    grads = tuple(_add_chunks(acc, x.astype(acc.dtype), offsets, counts, C)
                  for acc, x in zip(grads, own))
    return tuple(x.astype(f32) for x in d_in), tuple(new_heads), dparams, grads

  starts, needed = block_states

  def step(i, carry):
    j = needed - 1 - i                          # the blocks the forward pass ran, in reverse
    first = j * S
    given = tuple(jax.lax.dynamic_slice_in_dim(d, first, S, 0) for d in decisions)
    state_in = tuple(jax.lax.dynamic_index_in_dim(x, j, 0, keepdims=False) for x in starts)
    return block_grad(carry, first, state_in, given)

  carry = jax.lax.fori_loop(0, needed, step, carry)
  d_state, _, dparams, grads = carry
  grads = tuple(gr[:, :x.shape[1]] for gr, x in zip(grads, sources))
  dparams = jax.tree_util.tree_map(lambda gr, p: gr.astype(p.dtype), dparams, params)
  return dparams, d_state, grads, None


_scan.defvjp(_scan_fwd, _scan_bwd)


def kvm_attention_scan_documents(q: Array, k: Array, v: Array, merge_gate: Array,
                                 params: KVMParams, docs: Documents, cfg: KVMConfig,
                                 ops: ChunkOps = XLA_OPS, row_update: str = "auto"):
  """KVM over the documents of packed rows through the chunk-aligned layout.

  ``q [B, T, H, D]``, ``k`` / ``v`` / ``merge_gate`` as in :func:`kvm_jax.kvm_attention`;
  ``docs``: :func:`kvm_jax.ops.documents.documents` of the rows. ``ops`` must be plain XLA
  functions (the masks are per batch row). The backward pass keeps the state every ~sqrt(chunks)
  chunks, whatever ``remat`` says elsewhere. Returns ``(y [B, T, H, Dv], state)``: the state the
  last document longer than the window left in each row, ``num_rows [B]`` (0 in a row without
  one)."""
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[-1]
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched = kvm_schedule(cfg, T)          # a document is at most a row: its chunks' appends
  R = sched.final_rows
  block = document_block(sched.num_chunks)
  # The layout's chunks rounded up to whole blocks (the added ones empty): one loop of blocks
  # covers them all, with no leftover piece compiled beside it (a second copy of the chunk's
  # program forward and backward: twice the compile time). The loop stops after the last block
  # holding a token, so the added chunks cost nothing unless a row fills the whole layout.
  nC = -(-layout_chunks(T, cfg) // block) * block
  fold_chunks = range(nb, max(nb, sched.num_chunks - 1))
  rows_after = {sched.rows_before[c] + sched.n_append[c] for c in fold_chunks}
  # One run from the first chunk: the first nb - 1 chunks' leaving chunks are the empty ones in
  # front (no row folds there), and blocks then start at chunk 0, so a row of whole blocks of
  # chunks fills its blocks (a separate front run would shift every block by nb - 1 chunks).
  runs = (Run(0, nC, True, True, any(sched.n_append[c] > 0 for c in fold_chunks)),)
  plan = ScanPlan(cfg=cfg, ops=ops, row_update=row_update, runs=runs,
               n_append=tuple(sched.n_append), rows_before=tuple(sched.rows_before),
               num_chunks=nC, initial_rows=0, capacity=R, block=block,
               out_dtype=jnp.dtype(q.dtype), time_major=True, chunk_fn=_document_chunk,
               rows_after=rows_after.pop() if len(rows_after) == 1 else None)
  layout = _whole_blocks(aligned_layout(docs, cfg), nC, T, cfg)
  sources = (q.reshape(B, T, Hkv, H // Hkv, D), k, v, merge_gate)
  f32 = jnp.float32
  state0 = (jnp.zeros((B, Hkv, R, D), f32), jnp.zeros((B, Hkv, R, Dv), f32),
            jnp.zeros((B, Hkv, R), f32))
  y, (keys, values, radius, num_rows) = _scan(plan, params, state0, sources, layout)
  # A padding token attends to itself alone: its output is its value, for each query head of
  # its group (the layout computes no chunk of padding only, and this also stops the gradient
  # of a padding output at the scan).
  own = jnp.repeat(v, H // Hkv, axis=2).astype(y.dtype)
  y = jnp.where(docs.valid[:, :, None, None], y[:, :T], own)
  return y, KVMState(keys=keys, values=values, radius=radius, num_rows=num_rows)
