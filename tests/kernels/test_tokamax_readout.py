"""kvm_jax.kernels.tokamax_readout: the KVM readout run by tokamax equals kvm_jax.ops.common.joint_attention.

Tolerance: both sides compute the same float32 softmax with float32 (HIGHEST) matmuls; they differ
only in rounding order — the tokamax readout multiplies the keys by the temperature before the dot product
(the XLA readout scales the score after it), concatenates state and window before one reduction
(the XLA readout reduces them separately) and normalizes inside tokamax. With scores of order 1-10,
at most 40 keys and outputs of order 1, that is a few tens of float32 ulps (eps = 1.2e-7): 1e-5
absolute/relative leaves margin while a wrong temperature, mask or head order is off by >= 1e-2.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvm_jax.kernels import tokamax_readout
from kvm_jax.ops.common import joint_attention

TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def tokamax():
  return pytest.importorskip("tokamax")


def make_inputs(seed, *, B=2, Tq=8, Hkv=2, G=1, D=16, Dv=8, R=12, W=16, per_head_values=False,
                per_query_state_mask=False):
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  q = jax.random.normal(ks[0], (B, Tq, Hkv, G, D))
  sk = jax.random.normal(ks[1], (B, Hkv, R, D))
  sv_shape = (B, Hkv, G, R, Dv) if per_head_values else (B, Hkv, R, Dv)
  sv = jax.random.normal(ks[2], sv_shape)
  wk = jax.random.normal(ks[3], (B, W, Hkv, D))
  wv = jax.random.normal(ks[4], (B, W, Hkv, Dv))
  # Temperatures far from 1 and different between state and window, per query head.
  st = jax.random.uniform(ks[5], (Hkv, G), minval=0.3, maxval=3.0)
  wt = jax.random.uniform(ks[6], (Hkv, G), minval=0.3, maxval=3.0)
  rows = np.arange(R)
  if per_query_state_mask:
    state_valid = rows[None, :] < (np.arange(Tq)[:, None] % R + 1)          # [Tq, R]
  else:
    state_valid = (rows < R - 5)[None, :]                                    # [1, R]: 5 masked
  # Causal window over the last Tq slots, plus two masked (out-of-sequence) leading slots.
  slot = np.arange(W)
  window_valid = (slot[None, :] <= W - Tq + np.arange(Tq)[:, None]) & (slot >= 2)[None, :]
  return (q, sk, sv, jnp.asarray(state_valid), wk, wv, jnp.asarray(window_valid), st, wt)


CASES = {
    "mha": dict(G=1),
    "mha_per_query_state_mask": dict(G=1, per_query_state_mask=True),
    "gqa": dict(G=2),
    "gqa_per_head_values": dict(G=2, per_head_values=True),
    "decode_token": dict(G=1, Tq=1, W=8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_joint_attention(tokamax, case):
  args = make_inputs(0, **CASES[case])
  want = joint_attention(*args)
  got = tokamax_readout.joint_attention_tokamax(*args, implementation="xla")
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), **TOL)


def test_masks_and_temperatures_matter(tokamax):
  """The inputs exercise what the comparison guards: changing a temperature, unmasking a masked
  state row or a masked window slot each moves the reference output by far more than TOL."""
  q, sk, sv, s_ok, wk, wv, w_ok, st, wt = make_inputs(0, G=2)
  base = joint_attention(q, sk, sv, s_ok, wk, wv, w_ok, st, wt)
  variants = [joint_attention(q, sk, sv, s_ok, wk, wv, w_ok, jnp.ones_like(st), wt),
              joint_attention(q, sk, sv, s_ok, wk, wv, w_ok, st, jnp.ones_like(wt)),
              joint_attention(q, sk, sv, jnp.ones_like(s_ok), wk, wv, w_ok, st, wt),
              joint_attention(q, sk, sv, s_ok, wk, wv, jnp.ones_like(w_ok), st, wt),
              joint_attention(q, sk, sv, s_ok, wk, wv, w_ok, wt, st)]
  for other in variants:
    assert float(jnp.max(jnp.abs(other - base))) > 1e-2


def test_under_jit_and_gradients(tokamax):
  args = make_inputs(1, G=2)
  loss = lambda fn: lambda q, sk, st, wt: jnp.sum(
      jnp.sin(fn(q, sk, args[2], args[3], args[4], args[5], args[6], st, wt)))
  ours = jax.jit(lambda *a: tokamax_readout.joint_attention_tokamax(*a, implementation="xla"))
  np.testing.assert_allclose(np.asarray(ours(*args)), np.asarray(joint_attention(*args)), **TOL)
  argnums = (0, 1, 2, 3)
  picked = (args[0], args[1], args[7], args[8])
  g_ref = jax.grad(loss(joint_attention), argnums)(*picked)
  g_ours = jax.grad(loss(lambda *a: tokamax_readout.joint_attention_tokamax(*a, implementation="xla")),
                    argnums)(*picked)
  for a, b in zip(g_ours, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_default_implementation_follows_the_kernel_config(tokamax):
  from kvm_jax.kernels.backend import KernelConfig
  cpu = KernelConfig.for_target("cpu")
  assert tokamax_readout.default_implementation(cpu) == "xla"
  assert tokamax_readout.default_implementation(KernelConfig.for_target("tpu")) is None
  args = make_inputs(2, G=1)
  np.testing.assert_allclose(np.asarray(tokamax_readout.joint_attention_tokamax(*args, kc=cpu)),
                             np.asarray(joint_attention(*args)), **TOL)


def test_missing_tokamax_names_the_fix(monkeypatch):
  monkeypatch.setitem(sys.modules, "tokamax", None)  # makes `import tokamax` raise ImportError
  tokamax_readout.tokamax_available.cache_clear()
  try:
    assert not tokamax_readout.tokamax_available()
    with pytest.raises(ImportError, match=r"pip install 'kvm_jax\[tokamax\]'"):
      tokamax_readout.joint_attention_tokamax(*make_inputs(0))
  finally:
    tokamax_readout.tokamax_available.cache_clear()


def test_readout_choice_through_the_op(tokamax):
  """readout="tokamax" runs the whole KVM op with tokamax's readout: the same outputs and
  gradients as the op's own readout; "auto" keeps the own readout where no benchmark listed
  tokamax as faster (every backend today); an unknown choice names the valid ones."""
  import kvm_jax as kj
  from kvm_jax.ops.kvm.api import TOKAMAX_READOUT_BACKENDS
  from kvm_jax.ops.kvm.cases import random_inputs

  def ops(readout):
    return kj.resolve_kvm_backend(cfg, implementation="xla", readout=readout).chunk_ops()

  cfg = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=4,
                     budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))
  q, k, v, g = random_inputs(0, 2, 45, 4, 2, 16, 16)
  params = kj.KVMParams(jnp.ones(16), jnp.zeros(16), jnp.linspace(0.7, 1.3, 4),
                        jnp.linspace(1.2, 0.8, 4))

  def loss(readout):
    backend = kj.resolve_kvm_backend(cfg, implementation="xla", readout=readout)
    return lambda q, k: jnp.sum(jnp.sin(kj.kvm_attention(q, k, v, g, params, cfg,
                                                         backend=backend).y))

  own, tok = (jax.jit(jax.value_and_grad(loss(r), argnums=(0, 1)))(q, k)
              for r in ("own", "tokamax"))
  np.testing.assert_allclose(tok[0], own[0], rtol=1e-5)
  for a, b in zip(tok[1], own[1]):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(jnp.max(jnp.abs(b))))
  assert jax.default_backend() not in TOKAMAX_READOUT_BACKENDS["xla"]
  assert "tokamax" not in ops("auto").name
  assert "tokamax" in ops("tokamax").name
  with pytest.raises(ValueError, match="readout='flash'"):
    ops("flash")
