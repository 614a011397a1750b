"""Test processes of ``kvm-train`` and scripts: one process with 4 CPU devices or several joined
by ``jax.distributed`` (gloo over 127.0.0.1), their outcome, and a run's logged metrics by step."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from kvm_jax.runs.launch import free_local_port
from tests.helpers import ROOT, subprocess_xla_flags

TIMEOUT = 400


def process_env(devices: int) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT),
             JAX_DISABLE_MOST_OPTIMIZATIONS="true")  # tiny programs: compile fast
  env["XLA_FLAGS"] = subprocess_xla_flags(devices)
  return env


def launch(command: list[str], processes: int) -> list[subprocess.Popen]:
  """``command`` as one process with 4 devices, or as ``processes`` processes of 4/processes
  devices joined by ``--distributed`` (the flags of kvm-train; a script gets them as argv)."""
  if processes == 1:
    return [subprocess.Popen(command, cwd=ROOT, env=process_env(4), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)]
  port = free_local_port()
  return [subprocess.Popen(command + ["--distributed", f"--coordinator=127.0.0.1:{port}",
                                      f"--num-processes={processes}", f"--process-id={i}"],
                           cwd=ROOT, env=process_env(4 // processes), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
          for i in range(processes)]


def finish(procs: list[subprocess.Popen], timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
  """(returncode, stdout, stderr) of every process; all are killed if one hangs."""
  deadline, results = time.time() + timeout, []
  try:
    for p in procs:
      out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
      results.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  return results


def run_metrics(workdir: Path) -> dict[int, dict]:
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if l]
  steps = [l["step"] for l in lines]
  assert len(set(steps)) == len(steps), f"a step was logged twice: {steps}"
  return {l["step"]: l for l in lines}
