"""The RWKV-7 recurrence (kvm_jax.ops.rwkv7): the chunk-parallel form and the one-token step
against the per-token oracle (outputs, final state, the gradient of every input and of the
initial state), and the recurrence worked out by hand.

Inputs are drawn as the time mix makes them: ``w`` in (-e^-½, 0), ``a = -kk`` and ``b = kk·α`` with
``kk`` unit per head and α in (0, 1). Tolerances (float32): the chunk form reorders the sums (a
triangular solve per chunk, decays split at the chunk's middle), a few ulps per operation over
the sequence: observed <= 5e-7 relative RMS for outputs and states and <= 3e-6 for gradients;
the KVM checks' bounds (2e-5, 1e-4) apply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvm_jax.ops.kvm.cases import TOLERANCE, rel_rms
from kvm_jax.ops.rwkv7 import rwkv7_recurrence, rwkv7_recurrence_reference, rwkv7_step
from kvm_jax.ops.rwkv7.cases import select, time_mix_inputs
from tests.helpers import in_ci

OUT_TOL = TOLERANCE["float32"]["output"]
GRAD_TOL = TOLERANCE["float32"]["grad"]


_reference = jax.jit(rwkv7_recurrence_reference)

_id = lambda case: case.name


@pytest.mark.parametrize("case", in_ci(select("oracle"), {"ragged_tail", "carried_state",
                                                          "chunks_of_two", "repeated_keys"},
                                       ids=_id), ids=_id)
def test_chunked_matches_oracle(case):
  inputs, h0 = case.inputs()
  o_ref, h_ref = _reference(*inputs, initial_state=h0)
  o, h = rwkv7_recurrence(*inputs, initial_state=h0, chunk_size=case.chunk_size)
  B, H = case.batch, case.heads
  assert o.shape == (B, case.seq_len, H, case.value_dim) and h.dtype == jnp.float32
  assert h.shape == (B, H, case.key_dim, case.value_dim)
  assert rel_rms(o, o_ref) < OUT_TOL and rel_rms(h, h_ref) < OUT_TOL


def test_strongest_decay_over_a_long_chunk():
  """w at its bound -e^-½ everywhere and chunks of 256: the decay across a chunk is e^-155, past
  float32's range; the split at the chunk's middle keeps every factor within e^±78."""
  r, w, k, v, a, b = time_mix_inputs(T=300, decay_scale=8.0)
  assert float(jnp.min(w)) < -0.6
  o_ref, h_ref = _reference(r, w, k, v, a, b)
  o, h = rwkv7_recurrence(r, w, k, v, a, b, chunk_size=256)
  assert rel_rms(o, o_ref) < OUT_TOL and rel_rms(h, h_ref) < OUT_TOL


def _loss(fn, weights):
  def loss(r, w, k, v, a, b, h0):
    o, h = fn(r, w, k, v, a, b, initial_state=h0)
    return jnp.sum(o * weights[0]) + jnp.sum(h * weights[1])
  return loss


@pytest.mark.parametrize("case", in_ci(select("grad"), {"whole_chunks", "batch_of_32",
                                                        "repeated_keys"}, ids=_id), ids=_id)
def test_gradients_match_oracle(case):
  """Gradients of r, w, k, v, a, b and of the initial state through the outputs and the final
  state."""
  inputs, _ = case.inputs(seed=1)
  B, T, H, K, V = case.batch, case.seq_len, case.heads, case.key_dim, case.value_dim
  rng = np.random.default_rng(11)
  h0 = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
  weights = (jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32),
             jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32))
  argnums = tuple(range(7))
  ref = jax.jit(jax.grad(_loss(rwkv7_recurrence_reference, weights), argnums))(*inputs, h0)
  chunked = lambda *x, initial_state: rwkv7_recurrence(*x, initial_state=initial_state,
                                                       chunk_size=case.chunk_size)
  got = jax.jit(jax.grad(_loss(chunked, weights), argnums))(*inputs, h0)
  for name, g, want in zip(("r", "w", "k", "v", "a", "b", "initial state"), got, ref):
    assert float(jnp.max(jnp.abs(want))) > 0, name
    assert rel_rms(g, want) < GRAD_TOL, name


def test_step_matches_oracle():
  inputs = time_mix_inputs(T=40, seed=2)
  o_ref, h_ref = _reference(*inputs)
  step = jax.jit(rwkv7_step)
  h = jnp.zeros((2, 2, 16, 12), jnp.float32)
  outs = []
  for t in range(40):
    o, h = step(*(x[:, t] for x in inputs), h)
    outs.append(o)
  assert rel_rms(jnp.stack(outs, 1), o_ref) < OUT_TOL and rel_rms(h, h_ref) < OUT_TOL


def test_recurrence_by_hand():
  """Dk = 2, Dv = 1, one head. S_t = S_{t-1}(diag(e^w) + a bᵀ) + v kᵀ, o_t = S_t r:
  t=1: S = 0 + 2·(1, 0) = (2, 0), o = S·(1, 1) = 2;
  t=2: S·diag(e^w) = (2·0.5, 0) = (1, 0); S a = 2·1 = 2, times bᵀ = (0, 0.5) -> (0, 1);
       plus 3·(0, 1) -> S = (1, 4), o = S·(1, 2) = 9."""
  f = lambda x: jnp.asarray(x, jnp.float32).reshape(1, 2, 1, -1)
  r = f([[1, 1], [1, 2]])
  w = f([[0, 0], [np.log(0.5), 0]])
  k = f([[1, 0], [0, 1]])
  v = f([[2], [3]])
  a = f([[0, 0], [1, 0]])
  b = f([[0, 0], [0, 0.5]])
  for o, h in (_reference(r, w, k, v, a, b), rwkv7_recurrence(r, w, k, v, a, b, chunk_size=2)):
    np.testing.assert_allclose(np.asarray(o).ravel(), [2, 9], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(h).reshape(2), [1, 4], rtol=1e-6)  # h = Sᵀ


def test_bfloat16_inputs_keep_a_float32_state():
  inputs = time_mix_inputs(T=70, seed=3)
  o32, h32 = rwkv7_recurrence(*inputs)
  o16, h16 = rwkv7_recurrence(*(x.astype(jnp.bfloat16) for x in inputs))
  assert o16.dtype == jnp.bfloat16 and h16.dtype == jnp.float32
  assert rel_rms(o16.astype(jnp.float32), o32) < TOLERANCE["bfloat16"]["output"]
  assert rel_rms(h16, h32) < TOLERANCE["bfloat16"]["output"]


def test_bad_chunk_sizes_and_shapes_are_refused():
  """Odd chunks, and chunks past 256 (whose decay factors overflow float32), by name; shapes that
  do not fit each other, by shape."""
  from kvm_jax.nn.mixers.rwkv7 import RWKV7Options
  x = time_mix_inputs(T=8)
  with pytest.raises(ValueError, match=r"chunk_size must be an even int in \[2, 256\], got 7"):
    rwkv7_recurrence(*x, chunk_size=7)
  with pytest.raises(ValueError, match=r"RWKV7Options.chunk_size must be an even int in "
                                       r"\[2, 256\], got 512"):
    RWKV7Options(chunk_size=512)
  with pytest.raises(ValueError, match="v must be"):
    rwkv7_recurrence(*x[:3], x[3][:, :4], *x[4:])
  with pytest.raises(ValueError, match=r"the state must be \[B, H, Dk, Dv\]"):
    rwkv7_step(*(z[:, 0] for z in x), jnp.zeros((2, 2, 16, 11)))
