"""What the tests share: fast compilation settings (set before JAX starts), the CI/nightly split of
case matrices, subprocess environments, perturbed and random tiny models and their compiled
forward / prefill / decode, and run directories made without training. Fixtures and pytest
hooks stay in ``tests/conftest.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Test programs are tiny: XLA's optimization passes dominate their compile time and buy nothing at
# run time. scripts/nightly.sh runs the suite with KVM_TEST_FAST_COMPILE=0 (fully optimized, XLA's
# default code generation).
FAST_COMPILE = os.environ.get("KVM_TEST_FAST_COMPILE", "1") == "1"

# XLA:CPU's fusion emitters (MLIR, its default) take about twice as long to compile a test's
# programs as the elemental emitter they replaced (a 4-layer model's gradient: 5.9 s -> 4.0 s,
# tests/ops/test_documents.py 130 s -> 74 s on 2 workers), which still emits every fusion. An XLA that
# does not know a flag aborts the process, so it is passed only where a probe process accepted it;
# the controller probes once and its xdist workers and subprocesses inherit the answer.
FAST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def _xla_accepts(flags: str) -> bool:
  probe = "import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
  try:
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                          timeout=120).returncode == 0
  except subprocess.TimeoutExpired:
    return False


if FAST_COMPILE and "KVM_TEST_XLA_FLAGS" not in os.environ:
  os.environ["KVM_TEST_XLA_FLAGS"] = FAST_XLA_FLAGS if _xla_accepts(FAST_XLA_FLAGS) else ""
#: The XLA flags of every test process (this one and its subprocesses): see FAST_XLA_FLAGS.
TEST_XLA_FLAGS = os.environ.get("KVM_TEST_XLA_FLAGS", "") if FAST_COMPILE else ""
if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()


def subprocess_xla_flags(devices: int) -> str:
  """``XLA_FLAGS`` of a test's subprocess: ``devices`` CPU devices and :data:`TEST_XLA_FLAGS`."""
  return f"--xla_force_host_platform_device_count={devices} {TEST_XLA_FLAGS}".strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.eval.kind_check import perturbed_model
from kvm_jax.nn.layers import path_names
from kvm_jax.runs import logits_fn

if FAST_COMPILE:
  jax.config.update("jax_disable_most_optimizations", True)


ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"  # the fixtures made outside the repository's code


def in_ci(values, keep, ids=None):
  """Parameters for ``pytest.mark.parametrize``: those in ``keep`` run in CI, the others carry
  the ``slow`` marker and run nightly (scripts/nightly.sh). ``ids`` names a value (default str).

  CI must stay within ten minutes on 2 cores; a family of cases keeps in CI the members that
  together exercise every code path, and the rest of the matrix runs every night."""
  name = ids or str
  slow = lambda v: pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
  return [v if name(v) in keep else slow(v) for v in values]


def subprocess_env(tmp_root, devices: int = 1, **extra: str) -> dict:
  """The environment of a test's Python subprocess (a ``kvm-train`` run, a multi-process job).

  CPU with ``devices`` host devices, the repository first on the path, the same fast compilation
  and XLA flags as this process (see above), and the session's persistent compilation cache (see
  :func:`pytest_configure`; else one under ``tmp_root``): the runs of one test (straight, killed,
  resumed) compile the same step programs, and only the first pays for it. A cache hit loads the
  very executable the first run compiled, so bitwise comparisons between runs are unaffected."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **extra)
  env["XLA_FLAGS"] = subprocess_xla_flags(devices)
  env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true" if FAST_COMPILE else "false"
  env["JAX_COMPILATION_CACHE_DIR"] = os.environ.get("KVM_TEST_CACHE_DIR",
                                                   str(tmp_root / "jax-cache"))
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  return env


# A model's forward, prefill and decode step as compiled programs. Eager calls dispatch hundreds
# of small operations, each compiled on first use, and cost several times a jitted call; these
# jit objects are shared by every test, so one model's programs compile once.
forward = nnx.jit(lambda model, tokens: model(tokens))


prefill = nnx.jit(lambda model, tokens, caches: model.prefill(tokens, caches))


decode_step = nnx.jit(lambda model, token, caches: model.decode_step(token, caches))


def decode_all(model: kj.LM, tokens, prompt: int):
  """Logits ``[B, T, V]`` of ``tokens`` by prefilling the first ``prompt`` tokens and decoding
  the rest one at a time (jitted), and the final caches."""
  logits, caches = prefill(model, tokens[:, :prompt], model.init_cache(*tokens.shape))
  outs = [logits]
  for t in range(prompt, tokens.shape[1]):
    logits, caches = decode_step(model, tokens[:, t:t + 1], caches)
    outs.append(logits)
  return jnp.concatenate(outs, axis=1), caches


def make_model(mixers="kvm", seed: int = 0, **overrides) -> kj.LM:
  """A tiny LM whose zero-initialized projections are perturbed, so every path matters
  (``kvm-check --kinds``'s model)."""
  return perturbed_model(mixers, seed, **overrides)


def random_parameter(names: list[str], shape: tuple, rng: np.random.Generator) -> np.ndarray:
  """A value for the parameter at path ``names``: every one random and far from its
  initialization (zero-initialized projections included, like conftest's ``make_model``), at
  scales that keep activations O(1): kernels N(0, 1/fan_in), LayerNorms 1 + 0.1·N / 0.1·N, token
  shift mixes U(0, 1), v_gate0 0.5·N (sigmoid gates spread around 1/2), KVM temperatures and OVQ's
  beta U(0.5, 1.5) so that a missing or misplaced temperature shows; RWKV-7's biases w0, a0, v0
  0.5·N, k_k U(0, 1), k_a U(0.5, 1.5), r_k 0.3·N."""
  leaf, owner = names[-1], names[-2]
  if leaf == "kernel":
    return rng.normal(size=shape) / np.sqrt(shape[0])
  if leaf == "scale":
    return 1.0 + 0.1 * rng.normal(size=shape)
  if leaf == "bias":
    return 0.1 * rng.normal(size=shape)
  if leaf in ("x_q", "x_k", "x_v", "x_r", "x_w", "x_a", "x_g", "k_k"):
    return rng.uniform(0.0, 1.0, shape)
  if leaf in ("v_gate0", "w0", "a0", "v0"):
    return 0.5 * rng.normal(size=shape)
  if leaf in ("window_temperature", "state_temperature", "beta", "k_a"):
    return rng.uniform(0.5, 1.5, shape)
  if leaf == "r_k":
    return 0.3 * rng.normal(size=shape)
  if owner == "wte":
    return rng.normal(size=shape)
  raise AssertionError(f"no test value for parameter {'/'.join(names)}")


def random_model(cfg: kj.ModelConfig, seed: int = 0) -> kj.LM:
  """``LM(cfg)`` with every parameter drawn by :func:`random_parameter` in numpy (conftest's
  ``make_model`` perturbs a real initialization, but its eager init compiles dozens of small
  programs per config)."""
  graphdef, params = nnx.split(nnx.eval_shape(lambda: kj.LM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.asarray(random_parameter(path_names(path), x.shape, rng), x.dtype),
      params)
  return nnx.merge(graphdef, params)


def model_logits(model: kj.LM, tokens) -> np.ndarray:
  """The model's float32 logits through ``kvm_jax.runs.logits_fn`` (one jitted program per model
  structure and shape, shared by every model built alike), with float32 matmuls at full precision
  (no TF32/bf16 passes on accelerators)."""
  with jax.default_matmul_precision("highest"):
    return np.asarray(logits_fn(model)(jnp.asarray(tokens)))


def write_run(workdir, cfg, model) -> Path:
  """A run directory of ``model``'s parameters without training: a teacher or a source for
  conversion, at no compile cost."""
  from kvm_jax.runs.directory import save_starting_point
  save_starting_point(workdir, cfg, nnx.state(model), {})
  return Path(workdir)


# Agreement with the authors' logits, relative to max |their logit|. In float32 numerics both
# sides round only float32 operations (observed <= 9e-7 over 14 model families); 1e-5 is the
# project's float32 target. With their numerics both sides also round the RoPE tables and the KVM
# readout values to bfloat16, and a float32 difference of one ulp before such a cast can flip a
# bfloat16 rounding (2^-8 relative) in one element: observed up to 7e-5 on 4-layer models, so
# the bound there is 1e-4.
FLOAT32_TOL = 1e-5
