"""The stages in the order they run, their budgets, and every shape of the two modes.

The order puts the most valuable numbers first, so that a short lease loses the least: the
environment, a pre-flight of every Pallas kernel, numerics (Pallas vs XLA), ``kvm-check``, the
prefill / decode / backward timings against cuDNN attention, packed documents (exactness, and the
op's time with segment ids against without), then the compile-only matrix and one profiler trace
if time remains.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

STAGES = ("env", "kernels", "numerics", "check", "prefill", "decode", "backward", "documents",
          "compile", "trace")

# Seconds per stage, counted from the start of the stage's process (imports and CUDA start-up
# included). Full: 530 s in all; with the grace below and the parent's own start the whole run
# stays inside 9 minutes and a half on an H200 (a lease of 15 minutes keeps time for a follow-up).
BUDGETS = {"env": 15, "kernels": 40, "numerics": 45, "check": 120, "prefill": 85, "decode": 40,
           "backward": 45, "documents": 90, "compile": 30, "trace": 20}
# Smoke: tiny shapes on any backend (CPU: Pallas interpreted); each stage's first entries.
SMOKE_BUDGETS = {"env": 10, "kernels": 10, "numerics": 5, "check": 15, "prefill": 5,
                 "decode": 5, "backward": 5, "documents": 5, "compile": 5, "trace": 5}
TOTAL_BUDGET = {"full": 530.0, "smoke": 75.0}
GRACE = {"full": 10.0, "smoke": 8.0}


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Every shape of one mode (paper or smoke)."""

  batch: int
  heads: int
  kv_heads: tuple[int, ...]       # compile matrix: MHA and a GQA variant
  head_dim: int
  dtype: str
  chunk: int
  window_chunks: int
  rope_dims: int
  compile_rows: tuple[int, ...]
  # kernels pre-flight: B=1, kernel_kv_heads, groups G (query heads per KV head), kernel_rows
  kernel_kv_heads: int
  kernel_groups: tuple[int, ...]
  kernel_rows: int
  kernel_chunk: int
  kernel_head_dim: int
  # numerics
  num_batch: int
  num_heads: int
  num_kv_heads: tuple[int, ...]
  num_length: int
  num_budget: tuple[float, float, int]   # PowerLawBudget(factor, exponent, min_rows)
  # kvm-check
  check_size: str
  check_args: tuple[str, ...]
  check_cases: Optional[int]     # None: every case of the size
  check_baselines: bool          # one more entry: kvm-check --ops ovq,rwkv7
  # timings (KVM: FixedBudget(timing_rows), MHA)
  timing_rows: int
  prefill_lengths: tuple[int, ...]
  decode_context: int
  decode_steps: int
  backward_lengths: tuple[int, ...]
  trace_length: int
  trace_steps: int
  repeats: int
  # documents: exactness at the numerics' shapes (float32), timing at doc_length
  doc_length: int


PAPER = Geometry(batch=8, heads=32, kv_heads=(32, 8), head_dim=128, dtype="bfloat16", chunk=256,
                 window_chunks=2, rope_dims=64, compile_rows=(256, 1024, 4096),
                 kernel_kv_heads=2, kernel_groups=(1, 4), kernel_rows=256, kernel_chunk=256,
                 kernel_head_dim=128,
                 num_batch=2, num_heads=8, num_kv_heads=(8, 2), num_length=4096,
                 num_budget=(16.0, 0.5, 256), check_size="paper", check_args=(),
                 check_cases=None, check_baselines=True, timing_rows=256,
                 prefill_lengths=(4096, 8192, 16384, 32768), decode_context=32768,
                 decode_steps=64, backward_lengths=(8192, 16384, 32768), trace_length=16384,
                 trace_steps=2, repeats=3, doc_length=8192)
SMOKE = Geometry(batch=1, heads=2, kv_heads=(2, 1), head_dim=16, dtype="bfloat16", chunk=16,
                 window_chunks=2, rope_dims=8, compile_rows=(16, 32),
                 kernel_kv_heads=2, kernel_groups=(1, 4), kernel_rows=16, kernel_chunk=16,
                 kernel_head_dim=16,
                 num_batch=1, num_heads=2, num_kv_heads=(2, 1), num_length=256,
                 num_budget=(2.0, 0.5, 16), check_size="small", check_args=("--no-grads",),
                 check_cases=1, check_baselines=False,
                 timing_rows=32, prefill_lengths=(128, 256), decode_context=256,
                 decode_steps=8, backward_lengths=(128, 256), trace_length=256, trace_steps=2,
                 repeats=2, doc_length=256)


def baselines_first(entries, is_pallas) -> list:
  """``entries`` with every non-Pallas entry (cuDNN, XLA attention, the KVM XLA scan) before
  any Pallas entry, each group in its given order: a Pallas entry that aborts its process or
  poisons the device then costs no baseline."""
  entries = list(entries)
  return [e for e in entries if not is_pallas(e)] + [e for e in entries if is_pallas(e)]


def longest_first(lengths) -> list[int]:
  """The longest length, then the others ascending: when a stage runs out of time it loses the
  middle of the range, not its most telling end."""
  rest = sorted(lengths)
  return rest[-1:] + rest[:-1]
