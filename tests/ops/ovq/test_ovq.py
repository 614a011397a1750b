"""The OVQ op (kvm_jax.ops.ovq): the chunked scan and the decode step against the oracle, the
size schedule against the authors' formula, and the assignment and fold worked out by hand.

Oracles: ``ovq_attention_reference`` (a Python loop over chunks in the authors' layout, dictionary
sliced to its size, every centroid written as a running mean from one-hot assignments: none of the
scan's arithmetic); the authors' schedule written down here in float64 as they compute it; small
cases computed by hand.

Tolerances (float32): the paths sum the same terms in different orders (a running mean as
``(c·old + Σ) / (c + m)`` against their ``old - Σ (old - k) / (c + m)``, a joint softmax over masked
rows), a few ulps per operation: observed <= 3e-7 relative RMS for outputs and states and <= 4e-7
for gradients; the KVM checks' bounds (2e-5, 1e-4) apply. Counts are integers and must be equal;
a single different assignment would move a whole centroid, far outside the state tolerance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvm_jax.ops.kvm.cases import TOLERANCE, rel_rms
from kvm_jax.ops.ovq import (OVQConfig, OVQState, ovq_attention, ovq_attention_reference,
                             ovq_decode_step, ovq_init_cache, ovq_prefill)
from kvm_jax.ops.ovq import state as ovq_state
from kvm_jax.ops.ovq.cases import get, select
from tests.helpers import in_ci

OUT_TOL = TOLERANCE["float32"]["output"]
GRAD_TOL = TOLERANCE["float32"]["grad"]


CASES = select("oracle")
GRAD_CASES = select("grad")
# In CI: the paper's flags, every switch at once, a full dictionary, and the two switches whose
# behaviour differs once combined (normalized values without the delta rule, the delta rule's
# prediction with the count bias).
CI_FORWARD = {"paper_flags", "all_switches", "full_dictionary", "normalized",
              "delta_rule_with_counts"}
CI_GRADS = {"paper_flags", "all_switches"}
_PAPER = get("paper_flags").cfg


def _id(case):
  return case.name


def test_schedule_is_the_authors_plateau():
  """Their ``_compute_dict_sizes``: floor(t·M / (t + M)) in float64 (or min(t, M)) at t = the
  tokens after each chunk (a partial last chunk counts its tokens), never shrinking, capped at M."""
  def theirs(T, C, M, use_min):
    sizes = [0]
    for c in range(1, -(-T // C) + 1):
      t = min(T, c * C)
      size = min(t, M) if use_min else min(int((float(t) * float(M)) / (float(t) + float(M))), M)
      sizes.append(min(max(size, sizes[-1]), M))
    return tuple(sizes)

  for T, C, M in ((45, 8, 12), (8192, 256, 1024), (1000, 7, 3), (65536, 256, 1024), (5, 8, 12)):
    for use_min in (False, True):
      cfg = OVQConfig(chunk_size=C, max_centroids=M, min_state_size=use_min)
      assert cfg.dictionary_sizes(T) == theirs(T, C, M, use_min), (T, C, M, use_min)
  paper = OVQConfig()  # C = 256, M = 1024
  assert [paper.dictionary_size(t) for t in (256, 512, 1024, 4096, 8192, 32768)] == [
      204, 341, 512, 819, 910, 992]
  assert paper.capacity(8192) == 910 and OVQConfig(chunk_size=8, max_centroids=12).capacity(1) == 1


@pytest.mark.parametrize("case", in_ci(CASES, CI_FORWARD, ids=_id), ids=_id)
def test_scan_matches_oracle(case):
  q, k, v, beta = case.inputs()
  y_ref, s_ref = jax.jit(ovq_attention_reference, static_argnums=4)(q, k, v, beta, case.cfg)
  y, s = ovq_attention(q, k, v, beta, case.cfg, row_update=case.row_update)
  assert y.shape == v.shape and y.dtype == jnp.float32
  rows = case.cfg.capacity(case.seq_len)
  assert s.keys.shape == (case.batch, case.heads, rows, case.head_dim)
  assert rel_rms(y, y_ref) < OUT_TOL
  np.testing.assert_array_equal(s.counts, s_ref.counts)
  assert float(jnp.sum(s.counts)) == case.batch * case.heads * case.seq_len
  assert rel_rms(s.keys, s_ref.keys) < OUT_TOL and rel_rms(s.values, s_ref.values) < OUT_TOL


def _projection_loss(fn, cfg, weights, **kw):
  def loss(q, k, v, beta):
    y, s = fn(q, k, v, beta, cfg, **kw)
    return (jnp.sum(y * weights[0]) + jnp.sum(s.keys * weights[1])
            + jnp.sum(s.values * weights[2]))
  return loss


@pytest.mark.parametrize("case", in_ci(GRAD_CASES, CI_GRADS, ids=_id), ids=_id)
def test_gradients_match_oracle(case):
  """Gradients of q, k, v and beta through the outputs and the final dictionary: the running
  means carry gradients into earlier chunks' keys and values."""
  inputs = case.inputs(seed=1)
  y, s = ovq_attention(*inputs, case.cfg)
  rng = np.random.default_rng(2)
  weights = [jnp.asarray(rng.normal(size=x.shape), jnp.float32) for x in (y, s.keys, s.values)]
  ref = jax.jit(jax.grad(_projection_loss(ovq_attention_reference, case.cfg, weights),
                         argnums=(0, 1, 2, 3)))(*inputs)
  got = jax.jit(jax.grad(_projection_loss(ovq_attention, case.cfg, weights,
                                          row_update=case.row_update), argnums=(0, 1, 2, 3)))(
                                              *inputs)
  for name, g, r in zip("qkv", got, ref):
    assert float(jnp.max(jnp.abs(r))) > 0, name
    assert rel_rms(g, r) < GRAD_TOL, name
  assert rel_rms(got[3], ref[3]) < GRAD_TOL  # beta


_step = jax.jit(ovq_decode_step, static_argnums=4, static_argnames="row_update")
_prefill = jax.jit(ovq_prefill, static_argnums=4, static_argnames="row_update")


@pytest.mark.parametrize("prompt", [1, 13, 16])   # inside a chunk, ragged, whole chunks
def test_prefill_then_decode_matches_the_whole_sequence(prompt):
  """Outputs equal the scan's; the cache's dictionary after the last token equals the scan's
  dictionary after every *full* chunk (a decode cache folds a chunk when it completes)."""
  case = get("all_switches" if prompt == 13 else "paper_flags")
  cfg = case.cfg
  q, k, v, beta = case.inputs(seed=3)
  T = 40                                                    # five whole chunks
  q, k, v = q[:, :T], k[:, :T], v[:, :T]
  cache = ovq_init_cache(cfg, batch=case.batch, heads=case.heads, head_dim=case.head_dim,
                         value_dim=case.value_dim, max_len=T + 3)
  y0, cache = _prefill(q[:, :prompt], k[:, :prompt], v[:, :prompt], beta, cfg, cache)
  outs = [y0]
  for t in range(prompt, T):
    y, cache = _step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta, cfg, cache)
    outs.append(y)
  np.testing.assert_array_equal(cache.length, [T] * cache.length.shape[0])  # one per row
  want, state = ovq_attention(q, k, v, beta, cfg)
  assert rel_rms(jnp.concatenate(outs, 1), want) < OUT_TOL
  rows = state.keys.shape[2]
  np.testing.assert_array_equal(cache.state.counts[:, :, :rows], state.counts)
  assert not np.any(np.asarray(cache.state.counts[:, :, rows:]))
  assert rel_rms(cache.state.keys[:, :, :rows], state.keys) < OUT_TOL
  assert rel_rms(cache.state.values[:, :, :rows], state.values) < OUT_TOL


def test_assignments_and_fold_by_hand():
  """One head, D = 2. Dictionary rows (1, 0) count 2 and (0, 1) count 1; a chunk of three keys:
  (0.8, 0.6) -> row 0 (0.8 > 0.6), (0.6, 0.8) -> row 1, (-1, 0) has the lowest best similarity
  (0 against row 1) and opens row 2. Counts 3, 2, 1; row 0 = (2·(1,0) + (0.8,0.6)) / 3,
  row 1 = ((0,1) + (0.6,0.8)) / 2, row 2 = (-1, 0); values alike."""
  f = lambda x: jnp.asarray(x, jnp.float32)[None, None]
  state = OVQState(keys=f([[1, 0], [0, 1], [0, 0]]), values=f([[1, 2], [3, 4], [0, 0]]),
                   counts=f([2, 1, 0]))
  keys = f([[0.8, 0.6], [0.6, 0.8], [-1, 0]])
  values = f([[10, 20], [30, 40], [50, 60]])
  cfg = OVQConfig(chunk_size=3, max_centroids=3)
  index = ovq_state.assignments(keys, state, 2, 1)
  np.testing.assert_array_equal(index[0, 0], [0, 1, 2])
  for row_update in ("scatter", "onehot"):
    out = ovq_state.fold(state, keys, values, keys, 2, 1, cfg, row_update)
    np.testing.assert_allclose(out.counts[0, 0], [3, 2, 1])
    np.testing.assert_allclose(out.keys[0, 0], [[2.8 / 3, 0.2], [0.3, 0.9], [-1, 0]], rtol=1e-6)
    np.testing.assert_allclose(out.values[0, 0], [[12 / 3, 24 / 3], [16.5, 22], [50, 60]],
                               rtol=1e-6)
  # An empty dictionary: the first token opens row 0 and every token joins it, then the n - 1
  # tokens least like the first open rows 1, 2, ... (here (-1, 0), then (0.6, 0.8)).
  empty = OVQState(keys=jnp.zeros((1, 1, 3, 2)), values=jnp.zeros((1, 1, 3, 2)),
                   counts=jnp.zeros((1, 1, 3)))
  np.testing.assert_array_equal(ovq_state.assignments(keys, empty, 0, 3)[0, 0], [0, 2, 1])
  np.testing.assert_array_equal(ovq_state.assignments(keys, empty, 0, 2)[0, 0], [0, 0, 1])


def test_readout_by_hand():
  """One query against one centroid (count 3) and its own token: weights ∝ exp(s + log 3) and
  exp(s'), i.e. 3·e^s : e^s'."""
  f = lambda x: jnp.asarray(x, jnp.float32)[None, None]
  state = OVQState(keys=f([[1.0, 0.0]]), values=f([[2.0]]), counts=f([3.0]))
  q, k, v = f([[0.5, 0.0]]), f([[0.0, 1.0]]), f([[5.0]])
  y = ovq_state.readout(q, k, v, state, 1, count_bias=True)
  w = 3 * np.exp(0.5) / (3 * np.exp(0.5) + 1.0)
  np.testing.assert_allclose(float(y[0, 0, 0, 0]), w * 2 + (1 - w) * 5, rtol=1e-6)
  y = ovq_state.readout(q, k, v, state, 1, count_bias=False)
  w = np.exp(0.5) / (np.exp(0.5) + 1.0)
  np.testing.assert_allclose(float(y[0, 0, 0, 0]), w * 2 + (1 - w) * 5, rtol=1e-6)
  y = ovq_state.readout(q, k, v, state, 0, count_bias=True)   # the row does not exist yet
  np.testing.assert_allclose(float(y[0, 0, 0, 0]), 5.0, rtol=1e-6)


def test_bfloat16_inputs_follow_float32():
  """bf16 q, k, v: the dictionary and scores stay float32, the output is bf16 within bf16
  rounding of the float32 result (routing may differ only where similarities tie in bf16)."""
  case = get("paper_flags")
  q, k, v, beta = case.inputs(seed=4)
  y32, _ = ovq_attention(q, k, v, beta, case.cfg)
  y16, s16 = ovq_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), beta, case.cfg)
  assert y16.dtype == jnp.bfloat16 and s16.keys.dtype == jnp.float32
  assert rel_rms(y16.astype(jnp.float32), y32) < TOLERANCE["bfloat16"]["output"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), r"OVQConfig.chunk_size must be a positive int, got 0"),
    (dict(max_centroids=2.5), r"OVQConfig.max_centroids must be a positive int, got 2.5"),
    (dict(delta_rule=1), r"OVQConfig.delta_rule must be a bool, got 1"),
])
def test_bad_options_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    OVQConfig(**kwargs)


def test_bad_shapes_are_named():
  q, k, v, beta = get("paper_flags").inputs()
  with pytest.raises(ValueError, match=r"beta must be \[H\] = \[2\]"):
    ovq_attention(q, k, v, beta[:1], _PAPER)
  with pytest.raises(ValueError, match="same B, T, H"):
    ovq_attention(q, k[:, :3], v, beta, _PAPER)
  cache = ovq_init_cache(_PAPER, batch=2, heads=2, head_dim=8, value_dim=6, max_len=4)
  with pytest.raises(ValueError, match="exceeds the cache's max_len=4"):
    ovq_prefill(q, k, v, beta, _PAPER, cache)
