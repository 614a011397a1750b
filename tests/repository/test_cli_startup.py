"""The commands start fast: ``--help`` of every console script imports no JAX (nor Flax, orbax or
the model), and the persistent compilation cache (kvm_jax.util.compilation_cache) is on by default, so
a second run of the same programs compiles nothing.

Whether JAX was imported is checked, not the time: a fresh interpreter runs the script's entry
point with ``--help`` and reports what ``sys.modules`` holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvm_jax.util import compilation_cache

from tests.helpers import ROOT  # noqa: E402
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
HEAVY = ("jax", "flax", "orbax", "optax", "grain")
# Console scripts whose --help may still import JAX, each until its module defers it.
NOT_YET_LAZY: frozenset[str] = frozenset()

HELP_PROBE = """
import importlib, json, sys
module, function = sys.argv[1].split(":")
try:
  getattr(importlib.import_module(module), function)(["--help"])
except SystemExit:
  pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))))
"""


def heavy_modules_of_help(entry: str, where: Path = ROOT) -> tuple[list[str], str]:
  """The heavy top-level packages (:data:`HEAVY`) loaded by ``entry(["--help"])`` in a fresh
  interpreter started in ``where``, and the help text it printed."""
  out = subprocess.run([sys.executable, "-c", HELP_PROBE, entry, ",".join(HEAVY)],
                       capture_output=True, text=True, timeout=120, cwd=where)
  assert out.returncode == 0, out.stderr[-2000:]
  *help_lines, loaded = out.stdout.rstrip("\n").split("\n")
  return json.loads(loaded), "\n".join(help_lines)


@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - NOT_YET_LAZY))
def test_help_imports_no_jax(script):
  loaded, text = heavy_modules_of_help(SCRIPTS[script])
  assert f"usage: {script}" in text, text[:500]
  assert not loaded, (f"{script} --help imported {loaded}: import them in main() after the "
                      "arguments are parsed")


def test_the_probe_sees_an_eager_import(tmp_path):
  """The probe itself: a command whose module imports JAX at the top is reported."""
  (tmp_path / "eager_cli.py").write_text(
      "import argparse\nimport jax\n\n\ndef main(argv=None):\n"
      "  argparse.ArgumentParser(prog='eager').parse_args(argv)\n")
  loaded, text = heavy_modules_of_help("eager_cli:main", tmp_path)
  assert "usage: eager" in text and "jax" in loaded


def test_every_compiling_command_takes_the_cache_flag():
  """Each script but kvm-data (which compiles nothing) documents --compilation-cache."""
  for script in sorted(set(SCRIPTS) - NOT_YET_LAZY - {"kvm-data"}):
    assert "--compilation-cache" in heavy_modules_of_help(SCRIPTS[script])[1], script


def test_package_names_resolve_on_first_use():
  """``import kvm_jax`` loads no JAX; every public name resolves, ``dir()`` lists them, and
  ``kj.generate`` stays the function even when the module ``kvm_jax.generation.generate`` is imported first
  (Python binds a submodule on its package)."""
  probe = """
import sys, kvm_jax, kvm_jax.train, kvm_jax.runs, kvm_jax.hf, kvm_jax.tasks, kvm_jax.ops
print("jax" in sys.modules)
from kvm_jax.generation.generate import prefill_logits
import kvm_jax as kj, kvm_jax.generation.generate
assert kj.generate is sys.modules["kvm_jax.generation.generate"].generate and callable(kj.generate)
for package in (kj, kvm_jax.train, kvm_jax.runs, kvm_jax.hf, kvm_jax.tasks, kvm_jax.ops):
  assert set(package.__all__) <= set(dir(package)), package
  [getattr(package, name) for name in package.__all__]
from kvm_jax import LM, presets, config
assert LM is kj.LM and presets.tiny and config.__name__ == "kvm_jax.config"
print("ok")
"""
  out = subprocess.run([sys.executable, "-W", "ignore", "-c", probe], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
  assert out.stdout.split() == ["False", "ok"], out.stderr[-2000:]


def test_the_cache_directory_follows_the_settings(tmp_path):
  """The flag, then KVM_JAX_COMPILATION_CACHE, then JAX's own directory, then XDG_CACHE_HOME."""
  choose = compilation_cache.choose_dir
  env = {"XDG_CACHE_HOME": str(tmp_path)}
  default = tmp_path / "kvm_jax" / "jax-compilation-cache"
  assert choose(None, env) == default and compilation_cache.is_off("Off")
  assert choose(None, env, jax_dir="/jax") == Path("/jax")
  assert choose(None, {**env, "KVM_JAX_COMPILATION_CACHE": "/env"}, "/jax") == Path("/env")
  assert choose("/flag", {**env, "KVM_JAX_COMPILATION_CACHE": "/env"}, "/jax") == Path("/flag")
  assert choose("off", {**env, "KVM_JAX_COMPILATION_CACHE": "/env"}) is None
  assert choose(None, {**env, "KVM_JAX_COMPILATION_CACHE": "off"}, "/jax") is None


def test_hf_commands_offer_the_readers_options():
  """kvm-import and kvm-convert spell the reading options out (their parsers import no reader)."""
  from kvm_jax.hf import authors_config, cli
  assert (cli.DTYPES, cli.NUMERICS) == (authors_config.DTYPES, authors_config.NUMERICS)


BENCH = ["-m", "kvm_jax.eval.bench.core_speed", "--lengths", "32", "--decode-context", "0",
         "--chunk-size", "8", "--repeats", "1", "--heads", "1", "--head-dim", "8"]


def test_a_second_run_compiles_nothing(tmp_path, subprocess_environ):
  """kvm-bench-core (its smallest shapes) fills an empty cache directory named by the flag; the
  same run with the directory named by KVM_JAX_COMPILATION_CACHE adds no entry; with 'off' and
  no other setting nothing is written (not even the default directory)."""
  env = subprocess_environ()
  del env["JAX_COMPILATION_CACHE_DIR"]  # the test session's cache: not this test's subject
  env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
  cache = tmp_path / "cache"

  def run(*flags, **extra):
    out = subprocess.run([sys.executable, *BENCH, *flags], env={**env, **extra},
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]

  run("--compilation-cache", str(cache))
  first = {p.name for p in cache.iterdir()}
  assert first, "the first run cached nothing"
  run(KVM_JAX_COMPILATION_CACHE=str(cache))
  assert {p.name for p in cache.iterdir()} == first, "the second run compiled again"
  run("--compilation-cache", "off")
  assert not (tmp_path / "xdg").exists()
