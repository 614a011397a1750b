"""Shared fixtures and helpers: random inputs, non-trivial parameters, error metrics."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def make_inputs(seed: int, B: int, T: int, H: int, Hkv: int, D: int, Dv: int,
                dtype=jnp.float32):
  """q [B,T,H,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv], g = 1 + ELU(normal) [B,T,Hkv] (> 0)."""
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (B, T, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, T, Hkv, Dv), jnp.float32).astype(dtype)
  g = 1.0 + jax.nn.elu(jax.random.normal(kg, (B, T, Hkv), jnp.float32))
  return q, k, v, g


def make_params(seed: int, D: int, H: int) -> kj.KVMParams:
  """Parameters away from their init so that every one of them matters in the checks."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(1000 + seed), 4)
  return kj.KVMParams(ln_scale=1.0 + 0.2 * jax.random.normal(k1, (D,)),
                      ln_bias=0.2 * jax.random.normal(k2, (D,)),
                      window_temperature=1.0 + 0.3 * jax.random.uniform(k3, (H,), minval=-1, maxval=1),
                      state_temperature=1.0 + 0.3 * jax.random.uniform(k4, (H,), minval=-1, maxval=1))


def make_model(mixers="kvm", seed: int = 0, **overrides) -> kj.LM:
  """A tiny LM whose zero-initialized projections are perturbed, so every path matters."""
  from flax import nnx
  model = kj.LM(kj.presets.tiny(mixers=mixers, **overrides), rngs=nnx.Rngs(seed))
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
  leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))
  return model


def rel_rms(actual, expected) -> float:
  """fla-style relative error: RMS(actual - expected) / RMS(expected)."""
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  denom = np.sqrt(np.mean(e * e))
  return float(np.sqrt(np.mean((a - e) ** 2)) / max(denom, 1e-30))


def valid_state(state: kj.KVMState):
  """The valid rows of a state as float64 numpy arrays."""
  n = int(state.num_rows)
  return (np.asarray(state.keys[:, :, :n], np.float64), np.asarray(state.values[:, :, :n], np.float64),
          np.asarray(state.radius[:, :, :n], np.float64))
