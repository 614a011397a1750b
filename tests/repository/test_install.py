"""A regular (not editable) install works on its own: run from another directory, with the
repository out of sight, it imports the trainer and the evaluations under the one name ``kvm_jax``
(no module named ``train``, ``eval`` or ``pallas_kernels`` is ever loaded), ships the lm-eval task
files, leaves out the device check's harness (``benchmarks/``), and the console scripts answer
``--help``.

The install is real (``pip install --no-deps`` of a copy of the repository, built from source, into
a fresh virtual environment); the environment sees the test environment's dependencies through a
``.pth`` line, so nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.helpers import ROOT  # noqa: E402
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]

IMPORTS = """
import sys, kvm_jax, kvm_jax.train.loop, kvm_jax.train.main, kvm_jax.eval.cli, kvm_jax.eval.check
import kvm_jax.eval.bench.speed, kvm_jax.eval.lm_eval_adapter, kvm_jax.kernels.readout, kvm_jax.runs
from kvm_jax.eval.lm_eval_adapter import TASKS_DIR
print("FILE", kvm_jax.__file__)
print("TASKS", sorted(p.name for p in TASKS_DIR.glob("*/*.yaml")))
print("FOLDERS", sorted(m for m in sys.modules if m.split(".")[0] in ("train", "eval",
                                                                    "pallas_kernels")))
"""


def _tracked_copy(dest: Path) -> Path:
  """The repository's tracked and new files (what a clone has), without build artifacts."""
  files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.split()
  for name in files:
    if (ROOT / name).is_file():
      (dest / name).parent.mkdir(parents=True, exist_ok=True)
      shutil.copy2(ROOT / name, dest / name)
  return dest


def test_regular_install_from_another_directory(tmp_path):
  source = _tracked_copy(tmp_path / "src")
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  python = venv / "bin" / "python"
  site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], check=True, capture_output=True,
                             text=True).stdout.strip())
  # The dependencies come from this test environment (appended after the venv's own packages).
  parent = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
  (site / "test_environment.pth").write_text("\n".join(sorted(parent)) + "\n")
  install = subprocess.run(
      [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
       "--quiet", "--target", str(site), str(source)], capture_output=True, text=True)
  assert install.returncode == 0, install.stderr[-3000:]
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
  env["JAX_PLATFORMS"] = "cpu"
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()

  out = subprocess.run([python, "-c", IMPORTS], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
  assert Path(lines["FILE"]).is_relative_to(site), lines["FILE"]  # the install, not the repo
  assert lines["FOLDERS"] == "[]"
  assert lines["TASKS"] == str(["kvm_local_choice.yaml", "kvm_local_generate.yaml",
                                "kvm_local_perplexity.yaml"])
  assert not (site / "train").exists() and not (site / "eval").exists()
  assert not (site / "pallas_kernels").exists()
  # the device check's harness (benchmarks/) runs from a checkout only: nothing of it installed
  assert not (site / "benchmarks").exists()
  assert not [p for p in site.rglob("*device_check*")], "device_check installed"

  # Every console script is installed; the three a user needs first answer --help.
  for name in SCRIPTS:
    assert (site / "bin" / name).exists(), name
  for name in ("kvm-train", "kvm-eval", "kvm-check"):
    help_ = subprocess.run([python, site / "bin" / name, "--help"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, timeout=300)
    assert help_.returncode == 0, (name, help_.stderr[-2000:])
    assert f"usage: {name}" in help_.stdout, (name, help_.stdout[:500])
