"""Which Pallas backend a kernel is being built for, and its compiler parameters.

Kernels run natively on TPU (Mosaic) and GPU (Triton), and in interpret mode everywhere else (the
CPU reference path of the tests). ``target("tpu")`` / ``target("cuda")`` overrides the choice so a
CPU-only machine can lower the kernels for an accelerator (the lowering tests).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import jax
import jax.numpy as jnp

_override: Optional[str] = None


@contextlib.contextmanager
def target(platform: str):
  """Build kernels for ``platform`` ("tpu", "cuda"/"gpu" or "cpu") inside this block."""
  global _override
  if platform not in ("tpu", "cuda", "gpu", "cpu"):
    raise ValueError(f"unknown Pallas target {platform!r}; choose tpu, cuda or cpu.")
  previous, _override = _override, ("gpu" if platform == "cuda" else platform)
  try:
    yield
  finally:
    _override = previous


def platform() -> str:
  """"tpu", "gpu" or "cpu": the target being built for."""
  return _override or jax.default_backend()


def default_interpret() -> bool:
  """Interpret mode where no Pallas compiler exists (CPU)."""
  return platform() not in ("tpu", "gpu")


def compiler_params(grid_dims: int):
  p = platform()
  if p == "tpu":
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_dims)
  if p == "gpu":
    from jax.experimental.pallas import triton as pltriton
    return pltriton.CompilerParams(num_warps=4, num_stages=2)
  return None


def needs_min_rows() -> bool:
  """Triton's matmuls need at least 16 rows per operand."""
  return platform() == "gpu"


def matmul_precision(dtype):
  """float32 inputs: exact float32 products (as the XLA path's HIGHEST); Triton takes the default
  (it has no precision knob and computes float32 dots in IEEE float32 unless TF32 is enabled)."""
  if platform() == "gpu" or jnp.dtype(dtype) != jnp.float32:
    return None
  return jax.lax.Precision.HIGHEST


def padded_size(n: int) -> int:
  """Triton needs power-of-two array sizes: the size a kernel dimension is padded to (elsewhere
  the size itself; Mosaic takes whole-array blocks of any size)."""
  if platform() != "gpu":
    return n
  return max(16, 1 << (n - 1).bit_length())


def pad_axis(x, axis: int, size: int, value=0):
  """``x`` padded with ``value`` along ``axis`` to ``size``."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def check_sizes(**sizes: int) -> None:
  """Triton cannot pad the chunk or head dimensions for us (they are semantic): require powers of
  two there, with the fix in the message."""
  if platform() != "gpu":
    return
  bad = {k: v for k, v in sizes.items() if v & (v - 1)}
  if bad:
    raise ValueError(f"the Pallas GPU (Triton) kernels need power-of-two sizes, got {bad}; use "
                     "e.g. chunk_size=256 and head dims 64/128, or implementation='xla'.")
