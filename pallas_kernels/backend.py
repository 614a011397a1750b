"""Which Pallas backend a kernel is built for, and everything that depends on it.

Kernels run natively on TPU (Mosaic) and GPU (Triton), and in interpret mode everywhere else (the
CPU reference path of the tests). A :class:`KernelConfig` is fixed when the caller is traced and
passed to the kernels as a static argument — never read from global state while a kernel is
traced, because ``custom_vjp`` traces its forward rule lazily, under ``grad``. By default it is
built for the current target (``kvm_jax.config.target.current_target()``: this machine, or inside
``kvm_jax.compile_target("v5e:2x2")`` the chip being compiled for); an explicit platform ("tpu",
"cuda") or target name builds it for that chip.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvm_jax.kernels.sharding import ShardAxes
from kvm_jax.config import target as targets


KiB, MiB = 1024, 1024 * 1024
GPU_STAGES, GPU_WARPS = 2, 4   # Triton software-pipelining stages and warps per program
#: VMEM a kernel's own buffers may take: three quarters of the core's, the rest left to Mosaic's
#: internal scratch. Chips: v5e and v6e 128 MiB, v5p 64 MiB (kvm_jax.config.target.CHIPS; measured: a
#: kernel needing 128 MiB compiles for neither v5p nor v6e, 64 MiB compiles for all three).
TPU_VMEM_SHARE = 0.75
DEFAULT_TPU_VMEM = 128 * MiB   #: a TPU platform named without a chip: v5e's


@dataclasses.dataclass(frozen=True)
class WorkingSet:
  """Bytes one program of a kernel holds: ``shared`` memory and ``registers`` (GPU, Triton) or
  ``vmem`` (TPU, Mosaic); computed by each kernel module from its own tiles and compared with the
  hardware by :mod:`kvm_jax.kernels.resources`."""

  kernel: str
  shared: int = 0
  registers: int = 0
  vmem: int = 0


def nbytes(shape, dtype) -> int:
  """Bytes of a dense tile."""
  return math.prod(shape) * jnp.dtype(dtype).itemsize


def tpu_bytes(shape, dtype) -> int:
  """Bytes of a VMEM buffer: the last dim padded to 128 lanes, the one before to whole sublane
  tiles (8 rows of 32-bit, 16 of 16-bit)."""
  itemsize = jnp.dtype(dtype).itemsize
  *lead, rows, lanes = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  sublanes = 8 * max(1, 4 // itemsize)
  return (math.prod(lead) * (-(-rows // sublanes) * sublanes) * (-(-lanes // 128) * 128)
          * itemsize)


def tpu_vmem(pipelined, scratch) -> int:
  """VMEM of a Mosaic kernel: every ``(shape, dtype)`` BlockSpec block twice (the pipeline
  double-buffers them) plus the in-kernel ``scratch`` temporaries, each padded to whole tiles."""
  return (2 * sum(tpu_bytes(s, d) for s, d in pipelined)
          + sum(tpu_bytes(s, d) for s, d in scratch))


def bounds_in_scalar_memory(kc: "KernelConfig") -> bool:
  """Whether a kernel's loop bounds live in scalar memory (compiled for TPU, where loop bounds
  are scalars) rather than in a block of their own."""
  return kc.platform == "tpu" and not kc.interpret


def scalar_bounds_spec(kc: "KernelConfig", shape):
  """A small int32 bounds array: scalar memory on TPU (:func:`bounds_in_scalar_memory`), else one
  whole-array block (grid ``(b, h, i)``)."""
  if bounds_in_scalar_memory(kc):
    from jax.experimental.pallas import tpu as pltpu
    return pl.BlockSpec(memory_space=pltpu.SMEM)
  return pl.BlockSpec(shape, lambda b, h, i: (0, 0))


def vmem_budget(vmem: int = DEFAULT_TPU_VMEM) -> int:
  """Bytes of a TPU core's ``vmem`` that a kernel's buffers may use (:data:`TPU_VMEM_SHARE`)."""
  return int(vmem * TPU_VMEM_SHARE)


def vmem_limit_bytes(ws: WorkingSet, vmem: int = DEFAULT_TPU_VMEM) -> int:
  """The VMEM to request from Mosaic for a kernel on a core of ``vmem`` bytes: the model's figure
  plus half again for the compiler's own temporaries, at least the 16 MiB default scoped limit,
  at most the budget (:func:`vmem_budget`)."""
  return int(min(vmem_budget(vmem), max(16 * MiB, ws.vmem * 3 // 2)))


def platform(target: Optional[str] = None) -> str:
  """"tpu", "gpu" or "cpu": of ``target`` (a platform "tpu", "cuda"/"gpu", "cpu", or a target
  name such as "v5e:2x2" / "h100:1x8"), default the current target's."""
  if target is None:
    return targets.current_platform()
  if target in ("tpu", "cuda", "gpu", "cpu"):
    return "gpu" if target == "cuda" else target
  try:
    return targets.parse_target(target).platform
  except ValueError:
    raise ValueError(f"unknown Pallas target {target!r}; choose tpu, cuda, cpu or a target "
                     "name such as v5e:2x2 or h100:1x8.") from None


def chip_vmem(target: Optional[str] = None) -> int:
  """A TPU core's VMEM for ``target``: the named chip's, the current target's when it is a TPU,
  else :data:`DEFAULT_TPU_VMEM`."""
  if target not in (None, "tpu", "cuda", "gpu", "cpu"):
    chip = targets.parse_target(target).chip
  else:
    chip = targets.current_target().chip
  return chip.vmem if chip.platform == "tpu" and chip.vmem else DEFAULT_TPU_VMEM


def default_interpret(target: Optional[str] = None) -> bool:
  """Interpret mode where no Pallas compiler exists (CPU)."""
  return platform(target) not in ("tpu", "gpu")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static facts a kernel is built with: the platform, whether it is interpreted, the mesh axes
  it may split over (:class:`ShardAxes`, given by the caller) and, on TPU, the core's VMEM."""

  platform: str
  interpret: bool
  shard_axes: ShardAxes = ShardAxes()
  vmem: int = DEFAULT_TPU_VMEM

  @classmethod
  def for_target(cls, target: Optional[str] = None, interpret: Optional[bool] = None,
                 shard_axes: ShardAxes = ShardAxes()) -> "KernelConfig":
    """Kernels for ``target`` (a platform or target name; default the current target),
    interpreted where no compiler exists."""
    interpret = default_interpret(target) if interpret is None else bool(interpret)
    return cls(platform(target), interpret, shard_axes, chip_vmem(target))

  def compiler_params(self, grid_dims: int, working_set: Optional[WorkingSet] = None):
    """Per-backend compiler parameters; ``working_set`` (the kernel's :class:`WorkingSet`) sets
    the VMEM Mosaic may use (``vmem_limit_bytes``) from the resource model, not the default."""
    if self.interpret:
      return None
    if self.platform == "tpu":
      from jax.experimental.pallas import tpu as pltpu
      extra = ({} if working_set is None
               else {"vmem_limit_bytes": vmem_limit_bytes(working_set, self.vmem)})
      return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_dims, **extra)
    if self.platform == "gpu":
      from jax.experimental.pallas import triton as pltriton
      return pltriton.CompilerParams(num_warps=GPU_WARPS, num_stages=GPU_STAGES)
    return None

  @property
  def triton(self) -> bool:
    return self.platform == "gpu" and not self.interpret

  def padded_size(self, n: int) -> int:
    """Triton needs power-of-two array sizes (and matmul operands of >= 16 rows): the size a
    kernel dimension is padded to. Elsewhere the kernels pad to their own tiles (on TPU a block's
    last two dims are multiples of (8, 128) or whole array dims, and a dynamic lane slice starts
    at a multiple of 128: ``kvm_jax.kernels.readout.readout_blocks``)."""
    return max(16, 1 << (n - 1).bit_length()) if self.triton else n

  def matmul_precision(self, dtype):
    """float32 operands: HIGHEST, i.e. true float32 products on every backend (the Triton
    lowering maps it to IEEE input precision, where the default is TF32 with a 10-bit mantissa;
    Mosaic to an fp32 contraction). Routing decisions must match the XLA path exactly, so no
    float32 dot may run at reduced precision. bfloat16 operands: the default (bf16 products are
    exact in the float32 accumulator)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None

  def for_matmul(self, x):
    """Matmul operand: as is when compiled; interpreted on CPU, bfloat16 is widened to float32
    (exact: bfloat16 products are exact in float32 and the accumulation is float32 on both),
    because XLA:CPU has no bfloat16 x bfloat16 -> float32 dot."""
    if not self.interpret or x.dtype == jnp.float32:
      return x
    return x.astype(jnp.float32)

  def check_sizes(self, **sizes: int) -> None:
    """Triton cannot pad the chunk or head dimensions (they are semantic): require powers of two
    there, with the fix in the message."""
    if not self.triton:
      return
    bad = {k: v for k, v in sizes.items() if v & (v - 1)}
    if bad:
      raise ValueError(f"the Pallas GPU (Triton) kernels need power-of-two sizes, got {bad}; "
                       "use e.g. chunk_size=256 and head dims 64/128, or implementation='xla'.")


def pad_axis(x, axis: int, size: int, value=0):
  """``x`` padded with ``value`` along ``axis`` to ``size``."""
  extra = size - x.shape[axis]
  if extra == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def onehot_matmul(onehot, x, kc: "KernelConfig"):
  """``onehot [M, N] @ x [N, K]`` exactly in float32, where ``onehot`` holds only 0 and 1.

  A 0/1 operand is exact in bfloat16, so ``x`` split into three bfloat16 parts (hi + mid + lo
  carries float32's 24-bit mantissa) gives three bf16 x bf16 -> f32 matmuls whose products are
  exact: full float32 accuracy on the tensor cores / MXU, about twice as fast as an IEEE float32
  dot on a GPU and without TF32's truncation. Interpreted on CPU, one HIGHEST float32 dot
  computes the same sums."""
  x = x.astype(jnp.float32)
  if kc.interpret:
    return jnp.dot(onehot.astype(jnp.float32), x, precision=jax.lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32)
  hi = x.astype(jnp.bfloat16)
  rest = x - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
  oh = onehot.astype(jnp.bfloat16)
  dot = lambda part: jnp.dot(oh, part, preferred_element_type=jnp.float32)
  return dot(hi) + dot(mid) + dot(lo)
