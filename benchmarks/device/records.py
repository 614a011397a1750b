"""The run's records (``results.jsonl``) and the files a run writes.

Every measurement is one JSON object on its own line, appended and flushed as it is made, so a
stage killed or crashed mid-run keeps everything it measured before. ``kind`` is:

* ``"run"`` — the first line: mode, stages, budgets, the command line;
* ``"plan"`` — the entries a stage will try, with their fields (written by the stage's child
  before its first entry, so the parent can account for entries a crash never reached);
* ``"entry"`` — one measurement: ``status`` ok / failed (ran, wrong or out-of-tolerance numbers) /
  error (raised; ``error`` holds why) / skipped (``reason`` says why: "time", a failed kernel,
  no GPU, ...);
* ``"stage"`` — one per stage, written by the parent: ok / error / timeout / crashed / skipped.

No jax import here: the parent process and the report read records without starting a backend.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import os
import re
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

RESULTS, SUMMARY, STAGES_LOG, CHECK_LOG, ENV_REPORT, TRACE = (
    "results.jsonl", "summary.md", "stages.log", "check.txt", "env.txt", "trace.tar.gz")
# Everything a run may leave in its output folder, the same names in every mode. The device
# machine returns at most 8 files, none deeper than two folders, named in [A-Za-z0-9._-].
OUTPUT_FILES = (RESULTS, SUMMARY, STAGES_LOG, CHECK_LOG, ENV_REPORT, TRACE)

# The Pallas kernels, as the ``kernels`` stage names them and later entries list what they use.
KERNELS = ("readout", "novelty", "merge_target", "add_rows", "decode")
SCAN_KERNELS = ("readout", "novelty", "merge_target", "add_rows")   # a Pallas prefill/backward
DECODE_KERNELS = ("decode", "novelty", "merge_target", "add_rows")  # a decode step that folds

# Errors after which a CUDA context is unusable: every later launch in the process fails too.
STICKY_DEVICE_ERRORS = re.compile(
    r"ILLEGAL_ADDRESS|illegal memory access|MISALIGNED_ADDRESS|ILLEGAL_INSTRUCTION|"
    r"LAUNCH_FAILED|unspecified launch failure|cudaErrorIllegalAddress|CUDA_ERROR_ASSERT")


def plain(x: Any) -> Any:
  """``x`` as strict JSON: NaN/inf become strings, numpy scalars and tuples plain Python."""
  if isinstance(x, dict):
    return {str(k): plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [plain(v) for v in x]
  if isinstance(x, bool) or x is None or isinstance(x, str):
    return x
  if isinstance(x, int):
    return int(x)
  if isinstance(x, float):
    return x if math.isfinite(x) else str(x)
  if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # numpy / jax scalars
    return plain(x.item())
  return str(x)


def append_record(path: Path, record: dict) -> None:
  """Appends one JSON line and flushes it to disk (a killed stage keeps what it wrote)."""
  line = json.dumps(plain(record), allow_nan=False, sort_keys=False)
  with open(path, "a", encoding="utf-8") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
  """The records of a results.jsonl; a torn last line (a stage killed mid-write) is skipped."""
  records = []
  if not path.exists():
    return records
  for line in path.read_text(encoding="utf-8").splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def stage_entries(records: Sequence[dict], stage: str) -> list[dict]:
  """The entry records of ``stage`` (not the stage-level failure record "(stage)")."""
  return [r for r in records if r.get("kind") == "entry" and r.get("stage") == stage
          and r.get("entry") != "(stage)"]


def broken_kernels(records: Sequence[dict]) -> dict[str, str]:
  """Kernel -> why, for each Pallas kernel whose pre-flight entry in the ``kernels`` stage raised
  or crashed its process. Later entries that use one are skipped: a kernel that aborts takes its
  process down, and a sticky CUDA error fails everything after it."""
  broken: dict[str, str] = {}
  for r in stage_entries(records, "kernels"):
    if r.get("status") == "error" and r.get("kernel"):
      broken.setdefault(r["kernel"], f"{r.get('entry')}: {str(r.get('error', ''))[:200]}")
  return broken


def kernel_skip_reason(fields: dict, broken: dict[str, str]) -> Optional[str]:
  """Why an entry described by ``fields`` must not run (it uses a kernel in ``broken``, see
  :func:`broken_kernels`), or None."""
  hit = sorted(set(fields.get("kernels") or ()) & set(broken))
  return f"kernel {', '.join(hit)} failed in the kernels stage" if hit else None


def is_oom(err: BaseException) -> bool:
  text = f"{type(err).__name__}: {err}"
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


class DeviceLost(Exception):
  """Raised by :meth:`Recorder.entry` after it recorded an error that leaves the device unusable
  in this process; the stage's child exits with :data:`EXIT_DEVICE_LOST` and the parent starts a
  fresh process for the entries left."""


EXIT_DEVICE_LOST = 3


@dataclasses.dataclass
class Task:
  """One entry of a stage: ``fn() -> dict`` of measurements, described by ``fields``.

  ``fields["kernels"]`` (optional) names the Pallas kernels the entry runs: it is skipped when
  one of them failed its pre-flight. ``kind``: entries of one kind take about as long as each
  other (the time estimate of :class:`Recorder`)."""

  name: str
  fn: Callable[[], Optional[dict]]
  fields: dict = dataclasses.field(default_factory=dict)
  always: bool = False
  kind: Any = None


class Recorder:
  """Writes one stage's records and keeps its clock.

  :meth:`entry` runs one measurement under an exception guard. An entry is skipped for time when
  the stage's deadline has passed or what is left is shorter than the entry is expected to take
  (as long as the last entry of its kind, else half as long as the last entry); from then on
  every later entry of the stage is skipped too ("skipped: time"). Entries this stage already
  recorded (an earlier process of the same stage, before a crash) are not run again."""

  def __init__(self, path: Path, stage: str, deadline: float,
               crash_entries: Sequence[str] = ()):
    self.path, self.stage, self.deadline = path, stage, deadline
    self.last_seconds = 0.0
    self.seconds_by_kind: dict = {}
    self.time_up = False
    records = read_records(path)
    self.done = {r.get("entry") for r in stage_entries(records, stage)}
    self.broken = broken_kernels(records) if stage != "kernels" else {}
    self.crash_entries = tuple(crash_entries)

  def remaining(self) -> float:
    return self.deadline - time.monotonic()

  def write(self, **record) -> None:
    append_record(self.path, {"stage": self.stage, "time": round(time.time(), 3), **record})

  def run(self, tasks: Sequence[Task]) -> None:
    """Records the plan (every entry with its fields, so that a crashed stage's parent can
    account for the ones never reached), then runs the entries not yet recorded, in order."""
    if not self.done:
      self.write(kind="plan", entries=[t.name for t in tasks],
                 fields={t.name: t.fields for t in tasks})
    for t in tasks:
      if t.name not in self.done:
        self.entry(t.name, t.fn, always=t.always, kind=t.kind, **t.fields)

  def _entry(self, name: str, status: str, fields: dict, extra: dict) -> None:
    self.write(**{**fields, **extra, "kind": "entry", "entry": name, "status": status})

  def _skip(self, name: str, fields: dict, reason: str, **extra) -> None:
    self._entry(name, "skipped", fields, {"reason": reason, **extra})
    print(f"{name}: skipped ({reason})", flush=True)

  def entry(self, name: str, fn: Callable[[], Optional[dict]], always: bool = False,
            kind: Any = None, **fields) -> Optional[dict]:
    """Runs ``fn`` (returns a dict of measurements, or None) and records it; ``fields`` describe
    the entry and are recorded whatever happens. ``fn`` may return ``status``/``reason`` itself
    (e.g. ``status="skipped"`` where cuDNN is absent, ``status="failed"`` for a failed check).
    ``always``: run even when the stage's time is up (it is still killed at budget + grace)."""
    reason = kernel_skip_reason(fields, self.broken)
    if reason:
      return self._skip(name, fields, reason, kernel_errors={
          k: v for k, v in self.broken.items() if k in fields["kernels"]})
    expected = self.seconds_by_kind.get(kind, 0.5 * self.last_seconds)
    if not self.time_up and (self.remaining() <= 0 or self.remaining() < expected):
      self.time_up = True
    if self.time_up and not always:
      return self._skip(name, fields, "time")
    print(f"{name} ...", flush=True)
    start = time.monotonic()
    try:
      if any(c in name for c in self.crash_entries):
        print(f"{name}: planted crash (--crash-entry): abort()", flush=True)
        os.abort()
      result = dict(fn() or {})
      status = result.pop("status", "ok")
      self._entry(name, status, fields, {"seconds": time.monotonic() - start, **result})
      print(f"{name}: {status} {json.dumps(plain(result))[:300]}", flush=True)
      return result
    except Exception as e:  # noqa: BLE001 - one entry's failure is a result, not the end
      text = f"{type(e).__name__}: {e}"
      lost = STICKY_DEVICE_ERRORS.search(text) is not None
      self._entry(name, "error", fields, {"seconds": time.monotonic() - start,
                                          "error": text[:2000], "oom": is_oom(e),
                                          "device_lost": lost})
      print(f"{name}: error\n{traceback.format_exc()}", flush=True)
      if lost:
        raise DeviceLost(text[:300]) from e
      return None
    finally:
      self.last_seconds = self.seconds_by_kind[kind] = time.monotonic() - start
      gc.collect()
