"""Matmul FLOPs read from compiled HLO, loops counted by their trip counts, against hand counts.

XLA's own ``cost_analysis()`` counts a loop body once; the programs below are a 12-step scan of
matmuls and its gradient, whose FLOPs are counted by hand: forward 13 matmuls of
[64, 256] x [256, 256], the gradient three times that less the input gradient of the first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kvm_jax.config.target import compile_target
from kvm_jax.util.hlo_flops import hlo_flops

MATMUL = 2 * 64 * 256 * 256


def _scanned(x, w):
  def body(carry, layer):
    return jnp.tanh(carry @ layer), None
  y, _ = jax.lax.scan(body, x, w)
  return (y @ w[0]).sum()


ARGS = (jax.ShapeDtypeStruct((64, 256), jnp.float32), jax.ShapeDtypeStruct((12, 256, 256),
                                                                          jnp.float32))


def _count(fn, target: str) -> tuple[float, float]:
  with compile_target(target) as t:
    compiled = jax.jit(fn).lower(*t.structs(ARGS)).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return hlo_flops(compiled.as_text()).flops, cost["flops"]


def test_loops_count_as_often_as_they_run_on_cpu():
  forward, xla_forward = _count(_scanned, "local")
  assert forward == 13 * MATMUL
  assert xla_forward < 3 * MATMUL  # XLA's own count sees the body once
  backward, _ = _count(jax.grad(_scanned, argnums=(0, 1)), "local")
  assert backward == 3 * 13 * MATMUL - MATMUL


@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_tpu_convolutions_count_as_the_matmuls_they_are():
  """XLA:TPU writes the matmuls as convolutions (a batched one with a dilated window); the
  count stays within 3 % of the hand count (XLA:TPU may fold the first layer's input gradient
  differently)."""
  pytest.importorskip("libtpu")
  forward, _ = _count(_scanned, "v5e:1x1")
  assert forward == 13 * MATMUL
  backward, _ = _count(jax.grad(_scanned, argnums=(0, 1)), "v5e:1x1")
  assert backward == pytest.approx(3 * 13 * MATMUL - MATMUL, rel=0.03)


@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_tpu_batched_matmuls_count_once_per_product():
  """A batched matmul, which XLA:TPU may write as a convolution whose window and input dilation
  both span the batch: the taps that meet dilation holes do no work."""
  pytest.importorskip("libtpu")
  a = jax.ShapeDtypeStruct((4, 4, 32, 183), jnp.float32)
  b = jax.ShapeDtypeStruct((4, 4, 183, 32), jnp.float32)
  with compile_target("v5e:1x1") as t:
    compiled = jax.jit(lambda x, y: jnp.einsum("nbij,nbjk->nbik", jnp.exp(x), y)).lower(
        *t.structs((a, b))).compile()
  assert hlo_flops(compiled.as_text()).flops == 2 * 16 * 32 * 32 * 183


# A projection of a batch of 4 as XLA:TPU wrote it in a KVM train step (v5e, 2026-12-08): the
# weight is the convolution's input, the activations its kernel, and the batch a spatial axis
# of size 1 padded by 3 on each side under a window of 4, so each output position meets one real
# tap. Its work is one [4 x 8192, 768] x [768, 768] matmul.
PADDED_BATCH = """
ENTRY %main (p0: bf16[768,768,1], p1: bf16[4,8192,768]) -> bf16[4,8192,768] {
  %p0 = bf16[768,768,1]{0,1,2} parameter(0)
  %p1 = bf16[4,8192,768]{1,2,0} parameter(1)
  ROOT %convolution.168 = bf16[4,8192,768]{1,2,0} convolution(%p0, %p1), window={size=4 pad=3_3 rhs_reversal=1}, dim_labels=fb0_0oi->0fb
}
"""


def test_padded_window_taps_do_no_work():
  assert hlo_flops(PADDED_BATCH).flops == 2 * 4 * 8192 * 768 * 768
