"""The KVM layer as one ``jax.lax.scan`` over chunks: the fast path on every backend, and the
reference the fused kernels are tested against.

Per query chunk ``c`` the scan body (1) attends the chunk's queries jointly to the valid state rows
and to the exact window (the previous ``window_chunks - 1`` chunks plus the causal current chunk),
then (2) if the static schedule says so, folds the oldest window chunk into the state. The state
lives in a buffer of static capacity (the budget at this sequence length) with a traced row count,
so the whole computation is one compiled loop with ``O(T · (R + L))`` work.

The two per-chunk operations are pluggable (:class:`ChunkOps`): the XLA functions of
``state.py`` / ``kvm_jax.ops.common`` (:data:`XLA_OPS`), or the fused Pallas kernels, which the
implementation registry (``api.py``) plugs in. This module never imports the kernels.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.config.budget import kvm_schedule
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import (current_platform, joint_attention, joint_attention_heads,
                                to_chunks, window_mask, window_stack)
from kvm_jax.ops.kvm.state import (KVMOutput, KVMParams, KVMState, RoutedKVMOutput,
                                   initial_state, state_readout, temperatures, update_state)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ChunkOps:
  """The two operations a KVM scan (or decode step) runs per chunk.

  Attributes:
    name: what runs, e.g. "xla" or "pallas[gpu]" (shown in errors and benchmarks).
    attend_fn: the contract of :func:`kvm_jax.ops.common.joint_attention` (what the scan calls
      with time-major sources, ``source_layout="time"``).
    update_fn: the contract of :func:`kvm_jax.ops.kvm.state.update_state`.
    attend_heads_fn: ``attend_fn`` in head-major layout, the contract of
      :func:`kvm_jax.ops.common.joint_attention_heads` (what the scan calls with head-major
      sources, ``source_layout="heads"``); None: transposes around ``attend_fn``.
    decode_attend_fn: one token against state and ring, the contract of
      :func:`kvm_jax.ops.kvm.decode.decode_attention`; None: that function over ``attend_fn``.
    kernel: static configuration passed to all three as ``kc=`` (a kernel's target, interpret
      mode and mesh axes), or None for plain XLA functions.
    heads_split: whether a mesh axis may split the heads of the arrays a scan reads (the caller
      named a head axis): the scan's TPU layout pins then keep heads whole
      (:func:`in_row_major`). Decided with the backend
      (:func:`kvm_jax.ops.kvm.api.resolve_kvm_backend`).

  :meth:`attend` and :meth:`attend_heads` take ``softcap=`` (the config's
  ``logit_softcap``), passed on when set: only the XLA functions take it (the backend resolver
  refuses kernels and the tokamax readout for a config with a cap).

  Frozen and compared by value, so it is a static argument of ``jit``: equal ops share compiled
  programs.
  """

  name: str
  attend_fn: Callable
  update_fn: Callable
  kernel: Optional[Any] = None
  decode_attend_fn: Optional[Callable] = None
  attend_heads_fn: Optional[Callable] = None
  heads_split: bool = False

  def attend(self, *args, softcap=None, **kwargs):
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    if softcap is not None:
      kwargs["softcap"] = softcap
    return self.attend_fn(*args, **kwargs)

  def update(self, *args, **kwargs):
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    return self.update_fn(*args, **kwargs)

  def attend_heads(self, *args, softcap=None, **kwargs):
    """:meth:`attend` in the scan's head-major layout (``attend_heads_fn``'s contract:
    :func:`kvm_jax.ops.common.joint_attention_heads`); without one, transposes around
    :meth:`attend`."""
    if self.attend_heads_fn is None:
      q, sk, sv, sval, wk, wv, *rest = args
      y = self.attend(jnp.transpose(q, (0, 3, 1, 2, 4)), sk, sv, sval,
                      jnp.transpose(wk, (0, 2, 1, 3)), jnp.transpose(wv, (0, 2, 1, 3)), *rest,
                      softcap=softcap, **kwargs)
      return jnp.transpose(y, (0, 2, 3, 1, 4))
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    if softcap is not None:
      kwargs["softcap"] = softcap
    return self.attend_heads_fn(*args, **kwargs)

  def decode_attend(self, *args, **kwargs):
    """``decode_attend_fn`` (callers check that it is set; decode.py falls back to its own
    ``decode_attention`` over :meth:`attend`)."""
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    return self.decode_attend_fn(*args, **kwargs)


#: The XLA per-chunk operations (the functions of ``state.py`` and ``kvm_jax.ops.common``).
XLA_OPS = ChunkOps("xla", joint_attention, update_state, attend_heads_fn=joint_attention_heads)


def scan_inputs(q: Array, k: Array, v: Array, cfg: KVMConfig):
  """Per-chunk scan inputs of the shared-routing replay (``shared_routing.py``):
  ``(schedule, xs, pad_time, mask)``.

  ``xs`` holds, per query chunk, its index, queries ``[B, C, Hkv, G, D]``, the window keys and
  values ``[B, nb·C, Hkv, ·]`` and the schedule's row counts; ``pad_time`` pads a ``[B, T, ...]``
  array to whole chunks; ``mask(chunk)`` is the ``[C, nb·C]`` causal, in-sequence window mask.
  """
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched = kvm_schedule(cfg, T)
  nC = sched.num_chunks

  def pad_time(x):
    return jnp.pad(x, [(0, 0), (0, nC * C - T)] + [(0, 0)] * (x.ndim - 2))

  xs = {
      "chunk": jnp.arange(nC, dtype=jnp.int32),
      "q": to_chunks(pad_time(q), nC, C).reshape(nC, B, C, Hkv, H // Hkv, D),
      "win_k": window_stack(pad_time(k), nC, C, nb),                  # [nC, B, nb*C, Hkv, D]
      "win_v": window_stack(pad_time(v), nC, C, nb),                  # [nC, B, nb*C, Hkv, Dv]
      "visible": jnp.asarray(sched.state_visible),
      "n_append": jnp.asarray(sched.n_append, jnp.int32),
  }
  return sched, xs, pad_time, functools.partial(window_mask, chunk=C, window_chunks=nb)


# ----------------------------------------------------------------------------------------------
# The static schedule as runs of chunks
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
  """Chunks ``[start, stop)`` that one scan body serves: whether their queries see the state,
  whether a chunk is folded in after them, and whether any of those folds appends rows. All three
  are static (the schedule depends only on positions), so no chunk decides them on the device."""

  start: int
  stop: int
  visible: bool
  update: bool
  may_append: bool

  @property
  def length(self) -> int:
    return self.stop - self.start


def schedule_runs(sched, max_runs: int = 8) -> tuple[Run, ...]:
  """The schedule cut into maximal runs of chunks of one kind (typically: the causal front
  without state or folds, the folding middle, the last chunk). A budget whose appends come and go
  every few chunks would make many runs (one compiled body each); past ``max_runs`` appending and
  non-appending folds share a body that selects by ``n_append > 0``."""

  def runs_of(kinds):
    out, first = [], 0
    for c in range(1, len(kinds) + 1):
      if c == len(kinds) or kinds[c] != kinds[first]:
        out.append(Run(first, c, *kinds[first]))
        first = c
    return tuple(out)

  def kind(c, merged):
    update = sched.update_after[c]
    appends = any(sched.n_append) if merged else sched.n_append[c] > 0
    return (sched.state_visible[c], update, update and appends)

  runs = runs_of([kind(c, False) for c in range(sched.num_chunks)])
  if len(runs) > max_runs:
    runs = runs_of([kind(c, True) for c in range(sched.num_chunks)])
  return runs


@dataclasses.dataclass(frozen=True)
class ScanPlan:
  """Everything static about one call (hashable: a ``custom_vjp`` non-differentiable argument)."""

  cfg: KVMConfig
  ops: ChunkOps
  row_update: str
  runs: tuple[Run, ...]
  n_append: tuple[int, ...]
  rows_before: tuple[int, ...]  # valid state rows when each chunk attends (the schedule's)
  num_chunks: int
  initial_rows: int
  capacity: int
  block: int            # chunks between stored states in the backward pass (about sqrt(chunks))
  out_dtype: Any
  time_major: bool      # sources in the caller's time-major layout (see SOURCE_LAYOUTS)
  # Query heads per KV head, for a time-major query source given as the caller's [B, T, H, D]
  # (viewed as [B, C, Hkv, G, D] per chunk, :func:`query_chunk`); None: sources are 5-D.
  groups: Optional[int] = None
  rows_after: Optional[int] = None  # rows after every fold, when one number (documents' scan)
  # Another per-chunk function with ``_chunk``'s contract plus one argument, the chunk's
  # extra sources (packed documents: ``kvm_jax.ops.kvm.document_scan``); None: ``_chunk``.
  chunk_fn: Optional[Callable] = None

  @property
  def heads_split(self) -> bool:
    """Whether a mesh axis may split the sources' heads (``ChunkOps.heads_split``): the TPU
    layout pins then keep heads whole (:func:`in_row_major`)."""
    return self.ops.heads_split

  @property
  def q_time(self) -> int:
    """Time axis of the query source: ``[B, T, H, D]``, ``[B, T, Hkv, G, D]`` or head-major
    ``[B, Hkv, G, T, D]``."""
    return 1 if self.time_major else 3

  def dims(self, q_src: Array) -> tuple[int, int, int, int]:
    """``(B, time steps, Hkv, G)`` of a query source in this plan's layout."""
    if self.time_major and q_src.ndim == 4:
      B, T, H = q_src.shape[:3]
      return B, T, H // self.groups, self.groups
    if self.time_major:
      return q_src.shape[:4]
    B, Hkv, G, T = q_src.shape[:4]
    return B, T, Hkv, G

  @property
  def kv_time(self) -> int:
    """Time axis of the key / value / gate sources: ``[B, T, Hkv, ·]`` or ``[B, Hkv, T, ·]``."""
    return 1 if self.time_major else 2

  @property
  def overlap(self) -> int:
    """Time steps a chunk's window reaches back before the chunk: ``(window_chunks - 1)·C``."""
    return (self.cfg.window_chunks - 1) * self.cfg.chunk_size


#: How the scan reads its inputs. "heads": transposed once per sequence to head-major copies
#: (queries [B, Hkv, G, T, D], keys / values [B, Hkv, T, ·], gates [B, Hkv, T]), the layout the
#: fused kernels read in blocks. "time": sliced in place from the caller's [B, T, H, ·] arrays
#: (each query chunk viewed as [B, C, Hkv, G, D], :func:`query_chunk`) and transposed per chunk
#: inside the readout's own fusions. XLA:CPU allocates a program's temporaries
#: as one block per call, and a block over 32 MiB comes fresh from the OS, so every page of it
#: faults on first touch every call (~2 us per 4 KiB page measured on the project's 2-core VM:
#: 60 ms of a 250 ms call at T = 16,384, where the head-major copies and the stacked outputs made a
#: 120 MB block). On a TPU the head-major copies are as large as the inputs (6 GiB at the paper's
#: B=8, T=32,768, H=32, D=128 bf16), more than a v5e's 15.75 GiB holds beside the inputs and the
#: output: "time" there too. On GPUs memory comes from a pool of ample size and the kernels want
#: head-major blocks: "heads" (source_layout_for). "auto": that rule applied to this machine's
#: platform.
SOURCE_LAYOUTS = ("auto", "time", "heads")


def source_layout_for(platform: str, kernels: bool) -> str:
  """The source layout ("time" or "heads") for ``platform`` when the per-chunk operations are
  ``kernels`` (Pallas) or plain XLA functions: "time" for XLA on CPU and for both on TPU,
  "heads" otherwise. The rule the KVM op's backend resolver applies; a pure function: the caller
  says which platform."""
  return "time" if platform == "tpu" or (platform == "cpu" and not kernels) else "heads"


def _time_major(source_layout: str, ops: ChunkOps) -> bool:
  if source_layout not in SOURCE_LAYOUTS:
    raise ValueError(f"source_layout must be one of {SOURCE_LAYOUTS}, got {source_layout!r}.")
  if source_layout == "auto":
    # Only direct callers of the scan get here (tests, introspection); the KVM op passes the
    # layout its backend resolver decided.
    source_layout = source_layout_for(current_platform(), ops.kernel is not None)
  return source_layout == "time"


# ----------------------------------------------------------------------------------------------
# One chunk, and runs of chunks
# ----------------------------------------------------------------------------------------------


def _is_16bit_float(x: Array) -> bool:
  return x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)


def _as_bits(x: Array) -> Array:
  """16-bit floats as their bits (uint16), anything else as is: XLA:CPU has no bfloat16 dynamic
  slice or update, and its float normalization would convert the *whole* loop-invariant or
  loop-carried array to float32 around every access (a sequence-sized float32 copy per array,
  ~1 GiB at T = 65,536 in the backward pass). A bitcast has no derivative: only values that are
  not differentiated go through it bare (see :func:`slice_time`)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if _is_16bit_float(x) else x


def _from_bits(x: Array, dtype) -> Array:
  return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def _moved_as_bits(x: Array) -> bool:
  """Whether :func:`slice_time` and :func:`_update_slice` move ``x`` as bits: 16-bit floats when
  the program is built for CPU (:func:`current_platform`), where :func:`_as_bits` says why. XLA:TPU
  slices 16-bit floats natively and materializes the bitcast of a whole sequence as a copy of it
  (2 GiB per input at B=8, T=32,768, H=32, D=128 bf16)."""
  return _is_16bit_float(x) and current_platform() == "cpu"


# Whether the arrays the scan slices may be split over their heads (a mesh axis shards them):
# read by the TPU layout pins below, set from the plan for the time a scan's functions are
# traced (:func:`plan_pins`). A context, not an argument, because every slice and write of the
# scan pins its result; the plan (a static argument of every jitted entry) carries the value, so
# equal plans trace equal programs.
_HEADS_SPLIT: contextvars.ContextVar[bool] = contextvars.ContextVar("kvm_scan_heads_split",
                                                                    default=False)


def plan_pins(fn: Callable) -> Callable:
  """``fn(plan, ...)`` traced with the layout pins its plan allows (``plan.heads_split``)."""

  @functools.wraps(fn)
  def traced(plan, *args, **kwargs):
    token = _HEADS_SPLIT.set(plan.heads_split)
    try:
      return fn(plan, *args, **kwargs)
    finally:
      _HEADS_SPLIT.reset(token)

  return traced


def in_row_major(x: Array) -> Array:
  """``x`` (a chunk or block ``[B, ·, H, D]`` of a time-major array) kept in the row-major
  layout of the arrays it is sliced from or written into, when the program is built for TPU.

  XLA:TPU chooses every intermediate array's layout. The readout reads heads-first and scores
  keys with time in the minor dimension: left free, XLA gives the chunks those layouts and
  passes them back to the arrays they are sliced from (a head-major or time-minor copy of q, k
  or v, 256 MiB each at B=1, T=32,768, H=32, D=128 bf16) and on to the buffers gradient pieces
  are written into (head-major gradients, copied into the row-major results at the end). Time
  and heads merged into one axis, ``[B, ·×H, D]``, can only be laid out with the features minor,
  as the caller's arrays are (with H a multiple of the tile's rows, the merge is free), and an
  optimization barrier keeps the merge from being simplified away: the transposes happen chunk
  by chunk. The batch stays its own axis, so a batch-sharded array keeps its sharding.

  Merging time with heads would gather heads that a mesh axis splits (the partitioner cannot
  express the split in the merged axis). Where the plan says heads may be split (``heads_split``:
  the caller named a head axis, :func:`kvm_jax.kernels.sharding.kernel_sharding`), only heads and
  features are merged: that keeps the sharding and fixes the head order, though XLA may still
  lay keys and values out time-minor (in the backward pass it does: a copy of each).

  Exact (no arithmetic), and a no-op on other platforms, whose programs stay as they were."""
  if x.ndim < 4 or current_platform() != "tpu":
    return x
  if _HEADS_SPLIT.get():
    merged = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
  else:
    merged = x.reshape(x.shape[0], -1, x.shape[-1])
  return jax.lax.optimization_barrier(merged).reshape(x.shape)


def pin_whole(x: Array) -> Array:
  """:func:`in_row_major` for a sequence-sized buffer (a gradient carried through the backward
  loop), only where the pin is free: with time merged into heads. The heads-and-features merge
  tiles differently from ``[B, T, H, D]`` and would copy the whole buffer at every step."""
  return x if _HEADS_SPLIT.get() else in_row_major(x)


def slice_time(x: Array, start, size: int, axis: int = 1) -> Array:
  """``x[start : start + size]`` along ``axis`` (``start`` may be traced). Differentiable; 16-bit
  floats are sliced as bits on CPU (``_moved_as_bits``), and so is their cotangent placed.
  On TPU the slice keeps its heads and features in the source's order (:func:`in_row_major`)."""
  if _moved_as_bits(x):
    return _slice_bits(size, axis, x.shape, x, start)
  return in_row_major(jax.lax.dynamic_slice_in_dim(x, start, size, axis))


def _update_slice(x: Array, update: Array, start, axis: int = 1) -> Array:
  """``x`` with ``update`` written at ``start`` along ``axis`` (in place in a loop carry).
  Differentiable; 16-bit floats are written as bits on CPU (``_moved_as_bits``)."""
  if _moved_as_bits(x):
    return _update_slice_bits(axis, update.shape, x, update, start)
  return jax.lax.dynamic_update_slice_in_dim(x, in_row_major(update), start, axis)


# The bit-level slice and update with their derivatives. Shapes are static arguments, so the only
# residual is the (scalar) start: a loop-invariant source is never kept per chunk.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _slice_bits(size: int, axis: int, shape: tuple, x: Array, start) -> Array:
  return _from_bits(jax.lax.dynamic_slice_in_dim(_as_bits(x), start, size, axis), x.dtype)


def _slice_bits_fwd(size, axis, shape, x, start):
  return _slice_bits(size, axis, shape, x, start), start


def _slice_bits_bwd(size, axis, shape, start, ct):
  zeros = jnp.zeros(shape, ct.dtype)
  return _update_slice_bits(axis, ct.shape, zeros, ct, start), None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _update_slice_bits(axis: int, update_shape: tuple, x: Array, update: Array, start) -> Array:
  return _from_bits(jax.lax.dynamic_update_slice_in_dim(_as_bits(x), _as_bits(update), start,
                                                        axis), x.dtype)


def _update_slice_bits_fwd(axis, update_shape, x, update, start):
  return _update_slice_bits(axis, update_shape, x, update, start), start


def _update_slice_bits_bwd(axis, update_shape, start, ct):
  d_update = _slice_bits(update_shape[axis], axis, ct.shape, ct, start)
  d_x = _update_slice_bits(axis, update_shape, ct, jnp.zeros(update_shape, ct.dtype), start)
  return d_x, d_update, None


_slice_bits.defvjp(_slice_bits_fwd, _slice_bits_bwd)
_update_slice_bits.defvjp(_update_slice_bits_fwd, _update_slice_bits_bwd)


def _whole_sequence_order() -> bool:
  """Whether the scan views queries as ``[B, T, Hkv, G, D]`` once per sequence and writes the
  front chunks' outputs in order, as it does when building for CPU, rather than viewing queries
  per chunk and writing the front last (:func:`query_chunk`, :func:`_front_run`: each avoids a
  sequence-sized copy XLA:TPU would make). XLA:CPU makes neither copy, but fuses the two orders
  differently and rounds their float32 sums apart by about an ulp; the whole-sequence order is
  the one ``tests/data/documents/none_path_logits.npz`` pins bit for bit."""
  return current_platform() == "cpu"


def query_chunk(plan: ScanPlan, q_src: Array, start, size: int) -> Array:
  """``size`` query time steps from ``start``: ``[B, size, Hkv, G, D]`` (time-major) or
  ``[B, Hkv, G, size, D]`` (head-major). A time-major ``[B, T, H, D]`` source is viewed per
  chunk: a whole-sequence ``[B, T, Hkv, G, D]`` view would be an array of its own, whose layout
  XLA:TPU is free to choose, and it chooses the head-major one the readout reads, copying every
  query once (2 GiB at B=8, T=32,768, H=32, D=128 bf16) instead of transposing chunk by chunk."""
  q_c = slice_time(q_src, start, size, plan.q_time)
  if plan.time_major and q_c.ndim == 4:
    B, _, Hkv, G = plan.dims(q_src)
    q_c = q_c.reshape(B, size, Hkv, G, q_c.shape[-1])
  return q_c


def window_slice(x: Array, start, size: int, axis: int) -> tuple[Array, int]:
  """``(x[max(start, 0) : start + size], slots cut off before row 0)`` along ``axis``. A static
  negative ``start`` (a front chunk, whose window reaches before the sequence) keeps only the
  rows that exist; a traced ``start`` is never negative (only chunks past the front have one)."""
  if isinstance(start, int) and start < 0:
    return in_row_major(jax.lax.slice_in_dim(x, 0, start + size, axis=axis)), -start
  return slice_time(x, start, size, axis), 0


def _chunk(plan: ScanPlan, run: Run, params: KVMParams, state: KVMState, c, base: int | Array,
           k_lead: int, q_src, k_src, v_src, g_src, routing_c):
  """Query chunk ``c`` (absolute index, may be traced) attends and, if its run folds, folds the
  chunk leaving the window.

  Sources (layout per ``plan``): ``q_src`` starts at chunk ``base``, so the chunk's queries are
  its time steps ``[(c - base)·C, (c - base + 1)·C)``; ``k_src`` / ``v_src`` / ``g_src`` start
  ``k_lead`` time steps before chunk ``base`` (0 for the whole sequence, the window overlap for a
  block of the backward pass), and the window is the ``nb·C`` steps ending with the chunk, whose
  first ``C`` are the overflow chunk. Returns ``(state, y [B, C, H, Dv] in the output dtype,
  (dest, target))``.

  Masks are constants wherever the schedule decides them: a chunk that sees the state is at or
  past the window (``c >= nb``), so its window lies inside the sequence and its mask is the
  causal one; its state rows are all valid when every chunk of its run sees a full state. A
  front chunk with a static index drops the window slots before the sequence start instead of
  masking them (chunk 0 scores ``C`` keys instead of ``nb·C``)."""
  cfg, ops = plan.cfg, plan.ops
  C, nb, R = cfg.chunk_size, cfg.window_chunks, plan.capacity
  kt = plan.kv_time
  B, _, Hkv, G = plan.dims(q_src)
  q_c = query_chunk(plan, q_src, (c - base) * C, C)
  win_start = (c - base) * C + k_lead - plan.overlap
  win_k, before = window_slice(k_src, win_start, nb * C, kt)
  win_v, _ = window_slice(v_src, win_start, nb * C, kt)
  # [B, C, Hkv, G, ·] and [B, W, Hkv, ·], or [B, Hkv, G, C, ·] and [B, Hkv, W, ·]
  attend = ops.attend if plan.time_major else ops.attend_heads
  # The front (no state seen, nothing folded) needs no readout of the state.
  state_keys, state_values = (state_readout(state, params, cfg, G) if run.visible or run.update
                              else (None, None))
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  # Whether every chunk of this run sees a full state and appends nothing (a fixed budget after
  # its first chunk): the state and merge masks are then all-true, known at trace time.
  full = all(plan.rows_before[i] == R and plan.n_append[i] == 0
             for i in range(run.start, run.stop))
  if run.visible:
    if full:
      state_valid = np.ones((1, R), bool)
    else:
      state_valid = (jnp.arange(R) < state.num_rows)[None, :]
    y = attend(q_c, state_keys, state_values, state_valid, win_k, win_v,
               window_mask(nb, C, nb), state_temp, window_temp, softcap=cfg.logit_softcap)
  else:
    # The causal front sees no state: reading all R rows only to mask them would cost R
    # columns per query.
    row_keys, row_values = no_state_readout(params, cfg, B, Hkv, G, k_src.shape[-1],
                                            v_src.shape[-1])
    y = attend(q_c, row_keys, row_values, np.zeros((1, 1), bool), win_k, win_v,
               window_mask(c, C, nb)[:, before:], state_temp, window_temp,
               softcap=cfg.logit_softcap)
  if not plan.time_major:
    y = jnp.transpose(y, (0, 3, 1, 2, 4))               # [B, C, Hkv, G, Dv]
  y = y.reshape(B, C, Hkv * G, y.shape[-1]).astype(plan.out_dtype)
  none = jnp.full((B, Hkv, C), R, jnp.int32)  # "no row": the decisions of a chunk without a fold
  if not run.update:
    return state, y, (none, none)
  overflow = lambda x: jax.lax.slice_in_dim(x, 0, C, axis=kt)  # noqa: E731
  overflow_g = slice_time(g_src, win_start, C, kt)
  n_append = jnp.asarray(plan.n_append, jnp.int32)[c]
  state, decisions = ops.update(state, overflow(win_k), overflow(win_v), overflow_g, n_append,
                                params, cfg, plan.row_update, state_keys, routing=routing_c,
                                return_routing=True, may_append=run.may_append,
                                head_major=not plan.time_major, rows_after=R if full else None)
  return state, y, decisions


def no_state_readout(params, cfg: KVMConfig, batch: int, kv_heads: int, groups: int,
                     key_dim: int, value_dim: int) -> tuple[Array, Array]:
  """Readout keys and values of one zero state row, ``[B, Hkv, 1, ·]``: what a chunk whose
  queries read no state attends to in the state's place, always masked (exact: its weight is
  exp(MASKED - max) = 0, and every query sees at least itself in the window)."""
  zeros = lambda d: jnp.zeros((batch, kv_heads, 1, d), jnp.float32)  # noqa: E731
  no_state = KVMState(keys=zeros(key_dim), values=zeros(value_dim),
                      radius=jnp.zeros((batch, kv_heads, 1), jnp.float32),
                      num_rows=jnp.zeros((), jnp.int32))
  return state_readout(no_state, params, cfg, groups)


def scan_chunks(plan: ScanPlan, run: Run, params, state, first, count: int, base, k_lead: int,
                 q_src, k_src, v_src, g_src, routing=None, remat_chunks: bool = False,
                 out=None, extra=None):
  """Chunks ``first .. first + count - 1`` of ``run`` (``first`` may be traced, ``count`` is
  static) in one ``lax.scan``; ``base`` and ``k_lead`` place the sources (``_chunk``).
  ``routing``: decisions to apply, ``[count, B, Hkv, C]`` each, or None to compute them.

  ``extra``: what ``plan.chunk_fn`` takes besides ``_chunk``'s arguments.
  ``out``: None, or an output buffer ``[B, ·, H, Dv]`` whose row 0
  is chunk ``base``'s first time step; each chunk writes its rows into it in place.
  Returns ``(state, y, decisions)``: ``y`` is the updated ``out``, or (without one) the chunks'
  outputs stacked, ``[count, B, C, H, Dv]``.

  The causal front (at most ``window_chunks`` chunks) is unrolled when ``first`` is static, so
  each of its chunks knows its index and reads only the window slots inside the sequence."""
  C = plan.cfg.chunk_size
  unrolled = isinstance(first, int) and isinstance(base, int) and not run.visible

  def one(state, routing_c, c):
    if plan.chunk_fn is not None:
      return plan.chunk_fn(plan, run, params, state, c, base, k_lead, q_src, k_src, v_src, g_src,
                           routing_c, extra)
    return _chunk(plan, run, params, state, c, base, k_lead, q_src, k_src, v_src, g_src,
                  routing_c)

  if remat_chunks:
    one = jax.checkpoint(one, prevent_cse=False, static_argnums=(2,) if unrolled else ())

  def step(carry, x):
    state, out = carry
    i, routing_c = x
    c = first + i
    state, y, decisions = one(state, routing_c, c)
    if out is None:
      return (state, None), (y, decisions)
    # The output buffer is carried, not stacked: a scan's stacked outputs are a second buffer of
    # their own size, initialized and then copied into place.
    return (state, _update_slice(out, y, (c - base) * C, axis=1)), (None, decisions)

  if unrolled:
    outs = []
    carry = (state, out)
    for i in range(count):
      carry, o = step(carry, (i, None if routing is None else tuple(r[i] for r in routing)))
      outs.append(o)
    ys, decisions = jax.tree_util.tree_map(lambda *x: jnp.stack(x), *outs)
  else:
    carry, (ys, decisions) = jax.lax.scan(step, (state, out),
                                          (jnp.arange(count, dtype=jnp.int32), routing))
  state, out = carry
  return state, (ys if out is None else out), decisions


def _state(arrays, num_rows) -> KVMState:
  keys, values, radius = arrays
  return KVMState(keys=keys, values=values, radius=radius,
                  num_rows=jnp.asarray(num_rows, jnp.int32))


def _routing_slice(routing, start: int, stop: int):
  return None if routing is None else tuple(r[start:stop] for r in routing)


def _output_buffer(plan: ScanPlan, q_src, v_src) -> Array:
  """The zero output ``[B, num_chunks·C, H, Dv]`` the chunks write into."""
  B, Tp, Hkv, G = plan.dims(q_src)
  return jnp.zeros((B, Tp, Hkv * G, v_src.shape[-1]), plan.out_dtype)


def _front_run(run: Run) -> bool:
  """Whether ``run`` is the causal front (no state seen, chunks unrolled), whose outputs are
  written into the output buffer after every other run (:func:`write_chunks`). XLA turns a first
  write into a zero buffer into a pad of the written rows, and the pad takes their layout: on TPU
  the readout's head-major one, which the loops would then carry the whole buffer in and copy it
  out of at the end (one more output-sized temporary: 2 GiB at B=8, T=32,768, H=32, Dv=128
  bf16). Written last, the rows go into a buffer already in the output's layout."""
  return not run.visible and not _whole_sequence_order()


def write_chunks(out: Array, ys: Array, first: int, chunk: int) -> Array:
  """``out [B, ·, H, Dv]`` with the chunk outputs ``ys [count, B, C, H, Dv]`` written at chunks
  ``first .. first + count - 1``."""
  for i in range(ys.shape[0]):
    out = _update_slice(out, ys[i], (first + i) * chunk, axis=1)
  return out


@plan_pins
def _forward(plan: ScanPlan, params, state0, q_p, k_p, v_p, g_p, routing):
  """The whole sequence, run by run: ``(y [B, nC·C, H, Dv], state arrays, decisions)``."""
  state = _state(state0, plan.initial_rows)
  out = _output_buffer(plan, q_p, v_p)
  decisions, front = [], []
  for run in plan.runs:
    state, y, d = scan_chunks(plan, run, params, state, run.start, run.length, 0, 0, q_p, k_p,
                               v_p, g_p, _routing_slice(routing, run.start, run.stop),
                               out=None if _front_run(run) else out)
    if _front_run(run):
      front.append((run.start, y))
    else:
      out = y
    decisions.append(d)
  for first, ys in front:
    out = write_chunks(out, ys, first, plan.cfg.chunk_size)
  decisions = tuple(jnp.concatenate([d[i] for d in decisions], axis=0) for i in range(2))
  return out, (state.keys, state.values, state.radius), decisions


# ----------------------------------------------------------------------------------------------
# Backward in O(sqrt(chunks)) states: stored block states, decisions replayed, never recomputed
# ----------------------------------------------------------------------------------------------


def plan_blocks(plan: ScanPlan, run: Run) -> tuple[int, int]:
  """(full blocks, leftover chunks) of ``run`` at ``plan.block`` chunks per block. The causal
  front (at most ``window_chunks`` chunks, no state) is one leftover piece, so its chunk indices
  stay static (see :func:`scan_chunks`)."""
  if not run.visible:
    return 0, run.length
  return run.length // plan.block, run.length % plan.block


def first_rows(plan: ScanPlan, *sources: Array) -> tuple[Array, ...]:
  """The first ``plan.initial_rows`` time steps of each key-side source (the plan's layout)."""
  return tuple(jax.lax.slice_in_dim(x, 0, plan.initial_rows, axis=plan.kv_time) for x in sources)


def initial_rows_state(plan: ScanPlan, params, k0: Array, v0: Array, g0: Array):
  """The state arrays ``(keys, values, radius)`` before the first fold: the time steps ``k0`` /
  ``v0`` / ``g0`` (:func:`first_rows`, in the plan's layout) copied into the first rows of a
  ``plan.capacity`` buffer (:func:`kvm_jax.ops.kvm.state.initial_state`)."""
  if not plan.time_major:  # [B, Hkv, n, ·] -> [B, n, Hkv, ·]
    k0, v0, g0 = (jnp.swapaxes(x, 1, 2) for x in (k0, v0, g0))
  s0 = initial_state(k0, v0, g0, plan.initial_rows, plan.capacity, params, plan.cfg)
  return (s0.keys, s0.values, s0.radius)


# ``state0`` is ``initial_rows_state(plan, params, *first_rows(plan, k_p, v_p, g_p))`` (as
# :func:`kvm_attention_scan` builds it): its gradient is taken through ``params`` and the first
# rows of ``k_p``, ``v_p`` and ``g_p``, where the backward pass adds it in place
# (:func:`_initial_state_grads`), and ``state0`` itself gets none (a symbolic zero). Passed back through ``state0``, JAX would add the two cotangents
# of k, v and g as whole arrays, a pad of the first rows plus an add that XLA:TPU gives a buffer
# of its own (256 MiB per input at B=1, T=32,768, H=32, D=128 bf16, and a head-major one for
# keys).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_checkpointed(plan: ScanPlan, params, state0, q_p, k_p, v_p, g_p, routing):
  return _forward(plan, params, state0, q_p, k_p, v_p, g_p, routing)


@plan_pins
def _forward_checkpointed_fwd(plan, params, state0, q_p, k_p, v_p, g_p, routing):
  """The forward pass, keeping the state at the start of every block of ``plan.block`` chunks
  and every chunk's routing decisions (int32, ``[nC, B, Hkv, C]``)."""
  S = plan.block
  state = _state(state0, plan.initial_rows)
  out = _output_buffer(plan, q_p, v_p)
  decisions, block_states, front = [], [], []
  for run in plan.runs:
    full, left = plan_blocks(plan, run)
    if full:
      def block(carry, j, run=run):
        state, out = carry
        first = run.start + j * S
        given = None if routing is None else tuple(
            jax.lax.dynamic_slice_in_dim(r, first, S, 0) for r in routing)
        state_in = (state.keys, state.values, state.radius)
        state, out, d = scan_chunks(plan, run, params, state, first, S, 0, 0, q_p, k_p, v_p,
                                     g_p, given, out=out)
        return (state, out), (state_in, d)

      (state, out), (starts, d) = jax.lax.scan(block, (state, out),
                                               jnp.arange(full, dtype=jnp.int32))
      block_states.append(starts)
      decisions.append(tuple(x.reshape(full * S, *x.shape[2:]) for x in d))
    else:
      block_states.append(None)
    if left:
      first = run.start + full * S
      block_states.append((state.keys, state.values, state.radius))
      state, y, d = scan_chunks(plan, run, params, state, first, left, 0, 0, q_p, k_p, v_p,
                                 g_p, _routing_slice(routing, first, run.stop),
                                 out=None if _front_run(run) else out)
      if _front_run(run):
        front.append((first, y))
      else:
        out = y
      decisions.append(d)
    else:
      block_states.append(None)
  for first, ys in front:
    out = write_chunks(out, ys, first, plan.cfg.chunk_size)
  decisions = tuple(jnp.concatenate([d[i] for d in decisions], axis=0) for i in range(2))
  out = (out, (state.keys, state.values, state.radius), decisions)
  return out, (params, q_p, k_p, v_p, g_p, tuple(block_states), decisions)


def _block_sources(x: Array, start, size: int, axis: int) -> Array:
  """:func:`window_slice` with the rows before the sequence start zero-padded back in front (the
  first block, whose window overlap reaches before the sequence)."""
  part, before = window_slice(x, start, size, axis)
  return jnp.pad(part, [(0, 0)] * axis + [(before, 0)] + [(0, 0)] * (x.ndim - axis - 1))


def _block_grad_fn(plan, params, q_p, k_p, v_p, g_p):
  """One block's backward for :func:`_forward_checkpointed_bwd`: ``block_grad(carry, first,
  count, run, state_in, dy_blk, given)`` reruns the block from ``state_in`` with the ``given``
  decisions under ``jax.vjp`` and returns the new carry (state cotangent, the carried key / value
  / gate rows shared with the block before, parameter gradients) and the block's own gradient
  rows of q, k, v and the gate."""
  C, T, QT, overlap = plan.cfg.chunk_size, plan.kv_time, plan.q_time, plan.overlap
  f32 = jnp.float32

  def block_grad(carry, first, count: int, run: Run, state_in, dy_blk, given):
    d_state, heads, dparams = carry
    q_blk = slice_time(q_p, first * C, count * C, QT)
    k_blk, v_blk, g_blk = (_block_sources(x, first * C - overlap, count * C + overlap, T)
                           for x in (k_p, v_p, g_p))
    num_rows = jnp.asarray(plan.rows_before, jnp.int32)[first]
    # [B, count·C, H, Dv] -> the stacked chunks' layout [count, B, C, H, Dv]
    B, _, H, Dv = dy_blk.shape
    dy_chunks = jnp.moveaxis(dy_blk.reshape(B, count, C, H, Dv), 1, 0)

    def f(state_arrays, params, q_blk, k_blk, v_blk, g_blk):
      state, y, _ = scan_chunks(plan, run, params, _state(state_arrays, num_rows), first,
                                 count, first, overlap, q_blk, k_blk, v_blk, g_blk, given,
                                 remat_chunks=True)
      return y, (state.keys, state.values, state.radius)

    _, vjp = jax.vjp(f, state_in, params, q_blk, k_blk, v_blk, g_blk)
    d_in, dp, dq_b, dk_b, dv_b, dg_b = vjp((dy_chunks, d_state))
    pieces, new_heads = [dq_b.astype(q_p.dtype)], []
    for x, grad, head in zip((k_p, v_p, g_p), (dk_b, dv_b, dg_b), heads):
      own, head = complete_block_rows(grad, head, count * C, overlap, T)
      pieces.append(own.astype(x.dtype))
      new_heads.append(head)
    dparams = jax.tree_util.tree_map(lambda a, b: a + b.astype(f32), dparams, dp)
    return (tuple(x.astype(f32) for x in d_in), tuple(new_heads), dparams), tuple(pieces)

  return block_grad


@plan_pins
def _forward_checkpointed_bwd(plan, residuals, cotangents):
  """Blocks in reverse: each is run again from its stored state *with the stored decisions*
  (routing is never recomputed), under ``jax.vjp`` with per-chunk rematerialization, so at most
  ``block`` chunk states are alive besides the stored block states."""
  params, q_p, k_p, v_p, g_p, block_states, decisions = residuals
  dy, d_final, _ = cotangents
  C, S = plan.cfg.chunk_size, plan.block
  f32 = jnp.float32
  d_state = tuple(x.astype(f32) for x in d_final)
  # Each query row belongs to one chunk: its gradient is produced once. A key/value/gate row
  # belongs to nb windows: with blocks walked in reverse, a block's first (nb-1)·C rows are
  # shared only with the block before it, so they are carried (float32) into that block, and
  # every block emits its own rows complete, in the input's dtype, written in place into the
  # gradients, loop-carried buffers of the inputs' size: per-block pieces stacked as scan outputs
  # would be a second copy of the gradients (240 MiB each of q, k and v at B=1, T=32,768, H=32,
  # D=128 bf16), concatenated into them at the end. 16-bit gradients are written as bits on CPU
  # (:func:`_update_slice`), where XLA would widen a carried buffer to float32.
  overlap, T, QT = plan.overlap, plan.kv_time, plan.q_time
  heads = tuple(jnp.zeros((*x.shape[:T], overlap, *x.shape[T + 1:]), f32)
                for x in (k_p, v_p, g_p))
  dparams = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, f32), params)

  block_grad = _block_grad_fn(plan, params, q_p, k_p, v_p, g_p)

  carry = (d_state, heads, dparams)
  grads = tuple(jnp.zeros(x.shape, x.dtype) for x in (q_p, k_p, v_p, g_p))
  grad_axes = (QT, T, T, T)

  def write(grads, first, pieces):
    return tuple(_update_slice(g, p, first * C, axis)
                 for g, p, axis in zip(grads, pieces, grad_axes))

  # The pieces of blocks outside the loops (static starts) are written after every loop, as the
  # forward writes its front chunks (:func:`_front_run`): a first write into the zero buffers
  # would become a pad that gives the carried gradients the pieces' layout.
  pieces = []
  for r in reversed(range(len(plan.runs))):
    run = plan.runs[r]
    full, left = plan_blocks(plan, run)
    starts, left_state = block_states[2 * r], block_states[2 * r + 1]
    if left:
      first = run.start + full * S
      carry, piece = block_grad(carry, first, left, run, left_state,
                                jax.lax.slice_in_dim(dy, first * C, run.stop * C, axis=1),
                                _routing_slice(decisions, first, run.stop))
      pieces.append((first, piece))
    if full:
      def step(carry_grads, x, run=run):
        carry, grads = carry_grads
        j, state_in = x
        first = run.start + j * S
        dy_blk = slice_time(dy, first * C, S * C, axis=1)
        given = tuple(jax.lax.dynamic_slice_in_dim(d, first, S, 0) for d in decisions)
        carry, piece = block_grad(carry, first, S, run, state_in, dy_blk, given)
        return (carry, tuple(pin_whole(g) for g in write(grads, first, piece))), None

      (carry, grads), _ = jax.lax.scan(step, (carry, grads),
                                       (jnp.arange(full, dtype=jnp.int32), starts), reverse=True)
  for first, piece in pieces:
    grads = write(grads, first, piece)
  d_state, _, dparams = carry  # the last heads carried: rows before the sequence start
  dq, *key_side = grads
  d_initial_params, key_side = _initial_state_grads(plan, params, (k_p, v_p, g_p), d_state,
                                                      key_side)
  dparams = jax.tree_util.tree_map(lambda g, g0, p: (g + g0.astype(f32)).astype(p.dtype),
                                   dparams, d_initial_params, params)
  return (dparams, None, dq, *key_side, None)


_forward_checkpointed.defvjp(_forward_checkpointed_fwd, _forward_checkpointed_bwd)


def _initial_state_grads(plan: ScanPlan, params, sources, d_state, key_side):
  """The initial state's share of the gradients: ``(parameter gradients, key_side)`` with
  ``key_side`` (the gradients of the key-side ``sources``: k, v and the gate) completed in their
  first ``plan.initial_rows`` time steps, in place, given ``d_state``, the cotangent of the state
  arrays before the first fold (summed in float32)."""
  f32 = jnp.float32
  state0, vjp = jax.vjp(functools.partial(initial_rows_state, plan), params,
                        *first_rows(plan, *sources))
  d_params, *d_rows = vjp(tuple(d.astype(s.dtype) for d, s in zip(d_state, state0)))
  completed = tuple(
      _update_slice(grad, (head.astype(f32) + extra.astype(f32)).astype(grad.dtype), 0,
                    plan.kv_time)
      for grad, head, extra in zip(key_side, first_rows(plan, *key_side), d_rows))
  return d_params, completed


def complete_block_rows(grad: Array, head: Array, rows: int, overlap: int,
                        axis: int) -> tuple[Array, Array]:
  """A backward block's key-side gradient ``grad`` (``overlap + rows`` along ``axis``: the
  window's rows before the block, then the block's own) completed with ``head``, the later
  block's gradient for the block's last ``overlap`` rows: ``(the block's own rows, complete;
  the partial gradient of the ``overlap`` rows before it, the head of the block before)``, both
  float32."""
  grad = grad.astype(jnp.float32)
  tail = jax.lax.slice_in_dim(grad, rows, rows + overlap, axis=axis) + head
  grad = jnp.concatenate([jax.lax.slice_in_dim(grad, 0, rows, axis=axis), tail], axis=axis)
  return (jax.lax.slice_in_dim(grad, overlap, overlap + rows, axis=axis),
          jax.lax.slice_in_dim(grad, 0, overlap, axis=axis))


# ----------------------------------------------------------------------------------------------
# The scan
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "remat", "row_update",
                                             "return_routing", "source_layout"))
def kvm_attention_scan(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                       cfg: KVMConfig, ops: ChunkOps = XLA_OPS, remat: bool = True,
                       row_update: str = "auto", routing=None, return_routing: bool = False,
                       source_layout: str = "auto"):
  """Chunked-scan KVM; see :func:`kvm_jax.kvm_attention` for the contract (inputs are not
  re-validated here: this is the layer below the public API).

  The static schedule is cut into :class:`Run` s, one ``lax.scan`` each, so no chunk decides on
  the device whether it folds or appends. Each chunk slices its queries and window from the
  inputs and writes its output rows in place; nothing of size ``window_chunks × T`` is built.

  Args:
    ops: the per-chunk operations (:data:`XLA_OPS`, or kernels from
      :func:`kvm_jax.ops.kvm.api.chunk_ops`).
    remat: the backward pass keeps the state only every ~sqrt(num_chunks) chunks and each chunk's
      routing decisions, and runs every block of chunks again in reverse applying the stored
      decisions: memory ``O(sqrt(T/C) · R)`` instead of ``O(T/C · R)`` for one more forward.
      False: plain autodiff through the scan (every chunk's intermediates stored).
    row_update: how the XLA update accumulates rows (:data:`kvm_jax.ops.kvm.state.ROW_UPDATES`,
      or "auto": the platform's rule, :func:`kvm_jax.ops.kvm.state.row_update_for`).
    routing: per-chunk decisions ``(dest, target)``, each ``[num_chunks, B, Hkv, C]`` int32, to
      apply instead of computing them (shared routing).
    return_routing: also return the decisions this call applied, in that form (chunks without an
      update hold ``capacity``: a no-op).
    source_layout: "time" (chunks sliced from the inputs as given), "heads" (head-major copies
      made once per sequence) or "auto" (the platform's rule, :func:`source_layout_for`); see
      :data:`SOURCE_LAYOUTS`. The results are the same. The KVM op passes both choices as its
      backend resolver decided them (:func:`kvm_jax.ops.kvm.api.resolve_kvm_backend`).
  Returns:
    a :class:`KVMOutput` ``(y [B, T, H, Dv], final state)``; with ``return_routing``, a
    :class:`RoutedKVMOutput` (the same and ``routing``, the decisions).
  """
  B, T, H, D = q.shape
  C = cfg.chunk_size
  sched = kvm_schedule(cfg, T)
  nC = sched.num_chunks
  plan = ScanPlan(cfg=cfg, ops=ops, row_update=row_update, runs=schedule_runs(sched),
               n_append=tuple(sched.n_append), rows_before=tuple(sched.rows_before),
               num_chunks=nC, initial_rows=sched.initial_rows, capacity=sched.final_rows,
               block=max(1, math.isqrt(nC - 1) + 1), out_dtype=jnp.dtype(q.dtype),
               time_major=_time_major(source_layout, ops), groups=H // k.shape[2])
  # Time padded to whole chunks (a copy only when T is not a multiple of C). Nothing is padded in
  # front: a window reaching before the sequence belongs to a front chunk, which has a static
  # index and slices only the rows that exist.
  Hkv = k.shape[2]
  pad = lambda x: x if nC * C == T else jnp.pad(  # noqa: E731
      x, [(0, 0), (0, nC * C - T)] + [(0, 0)] * (x.ndim - 2))
  q_p, k_p, v_p, g_p = (pad(x) for x in (q, k, v, merge_gate))
  if plan.time_major and _whole_sequence_order():
    q_p = q_p.reshape(B, nC * C, Hkv, H // Hkv, D)  # query head h = kv·G + g (free)
  if not plan.time_major:  # head-major, once per sequence (plan.q_time, plan.kv_time)
    q_p = jnp.transpose(q_p.reshape(B, nC * C, Hkv, H // Hkv, D), (0, 2, 3, 1, 4))
    k_p, v_p = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k_p, v_p))
    g_p = jnp.transpose(g_p, (0, 2, 1))
  state0 = initial_rows_state(plan, params, *first_rows(plan, k_p, v_p, g_p))
  core = _forward_checkpointed if remat else _forward
  y, (keys, values, radius), decisions = core(plan, params, state0, q_p, k_p, v_p, g_p, routing)
  if nC * C != T:
    y = y[:, :T]
  state = KVMState(keys=keys, values=values, radius=radius,
                   num_rows=jnp.asarray(sched.final_rows, jnp.int32))
  return RoutedKVMOutput(y, state, decisions) if return_routing else KVMOutput(y, state)
