"""``kvm-bench --slots``: how many concurrent requests of a model fit one chip, from compiled memory.

The generation engine serves every request from one decode cache of ``slots`` rows, and one
jitted step (:func:`kvm_jax.generation.engine.step_arguments`: its largest form, lanes feeding
whole prompt pieces) runs them all. Here that step is compiled for the chip (``--topology``,
e.g. ``v5e:1x1`` or ``h100:1x1``; from a CPU-only host through
:func:`kvm_jax.config.target.compile_target`) for a number of slots, and the most slots whose
program (weights, caches, step temporaries) fits the chip's memory are found: two compiles
beyond the prompt lanes' count give the bytes per slot, a third checks the predicted count, and the bracket around it is bisected
until ``n`` fits and ``n + 1`` does not. XLA:TPU refuses a program that does not fit; on GPUs the
compiled bytes are compared with the device memory.

A KVM cache holds the window and a state of a fixed (or slowly growing) number of rows, a full
attention cache every token of the context, so at 32K tokens a chip holds many times the KVM
slots (the paper's motivation); the table prints the ratio against full attention measured in
the same run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Union

# kvm-bench --help must answer without JAX: the functions below import what they run.
if TYPE_CHECKING:
  from kvm_jax.config.model import ModelConfig
  from kvm_jax.config.target import CompiledProgram

MIB = 2 ** 20
#: The presets ``--slots`` compares by default: KVM-256, the √N budget, and full attention (the
#: baseline of the ratio).
DEFAULT_MODELS = ("kvm256_120m", "kvm_sqrt16_120m", "gpta2_120m")
BASELINE = "gpta2_120m"
#: Prompt pieces the compiled step feeds in parallel (the engine's default prefill_lanes).
LANES = 4


@dataclasses.dataclass(frozen=True)
class SlotCapacity:
  """The most slots of ``model`` at ``context`` tokens that fit one chip of ``target``:
  ``slots`` (0: not even one), ``per_slot`` bytes (the compiled program's growth per slot),
  the program at ``slots`` (``fitting``) and at ``slots + 1`` (``failing``)."""

  model: str
  target: str
  context: int
  slots: int
  per_slot: float
  fitting: Optional[CompiledProgram]
  failing: Optional[CompiledProgram]
  compiles: int


def serving_model(model: Union[str, ModelConfig]):
  """An abstract bf16 model of a preset (by name) or a config (nothing allocated)."""
  from flax import nnx
  from kvm_jax import presets
  from kvm_jax.nn.model import LM
  if isinstance(model, str):
    if model not in presets.PRESETS:
      raise ValueError(f"unknown preset {model!r}; choose from {sorted(presets.PRESETS)}.")
    model = presets.PRESETS[model]()
  cfg = dataclasses.replace(model, param_dtype="bfloat16", compute_dtype="bfloat16")
  return nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0)))


def compile_step(model, slots: int, context: int, target, chunk: int) -> CompiledProgram:
  """The engine step for ``slots`` slots of ``context`` tokens compiled for ``target`` (a
  compiler refusal is a result, not an error)."""
  import time
  from kvm_jax.config.target import CompiledProgram, compile_target, compiler_reason
  from kvm_jax.generation.engine import step_arguments
  start = time.perf_counter()
  with compile_target(target) as t:
    step, arguments = step_arguments(model, slots=slots, max_len=context, prefill_chunk=chunk,
                                     prefill_lanes=LANES)
    placed = t.structs(arguments)  # a missing compiler (libtpu) raises here, not below
    try:
      compiled = step.lower(*placed).compile()
    except Exception as e:  # XLA:TPU's refusal of a program that does not fit is the answer
      return CompiledProgram(f"{slots} slots", t.name, False, time.perf_counter() - start,
                             memory=t.memory_per_chip, error=compiler_reason(e))
  m = compiled.memory_analysis()
  return CompiledProgram(f"{slots} slots", t.name, True, time.perf_counter() - start,
                         int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                         int(m.temp_size_in_bytes), int(m.alias_size_in_bytes),
                         t.memory_per_chip)


def most_slots(name: Union[str, ModelConfig], context: int, target, chunk: int = 256,
               progress: Optional[Callable[[CompiledProgram], None]] = None) -> SlotCapacity:
  """:class:`SlotCapacity` of a preset (by name) or a model config (see the module docstring
  for the search)."""
  from kvm_jax.config.target import parse_target
  model = serving_model(name)
  name = name if isinstance(name, str) else "model"
  compiled: dict[int, CompiledProgram] = {}

  def at(slots: int) -> CompiledProgram:
    if slots not in compiled:
      compiled[slots] = compile_step(model, slots, context, target, chunk)
      if progress is not None:
        progress(compiled[slots])
    return compiled[slots]

  if not at(1).fits:
    return SlotCapacity(name, parse_target(target).name, context, 0, 0.0, None, at(1),
                        len(compiled))
  # The step's prompt lanes grow with the slots up to LANES, so the bytes per slot are read
  # beyond them.
  low, high = at(LANES), at(3 * LANES)
  per_slot = ((high.total_bytes - low.total_bytes) / (2 * LANES) if low.ok and high.ok
              else float(at(1).total_bytes))  # refused: its bytes are unknown
  fixed = (low if low.ok else at(1)).total_bytes - per_slot * (LANES if low.ok else 1)
  guess = max(1, int((at(1).memory - fixed) // max(per_slot, 1)))
  lo, hi = 1, None   # lo fits; hi (when known) does not
  for probe in (LANES, 3 * LANES, guess, guess + 1):
    if at(probe).fits:
      lo = max(lo, probe)
    else:
      hi = probe if hi is None else min(hi, probe)
  while hi is None:  # the guess was low: grow until a count does not fit
    probe = lo * 2
    lo, hi = (probe, None) if at(probe).fits else (lo, probe)
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if at(mid).fits else (lo, mid)
  return SlotCapacity(name, parse_target(target).name, context, lo, per_slot, at(lo), at(hi),
                      len(compiled))


def run(args) -> list[dict]:
  """``--slots``: the table for ``args.slots_models`` on ``args.topology`` at
  ``args.context`` tokens; returns its rows."""
  from kvm_jax.config.target import parse_target
  target = parse_target(args.topology)
  if target.device_count != 1:
    raise SystemExit(f"--topology={args.topology}: the engine serves from one chip; name a "
                     "single-chip target (v5e:1x1, v6e:1x1, h100:1x1).")
  models = [m for m in args.slots_models.split(",") if m]
  print(f"engine slots of {args.context} tokens that fit one {target.chip.name} "
        f"({target.memory_per_chip / 2**30:.2f} GiB), from compiled memory:", flush=True)
  capacities = []
  for name in models:
    found = most_slots(name, args.context, target, args.slots_chunk,
                       progress=lambda p, n=name: print(f"  {n}: {p.line()}", flush=True))
    capacities.append(found)
  base = next((c for c in capacities if c.model == BASELINE), None)
  rows = []
  print(f"{'model':>20} {'MiB/slot':>10} {'slots':>7} {'vs ' + BASELINE:>18} {'compiles':>9}")
  for c in capacities:
    ratio = c.slots / base.slots if base is not None and base.slots else None
    rows.append({"model": c.model, "target": c.target, "context": c.context, "slots": c.slots,
                 "mib_per_slot": c.per_slot / MIB, "vs_full_attention": ratio,
                 "bytes_at_slots": c.fitting.total_bytes if c.fitting else None,
                 "refused_at": c.failing.error if c.failing else None})
    print(f"{c.model:>20} {c.per_slot / MIB:10.1f} {c.slots:7d} "
          f"{(f'{ratio:.1f}x' if ratio is not None else '-'):>18} {c.compiles:9d}")
  return rows


def add_flags(p) -> None:
  g = p.add_argument_group("serving capacity; --slots runs only this table")
  g.add_argument("--slots", action="store_true",
                 help="compile the engine's step for one chip and find the most concurrent "
                      "slots of each model that fit (from compiled memory, nothing allocated)")
  g.add_argument("--topology", default="v5e:1x1",
                 help="the chip to compile for: v5e:1x1, v6e:1x1, v5p:1x1x1 or h100:1x1 "
                      "(default: %(default)s; TPUs need libtpu, GPUs the CUDA compile plugins: "
                      "pip install 'kvm_jax[compile]')")
  g.add_argument("--context", type=int, default=32768,
                 help="tokens per slot, the cache's max_len (default: %(default)s)")
  g.add_argument("--slots-models", default=",".join(DEFAULT_MODELS),
                 help="comma-separated presets; the ratio column is against "
                      f"{BASELINE} when it is listed (default: %(default)s)")
  g.add_argument("--slots-chunk", type=int, default=256,
                 help="the engine's prefill_chunk: its lanes feed pieces this long in the "
                      "compiled step (default: %(default)s, the paper's KVM chunk)")
