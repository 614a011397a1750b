"""State-size budgets and the static KVM update schedule.

A budget answers one question: *how many state rows should exist once ``ctx_len`` tokens have been
processed?* The KVM layer then grows its state towards that target, one overflow chunk at a time,
under the extra caps of docs/kvm-spec.md §6.3 (``available`` tokens, ``max_state_rows``, never
shrink, at most ``chunk_size`` appends per update).

Because every quantity here depends only on token *positions* (never on values), the whole schedule
of a sequence is known when a function is traced. :func:`kvm_schedule` computes it once in Python and
the jitted code reads it as constants; that is what lets the state live in a static-capacity buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Protocol, Union, runtime_checkable


def _round_down_to_multiple(x: int, multiple: int) -> int:
  """Largest multiple of ``multiple`` that is <= ``x``, with both clamped like the authors' helper."""
  x = max(int(x), 0)
  multiple = max(int(multiple), 1)
  return (x // multiple) * multiple


@runtime_checkable
class Budget(Protocol):
  """Anything with ``target_rows(ctx_len) -> int`` (before the §6.3 caps)."""

  def target_rows(self, ctx_len: int) -> int:
    ...


def _check_int(name: str, value: Any, minimum: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")


@dataclasses.dataclass(frozen=True)
class FixedBudget:
  """A constant target of ``rows`` state rows (the paper's KVM-256: ``FixedBudget(256)``).

  This is a *target*, not a cap: the initial state always holds the first ``min(T, chunk_size)``
  tokens, so a fixed budget below ``chunk_size`` never shrinks it (docs/kvm-spec.md §6.3); with
  ``rows == chunk_size`` the state is full after the first chunk and never appends.
  """

  rows: int

  def __post_init__(self):
    _check_int("FixedBudget.rows", self.rows, 1)

  def target_rows(self, ctx_len: int) -> int:
    del ctx_len  # a fixed budget ignores the context length
    return self.rows


@dataclasses.dataclass(frozen=True)
class PowerLawBudget:
  """``max(round_down(floor(factor * ctx_len ** exponent)), min_rows)`` (paper: 16·√N, min 256).

  Evaluated with Python float math exactly like the authors' ``_desired_state_len`` so that the state
  sizes of their checkpoints are reproduced to the row.
  """

  factor: float
  exponent: float = 0.5
  min_rows: int = 0
  round_down: int = 1

  def __post_init__(self):
    if not (isinstance(self.factor, (int, float)) and self.factor > 0 and math.isfinite(self.factor)):
      raise ValueError(f"PowerLawBudget.factor must be a positive finite number, got {self.factor!r}.")
    if not (isinstance(self.exponent, (int, float)) and 0 <= self.exponent <= 1):
      raise ValueError(
          f"PowerLawBudget.exponent must be in [0, 1] (sub-linear growth), got {self.exponent!r}.")
    _check_int("PowerLawBudget.min_rows", self.min_rows, 0)
    _check_int("PowerLawBudget.round_down", self.round_down, 1)

  def target_rows(self, ctx_len: int) -> int:
    target = int(math.floor(self.factor * (float(max(ctx_len, 0)) ** self.exponent)))
    target = _round_down_to_multiple(target, self.round_down)
    return max(target, self.min_rows)


@dataclasses.dataclass(frozen=True)
class SaturatingBudget:
  """``max(round_down(floor(limit * ctx_len / (limit + ctx_len))), min_rows)`` (paper: limit 1024, min 1).

  Grows like ``ctx_len`` for short contexts and saturates toward ``limit`` rows.
  """

  limit: int
  min_rows: int = 0
  round_down: int = 1

  def __post_init__(self):
    _check_int("SaturatingBudget.limit", self.limit, 1)
    _check_int("SaturatingBudget.min_rows", self.min_rows, 0)
    _check_int("SaturatingBudget.round_down", self.round_down, 1)

  def target_rows(self, ctx_len: int) -> int:
    t = float(max(ctx_len, 0))
    target = int(math.floor((float(self.limit) * t) / (float(self.limit) + t)))
    target = _round_down_to_multiple(target, self.round_down)
    return max(target, self.min_rows)


@dataclasses.dataclass(frozen=True)
class CallableBudget:
  """Wraps any user callable ``ctx_len -> rows`` (must return a non-negative int)."""

  fn: Callable[[int], int]

  def target_rows(self, ctx_len: int) -> int:
    rows = self.fn(ctx_len)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
      raise ValueError(
          f"budget callable {self.fn!r} returned {rows!r} for ctx_len={ctx_len}; it must return a "
          "non-negative int number of state rows.")
    return rows


BudgetLike = Union[FixedBudget, PowerLawBudget, SaturatingBudget, CallableBudget, str,
                   Callable[[int], int]]


def as_budget(budget: BudgetLike) -> Budget:
  """Normalizes a budget object, a spec string (:func:`parse_budget`: ``"sqrt:16@256"``) or a plain
  ``ctx_len -> rows`` callable into a :class:`Budget`."""
  if isinstance(budget, str):
    return parse_budget(budget)
  if isinstance(budget, (FixedBudget, PowerLawBudget, SaturatingBudget, CallableBudget)):
    return budget
  if isinstance(budget, Budget):
    return budget
  if callable(budget):
    return CallableBudget(budget)
  raise ValueError(
      f"budget must be FixedBudget, PowerLawBudget, SaturatingBudget, a spec such as 'sqrt:16@256' "
      f"or a callable ctx_len -> rows, got {budget!r}.")


BUDGET_SPEC_HELP = ("fixed:ROWS, sqrt:FACTOR (FACTOR·√N), pow:FACTOR:EXPONENT "
                    "(FACTOR·N^EXPONENT) or sat:LIMIT (LIMIT·N/(LIMIT+N)), each optionally "
                    "followed by @MIN_ROWS, e.g. fixed:256, sqrt:16@256, sat:1024")


def parse_budget(spec: str) -> Budget:
  """The budget a short text names (command lines: ``kvm-eval --budget-sweep``, ``--kvm.budget``):
  ``fixed:256`` -> ``FixedBudget(256)``; ``sqrt:16@256`` -> ``PowerLawBudget(16, 0.5,
  min_rows=256)``; ``pow:4:0.75`` -> ``PowerLawBudget(4, 0.75)``; ``sat:1024@1`` ->
  ``SaturatingBudget(1024, min_rows=1)``. ``@MIN`` is the floor of rows (default 0)."""
  text = spec.strip()
  body, _, floor = text.partition("@")
  kind, _, args = body.partition(":")
  parts = args.split(":") if args else []
  arity = {"fixed": 1, "sqrt": 1, "pow": 2, "sat": 1}
  if kind not in arity or len(parts) != arity[kind]:
    raise ValueError(f"budget {spec!r} is not a budget spec; use {BUDGET_SPEC_HELP}.")
  try:
    min_rows = int(floor) if floor else 0
    if kind == "fixed":
      if floor:
        raise ValueError("a fixed budget has no floor")
      return FixedBudget(int(parts[0]))
    if kind == "sqrt":
      return PowerLawBudget(float(parts[0]), 0.5, min_rows=min_rows)
    if kind == "pow":
      return PowerLawBudget(float(parts[0]), float(parts[1]), min_rows=min_rows)
    return SaturatingBudget(int(parts[0]), min_rows=min_rows)
  except ValueError as e:
    raise ValueError(f"budget {spec!r}: {str(e).rstrip('.')}; use {BUDGET_SPEC_HELP}.") from None


def budget_label(budget: Budget) -> str:
  """The short text :func:`parse_budget` reads back (for a callable: its repr)."""
  if isinstance(budget, FixedBudget):
    return f"fixed:{budget.rows}"
  floor = lambda b: f"@{b.min_rows}" if b.min_rows else ""
  rounding = lambda b: "" if b.round_down == 1 else f" (rounded down to {b.round_down})"
  if isinstance(budget, PowerLawBudget):
    head = (f"sqrt:{budget.factor:g}" if budget.exponent == 0.5
            else f"pow:{budget.factor:g}:{budget.exponent:g}")
    return head + floor(budget) + rounding(budget)
  if isinstance(budget, SaturatingBudget):
    return f"sat:{budget.limit}" + floor(budget) + rounding(budget)
  return repr(budget)


def desired_rows(budget: Budget, ctx_len: int, available: int, current: int,
                 max_state_rows: int | None) -> int:
  """The authors' ``_desired_state_len`` (docs/kvm-spec.md §6.3): target, capped, never below
  ``current``."""
  target = budget.target_rows(max(int(ctx_len), 0))
  target = min(target, max(int(available), 0))
  if max_state_rows is not None:
    target = min(target, max_state_rows)
  return max(target, max(int(current), 0))


def bswa_begin(num_tokens: int, chunk_size: int, window_chunks: int) -> int:
  """First token of the exact window once ``num_tokens`` tokens exist (docs/kvm-spec.md §6.4)."""
  chunk_end = _round_down_to_multiple(num_tokens + chunk_size - 1, chunk_size)
  return max(0, chunk_end - window_chunks * chunk_size)


@dataclasses.dataclass(frozen=True)
class KVMSchedule:
  """Everything position-dependent about one sequence of ``seq_len`` tokens, per query chunk ``c``.

  Attributes:
    seq_len: number of real tokens T.
    num_chunks: ceil(T / chunk_size), the scan length.
    initial_rows: rows of the initial state, ``min(T, chunk_size)``.
    state_visible: per chunk, whether its queries attend the state (only chunks at or after the
      window, i.e. query positions >= L; the front uses plain causal attention).
    update_after: per chunk, whether an overflow update fires after the chunk's attention. The
      overflow chunk is then chunk ``c - window_chunks + 1``, the oldest chunk of its window.
    n_append: per chunk, rows appended by that update (0 where no update fires).
    rows_before: per chunk, valid state rows while that chunk attends.
    final_rows: valid rows after the last update (what a prefill leaves in the cache).
  """

  seq_len: int
  num_chunks: int
  initial_rows: int
  state_visible: tuple[bool, ...]
  update_after: tuple[bool, ...]
  n_append: tuple[int, ...]
  rows_before: tuple[int, ...]
  final_rows: int


@functools.lru_cache(maxsize=256)
def kvm_schedule(cfg, seq_len: int) -> KVMSchedule:
  """Replays the authors' prefill loop (docs/kvm-spec.md §6.5) on positions only.

  ``cfg`` is a :class:`kvm_jax.config.kvm.KVMConfig` (hashable, so the result is cached per shape).
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
  C, nb = cfg.chunk_size, cfg.window_chunks
  L = C * nb
  num_chunks = -(-seq_len // C)
  rows = min(seq_len, C)
  coverage = rows
  visible, update, n_append, rows_before = [], [], [], []
  for c in range(num_chunks):
    rows_before.append(rows)
    visible.append(c * C >= L)
    appended, fired = 0, False
    if c * C >= L:  # a query chunk of the main loop (the front has no updates)
      query_end = min(seq_len, (c + 1) * C)
      window_begin = bswa_begin(query_end, C, nb)
      if window_begin != coverage:  # an internal invariant of the schedule, not user input
        raise AssertionError(f"schedule drifted: coverage {coverage} != window start {window_begin}")
      if query_end < seq_len:
        next_begin = bswa_begin(min(seq_len, query_end + C), C, nb)
        if next_begin > window_begin:
          fired = True
          desired = desired_rows(cfg.budget, query_end, next_begin, rows, cfg.max_state_rows)
          appended = min(max(desired - rows, 0), next_begin - window_begin)
          rows += appended
          coverage = next_begin
    update.append(fired)
    n_append.append(appended)
  return KVMSchedule(seq_len=seq_len, num_chunks=num_chunks, initial_rows=min(seq_len, C),
                     state_visible=tuple(visible), update_after=tuple(update),
                     n_append=tuple(n_append), rows_before=tuple(rows_before), final_rows=rows)


def state_rows_after(cfg, seq_len: int) -> int:
  """Valid state rows after processing ``seq_len`` tokens (also the static capacity needed)."""
  return kvm_schedule(cfg, seq_len).final_rows


def average_window_keys(seq_len: int, chunk_size: int, window_chunks: int) -> float:
  """Keys of a chunk-aligned exact window per query, averaged over ``seq_len`` positions: a query
  in the chunk ending at ``end`` sees tokens ``bswa_begin(end) .. t`` (the causal front, before
  the window fills, sees every earlier token). Block sliding-window attention, and KVM's window."""
  total = 0
  for first in range(0, seq_len, chunk_size):
    end = min(seq_len, first + chunk_size)
    # sum over t = first .. end - 1 of (t + 1 - begin)
    total += (first + end + 1) * (end - first) // 2 - bswa_begin(end, chunk_size,
                                                                 window_chunks) * (end - first)
  return total / seq_len


def average_visible_keys(cfg, seq_len: int) -> float:
  """Keys a query attends to, averaged over the ``seq_len`` positions of one KVM sequence: the
  exact window (:func:`average_window_keys`) plus the state rows valid while its chunk attends
  (:func:`kvm_schedule`; the causal front sees no state). What the attention FLOPs of a training
  step scale with."""
  schedule = kvm_schedule(cfg, seq_len)
  C = cfg.chunk_size
  state = sum(rows * (min(seq_len, (c + 1) * C) - c * C)
              for c, (rows, visible) in enumerate(zip(schedule.rows_before,
                                                      schedule.state_visible)) if visible)
  return average_window_keys(seq_len, C, cfg.window_chunks) + state / seq_len
