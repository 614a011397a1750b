"""Several processes: two real ``jax.distributed`` CPU processes x 2 devices train, evaluate, resume,
stop on SIGTERM and load a run exactly like one process with 4 devices.

Each ``kvm-train`` below is a subprocess (a process can initialize ``jax.distributed`` once);
the processes talk through gloo over 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvm_jax.generation.engine import generate_many
from kvm_jax.generation.generate import SamplingConfig, generate
from kvm_jax.runs.directory import load_trained, logits_fn
from kvm_jax.runs.launch import free_local_port
from kvm_jax.train.evaluation import evaluate
from kvm_jax.train.main import main

from tests.helpers import ROOT
from tests.helpers.processes import TIMEOUT, finish, launch, process_env, run_metrics
TINY = ["--config=train/configs/tiny_mqar.py", "--config.steps=8", "--config.warmup_steps=2",
        "--config.batch_size=8", "--config.mqar.seq_len=64", "--config.mqar.num_pairs=4",
        "--config.log_every=1", "--config.checkpoint_every=4", "--config.eval_every=0",
        "--config.mesh_data=2", "--config.mesh_fsdp=2"]


def _train(workdir: Path, processes: int, *extra: str) -> list[tuple[int, str, str]]:
  cmd = [sys.executable, "-m", "kvm_jax.train.main", f"--workdir={workdir}", *TINY, *extra]
  results = finish(launch(cmd, processes))
  for i, (code, _, err) in enumerate(results):
    assert code == 0, f"process {i} of {processes} failed:\n{err[-3000:]}"
  return results


def _close(a: float, b: float, rtol: float) -> bool:
  return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-30)


# Run by every process of the second half of the test below: kvm-train's own main() resumes the
# run, then the run is loaded with parameters spanning the processes and used.
RESUME_AND_USE = """
import json, sys
import jax, numpy as np
from flax import nnx
from kvm_jax.train.main import main
workdir, launch = sys.argv[1], sys.argv[2:]
assert main([f"--workdir={workdir}", *TINY, *launch]) == 0  # starts jax.distributed
from kvm_jax.generation.generate import SamplingConfig, generate
from kvm_jax.runs.directory import load_trained, logits_fn
from kvm_jax.runs.launch import free_local_port
from kvm_jax.train.evaluation import evaluate
cfg, model, step = load_trained(workdir)
assert not jax.tree_util.tree_leaves(model)[0].is_fully_addressable  # spans both processes
tokens = np.arange(2 * 64).reshape(2, 64) % 128
logits = np.asarray(logits_fn(model)(tokens))
out, _ = generate(model, tokens[:, :40], max_new_tokens=5, key=jax.random.key(0),
                  sampling=SamplingConfig(temperature=0.0))
from kvm_jax.generation.engine import generate_many
many = generate_many(model, [tokens[0, :40].tolist(), tokens[1, :23].tolist()],
                     max_new_tokens=[5, 7], slots=2, prefill_chunk=16)
graphdef, params = nnx.split(model)
ev = evaluate(graphdef, params, cfg, 2)
print("RESULT", json.dumps({"step": step, "logits": float(np.abs(logits).sum()),
                            "tokens": np.asarray(out).tolist(), "eval": ev, "many": many}))
"""


@pytest.mark.slow  # 2+ minutes of four multi-process runs; the launch and mesh checks stay in CI
def test_two_processes_train_resume_and_load_like_one(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  reference = _train(one, 1)
  assert "in-process collectives" not in reference[0][2], reference[0][2][-2000:]
  results = _train(two, 2)
  a, b = run_metrics(one), run_metrics(two)
  assert sorted(a) == sorted(b) == list(range(1, 9))  # one line per step, written once
  # The same program on the same 4-device mesh with the same (gloo) collectives, which kvm-train
  # also gives one CPU process (--cpu-collectives): bitwise the same losses.
  assert all(a[s]["loss"] == b[s]["loss"] for s in a), [(s, a[s]["loss"], b[s]["loss"])
                                                          for s in a]
  # Only process 0 talks: process 1 prints none of the trainer's lines. (Its stdout still holds
  # gloo's connection notices, which a C++ stream may write in pieces, so they are not parsed.)
  assert "final:" in results[0][1]
  for marker in ("step ", "final:", "loss", "wrote", "compile"):
    assert marker not in results[1][1], (marker, results[1][1][-2000:])

  # Resume after the newest checkpoint is deleted: both processes restart from step 4 and redo
  # steps 5..8 exactly (the same program on the same data: bitwise). Then load_trained, logits,
  # generation and the trainer's evaluation with parameters spanning both processes give what
  # one process computes from the same checkpoint, and the same on both processes.
  shutil.rmtree(two / "checkpoints" / "8")
  script = f"TINY = {TINY!r}\n" + RESUME_AND_USE
  results = finish(launch([sys.executable, "-c", script, str(two)], 2))
  seen = []
  for code, out, err in results:
    assert code == 0, err[-3000:]
    seen.append(json.loads(next(l for l in out.splitlines() if l.startswith("RESULT"))[7:]))
  assert "resumed from step 4" in results[0][1]
  c = run_metrics(two)
  assert sorted(c) == list(range(1, 9))
  # Resumed, not restarted: steps 1..4 keep the lines the first run wrote (timings included), and
  # the resumed processes' first step is 5 (each process start logs compile_s once).
  assert all(c[s] == b[s] for s in range(1, 5))
  assert [s for s in c if "compile_s" in c[s]] == [1, 5]
  assert all(c[s]["loss"] == b[s]["loss"] for s in b), [(s, b[s]["loss"], c[s]["loss"])
                                                          for s in b]
  assert seen[0] == seen[1]
  cfg, model, step = load_trained(two)
  tokens = np.arange(2 * 64).reshape(2, 64) % 128
  out, _ = generate(model, jnp.asarray(tokens[:, :40]), max_new_tokens=5, key=jax.random.key(0),
                    sampling=SamplingConfig(temperature=0.0))
  graphdef, params = nnx.split(model)
  ev = evaluate(graphdef, params, cfg, 2)
  assert seen[0]["step"] == step == 8
  assert _close(seen[0]["logits"], float(np.abs(np.asarray(logits_fn(model)(tokens))).sum()),
                1e-5)
  assert seen[0]["tokens"] == np.asarray(out).tolist()
  # The engine on the pod: every process ran the same steps and read the same tokens, those of
  # one process, and the first prompt's are generate's.
  many = generate_many(model, [tokens[0, :40].tolist(), tokens[1, :23].tolist()],
                       max_new_tokens=[5, 7], slots=2, prefill_chunk=16)
  assert seen[0]["many"] == seen[1]["many"] == many
  assert many[0] == np.asarray(out)[0, 40:].tolist()
  assert all(_close(seen[0]["eval"][k], ev[k], 1e-5) for k in ev), (seen[0]["eval"], ev)


@pytest.mark.slow  # one process's SIGTERM save and resume run in CI in tests/train/test_train.py
def test_sigterm_on_one_process_stops_both_at_one_saved_step(tmp_path):
  workdir = tmp_path / "term"
  cmd = [sys.executable, "-m", "kvm_jax.train.main", f"--workdir={workdir}", *TINY,
         "--config.steps=400", "--config.checkpoint_every=1000", "--config.eval_every=0"]
  procs = launch(cmd, 2)
  deadline = time.time() + TIMEOUT
  metrics = workdir / "metrics.jsonl"
  while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().split()) >= 3):
    assert all(p.poll() is None for p in procs), "a process ended before the signal"
    time.sleep(0.1)
  procs[1].send_signal(signal.SIGTERM)  # the other process never gets a signal
  results = finish(procs)
  assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
  last = max(run_metrics(workdir))
  assert last < 400
  saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert saved == [last], (saved, last)  # one checkpoint, written by both, at the stop step
  assert f"preempted: saved step {last}" in results[0][1]


def test_cpu_device_count_is_read_before_jax_starts(monkeypatch):
  from kvm_jax.runs.launch import requested_cpu_devices
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("XLA_FLAGS", "--foo=1 --xla_force_host_platform_device_count=4")
  assert requested_cpu_devices() == 4
  monkeypatch.setenv("XLA_FLAGS", "")
  assert requested_cpu_devices() == 1
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")  # CPU collectives do not matter there
  assert requested_cpu_devices() == 1


def test_launch_flags_are_checked(tmp_path, capsys):
  with pytest.raises(SystemExit, match="only apply with --distributed"):
    main(["--config=train/configs/tiny_mqar.py", f"--workdir={tmp_path}", "--num-processes=2"])
  with pytest.raises(SystemExit, match="HOST:PORT"):
    main(["--config=train/configs/tiny_mqar.py", f"--workdir={tmp_path}", "--distributed",
          "--coordinator=localhost", "--num-processes=2", "--process-id=0"])
  with pytest.raises(SystemExit, match="--process-id=2 must lie in"):
    main(["--config=train/configs/tiny_mqar.py", f"--workdir={tmp_path}", "--distributed",
          "--coordinator=127.0.0.1:1", "--num-processes=2", "--process-id=2"])
  with pytest.raises(SystemExit, match="A:B"):
    main(["--config=train/configs/tiny_mqar.py", f"--workdir={tmp_path}", "--profile-steps=3"])
  # Nothing to auto-detect here (no pod, SLURM or MPI): a clear error, not a hang.
  out = subprocess.run([sys.executable, "-m", "kvm_jax.train.main", f"--workdir={tmp_path}",
                        "--config=train/configs/tiny_mqar.py", "--distributed"], cwd=ROOT,
                       env=process_env(1), capture_output=True, text=True, timeout=120)
  assert out.returncode != 0 and "give --coordinator, --num-processes and --process-id" in \
      out.stderr, out.stderr[-2000:]
  from kvm_jax.eval import cli as eval_cli  # kvm-eval shares the launch flags
  with pytest.raises(SystemExit, match="--coordinator only apply with --distributed"):
    eval_cli.main(["--checkpoint", str(tmp_path), "--coordinator=127.0.0.1:1"])


def test_a_mesh_that_does_not_fit_the_processes_is_a_clear_error(tmp_path):
  cmd = [sys.executable, "-m", "kvm_jax.train.main", f"--workdir={tmp_path / 'bad'}", *TINY,
         "--config.mesh_data=3", "--config.mesh_fsdp=1"]
  results = finish(launch(cmd, 2))
  for code, _, err in results:
    assert code != 0
    assert "does not divide the 4 available devices (2 processes x 2 devices each)" in err, \
        err[-2000:]
