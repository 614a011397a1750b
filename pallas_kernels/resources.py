"""What each kernel holds per program, from the block shapes it will use, against the hardware.

:func:`working_set` returns, for one kernel at one shape, the bytes a program (one grid step)
keeps live. Each kernel module computes its own figure from the tile function it launches with
(``readout.readout_working_set`` from ``readout_blocks``, ``update.route_working_set`` /
``add_rows_working_set`` from ``routing_blocks``, ``decode.working_set_bytes`` from
``decode_blocks``), so the model cannot drift from the code:

* **GPU (Triton)**: ``shared`` — the tiles a loop step loads for its dots (``stages`` copies of
  the streamed operands, as Triton software-pipelines them) — and ``registers`` — the float32
  score and accumulator tiles, spread over ``num_warps · 32`` threads;
* **TPU (Mosaic)**: ``vmem`` — every BlockSpec block twice (the pipeline double-buffers them),
  each padded to whole (sublane, 128-lane) tiles, plus the in-kernel float32 temporaries.

:data:`LIMITS` holds the budgets of every chip of ``kvm_jax.config.target.CHIPS``: H100 / H200 / B200
(shared memory per block, registers per thread) and TPU v5e / v5p / v6e (the share of a core's
VMEM a kernel may take); :func:`fits` compares. ``KernelConfig.compiler_params`` asks Mosaic for
the VMEM the model computes (``vmem_limit_bytes``) instead of the default scoped limit. The
compile tests (tests/kernels/test_chip_compile.py) hold the model to the compilers: tiles it says fit
compile, and a shape it says does not fit is refused.
"""

from __future__ import annotations

import dataclasses

from kvm_jax.config import target as targets
from kvm_jax.kernels import decode, readout, update
from kvm_jax.kernels.backend import (GPU_WARPS, MiB, WorkingSet, vmem_budget, vmem_limit_bytes)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program budgets of one accelerator."""

  name: str
  platform: str            # "gpu" or "tpu"
  shared: int = 0          # bytes of shared memory one block may use (GPU)
  registers: int = 0       # bytes of registers one program may use at GPU_WARPS warps (GPU)
  vmem: int = 0            # bytes of VMEM a kernel may be given (TPU)


def limits_of(chip: targets.Chip) -> Limits:
  """The per-program budgets of one chip: a GPU block's opt-in shared memory and 255 32-bit
  registers per thread × ``GPU_WARPS`` warps; a TPU kernel's share of the core's VMEM."""
  if chip.platform == "gpu":
    return Limits(chip.name, "gpu", shared=chip.shared_per_block,
                  registers=255 * 4 * GPU_WARPS * 32)
  return Limits(chip.name, "tpu", vmem=vmem_budget(chip.vmem))


#: The budgets of every chip of ``kvm_jax.config.target.CHIPS``, by name (``limits_of``).
LIMITS = {name: limits_of(chip) for name, chip in targets.CHIPS.items()}

def decode_set(R, L, G, D, Dv, dtype, platform) -> WorkingSet:
  """The decode kernel (``kvm_jax.kernels.decode``) over R state rows and an L-slot ring."""
  blocks = decode.decode_blocks(R, L, G, D, Dv, dtype, platform)
  total = decode.working_set_bytes(blocks, D, Dv, dtype, platform)
  if platform == "gpu":
    # the float32 score tile and accumulator (with max and sum) live in registers
    step = max(blocks["state_block"], blocks["window_block"])
    registers = blocks["g_pad"] * (step + Dv + 2) * 4
    return WorkingSet("decode", shared=total, registers=registers)
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
    return readout.readout_working_set(G * C, R, W, D, Dv, dtype, platform)
  if kernel == "route":
    return update.route_working_set(C, R, D, platform)
  if kernel == "add_rows":
    return update.add_rows_working_set(C, R, max(D, Dv), platform)
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


__all__ = ["KERNELS", "LIMITS", "Limits", "MiB", "WorkingSet", "fits", "vmem_limit_bytes",
           "working_set"]
