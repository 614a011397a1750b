"""Shared test setup: CPU, fast compilation, the ``slow`` marker, and a perturbed tiny model.

Random inputs, parameters, the error metric and the case matrix of the KVM checks are shared
with ``kvm-check``: they live in :mod:`kvm_jax.ops.kvm.cases`.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest
from flax import nnx

import kvm_jax as kj

# Test programs are tiny: XLA's optimization passes dominate their compile time and buy nothing at
# run time. scripts/nightly.sh runs the suite with KVM_TEST_FAST_COMPILE=0 (fully optimized).
if os.environ.get("KVM_TEST_FAST_COMPILE", "1") == "1":
  jax.config.update("jax_disable_most_optimizations", True)


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
