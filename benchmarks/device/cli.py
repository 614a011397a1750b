"""The prepared check of a GPU machine: ``bash scripts/device_check.sh [FLAGS]`` (the script runs
``python3 -m benchmarks.device`` from a plain checkout, no install needed).

Stages, in order, each in its own child process under its own wall-clock budget (counted from the
process's start, imports and CUDA start-up included), so a hung compile or a crash loses only the
entry it was running; a crashed stage is restarted for the entries it had not reached:

  env       jax/jaxlib versions, devices, memory statistics, configuration, nvidia-smi;
  kernels   pre-flight: each Pallas kernel (readout, novelty, merge target, row accumulation,
            decode) once at B=1, Hkv=2, G in {1, 4}, C=256, D=128, R=256, bf16 and f32, against
            its XLA op; a kernel that raises or crashes is recorded and every later entry that
            uses it is skipped, with the reason;
  numerics  Pallas vs XLA outputs, final state and every routing decision (B=2, H=8, D=128,
            T=4096, bf16 and f32, GQA and MHA interleaved), again under float32 matmuls;
  check     kvm-check --size paper, one KVM case per entry (then OVQ and RWKV-7 in one more),
            written through to check.txt;
  prefill   forward time at T = 4K..32K, B=8, H=32, D=128, bf16, FixedBudget(256);
  decode    64 decode steps at a 32K context in one jitted fori_loop;
  backward  gradient memory (compiled memory_analysis) and time at T = 8K..32K;
  documents packed documents (segment_ids): each document of two packed rows against itself
            alone (XLA, float32, T=4096), the op's time with segment ids over its time without
            (forward, then forward + backward; T=8192, B=8, H=32, D=128, bf16; one document per
            row and a log-normal mix with median 600 tokens), then Pallas against XLA on the
            exactness rows (outputs and state rows);
  compile   compile-only matrix: forward, gradient and decode step, Pallas then XLA, MHA and
            GQA, R in {256, 1024, 4096};
  trace     one jax.profiler trace of KVM prefill steps, packed into trace.tar.gz.

In every timing stage the cuDNN and XLA entries run, and are recorded, before any Pallas entry.
Budgets (seconds): env 15, kernels 40, numerics 45, check 120, prefill 85, decode 40, backward 45,
documents 90, compile 30, trace 20; 530 in all plus a 10 s grace: the whole run fits in 9 minutes
and a half.

Files in the output folder (--out, default $OUT, else ./device_out), the same set in every mode
and never more than six, none in a subfolder (the device machine returns at most 8 files):
  results.jsonl  one JSON object per measurement, appended and flushed as it is made;
  summary.md     the tables, built from results.jsonl at the end (--summarize rebuilds it),
                 with a follow-up command for the stages that ran out of time;
  stages.log     every line every stage's process printed, prefixed by [stage];
  check.txt      kvm-check's output as it prints;
  env.txt        the environment report, nvidia-smi included;
  trace.tar.gz   the profiler trace (absent if the trace did not run or came out over 15 MiB).

Follow-up while the machine is still warm, e.g. the check with a larger budget:
  bash scripts/device_check.sh --stages check --timeouts check=400 --total-budget 420

--smoke runs the same stages and writes the same files at tiny shapes (B=1, H=2, D=16, chunk 16,
T <= 256) on whatever backend is present; on CPU the Pallas kernels run interpreted and cuDNN is
recorded as skipped. The exit status is 0 when every stage finished (even if some of its entries
failed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.device.geometry import BUDGETS, GRACE, PAPER, SMOKE, SMOKE_BUDGETS, STAGES, \
    TOTAL_BUDGET
from benchmarks.device.records import KERNELS
from benchmarks.device.report import write_summary


def _timeouts(text: str) -> dict:
  out = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    try:
      seconds = float(value)
    except ValueError:
      seconds = -1.0
    if name not in STAGES or seconds <= 0:
      raise argparse.ArgumentTypeError(f"--timeouts: {item!r}; expected STAGE=SECONDS (> 0) "
                                       f"with STAGE one of {', '.join(STAGES)}")
    out[name] = seconds
  return out


def _stages(text: str) -> list:
  names = [s for s in text.split(",") if s]
  bad = [s for s in names if s not in STAGES]
  if bad:
    raise argparse.ArgumentTypeError(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
  return [s for s in STAGES if s in names]  # always in pipeline order


def _kernels(text: str) -> str:
  bad = [k for k in text.split(",") if k and k not in KERNELS]
  if bad:
    raise argparse.ArgumentTypeError(f"--fail-kernel: unknown {bad}; choose from "
                                     f"{', '.join(KERNELS)}")
  return text


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="bash scripts/device_check.sh", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=os.environ.get("OUT", "device_out"),
                 help="output folder (default: $OUT, else ./device_out); see the file list above")
  p.add_argument("--overwrite", action="store_true",
                 help="replace the files of an earlier run in --out (without it such a folder is "
                      "refused, so two runs' records never mix)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes (B=1, H=2, D=16, chunk 16, T <= 256, R in {16, 32}) and short "
                      "budgets on whatever backend is present (CPU: Pallas interpreted, cuDNN "
                      "skipped): the whole pipeline in about a minute, the same files")
  p.add_argument("--stages", type=_stages, default=list(STAGES),
                 help=f"comma-separated stages to run, always in pipeline order (default: all of "
                      f"{','.join(STAGES)})")
  p.add_argument("--timeouts", type=_timeouts, default={},
                 help="per-stage wall-clock budgets in seconds, e.g. 'check=400,prefill=120' "
                      f"(defaults: full {BUDGETS}; smoke {SMOKE_BUDGETS}). A stage starts no "
                      "entry past its budget (the rest are recorded 'skipped: time') and is "
                      "killed at budget + --grace")
  p.add_argument("--total-budget", type=float, default=None,
                 help="wall-clock budget of all stages together, in seconds (default: "
                      f"{TOTAL_BUDGET['full']:.0f} full, {TOTAL_BUDGET['smoke']:.0f} smoke); a "
                      "stage gets at most what is left, minus the grace")
  p.add_argument("--grace", type=float, default=None,
                 help="seconds a stage may overrun its budget to finish the entry in progress "
                      f"before it is killed (default: {GRACE['full']:.0f} full, "
                      f"{GRACE['smoke']:.0f} smoke)")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed runs after the warm-up of every timing, reported as their median "
                      f"(default: {PAPER.repeats} full, {SMOKE.repeats} smoke)")
  p.add_argument("--isolation", choices=("auto", "fork", "subprocess"), default="auto",
                 help="how a stage's child process starts: 'subprocess' (a fresh 'python -m "
                      "benchmarks.device --child STAGE': ~2 s of imports per stage, and no state "
                      "of the parent can leak into a GPU stage), 'fork' (the parent imports "
                      "kvm_jax once, touching no device, and forks: saves the imports, for CPU "
                      "runs) or 'auto' (default: fork with --smoke, subprocess otherwise)")
  p.add_argument("--fast-compile", action=argparse.BooleanOptionalAction, default=None,
                 help="set jax_disable_most_optimizations in the stages (default: on with "
                      "--smoke, off otherwise; timings with it on mean little)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="persistent compilation cache folder shared by the stages (default: none, "
                      "so every compile time is a real compile)")
  p.add_argument("--fail-stage", default=None, metavar="STAGES",
                 help="testing: these comma-separated stages raise at their start; shows that a "
                      "failed stage does not stop the next ones")
  p.add_argument("--hang-stage", default=None, metavar="STAGES",
                 help="testing: these stages hang until killed at their budget + grace")
  p.add_argument("--crash-entry", default=None, metavar="NAMES",
                 help="testing: an entry whose name contains one of these comma-separated "
                      "strings aborts its process (SIGABRT, as a Triton abort would); shows that "
                      "the stage restarts for the entries after it")
  p.add_argument("--fail-kernel", type=_kernels, default=None, metavar="KERNELS",
                 help=f"testing: the pre-flight of these kernels ({', '.join(KERNELS)}) raises; "
                      "shows that later entries using them are skipped")
  p.add_argument("--summarize", action="store_true",
                 help="only rebuild summary.md from OUT/results.jsonl and print it")
  p.add_argument("--child", choices=STAGES, default=None, metavar="STAGE",
                 help="internal (--isolation subprocess): run only this stage, in this process, "
                      "appending to OUT/results.jsonl")
  p.add_argument("--child-deadline", type=float, default=None, metavar="EPOCH",
                 help="internal: when the --child stage starts no more entries, in seconds since "
                      "the epoch (default: now + its full-run budget)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser().parse_args(argv)
  if args.fast_compile is None:
    args.fast_compile = args.smoke
  if args.isolation == "auto":
    args.isolation = "fork" if args.smoke else "subprocess"
  out = Path(args.out)
  if args.summarize:
    print(write_summary(out), end="")
    return 0
  from benchmarks.device import runner
  if args.child:  # --isolation subprocess: this process is one stage
    deadline = args.child_deadline or time.time() + BUDGETS[args.child]
    return runner.run_stage(args.child, args, deadline)
  return runner.run_all(args, argv)
