"""The parent process: runs each stage in a child process under its own budget, collects every
child's output into one ``stages.log`` (each line prefixed by its stage), restarts a stage whose
process crashed for the entries it had not reached, and writes the report.

A stage's child is a fresh ``python -m benchmarks.device --child STAGE`` (``--isolation
subprocess``, the default of a full run: no state of the parent can leak into a GPU stage) or a
fork of the parent, which imported kvm_jax once and touched no device (``fork``, the default with
``--smoke``: saves the imports on CPU). Either way the child leads its own process group, so a
kill at the budget also ends whatever it started.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.device.geometry import BUDGETS, GRACE, PAPER, SMOKE, SMOKE_BUDGETS, STAGES, \
    TOTAL_BUDGET
from benchmarks.device.records import CHECK_LOG, ENV_REPORT, EXIT_DEVICE_LOST, OUTPUT_FILES, \
    RESULTS, STAGES_LOG, DeviceLost, Recorder, append_record, broken_kernels, kernel_skip_reason, \
    read_records, stage_entries
from benchmarks.device.report import write_summary

RESTART_MIN_SECONDS = 10.0  # a restart pays imports and CUDA start-up again: below this, no restart


def _names(text: Optional[str]) -> set[str]:
  return set(filter(None, (text or "").split(",")))


STAGE_FUNCTIONS = {"env": "stages.stage_env", "kernels": "preflight.stage_kernels",
                   "numerics": "stages.stage_numerics", "check": "stages.stage_check",
                   "prefill": "timings.stage_prefill", "decode": "timings.stage_decode",
                   "backward": "timings.stage_backward",
                   "documents": "documents.stage_documents", "compile": "stages.stage_compile",
                   "trace": "stages.stage_trace"}


def stage_function(stage: str):
  """The function that runs ``stage``, imported on demand: only a stage's process needs jax,
  and only its own module."""
  module, _, name = STAGE_FUNCTIONS[stage].partition(".")
  return getattr(importlib.import_module(f"benchmarks.device.{module}"), name)


def run_stage(stage: str, args, deadline: float) -> int:
  """Body of a stage's child process: runs the stage until ``deadline`` (``time.time()``; no
  entry starts after it). Exit code: 0 finished (entries' own errors are records, not failures),
  1 the stage itself raised, :data:`EXIT_DEVICE_LOST` an entry left the device unusable."""
  out = Path(args.out)
  rec = Recorder(out / RESULTS, stage, time.monotonic() + (deadline - time.time()),
                 crash_entries=sorted(_names(args.crash_entry)))
  try:
    if stage in _names(args.hang_stage):
      print("planted hang (--hang-stage)", flush=True)
      while True:
        time.sleep(1.0)
    if stage in _names(args.fail_stage):
      raise RuntimeError(f"planted failure of stage {stage!r} (--fail-stage)")
    import jax
    if args.fast_compile:
      jax.config.update("jax_disable_most_optimizations", True)
    if args.compile_cache:
      jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    from benchmarks.device.measure import Context
    geo = SMOKE if args.smoke else PAPER
    ctx = Context(out=out, geo=geo, repeats=args.repeats or geo.repeats,
                  fail_kernels=frozenset(_names(args.fail_kernel)))
    stage_function(stage)(rec, ctx)
    return 0
  except DeviceLost as e:
    print(f"device unusable in this process ({e}); the runner restarts the stage", flush=True)
    return EXIT_DEVICE_LOST
  except Exception as e:  # noqa: BLE001
    rec.write(kind="entry", entry="(stage)", status="error",
              error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    traceback.print_exc()
    return 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()


class StageLog:
  """``stages.log``: every line of every stage's process, prefixed by ``[stage]``; the runner's
  own lines are prefixed ``[runner]`` and also printed."""

  def __init__(self, path: Path):
    self.path = path
    self.lock = threading.Lock()

  def line(self, prefix: str, text: str) -> None:
    with self.lock, open(self.path, "a", encoding="utf-8") as f:
      f.write(f"[{prefix}] {text.rstrip()}\n")

  def runner(self, text: str) -> None:
    print(text, flush=True)
    self.line("runner", text)

  def follow(self, stage: str, fd: int) -> threading.Thread:
    """A thread that copies the lines read from ``fd`` into the log until the writer closes."""
    def copy():
      with os.fdopen(fd, "rb") as pipe:
        for raw in pipe:
          self.line(stage, raw.decode("utf-8", "replace"))

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _wait_forked(pid: int, timeout: float) -> Optional[int]:
  """The exit code of forked child ``pid`` (negative: killed by that signal), or None at
  ``timeout``."""
  end = time.monotonic() + timeout
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.waitstatus_to_exitcode(status)
    if time.monotonic() >= end:
      return None
    time.sleep(0.05)


class Child:
  """One stage's process, leading its own process group: a fork (``popen`` None) or a fresh
  interpreter (``popen``); ``fd`` is the read end of its stdout and stderr."""

  def __init__(self, pid: int, fd: int, popen: Optional[subprocess.Popen] = None):
    self.pid, self.fd, self.popen = pid, fd, popen

  def wait(self, timeout: float) -> Optional[int]:
    """The exit code (negative: killed by that signal), or None at ``timeout``."""
    if self.popen is None:
      return _wait_forked(self.pid, max(0.0, timeout))
    try:
      return self.popen.wait(max(0.0, timeout))
    except subprocess.TimeoutExpired:
      return None

  def kill(self) -> None:
    """SIGTERM to the whole group, SIGKILL if it is still there 3 s later."""
    for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
      try:
        os.killpg(self.pid, sig)
      except ProcessLookupError:
        return
      if self.wait(pause) is not None:
        return


def _start(stage: str, args, argv: Sequence[str], deadline: float) -> Child:
  """Starts one stage's child in a new process group."""
  if args.isolation == "fork":
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its fds 1 and 2 (Python's and XLA's output) go to the pipe
      code = 1
      try:
        os.setsid()
        os.close(read)
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        code = run_stage(stage, args, deadline)
      finally:
        os._exit(code)
    os.close(write)
    return Child(pid, read)
  cmd = [sys.executable, "-m", "benchmarks.device", *argv, "--child", stage,
         "--child-deadline", f"{deadline:.3f}"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  fd = os.dup(proc.stdout.fileno())
  proc.stdout.close()
  return Child(proc.pid, fd, proc)


def _launch(stage: str, args, argv: Sequence[str], log: StageLog, deadline: float,
            hard: float) -> tuple[str, Optional[int]]:
  """One process of ``stage``: ``(status, exit code)`` with status ok / error / device lost /
  timeout / crashed."""
  child = _start(stage, args, argv, deadline)
  reader = log.follow(stage, child.fd)
  code = child.wait(hard)
  if code is None:
    child.kill()
  reader.join(timeout=10)
  if code is None:
    return "timeout", None
  if code == 0:
    return "ok", 0
  if code == 1:
    return "error", 1
  if code == EXIT_DEVICE_LOST:
    return "device lost", code
  return (f"crashed (signal {-code})" if code < 0 else f"crashed (exit {code})"), code


def _unreached(records: list[dict], stage: str) -> tuple[list[str], dict]:
  """The planned entries of ``stage`` not yet recorded, and the plan's fields."""
  plans = [r for r in records if r.get("stage") == stage and r.get("kind") == "plan"]
  plan = plans[-1] if plans else {}
  done = {r.get("entry") for r in stage_entries(records, stage)}
  return [e for e in plan.get("entries", []) if e not in done], plan.get("fields") or {}


def _counts(records: list[dict], stage: str) -> dict:
  counts: dict[str, int] = {}
  for r in stage_entries(records, stage):
    counts[r["status"]] = counts.get(r["status"], 0) + 1
  return counts


def run_one_stage(stage: str, args, argv: Sequence[str], log: StageLog, soft: float,
                  grace: float) -> tuple[str, dict]:
  """Runs ``stage`` within ``soft`` seconds (+ ``grace`` to finish the entry in progress),
  restarting its process after a crash or a lost device for the entries not yet reached.
  Returns the stage's status and its stage record's extra fields."""
  results = Path(args.out) / RESULTS
  start = time.monotonic()
  deadline = time.time() + soft   # the child's clock starts now, not after its imports
  crashes, restarts = [], 0   # what ended a process early, and how many replaced one
  while True:
    status, code = _launch(stage, args, argv, log, deadline,
                           deadline + grace - time.time())
    records = read_records(results)
    missing, fields = _unreached(records, stage)
    if status == "ok" or not missing:
      break
    if status == "error":  # the stage itself raised (recorded as "(stage)"): the rest not run
      for e in missing:
        append_record(results, {"stage": stage, **fields.get(e, {}), "kind": "entry",
                                "entry": e, "status": "skipped", "reason": "stage error"})
      break
    # timeout or crash: the entry in progress is recorded as this process's error
    if status != "device lost":
      why = (f"stage killed at its budget ({soft + grace:.0f} s) during this entry"
             if status == "timeout" else f"stage process {status} during this entry")
      append_record(results, {"stage": stage, **fields.get(missing[0], {}), "kind": "entry",
                              "entry": missing[0], "status": "error", "error": why})
      if status != "timeout":
        crashes.append(f"{status} in {missing[0]!r}")
      missing = missing[1:]
    else:
      crashes.append("device lost")
    left = deadline - time.time()
    if status == "timeout" or not missing or left < RESTART_MIN_SECONDS:
      reason = "time" if status == "timeout" or left < RESTART_MIN_SECONDS else status
      broken = broken_kernels(records)
      for e in missing:
        f = fields.get(e, {})
        append_record(results, {"stage": stage, **f, "kind": "entry", "entry": e,
                                "status": "skipped",
                                "reason": kernel_skip_reason(f, broken) or reason})
      break
    restarts += 1
    log.runner(f"== {stage}: {crashes[-1]}; restarting for {len(missing)} entries "
               f"({left:.0f} s left)")
  records = read_records(results)
  notes = []
  if status == "error":
    errs = [r for r in records if r.get("stage") == stage and r.get("entry") == "(stage)"]
    notes.append(errs[-1].get("error") if errs else None)
  elif status == "timeout":
    notes.append(f"killed after {time.monotonic() - start:.0f} s")
  if crashes:
    notes.append(f"{', '.join(crashes)}; {restarts} restart(s)")
  if status.startswith("crashed") or status == "device lost":
    status = "crashed"   # the last process crashed too: entries left are recorded skipped
  return status, {"exit_code": code, "seconds": time.monotonic() - start, "budget_s": soft,
                  "entries": _counts(records, stage), "restarts": restarts,
                  "note": "; ".join(filter(None, notes)) or None}


def prepare_out(out: Path, overwrite: bool) -> None:
  """Creates the output folder and the text files every run leaves, refusing to mix two runs."""
  out.mkdir(parents=True, exist_ok=True)
  present = [n for n in OUTPUT_FILES if (out / n).exists()]
  if present and not overwrite:
    raise SystemExit(f"{out} already holds {', '.join(present)} from an earlier run; pass "
                     "--overwrite to replace them, or choose another --out (or $OUT).")
  for n in present:
    (out / n).unlink()
  for name, head in ((CHECK_LOG, "# kvm-check output, written as it prints\n\n"),
                     (ENV_REPORT, "# Environment of the device check\n\n"),
                     (STAGES_LOG, "")):
    (out / name).write_text(head, encoding="utf-8")


def run_all(args, argv: Sequence[str]) -> int:
  """Every stage in order; the exit status is 0 when every stage finished (even if some of its
  entries failed or a crash was recovered from), 1 otherwise."""
  out = Path(args.out)
  prepare_out(out, args.overwrite)
  log = StageLog(out / STAGES_LOG)
  results = out / RESULTS
  mode = "smoke" if args.smoke else "full"
  budgets = {**(SMOKE_BUDGETS if args.smoke else BUDGETS), **args.timeouts}
  total = args.total_budget if args.total_budget is not None else TOTAL_BUDGET[mode]
  grace = args.grace if args.grace is not None else GRACE[mode]
  append_record(results, {"kind": "run", "mode": mode, "stages": args.stages,
                          "budgets_s": budgets, "total_budget_s": total, "grace_s": grace,
                          "isolation": args.isolation, "fast_compile": args.fast_compile,
                          "argv": list(argv), "time": round(time.time(), 3)})
  if args.isolation == "fork":
    # Imported once here (no device is touched: no backend starts before the fork) and shared
    # by every forked stage instead of being imported nine times.
    for stage in STAGES:
      stage_function(stage)
  start = time.monotonic()
  all_ok = True
  for stage in args.stages:
    left = total - (time.monotonic() - start)
    soft = min(float(budgets[stage]), left - grace)
    if soft < 1.0:
      append_record(results, {"kind": "stage", "stage": stage, "status": "skipped",
                              "reason": "time", "seconds": 0.0})
      log.runner(f"== {stage}: skipped (time)")
      all_ok = False
      continue
    log.runner(f"== {stage} (budget {soft:.0f} s)")
    status, extra = run_one_stage(stage, args, argv, log, soft, grace)
    all_ok &= status == "ok"
    append_record(results, {"kind": "stage", "stage": stage, "status": status, **extra})
    log.runner(f"== {stage}: {status} in {extra['seconds']:.1f} s; entries {extra['entries']}"
               + (f"; {extra['note']}" if extra["note"] else ""))
  text = write_summary(out)
  print(text, flush=True)
  return 0 if all_ok else 1
