"""scripts/device_check.sh and its driver (kvm_jax.eval.device_check) in --smoke mode on CPU: every
stage leaves a record, one failing or hung stage does not stop the others, and the report is
built from the records. No timing is asserted."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import kvm_jax as kj
from kvm_jax.eval import device_check as dc
from tests.conftest import ROOT


def strict_json(line: str) -> dict:
  """json.loads that rejects NaN and Infinity (not JSON, though Python writes them)."""
  def refuse(name):
    raise ValueError(f"non-JSON constant {name} in {line[:200]}")
  return json.loads(line, parse_constant=refuse)


def test_smoke_run_survives_a_failed_and_a_hung_stage(tmp_path, subprocess_environ):
  out = tmp_path / "out"
  env = subprocess_environ(1, OUT=str(out), PYTHON=sys.executable)
  # check raises at its start, trace hangs until killed (budget 1 s + grace 1 s); short budgets
  # (each stage's first entry still runs) and the total budget bound the run on a busy machine.
  proc = subprocess.run(
      ["bash", str(ROOT / "scripts" / "device_check.sh"), "--smoke", "--fail-stage", "check",
       "--hang-stage", "trace", "--timeouts", "compile=2,numerics=2,prefill=3,decode=3,"
       "backward=2,trace=1", "--grace", "1", "--total-budget", "28"],
      env=env, capture_output=True, text=True, timeout=150)
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]

  lines = (out / "results.jsonl").read_text().splitlines()
  records = [strict_json(line) for line in lines]
  assert records[0]["kind"] == "run" and records[0]["mode"] == "smoke"
  stages = [r for r in records if r["kind"] == "stage"]
  assert [r["stage"] for r in stages] == list(dc.STAGES)  # one line per stage, in order
  status = {r["stage"]: r["status"] for r in stages}
  assert status["env"] == "ok"
  assert status["check"] == "error" and "planted failure" in stages[3]["note"]
  assert status["trace"] == "timeout"
  for r in records:
    if r["kind"] == "entry":
      assert r["status"] in ("ok", "failed", "error", "skipped"), r
      assert r["status"] != "skipped" or r.get("reason"), r

  def entries(stage, st=None):
    return [r for r in records if r["kind"] == "entry" and r["stage"] == stage
            and (st is None or r["status"] == st)]

  assert {"versions", "devices", "memory", "config"} <= {r["entry"] for r in entries("env", "ok")}
  assert [r for r in entries("env", "ok") if r["entry"] == "devices"][0]["backend"] == "cpu"
  # the stages after the failed one ran and measured something (a busy machine may cut them short)
  assert entries("prefill", "ok") and status["prefill"] in ("ok", "timeout")
  ran_after = [s for s in ("prefill", "decode", "backward") if entries(s)]
  assert ran_after == ["prefill", "decode", "backward"]
  # no GPU here: cuDNN is recorded as skipped, with why
  cudnn = [r for r in entries("prefill") if r.get("impl") == "cudnn"]
  assert cudnn and all(r["status"] == "skipped" for r in cudnn)
  assert any("GPU" in r["reason"] for r in cudnn)
  # every planned entry of the stages that ran is accounted for
  for plan in (r for r in records if r["kind"] == "plan"):
    if status[plan["stage"]] == "ok":
      assert {r["entry"] for r in entries(plan["stage"])} == set(plan["entries"])

  summary = (out / "summary.md").read_text()
  assert "## Stages" in summary and "planted failure" in summary
  for stage in dc.STAGES:
    assert f"| {stage} |" in summary
  assert (out / "logs" / "trace.log").exists() and (out / "console.txt").exists()


def test_summary_from_records_and_strict_json(tmp_path):
  path = tmp_path / dc.RESULTS
  dc.append_record(path, {"kind": "run", "mode": "full", "stages": ["prefill", "decode"]})
  for impl, ms in (("cudnn", 8.0), ("kvm-xla", 4.0), ("kvm-pallas", float("nan"))):
    dc.append_record(path, {"kind": "entry", "stage": "prefill", "entry": f"{impl} T=4096",
                            "status": "ok", "impl": impl, "T": 4096, "batch": 8, "ms": ms,
                            "ms_per_seq": ms / 8})
  dc.append_record(path, {"kind": "entry", "stage": "prefill", "entry": "kvm-xla T=8192",
                          "status": "skipped", "reason": "time"})
  dc.append_record(path, {"kind": "stage", "stage": "prefill", "status": "ok", "seconds": 3.0,
                          "entries": {"ok": 3, "skipped": 1}})
  dc.append_record(path, {"kind": "entry", "stage": "decode", "entry": "(stage)",
                          "status": "error", "error": "RuntimeError: boom"})
  dc.append_record(path, {"kind": "stage", "stage": "decode", "status": "error",
                          "note": "RuntimeError: boom"})
  with open(path, "a") as f:
    f.write('{"kind": "entry", "stage": "deco')  # a line torn by a killed stage
  records = [strict_json(line) for line in path.read_text().splitlines()[:-1]]
  assert records[3]["ms"] == "nan"  # NaN is written as a string, never as bare NaN
  text = dc.write_summary(tmp_path)
  assert (tmp_path / dc.SUMMARY).read_text() == text
  assert "| 4096 | kvm-xla | 8 | ok | 4 | 0.5 | cudnn | 2 |" in text  # 8 ms ÷ 4 ms
  assert "skipped: time" in text and "- decode: RuntimeError: boom" in text


def test_help_explains_every_flag_and_shapes():
  text = " ".join(dc.parser().format_help().split())
  for flag in ("--out", "--smoke", "--stages", "--timeouts", "--total-budget", "--grace",
               "--repeats", "--isolation", "--fast-compile", "--compile-cache", "--fail-stage",
               "--hang-stage", "--summarize", "--child", "--child-deadline"):
    assert re.search(rf"{flag}\b[^\n]*?\s\w", text), flag
  for stage in dc.STAGES:
    assert stage in text
  # T reaches R rows and folds once into the full state: R + 3 chunks at the paper's geometry
  cfg = dc.kvm_config(dc.PAPER, kj.FixedBudget(1024))
  assert dc.length_for_rows(cfg, 1024) == 1024 + 3 * 256
  assert kj.state_rows_after(cfg, 1024 + 3 * 256) == 1024
  assert dc.length_for_rows(dc.kvm_config(dc.PAPER, kj.FixedBudget(256)), 256) == 4 * 256
  assert dc.longest_first([4096, 8192, 16384, 32768]) == [32768, 4096, 8192, 16384]
  with pytest.raises(SystemExit):
    dc.parser().parse_args(["--timeouts", "nonsense=3"])
