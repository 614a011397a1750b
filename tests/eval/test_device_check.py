"""The device check (``scripts/device_check.sh``, harness ``benchmarks/device``) on CPU.

A ``--smoke`` run through the script, as the device machine would start it (python3 from a plain
checkout, without grain, tokamax or lm_eval installed), with a planted kernel failure, a planted
stage failure, a planted process crash and a planted hang: the files that come back, their
names and depth, the stage order, baselines before Pallas entries, the restart after the crash
and the skips after the failed kernel. Then the pieces alone: each kernel's pre-flight against
its XLA op, the write-through of kvm-check's output, the report and the follow-up command. No
timing is asserted."""

from __future__ import annotations

import dataclasses

import json
import re
import subprocess
import sys
import tarfile

import jax
import jax.numpy as jnp
import pytest

import kvm_jax as kj
from benchmarks.device import cli, geometry, measure, preflight, records, report, stages
from kvm_jax.kernels.backend import KernelConfig
from tests.helpers import ROOT, subprocess_env

# What the device machine returns: at most 8 files, none deeper than $OUT/a/b/file, named in
# letters, digits, '.', '_' and '-'.
RETURNED_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
BLOCKED = ("grain", "tokamax", "lm_eval")   # not on the GPU machine
BLOCKER = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {BLOCKED!r}:
      raise ModuleNotFoundError(f"No module named {{name!r}} (not on the device machine)")
sys.meta_path.insert(0, _Absent())
"""


def strict_json(line: str) -> dict:
  """json.loads that rejects NaN and Infinity (not JSON, though Python writes them)."""
  def refuse(name):
    raise ValueError(f"non-JSON constant {name} in {line[:200]}")
  return json.loads(line, parse_constant=refuse)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  """One smoke run (stages forked from one parent): the readout kernel's pre-flight raises,
  numerics raises at its start and compile hangs until killed."""
  tmp = tmp_path_factory.mktemp("device_check")
  return device_check(tmp, "--smoke", "--fail-kernel", "readout", "--fail-stage", "numerics",
                      "--hang-stage", "compile", "--timeouts",
                      "kernels=6,check=3,prefill=6,decode=4,backward=3,compile=1,trace=10",
                      "--grace", "2", "--total-budget", "60")


def device_check(tmp, *flags):
  """``bash scripts/device_check.sh FLAGS`` as the device machine runs it (its python, grain,
  tokamax and lm_eval absent), from a folder that is not the repository:
  ``(process, output folder, records)``."""
  block = tmp / "block"
  block.mkdir()
  (block / "sitecustomize.py").write_text(BLOCKER)
  out = tmp / "out"
  env = subprocess_env(tmp, 1, OUT=str(out), PYTHON=sys.executable)
  env["PYTHONPATH"] = f"{block}:{env['PYTHONPATH']}"
  proc = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh"), *flags], env=env,
                        capture_output=True, text=True, timeout=240, cwd=tmp)
  lines = (out / records.RESULTS).read_text().splitlines()
  return proc, out, [strict_json(line) for line in lines]


def _entries(recs, stage, status=None):
  return [r for r in recs if r["kind"] == "entry" and r["stage"] == stage
          and r.get("entry") != "(stage)" and (status is None or r["status"] == status)]


def test_smoke_run_returns_every_file_within_the_machines_limits(smoke_run):
  proc, out, recs = smoke_run
  assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # numerics, compile
  files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
  assert files == sorted(records.OUTPUT_FILES), files  # the same set a full run writes
  assert len(files) <= 8 and all(RETURNED_NAME.match(f) for f in files)
  assert not [p for p in out.rglob("*") if p.is_dir()]
  with tarfile.open(out / records.TRACE) as tar:
    assert tar.getnames()
  log = (out / records.STAGES_LOG).read_text()
  for stage in geometry.STAGES:
    assert f"[{stage}] " in log, stage
  assert "[runner] == env" in log
  env = (out / records.ENV_REPORT).read_text()
  assert "## versions" in env and "## nvidia-smi" in env and '"jax": "' in env
  summary = (out / records.SUMMARY).read_text()
  assert "## Stages" in summary and "planted failure" in summary
  for stage in geometry.STAGES:
    assert f"| {stage} |" in summary
  # nothing the device machine lacks was imported
  assert "not on the device machine" not in log


def test_smoke_run_order_restarts_and_skips(smoke_run):
  _, _, recs = smoke_run
  assert recs[0]["kind"] == "run" and recs[0]["mode"] == "smoke"
  stage_recs = [r for r in recs if r["kind"] == "stage"]
  order = [r["stage"] for r in stage_recs]
  assert order == list(geometry.STAGES)
  assert order.index("kernels") == 1 and order.index("kernels") < order.index("compile")
  status = {r["stage"]: r for r in stage_recs}
  assert status["env"]["status"] == "ok"
  assert status["numerics"]["status"] == "error" and "planted" in status["numerics"]["note"]
  assert status["compile"]["status"] == "timeout"
  for r in recs:
    if r["kind"] == "entry":
      assert r["status"] in ("ok", "failed", "error", "skipped"), r
      assert r["status"] != "skipped" or r.get("reason"), r

  # the failed kernel is recorded with its error; every later entry using it is skipped for it
  readout = [r for r in _entries(recs, "kernels") if r["kernel"] == "readout"]
  assert readout[0]["status"] == "error" and "planted" in readout[0]["error"]
  assert all(r["status"] == "error" or r["reason"] == "time" for r in readout)
  users = [r for r in recs if r["kind"] == "entry" and "readout" in (r.get("kernels") or [])
           and r["stage"] not in ("kernels", "numerics", "compile")]  # (those two never ran)
  # (the decode step has its own kernel: a Pallas decode entry does not use the readout)
  assert {r["stage"] for r in users} >= {"check", "prefill", "backward", "trace"}
  assert all(r["status"] == "skipped" and re.match(r"kernel .*readout.* failed in the kernels "
                                                   r"stage", r["reason"]) for r in users), users

  # baselines (cuDNN, XLA attention, KVM-XLA) recorded before any Pallas entry
  for stage in ("prefill", "decode", "backward"):
    impls = [r["impl"] for r in _entries(recs, stage)]
    pallas = [i for i, impl in enumerate(impls) if measure.is_pallas(impl)]
    others = [i for i, impl in enumerate(impls) if not measure.is_pallas(impl)]
    assert pallas and others and max(others) < min(pallas), (stage, impls)
  cudnn = [r for r in _entries(recs, "prefill") if r["impl"] == "cudnn"]
  assert all(r["status"] == "skipped" for r in cudnn) and "GPU" in cudnn[0]["reason"]  # no GPU
  # packed documents: the XLA path keeps each document as it is alone (smoke reaches this entry)
  exact = _entries(recs, "documents")[0]
  assert exact["entry"].startswith("exact: xla") and exact["status"] == "ok", exact
  assert exact["rel_rms"] <= exact["tolerance"] and exact["documents"] >= 5

  # every planned entry is accounted for exactly once, whatever stopped its stage
  for plan in (r for r in recs if r["kind"] == "plan"):
    got = [r["entry"] for r in _entries(recs, plan["stage"])]
    assert sorted(got) == sorted(plan["entries"]), plan["stage"]


def test_full_run_isolation_restarts_a_crashed_stage(tmp_path):
  """The full run's isolation (a fresh interpreter per stage, as on the GPU): the process running
  prefill's ``full-xla T=256`` aborts (SIGABRT, as a Triton abort would); that entry is recorded
  with the signal, and a new process runs the entries after it."""
  proc, out, recs = device_check(tmp_path, "--smoke", "--isolation", "subprocess", "--stages",
                                 "prefill", "--crash-entry", "full-xla T=256",
                                 "--timeouts", "prefill=20", "--total-budget", "40")
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  stage = [r for r in recs if r["kind"] == "stage" and r["stage"] == "prefill"][0]
  assert stage["status"] == "ok" and stage["restarts"] == 1 and "signal 6" in stage["note"]
  entries = {r["entry"]: r for r in _entries(recs, "prefill")}
  assert entries["full-xla T=256"]["status"] == "error"
  assert "crashed (signal 6)" in entries["full-xla T=256"]["error"]
  assert entries["kvm-xla T=256"]["status"] == "ok"  # measured by the restarted process
  assert len(_entries(recs, "prefill")) == len(entries)  # nothing recorded twice
  log = (out / records.STAGES_LOG).read_text()
  assert "planted crash" in log and "restarting for" in log


# (kernel, G) of every pre-flight entry (both modes run G in {1, 4})
assert geometry.SMOKE.kernel_groups == geometry.PAPER.kernel_groups
PREFLIGHTS = [(k, G) for k in records.KERNELS
              for G in (geometry.PAPER.kernel_groups if k in preflight.GROUPED else (1,))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernel_preflights_agree_with_their_xla_ops(dtype):
  """Every pre-flight entry (kernels interpreted here) passes against its XLA op, and a wrong
  kernel fails it: the comparison is real."""
  geo, kc, dt = geometry.SMOKE, KernelConfig.for_target(), jnp.dtype(dtype)
  chosen = PREFLIGHTS if dtype == "float32" else [("readout", 4), ("decode", 4)]
  for kernel, G in chosen:
    result = preflight.comparison(kernel, geo, G, dt, kc).run()
    assert result["status"] == "ok", (kernel, G, result)
  if dtype == "float32":
    wrong = preflight.merge_target(geo, dt, kc, first_row=2).run()
    assert wrong["status"] == "failed" and wrong["differences"] > 0


@pytest.mark.slow  # 25 s; tests/kernels/test_chip_compile.py compiles these kernels for an H100 every run
@pytest.mark.chip_compile
def test_kernel_preflights_compile_for_an_h100():
  """At the paper's pre-flight shapes (B=1, Hkv=2, C=256, D=128, R=256), every pre-flight kernel
  is a Triton custom call that compiles for an H100 on this CPU-only machine, in both dtypes (the
  kernels' own compile tests, tests/kernels/test_chip_compile.py, cover TPU and the larger shapes)."""
  for dtype in (jnp.bfloat16, jnp.float32):
    for kernel, G in PREFLIGHTS:
      with kj.compile_target("h100:1x1") as chip:
        c = preflight.comparison(kernel, geometry.PAPER, G, dtype, KernelConfig.for_target())
        lowered = jax.jit(c.kernel).lower(*chip.structs(c.args))
        lowered.compile()
      assert "xla.gpu.triton" in lowered.as_text(), (kernel, G, dtype)


def test_check_output_is_written_through_before_a_failure(tmp_path, monkeypatch):
  """kvm-check's lines reach check.txt as they are printed, so a stage killed mid-case keeps
  them: here the case raises after printing."""
  def fake_main(argv):
    print("kvm-check on cpu: first line", flush=True)
    assert (tmp_path / records.CHECK_LOG).read_text().endswith("first line\n")
    raise RuntimeError("killed mid-case")

  monkeypatch.setattr(stages.check, "main", fake_main)
  rec = records.Recorder(tmp_path / records.RESULTS, "check", deadline=1e18)
  ctx = measure.Context(out=tmp_path, geo=geometry.SMOKE, repeats=1)
  stages.stage_check(rec, ctx)
  text = (tmp_path / records.CHECK_LOG).read_text()
  assert "$ kvm-check --size small --no-grads --cases 1 --ops kvm" in text and "first line" in text
  entry = records.read_records(tmp_path / records.RESULTS)[-1]
  assert entry["status"] == "error" and "killed mid-case" in entry["error"]


def test_full_check_stage_runs_the_kvm_cases_then_the_baselines(tmp_path, monkeypatch):
  """At the paper's geometry every KVM case is an entry of its own (``--ops kvm``: the baselines
  must not run again with each case), and the OVQ and RWKV-7 checks are one last entry that uses
  no Pallas kernel (a broken kernel does not skip it)."""
  calls = []

  def fake_main(argv):
    calls.append(argv)
    print("1/1 checks passed")
    return 0

  monkeypatch.setattr(stages.check, "main", fake_main)
  rec = records.Recorder(tmp_path / records.RESULTS, "check", deadline=1e18)
  geo = dataclasses.replace(geometry.PAPER, check_cases=2)
  stages.stage_check(rec, measure.Context(out=tmp_path, geo=geo, repeats=1))
  assert calls == [["--size", "paper", "--cases", "1", "--ops", "kvm"],
                   ["--size", "paper", "--cases", "2", "--ops", "kvm"],
                   ["--size", "paper", "--ops", "ovq,rwkv7"]]
  entries = records.read_records(tmp_path / records.RESULTS)
  assert entries[-1]["entry"] == "baselines: ovq, rwkv7" and entries[-1]["kernels"] == []
  assert all(e["status"] == "ok" for e in entries[-3:])


def test_recorder_skips_entries_of_broken_kernels_and_recorded_entries(tmp_path):
  path = tmp_path / records.RESULTS
  records.append_record(path, {"kind": "entry", "stage": "kernels", "entry": "decode bf16 G=1",
                               "kernel": "decode", "status": "error", "error": "Boom"})
  records.append_record(path, {"kind": "entry", "stage": "kernels", "entry": "novelty bf16",
                               "kernel": "novelty", "status": "failed"})  # wrong, not broken
  records.append_record(path, {"kind": "entry", "stage": "decode", "entry": "full-xla",
                               "status": "ok"})  # recorded by a process that crashed later
  assert records.broken_kernels(records.read_records(path)) == {"decode": "decode bf16 G=1: Boom"}
  ran = []
  rec = records.Recorder(path, "decode", deadline=1e18)
  rec.run([records.Task(n, lambda n=n: ran.append(n), {"kernels": k}) for n, k in (
      ("full-xla", []), ("kvm-xla", []), ("kvm-pallas", list(records.DECODE_KERNELS)))])
  assert ran == ["kvm-xla"]
  last = records.read_records(path)[-1]
  assert last["entry"] == "kvm-pallas" and last["status"] == "skipped"
  assert last["reason"] == "kernel decode failed in the kernels stage"


def test_a_lost_device_ends_the_process_and_a_new_one_runs_the_rest(tmp_path, monkeypatch):
  """An error that leaves the CUDA context unusable is recorded, ends the stage's process with
  its own exit code, and the runner starts a fresh process for the entries after it (forked
  here, with a stand-in stage that touches no device)."""
  import argparse
  import os
  from benchmarks.device import runner

  def stage(rec, ctx):
    def lose():
      raise RuntimeError("INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access")
    rec.run([records.Task("first", lambda: {"pid": os.getpid()}), records.Task("lost", lose),
             records.Task("after", lambda: {"pid": os.getpid()})])

  monkeypatch.setattr(runner, "stage_function", lambda name: stage)
  args = argparse.Namespace(out=str(tmp_path), isolation="fork", smoke=True, repeats=None,
                            fast_compile=False, compile_cache=None, crash_entry=None,
                            hang_stage=None, fail_stage=None, fail_kernel=None)
  runner.prepare_out(tmp_path, overwrite=False)
  log = runner.StageLog(tmp_path / records.STAGES_LOG)
  status, extra = runner.run_one_stage("decode", args, [], log, soft=30.0, grace=5.0)
  recs = {r["entry"]: r for r in records.read_records(tmp_path / records.RESULTS)
          if r["kind"] == "entry"}
  assert recs["lost"]["status"] == "error" and recs["lost"]["device_lost"]
  assert recs["first"]["status"] == recs["after"]["status"] == "ok"
  assert recs["first"]["pid"] != recs["after"]["pid"]  # a fresh process ran the rest
  assert status == "ok" and extra["restarts"] == 1 and "device lost" in extra["note"]


def test_summary_from_records_and_follow_up_command(tmp_path):
  path = tmp_path / records.RESULTS
  records.append_record(path, {"kind": "run", "mode": "full", "stages": ["prefill", "check"],
                               "budgets_s": {"check": 120, "prefill": 70}})
  for impl, ms in (("cudnn", 8.0), ("kvm-xla", 4.0), ("kvm-pallas", float("nan"))):
    records.append_record(path, {"kind": "entry", "stage": "prefill", "entry": f"{impl} T=4096",
                                 "status": "ok", "impl": impl, "T": 4096, "batch": 8, "ms": ms,
                                 "ms_per_seq": ms / 8})
  records.append_record(path, {"kind": "entry", "stage": "check", "entry": "case 2",
                               "status": "skipped", "reason": "time"})
  records.append_record(path, {"kind": "stage", "stage": "prefill", "status": "ok",
                               "seconds": 3.0, "entries": {"ok": 3}})
  records.append_record(path, {"kind": "entry", "stage": "decode", "entry": "(stage)",
                               "status": "error", "error": "RuntimeError: boom"})
  with open(path, "a") as f:
    f.write('{"kind": "entry", "stage": "deco')  # a line torn by a killed stage
  recs = [strict_json(line) for line in path.read_text().splitlines()[:-1]]
  assert recs[3]["ms"] == "nan"  # NaN is written as a string, never as bare NaN
  text = report.write_summary(tmp_path)
  assert (tmp_path / records.SUMMARY).read_text() == text
  assert "| 4096 | kvm-xla | 8 | ok | 4 | 0.5 | cudnn | 2 |" in text  # 8 ms ÷ 4 ms
  assert "skipped: time" in text and "- decode: RuntimeError: boom" in text
  # only the stage cut short by time, three times its budget, within one device call
  command = report.follow_up(recs)
  assert command == ("bash scripts/device_check.sh --stages check --timeouts check=360 "
                     "--total-budget 540")
  assert command in text
  args = cli.parser().parse_args(command.split()[2:])
  assert args.stages == ["check"] and args.timeouts == {"check": 360.0}
  # README's example is what a run cut short in check and compile prints
  cut = [{"kind": "run", "mode": "full"}] + [
      {"kind": "entry", "stage": s, "entry": "x", "status": "skipped", "reason": "time"}
      for s in ("compile", "check")]
  assert report.follow_up(cut) in (ROOT / "README.md").read_text()


def test_help_explains_every_flag_and_the_plan_fits():
  text = " ".join(cli.parser().format_help().split())
  for flag in ("--out", "--overwrite", "--smoke", "--stages", "--timeouts", "--total-budget",
               "--grace", "--repeats", "--isolation", "--fast-compile", "--compile-cache",
               "--fail-stage", "--hang-stage", "--crash-entry", "--fail-kernel", "--summarize",
               "--child", "--child-deadline"):
    assert re.search(rf"{flag}\b[^\n]*?\s\w", text), flag
  for stage in geometry.STAGES:
    assert stage in text
  for name in records.OUTPUT_FILES:
    assert name in text
  # the whole full run, its grace and a parent's start inside 9 minutes and a half (a lease of
  # 15 minutes then keeps time for the machine's start and a follow-up)
  assert sum(geometry.BUDGETS.values()) == geometry.TOTAL_BUDGET["full"]
  assert geometry.TOTAL_BUDGET["full"] + geometry.GRACE["full"] + 20 <= 9.5 * 60
  assert set(geometry.BUDGETS) == set(geometry.SMOKE_BUDGETS) == set(geometry.STAGES)
  # T reaches R rows and folds once into the full state: R + 3 chunks at the paper's geometry
  cfg = measure.kvm_config(geometry.PAPER, kj.FixedBudget(1024))
  assert measure.length_for_rows(cfg, 1024) == 1024 + 3 * 256
  assert kj.state_rows_after(cfg, 1024 + 3 * 256) == 1024
  assert geometry.longest_first([4096, 8192, 16384, 32768]) == [32768, 4096, 8192, 16384]
  assert geometry.baselines_first(["kvm-pallas", "cudnn", "kvm-xla"], measure.is_pallas) == [
      "cudnn", "kvm-xla", "kvm-pallas"]
  for bad in (["--timeouts", "nonsense=3"], ["--timeouts", "check=0"], ["--stages", "x"],
              ["--fail-kernel", "softmax"]):
    with pytest.raises(SystemExit):
      cli.parser().parse_args(bad)


def test_an_earlier_runs_files_are_not_mixed_in(tmp_path):
  from benchmarks.device import runner
  (tmp_path / records.RESULTS).write_text('{"kind": "run"}\n')
  with pytest.raises(SystemExit, match="--overwrite"):
    runner.prepare_out(tmp_path, overwrite=False)
  runner.prepare_out(tmp_path, overwrite=True)
  assert not (tmp_path / records.RESULTS).exists() and (tmp_path / records.CHECK_LOG).exists()


def test_documents_stage_rows_and_entries(tmp_path):
  """The documents stage's exactness rows hold the lengths they promise, and its Pallas-exactness
  and forward-timing entries run at the smoke geometry (its smoke budget reaches only the first
  entry). Its mix is kvm-bench's (``packed_segments``, checked by hand in test_eval_speed.py)."""
  from benchmarks.device import documents
  C, T = geometry.SMOKE.chunk, geometry.SMOKE.num_length
  rows = documents.exact_layout(T, C)
  assert all(sum(map(abs, r)) == T for r in rows)
  lengths = [n for r in rows for n in r if n > 0]
  assert {1, C - 1, C, C + 1} <= set(lengths) and max(lengths) > 2 * C
  assert any(n < 0 for r in rows for n in r)
  with pytest.raises(ValueError, match="T >= 10"):
    documents.exact_layout(9 * C, C)

  ctx = measure.Context(out=tmp_path, geo=geometry.SMOKE, repeats=1)
  exact = documents._exact_pallas(ctx)
  assert exact["status"] == "ok" and exact["rows_same"], exact
  timing = documents._timing(ctx, backward=False)
  assert timing["plain_ms"] > 0 and timing["one_ratio"] > 0 and timing["mix_ratio"] > 0
  assert timing["documents_in_mix"] >= geometry.SMOKE.batch
