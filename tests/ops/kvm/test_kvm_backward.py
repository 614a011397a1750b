"""The scan's memory-lean backward pass and its static schedule.

* ``remat=True`` (the default) keeps the state only every ~sqrt(chunks) chunks plus each chunk's
  routing decisions, and re-runs blocks in reverse applying the stored decisions. Its gradients
  (of the outputs *and* of the final state) must equal plain autodiff through the scan
  (``remat=False``), which stores everything: an independent path through JAX's own transpose.
* The backward never recomputes routing: every update it traces is given its decisions.
* No ``cond`` in the compiled scan: the schedule is static, so whether a chunk folds or appends is
  decided at trace time, never on the device.
* One layer's backward at T = 65,536 (B=1, H=8, D=128, bf16) stays within a budget of temporaries
  (``BACKWARD_BUDGET_GIB``), measured from XLA's compiled memory analysis on this CPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.ops.kvm.cases import random_inputs
from kvm_jax.ops.kvm.scan import XLA_OPS, kvm_attention_scan, schedule_runs
from kvm_jax.ops.kvm.state import update_state
from tests.helpers import in_ci

# (window chunks, T, budget): leftover blocks, one-chunk windows, three-chunk windows, appends
# that start and stop (saturating: one scan body per run, or, past 8 runs, one body selecting by
# n_append > 0), a sequence shorter than the window.
CONFIGS = {
    "fixed_nb2": (2, 200, kj.FixedBudget(16)),
    "sqrt_nb3": (3, 221, kj.PowerLawBudget(4.0, 0.5, min_rows=8)),  # 28 chunks: 5 blocks + 3
    "sqrt_nb1": (1, 150, kj.PowerLawBudget(4.0, 0.5, min_rows=8)),
    "saturating": (2, 260, kj.SaturatingBudget(48, min_rows=8, round_down=8)),   # > 8 runs
    "saturating_runs": (2, 100, kj.SaturatingBudget(48, min_rows=8, round_down=8)),  # 7 runs
    "short": (2, 13, kj.FixedBudget(16)),
}


def _setup(name, H=4, Hkv=2, D=16, B=2, dtype=jnp.float32, T=None):
  nb, config_T, budget = CONFIGS[name]
  T = T or config_T
  cfg = kj.KVMConfig(chunk_size=8, window_chunks=nb, sink_rows=1, rope_dims=4, budget=budget)
  q, k, v, g = random_inputs(T, B, T, H, Hkv, D, D, dtype)
  # parameters away from their init, so every parameter gradient is exercised
  params = kj.KVMParams(jnp.linspace(0.5, 1.5, D), jnp.linspace(-0.2, 0.2, D),
                        jnp.linspace(0.6, 1.4, H), jnp.linspace(1.3, 0.7, H))
  return cfg, (q, k, v, g, params)


def _loss(cfg, remat, ops=XLA_OPS, source_layout="auto"):
  def loss(q, k, v, g, params):
    y, state = kvm_attention_scan(q, k, v, g, params, cfg=cfg, remat=remat, ops=ops,
                                  source_layout=source_layout)
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    # the final state's cotangent enters the backward too (a decode cache continues from it)
    return (jnp.sum(y.astype(jnp.float32) * w) + 0.3 * jnp.sum(state.keys)
            + 0.1 * jnp.sum(jnp.sin(state.values)) + jnp.sum(state.radius))
  return loss


@pytest.mark.parametrize("name", in_ci(sorted(CONFIGS), {"sqrt_nb3", "short"}))
def test_checkpointed_backward_equals_plain_autodiff(name):
  cfg, args = _setup(name)
  sched = kj.kvm_schedule(cfg, args[0].shape[1])
  g_ckpt = jax.jit(jax.grad(_loss(cfg, True), argnums=(0, 1, 2, 3, 4)))(*args)
  g_plain = jax.jit(jax.grad(_loss(cfg, False), argnums=(0, 1, 2, 3, 4)))(*args)
  # float32 both ways; the only difference is summation order (window rows summed across block
  # boundaries, parameter gradients summed per block): observed <= 6e-7 relative.
  for a, b in zip(jax.tree_util.tree_leaves(g_ckpt), jax.tree_util.tree_leaves(g_plain)):
    scale = float(jnp.max(jnp.abs(b)))  # 0 for the state temperature of "short" (no state)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * scale)
  if sched.num_chunks > 4:
    assert any(r.update for r in schedule_runs(sched))  # the case folds: the test is not vacuous


# In CI: a state that grows in more than 8 runs and a sequence inside the window (the layouts'
# three-chunk windows run nightly; the forward of three-chunk windows is checked against the
# oracle in CI, tests/ops/kvm/test_kvm_equivalence.py).
@pytest.mark.parametrize("name", in_ci(sorted(CONFIGS), {"short", "saturating"}))
def test_source_layouts_agree(name):
  """The scan reads its inputs in place ("time": XLA on CPU) or from head-major copies made once
  ("heads": accelerators, kernels): the same chunks in two layouts. Outputs, final state and
  every gradient (checkpointed backward) agree to float32 rounding (observed <= 3e-7 of max)."""
  cfg, args = _setup(name)
  run = lambda layout: kvm_attention_scan(*args, cfg=cfg, source_layout=layout)  # noqa: E731
  for a, b in zip(jax.tree_util.tree_leaves(run("time")), jax.tree_util.tree_leaves(run("heads"))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0,
                               atol=1e-6 * max(float(np.max(np.abs(b))), 1e-30))
  grads = {layout: jax.jit(jax.grad(_loss(cfg, True, source_layout=layout),
                                    argnums=(0, 1, 2, 3, 4)))(*args)
           for layout in ("time", "heads")}
  for a, b in zip(jax.tree_util.tree_leaves(grads["time"]),
                  jax.tree_util.tree_leaves(grads["heads"])):
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6 * scale)
  with pytest.raises(ValueError, match="source_layout"):
    run("rows")


def test_checkpointed_backward_bf16_inputs():
  """bf16 inputs: gradients come back in bf16, equal to float32 autodiff of the same (bf16-exact)
  inputs at bf16 resolution, both with and without the checkpointed backward. (The scan slices
  16-bit inputs as their bits; a bare bitcast has no derivative, which once made every q
  gradient and most k/v gradients exactly 0 on both paths alike.)"""
  cfg, args = _setup("fixed_nb2", dtype=jnp.bfloat16, T=100)  # 13 chunks, 10 state updates
  exact = [x.astype(jnp.float32) for x in args[:4]] + [args[4]]
  g_ref = jax.jit(jax.grad(_loss(cfg, True), argnums=(0, 1, 2)))(*exact)
  for remat in (True, False):
    grads = jax.jit(jax.grad(_loss(cfg, remat), argnums=(0, 1, 2)))(*args)
    for a, b in zip(grads, g_ref):
      assert a.dtype == jnp.bfloat16
      a, b = np.asarray(a, np.float32), np.asarray(b)
      # bf16 matmul operands in the readout and bf16 gradients (8-bit mantissa, a few roundings
      # per entry): observed <= 1.2% of the largest entry; a lost gradient is 100%.
      np.testing.assert_allclose(a, b, rtol=0, atol=2 ** -5 * np.abs(b).max())


def test_backward_applies_stored_routing():
  """The backward re-runs blocks from stored states, but every update it traces is *given* the
  forward's decisions: routing is never recomputed from a rebuilt state."""
  cfg, args = _setup("sqrt_nb3")
  computed = []

  def recording_update(*a, routing=None, **kw):
    computed.append(routing is None)
    return update_state(*a, routing=routing, **kw)

  ops = dataclasses.replace(XLA_OPS, name="recording", update_fn=recording_update)
  jax.make_jaxpr(lambda *a: _loss(cfg, True, ops)(*a))(*args)
  assert computed and all(computed)  # the forward computes routing
  computed.clear()
  jax.make_jaxpr(jax.grad(_loss(cfg, True, ops), argnums=(0, 1, 2)))(*args)
  # traced in order: the forward pass (computes routing), then the backward (given decisions)
  first_replay = computed.index(False)
  assert first_replay > 0 and all(computed[:first_replay])
  assert not any(computed[first_replay:])


def _primitives(jaxpr, found=None):
  found = set() if found is None else found
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      _primitives(sub, found)
  return found


@pytest.mark.parametrize("name", ["sqrt_nb3", "saturating"])
def test_no_conditionals_in_the_scan(name):
  """Folds and appends are known at trace time: no ``cond`` (on GPU a conditional reads its
  predicate back to the host every chunk), in the forward or the backward."""
  cfg, args = _setup(name)
  forward = jax.make_jaxpr(lambda *a: kvm_attention_scan(*a, cfg=cfg))(*args)
  backward = jax.make_jaxpr(jax.grad(_loss(cfg, True), argnums=(0, 1, 2, 3, 4)))(*args)
  for jaxpr in (forward, backward):
    prims = _primitives(jaxpr.jaxpr)
    assert "scan" in prims and "cond" not in prims


def test_schedule_runs_cover_the_schedule():
  cfg, _ = _setup("saturating")
  for T in (1, 8, 9, 100, 260, 5000):
    sched = kj.kvm_schedule(cfg, T)
    runs = schedule_runs(sched)
    assert runs[0].start == 0 and runs[-1].stop == sched.num_chunks
    assert all(a.stop == b.start for a, b in zip(runs, runs[1:]))
    for run in runs:
      for c in range(run.start, run.stop):
        assert run.visible == sched.state_visible[c] and run.update == sched.update_after[c]
        assert run.may_append or sched.n_append[c] == 0  # never skips an append
  # past max_runs, appending and non-appending folds share one body
  assert len(schedule_runs(kj.kvm_schedule(cfg, 5000), max_runs=2)) <= 4


# One layer's backward at T = 65,536, B=1, H=8, D=128, bf16 (kvm-bench's KVM configuration):
# before the checkpointed backward, 2.55 GiB (fixed256) and 10.35 GiB (sqrt16) of temporaries.
BACKWARD_BUDGET_GIB = {"fixed256": 1.6, "sqrt16": 2.5}


@pytest.mark.parametrize("budget", in_ci(sorted(BACKWARD_BUDGET_GIB), {"sqrt16"}))
def test_backward_memory_at_64k(budget):
  from kvm_jax.eval.bench.speed import kvm_config
  T, B, H, D = 65536, 1, 8, 128
  cfg = kvm_config(budget, D)
  params = kj.KVMParams.init(D, H)
  x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((B, T, H), jnp.bfloat16)

  def loss(q, k, v, g, w):
    y, _ = kj.kvm_attention(q, k, v, g, params, cfg)
    return jnp.sum(y.astype(jnp.float32) * w)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  memory = grad.lower(x, x, x, g, x).compile().memory_analysis()
  temp_gib = memory.temp_size_in_bytes / 2 ** 30
  assert temp_gib <= BACKWARD_BUDGET_GIB[budget], f"{budget}: {temp_gib:.2f} GiB of temporaries"
