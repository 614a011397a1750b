"""What each kernel holds per program, from the block shapes it will use, against the hardware.

:func:`working_set` returns, for one kernel at one shape, the bytes a program (one grid step)
keeps live, computed from the same tile functions the kernels call (``readout_blocks``,
``routing_blocks``, ``decode_blocks``), so the model cannot drift from the code:

* **GPU (Triton)**: ``shared`` — the tiles a loop step loads for its dots (``stages`` copies of the
  streamed operands, as Triton software-pipelines them) — and ``registers`` — the float32 score
  and accumulator tiles, spread over ``num_warps · 32`` threads;
* **TPU (Mosaic)**: ``vmem`` — every BlockSpec block twice (the pipeline double-buffers them),
  each padded to whole (sublane, 128-lane) tiles, plus the in-kernel float32 temporaries.

:data:`LIMITS` holds the budgets of H100 / H200 (shared memory per block, registers per
thread) and TPU v5e (VMEM); :func:`fits` compares. ``KernelConfig.compiler_params`` asks Mosaic
for the VMEM the model computes (``vmem_limit_bytes``) instead of the default scoped limit.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

KiB, MiB = 1024, 1024 * 1024
GPU_STAGES, GPU_WARPS = 2, 4   # backend.KernelConfig.compiler_params (Triton)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program budgets of one accelerator."""

  name: str
  platform: str            # "gpu" or "tpu"
  shared: int = 0          # bytes of shared memory one block may use (GPU)
  registers: int = 0       # bytes of registers one program may use at GPU_WARPS warps (GPU)
  vmem: int = 0            # bytes of VMEM a kernel may be given (TPU)


LIMITS = {
    # 227 KiB of shared memory per block; 255 32-bit registers per thread x 128 threads.
    "h100": Limits("H100", "gpu", shared=227 * KiB, registers=255 * 4 * GPU_WARPS * 32),
    "h200": Limits("H200", "gpu", shared=227 * KiB, registers=255 * 4 * GPU_WARPS * 32),
    # 128 MiB of VMEM per core; a quarter is left to the compiler's own buffers.
    "tpu_v5e": Limits("TPU v5e", "tpu", vmem=96 * MiB),
}


def _tpu_bytes(shape, dtype) -> int:
  """Bytes of a VMEM buffer: the last dim padded to 128 lanes, the one before to whole
  sublane tiles (8 rows of 32-bit, 16 of 16-bit)."""
  itemsize = jnp.dtype(dtype).itemsize
  *lead, rows, lanes = (1,) * max(0, 2 - len(shape)) + tuple(shape)
  sublanes = 8 * max(1, 4 // itemsize)
  return (math.prod(lead) * (-(-rows // sublanes) * sublanes) * (-(-lanes // 128) * 128)
          * itemsize)


def _bytes(shape, dtype) -> int:
  return math.prod(shape) * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class WorkingSet:
  """Bytes per program: ``shared`` and ``registers`` (GPU) or ``vmem`` (TPU)."""

  kernel: str
  shared: int = 0
  registers: int = 0
  vmem: int = 0


def readout_set(GT, R, W, D, Dv, dtype, platform) -> WorkingSet:
  """The readout (``kvm_jax.kernels.readout``) for G·Tq query rows, R state, W window rows."""
  from kvm_jax.kernels.readout import readout_blocks  # the kernels import this module
  b = readout_blocks(GT, R, W, platform)
  f32 = jnp.float32
  if platform == "gpu":
    step = max(b.state, b.window)
    shared = _bytes((b.queries, D), dtype) + GPU_STAGES * (
        _bytes((step, D), dtype) + _bytes((step, Dv), dtype) + _bytes((b.queries, step), f32))
    registers = (2 * _bytes((b.queries, step), f32) + _bytes((b.queries, Dv), f32)
                 + 4 * _bytes((b.queries, 1), f32))
    return WorkingSet("readout", shared=shared, registers=registers)
  blocks = [((b.queries, D), dtype), ((b.state_padded, D), dtype), ((b.state_padded, Dv), dtype),
            ((1, b.state_padded), f32), ((b.window_padded, D), dtype),
            ((b.window_padded, Dv), dtype), ((b.queries, b.window_padded), f32),
            ((b.queries, 1), f32), ((b.queries, 1), f32), ((b.queries, Dv), dtype),
            ((b.queries, 1), f32)]
  # score, probabilities, exp temporaries; accumulator; running max and sum
  scratch = [((b.queries, max(b.state, b.window)), f32)] * 3 + [((b.queries, Dv), f32)] + \
      [((b.queries, 1), f32)] * 2
  vmem = 2 * sum(_tpu_bytes(s, d) for s, d in blocks) + sum(_tpu_bytes(s, d) for s, d in scratch)
  return WorkingSet("readout", vmem=vmem)


def route_set(C, R, D, platform) -> WorkingSet:
  """Either routing-score kernel (``kvm_jax.kernels.update``)."""
  from kvm_jax.kernels.update import routing_blocks
  b = routing_blocks(C, R, platform)
  f32, i32 = jnp.float32, jnp.int32
  if platform == "gpu":
    shared = _bytes((b.tokens, D), f32) + GPU_STAGES * _bytes((b.rows, D), f32)
    registers = 2 * _bytes((b.tokens, b.rows), f32) + 2 * _bytes((b.tokens, 1), f32)
    return WorkingSet("route", shared=shared, registers=registers)
  blocks = [((1, 2), i32), ((b.tokens, D), f32), ((b.rows_padded, D), f32), ((b.tokens, 1), f32)]
  scratch = [((b.tokens, b.rows), f32)] * 3 + [((b.tokens, 1), f32)] * 2
  vmem = 2 * sum(_tpu_bytes(s, d) for s, d in blocks) + sum(_tpu_bytes(s, d) for s, d in scratch)
  return WorkingSet("route", vmem=vmem)


def add_rows_set(C, R, X, platform) -> WorkingSet:
  """The row accumulation (``kvm_jax.kernels.update.add_rows``) of width X."""
  from kvm_jax.kernels.update import routing_blocks
  b = routing_blocks(C, R, platform)
  f32, bf16 = jnp.float32, jnp.bfloat16
  if platform == "gpu":
    # one-hot tile and the three bf16 parts of an update tile per step
    shared = GPU_STAGES * (_bytes((b.acc_rows, b.acc_tokens), bf16)
                           + 3 * _bytes((b.acc_tokens, X), bf16))
    registers = _bytes((b.acc_rows, X), f32) * 2 + _bytes((b.acc_tokens, X), f32)
    return WorkingSet("add_rows", shared=shared, registers=registers)
  blocks = [((1, C), jnp.int32), ((C, X), f32), ((b.acc_rows, X), f32), ((b.acc_rows, X), f32)]
  scratch = [((b.acc_rows, b.acc_tokens), f32), ((b.acc_rows, X), f32)] + \
      [((b.acc_tokens, X), bf16)] * 3
  vmem = 2 * sum(_tpu_bytes(s, d) for s, d in blocks) + sum(_tpu_bytes(s, d) for s, d in scratch)
  return WorkingSet("add_rows", vmem=vmem)


def decode_set(R, L, G, D, Dv, dtype, platform) -> WorkingSet:
  """The decode kernel (``kvm_jax.kernels.decode``) over R state rows and an L-slot ring."""
  from kvm_jax.kernels import decode
  blocks = decode.decode_blocks(R, L, G, D, Dv, dtype, platform)
  total = decode.working_set_bytes(blocks, D, Dv, dtype, platform)
  if platform == "gpu":
    return WorkingSet("decode", shared=total)
  return WorkingSet("decode", vmem=total)


def working_set(kernel: str, *, H: int, Hkv: int, D: int, C: int, R: int, dtype,
                target: str, window_chunks: int = 2, Dv: int | None = None) -> WorkingSet:
  """Per-program bytes of ``kernel`` ("readout", "route", "add_rows", "decode") at one shape.

  ``target``: "gpu"/"cuda" or "tpu". The batch does not enter: it only adds programs."""
  platform = "gpu" if target in ("gpu", "cuda") else target
  if platform not in ("gpu", "tpu"):
    raise ValueError(f"working_set: target {target!r}; choose gpu (cuda) or tpu.")
  Dv = D if Dv is None else Dv
  G, W = H // Hkv, window_chunks * C
  if kernel == "readout":
    return readout_set(G * C, R, W, D, Dv, dtype, platform)
  if kernel == "route":
    return route_set(C, R, D, platform)
  if kernel == "add_rows":
    return add_rows_set(C, R, max(D, Dv), platform)
  if kernel == "decode":
    return decode_set(R, W, G, D, Dv, dtype, platform)
  raise ValueError(f"working_set: unknown kernel {kernel!r}; choose readout, route, add_rows "
                   "or decode.")


KERNELS = ("readout", "route", "add_rows", "decode")


def fits(ws: WorkingSet, limits: Limits) -> bool:
  """Whether a working set stays within one accelerator's budgets."""
  if limits.platform == "gpu":
    return ws.shared <= limits.shared and ws.registers <= limits.registers
  return ws.vmem <= limits.vmem


def vmem_limit_bytes(ws: WorkingSet) -> int:
  """The VMEM to request from Mosaic for a kernel: the model's figure plus half again for the
  compiler's own temporaries, at least the 16 MiB default and at most v5e's budget."""
  return int(min(LIMITS["tpu_v5e"].vmem, max(16 * MiB, ws.vmem * 3 // 2)))
