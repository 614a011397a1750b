"""Shared test setup: CPU, fast compilation, the ``slow`` marker, and a perturbed tiny model.

Random inputs, parameters, the error metric and the case matrix of the KVM checks are shared
with ``kvm-check``: they live in :mod:`kvm_jax.ops.kvm.cases`.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from flax import nnx

import kvm_jax as kj

ROOT = Path(__file__).resolve().parents[1]

# Test programs are tiny: XLA's optimization passes dominate their compile time and buy nothing at
# run time. scripts/nightly.sh runs the suite with KVM_TEST_FAST_COMPILE=0 (fully optimized).
FAST_COMPILE = os.environ.get("KVM_TEST_FAST_COMPILE", "1") == "1"
if FAST_COMPILE:
  jax.config.update("jax_disable_most_optimizations", True)


def subprocess_env(tmp_root, devices: int = 1, **extra: str) -> dict:
  """The environment of a test's Python subprocess (a ``kvm-train`` run, a multi-process job).

  CPU with ``devices`` host devices, the repository first on the path, the same fast compilation
  as this process (see above), and a persistent compilation cache under ``tmp_root`` (one per
  xdist worker): the runs of one test (straight, killed, resumed) compile the same step programs,
  and only the first pays for it. A cache hit loads the very executable the first run compiled,
  so bitwise comparisons between runs are unaffected."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true" if FAST_COMPILE else "false"
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_root / "jax-cache")
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return env


@pytest.fixture
def subprocess_environ(tmp_path_factory):
  """:func:`subprocess_env` bound to this worker's temporary root: ``subprocess_environ(devices)``."""
  root = tmp_path_factory.getbasetemp()
  return lambda devices=1, **extra: subprocess_env(root, devices, **extra)


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --runslow (scripts/nightly.sh)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


def make_model(mixers="kvm", seed: int = 0, **overrides) -> kj.LM:
  """A tiny LM whose zero-initialized projections are perturbed, so every path matters."""
  model = kj.LM(kj.presets.tiny(mixers=mixers, **overrides), rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
  return model
