"""The resource model (kvm_jax.kernels.resources): every kernel's per-program working set at the
paper's shapes stays within H100/H200/B200 shared memory and registers and TPU v5e/v5p/v6e VMEM, for state
sizes up to 4096 rows and GQA groups of 1, 3 and 4; and the model follows the kernels' tiles."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from kvm_jax.kernels import backend, resources
from kvm_jax.kernels.readout import readout_blocks, readout_working_set
from kvm_jax.kernels.update import routing_blocks

TARGETS = {"gpu": ("h100", "h200", "b200"), "tpu": ("v5e", "v5p", "v6e")}


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [256, 1024, 4096])
@pytest.mark.parametrize("groups", [1, 3, 4])
def test_kernels_fit_at_paper_shapes(target, dtype, rows, groups):
  for kernel in resources.KERNELS:
    ws = resources.working_set(kernel, H=8 * groups, Hkv=8, D=128, C=256, R=rows,
                               dtype=jnp.dtype(dtype), target=target)
    for name in TARGETS[target]:
      assert resources.fits(ws, resources.LIMITS[name]), (kernel, name, ws)
    if target == "tpu":
      assert ws.vmem > 0 and resources.vmem_limit_bytes(ws) >= ws.vmem
    else:
      assert ws.shared > 0 and ws.registers > 0


def test_working_sets_are_bounded_in_the_state_size_on_gpu():
  """Tiled: a program's GPU working set does not grow with the state (R = 256 -> 4096)."""
  for kernel in resources.KERNELS:
    small, big = (resources.working_set(kernel, H=32, Hkv=8, D=128, C=256, R=r,
                                        dtype=jnp.bfloat16, target="gpu") for r in (256, 4096))
    assert (big.shared, big.registers) == (small.shared, small.registers), kernel


def test_model_reads_the_kernels_tiles():
  """A change of tile in the kernels changes the model: the model calls the same functions."""
  b = readout_blocks(1024, 4096, 512, "gpu")
  assert (b.queries, b.state, b.window) == (64, 64, 64)
  ws = readout_working_set(1024, 4096, 512, 128, 128, jnp.bfloat16, "gpu")
  q_tile = 64 * 128 * 2
  assert ws.shared == q_tile + backend.GPU_STAGES * (2 * 64 * 128 * 2 + 64 * 64 * 4)
  r = routing_blocks(256, 4096, "tpu")
  assert r.rows_padded % r.rows == 0 and r.rows % 8 == 0


def test_an_untiled_kernel_would_not_fit():
  """The limits bite: the former update kernel's whole [C, R] float32 score tile and [R, C]
  one-hot at R = 4096 (4 MiB each) exceed an H200's shared memory."""
  whole_tiles = resources.WorkingSet("untiled", shared=2 * 256 * 4096 * 4, registers=0)
  assert not resources.fits(whole_tiles, resources.LIMITS["h200"])
  assert backend.tpu_bytes((8, 1), jnp.float32) == 8 * 128 * 4  # lane padding is counted
