"""Oracle (Python, dynamic state) vs chunked lax.scan: outputs, final state and gradients.

Tolerances (float32 everywhere): the two paths sum the same terms in different orders (joint
softmax without concatenation, scatter vs matmul accumulation), so they differ by a few float32
ulps per operation: outputs and states within 2e-5 relative RMS, gradients within 1e-4 (they pass
through softmax backward and LN backward, amplifying rounding). Routing is discrete: a single
different decision would move whole rows and show up as O(1) state errors, so exact agreement of
decisions is implied by the state tolerance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from tests.helpers import in_ci
from kvm_jax.ops.kvm.cases import TOLERANCE, Case, get, rel_rms, select, valid_rows
from kvm_jax.ops.kvm.scan import kvm_attention_scan

OUT_TOL = TOLERANCE["float32"]["output"]
GRAD_TOL = TOLERANCE["float32"]["grad"]
CASES = select("oracle")


def _run_both(case: Case, seed: int = 0):
  q, k, v, g, params = case.inputs(seed)
  ref = kj.kvm_attention_reference(q, k, v, g, params, case.cfg)
  out = kj.kvm_attention(q, k, v, g, params, case.cfg)
  return (q, k, v, g, params), ref, out


# Nightly only: options and edges whose code paths the other cases also reach (gate flags, rotary
# widths, a one-chunk window, prompts inside the first window).
FORWARD_NIGHTLY = {"keys_gated_only", "all_rope_channels", "no_rope_channels", "one_window_chunk",
                   "T_below_C", "T_equals_L"}


@pytest.mark.parametrize("case", in_ci(CASES, {c.name for c in CASES} - FORWARD_NIGHTLY,
                                       ids=lambda c: c.name), ids=lambda c: c.name)
def test_forward_and_state_match_oracle(case):
  _, (y_ref, s_ref), (y, s) = _run_both(case)
  assert y.shape == (case.batch, case.seq_len, case.heads, case.value_dim)
  assert y.dtype == jnp.float32
  assert int(s.num_rows) == int(s_ref.num_rows) == kj.state_rows_after(case.cfg, case.seq_len)
  assert s.keys.shape[2] == int(s.num_rows)  # capacity = rows reached at this length
  assert rel_rms(y, y_ref) < OUT_TOL
  for got, want in zip(valid_rows(s), valid_rows(s_ref)):
    assert got.shape == want.shape
    assert rel_rms(got, want) < OUT_TOL


def _loss_fn(fn, cfg, weights):
  def loss(q, k, v, g, params):
    y, s = fn(q, k, v, g, params, cfg)
    n = weights["keys"].shape[2]
    # Random projections of everything the layer returns, so every path gets a gradient.
    return (jnp.sum(y * weights["y"]) + jnp.sum(s.keys[:, :, :n] * weights["keys"])
            + jnp.sum(s.values[:, :, :n] * weights["values"])
            + jnp.sum(s.radius[:, :, :n] * weights["radius"]))
  return loss


def _shorter(case: Case) -> Case:
  """Gradient cases keep >= 3 state updates but fewer chunks: the unrolled oracle's backward
  compiles in time roughly linear in the number of chunks."""
  return dataclasses.replace(case, seq_len=min(case.seq_len, 4 * case.cfg.window_len - 3))


# In CI: no appends with a ragged tail, growth with MQA, gated appends and initial rows, and the
# bf16 readout cast with GQA (every gradient path: merges, appends, gates, the cast's rounding,
# group sums); the other gradient cases nightly (their forward passes all run in CI).
GRADS_IN_CI = {"fixed_C_no_append_ragged", "powerlaw_gqa", "gate_appends_and_initial",
               "bf16_readout_cast_gqa"}


@pytest.mark.parametrize("case", in_ci([_shorter(c) for c in select("grad")], GRADS_IN_CI,
                                       ids=lambda c: c.name), ids=lambda c: c.name)
def test_gradients_match_oracle(case):
  q, k, v, g, params = case.inputs(0)
  # Output shapes without compiling a forward pass.
  y_ref, s_ref = jax.eval_shape(
      lambda *a: kj.kvm_attention_reference(*a, case.cfg), q, k, v, g, params)
  rng = np.random.default_rng(7)
  weights = {name: jnp.asarray(rng.normal(size=shape), jnp.float32) for name, shape in
             (("y", y_ref.shape), ("keys", s_ref.keys.shape), ("values", s_ref.values.shape),
              ("radius", s_ref.radius.shape))}
  argnums = (0, 1, 2, 3, 4)
  grads_ref = jax.jit(jax.grad(_loss_fn(kj.kvm_attention_reference, case.cfg, weights), argnums))(
      q, k, v, g, params)
  grads = jax.jit(jax.grad(_loss_fn(kj.kvm_attention, case.cfg, weights), argnums))(
      q, k, v, g, params)
  names = ["q", "k", "v", "merge_gate", "params"]
  for name, got, want in zip(names, grads, grads_ref):
    for path, (a, b) in zip(jax.tree_util.tree_leaves_with_path(want),
                            zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))):
      a_np = np.asarray(a)
      assert np.all(np.isfinite(a_np)), (name, path)
      if not np.any(np.asarray(b)):
        np.testing.assert_array_equal(a_np, 0.0)
        continue
      assert rel_rms(a, b) < GRAD_TOL, (name, jax.tree_util.keystr(path[0]), rel_rms(a, b))
  # Sanity: the checked gradients are non-trivial where the spec says gradients flow.
  assert np.any(np.asarray(grads[1])) and np.any(np.asarray(grads[2]))
  if case.cfg.uses_gate and any(kj.kvm_schedule(case.cfg, case.seq_len).update_after):
    assert np.any(np.asarray(grads[3]))  # the gate gets gradient through merged sums
  if case.cfg.head_temperatures:
    assert np.any(np.asarray(grads[4].window_temperature))


def test_rope_channels_get_no_gradient_through_the_state_only():
  """Zeroed RoPE channels: with queries and window cut off, k's RoPE channels get no gradient."""
  case = get("fixed_above_C_appends_gqa_sink0")
  q, k, v, g, params = case.inputs(3)

  def state_only(k):
    _, s = kj.kvm_attention(q, k, v, g, params, case.cfg)
    return jnp.sum(s.keys ** 2)

  grad_k = np.asarray(jax.grad(state_only)(k))
  assert np.all(grad_k[..., : case.cfg.rope_dims] == 0)
  assert np.any(grad_k[..., case.cfg.rope_dims:] != 0)


@pytest.mark.parametrize("case", [get("fixed_above_C_appends_gqa_sink0"), get("powerlaw_gqa")],
                         ids=lambda c: c.name)
def test_scatter_and_onehot_row_updates_agree(case):
  """The CPU (scatter) and GPU/TPU (one-hot matmul) state accumulation paths are equivalent."""
  q, k, v, g, params = case.inputs(1)
  outs = {}
  for mode in ("scatter", "onehot"):
    outs[mode] = kvm_attention_scan(q, k, v, g, params, cfg=case.cfg, row_update=mode)
  assert rel_rms(outs["scatter"][0], outs["onehot"][0]) < OUT_TOL
  for a, b in zip(valid_rows(outs["scatter"][1]), valid_rows(outs["onehot"][1])):
    assert rel_rms(a, b) < OUT_TOL


def test_bf16_activations_track_float32():
  """bf16 q/k/v with float32 state statistics stays within bf16 rounding of the float32 run."""
  case = get("powerlaw_gqa")
  q, k, v, g, params = case.inputs(2)
  y32, s32 = kj.kvm_attention(q, k, v, g, params, case.cfg)
  cast = lambda x: x.astype(jnp.bfloat16)
  y16, s16 = kj.kvm_attention(cast(q), cast(k), cast(v), g, params, case.cfg)
  assert y16.dtype == jnp.bfloat16
  assert s16.keys.dtype == s16.values.dtype == s16.radius.dtype == jnp.float32
  # bf16 has an 8-bit mantissa (relative rounding 2^-9 ~ 2e-3); inputs, probabilities and output
  # are each rounded once, so a few 1e-3 is expected; 2e-2 leaves room for a rare routing flip
  # being *absent* (a flip would move a whole row and exceed it).
  assert rel_rms(y16.astype(jnp.float32), y32) < 2e-2
  assert int(s16.num_rows) == int(s32.num_rows)


def test_readout_cast_changes_values_like_bf16():
  """readout_value_dtype='bfloat16' reproduces the authors' cast: a bf16-sized, non-zero change."""
  case = get("powerlaw_gqa")
  q, k, v, g, params = case.inputs(4)
  y_plain, _ = kj.kvm_attention(q, k, v, g, params, case.cfg)
  y_cast, _ = kj.kvm_attention(q, k, v, g, params,
                               dataclasses.replace(case.cfg, readout_value_dtype="bfloat16"))
  err = rel_rms(y_cast, y_plain)
  assert 1e-5 < err < 1e-2


# Seconds to minutes each: nightly.
LARGE_CASES = [pytest.param(c, marks=pytest.mark.slow) for c in select("oracle-large")]


@pytest.mark.parametrize("case", LARGE_CASES, ids=lambda c: c.name)
def test_larger_shapes_match_oracle(case):
  """Longer sequences, wider heads, growing budgets: more rows, more chances of near-ties."""
  _, (y_ref, s_ref), (y, s) = _run_both(case, seed=3)
  assert int(s.num_rows) == int(s_ref.num_rows) > case.cfg.chunk_size
  assert rel_rms(y, y_ref) < OUT_TOL
  for got, want in zip(valid_rows(s), valid_rows(s_ref)):
    assert rel_rms(got, want) < OUT_TOL
