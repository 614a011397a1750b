"""The chip programs are built for: this machine's by default, or a named compile target.

Every backend decision of the package (which KVM and attention implementation ``auto`` picks,
whether Pallas kernels are compiled or interpreted, their tiles, the scan's layouts, the memory
report's label) asks :func:`current_target`. Outside any context that is this machine
(:func:`local_target`: JAX's default backend, the one place the package reads it). Inside
``with compile_target("v5e:2x2"):`` it is that chip, so a CPU-only host traces, lowers and
*compiles* programs exactly as they would be built on the chip::

    with kj.compile_target("h100:1x8") as target:
      compiled = jax.jit(f).lower(*target.structs(args)).compile()   # XLA:GPU and Triton run
    compiled.memory_analysis()                                         # bytes per chip

Targets by name:

* TPU topologies as JAX spells them: ``v5e:2x2`` … ``v5e:16x16``, ``v5p:2x2x1``, ``v6e:2x2``,
  Compiling for them needs libtpu (``pip install "kvm_jax[compile]"``), which
  compiles for any topology on a host without TPUs (one process at a time holds it).
* GPUs as ``CHIP:HOSTSxDEVICES`` (``h100:1x8``, ``h200:1x8``, ``b200:1x8``; ``h100`` alone is
  ``h100:1x1``). Compiling for them needs the CUDA compile plugins (also in ``[compile]``; no GPU,
  driver or CUDA libraries), and the chip's XLA ``GpuTargetConfigProto``, which ships with the
  package (``kvm_jax/config/target_configs/<chip>.txtpb``, written from the chip's published figures).

What a compile proves: the program is valid for the chip (XLA, Mosaic and Triton accept it) and
how many bytes it needs per chip. Not its speed, nor its numerics on the chip. XLA:TPU refuses a
program that does not fit the chip's memory; XLA:GPU does not check, so compare
:func:`program_bytes` with :attr:`Chip.memory` (:func:`compile_program` does).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import os
import re
import time
from importlib import resources
from typing import Any, Callable, Iterator, Optional, Sequence, Union

GiB, MiB, KiB = 2**30, 2**20, 2**10


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator (or this CPU host) as programs see it.

  ``memory``: bytes one program may use per device (a TPU's usable HBM as XLA:TPU reports it in
  its out-of-memory error, a GPU's device memory); ``kind``: JAX's ``device_kind``; ``vmem``:
  a TPU core's vector memory; ``shared_per_block``: a GPU block's opt-in shared memory;
  ``target_config``: the GPU's ``GpuTargetConfigProto`` file in ``kvm_jax/config/target_configs``."""

  name: str
  platform: str               # "tpu", "gpu" or "cpu"
  memory: int
  kind: str
  vmem: int = 0
  shared_per_block: int = 0
  target_config: Optional[str] = None


#: The chips a target may name, by name (:class:`Chip`).
CHIPS = {
    # Usable HBM per device: what XLA:TPU (libtpu 0.0.42) reports as "available HBM" when a
    # program does not fit (a v5e's 16 GiB: 15.75G).
    "v5e": Chip("v5e", "tpu", int(15.75 * GiB), "TPU v5 lite", vmem=128 * MiB),
    "v5p": Chip("v5p", "tpu", int(95.74 * GiB), "TPU v5", vmem=64 * MiB),
    "v6e": Chip("v6e", "tpu", int(31.25 * GiB), "TPU v6 lite", vmem=128 * MiB),
    # Device memory as CUDA reports it (the proto's device_memory_size); 227 KiB of opt-in shared
    # memory per block on Hopper and Blackwell.
    "h100": Chip("h100", "gpu", 84_942_979_072, "NVIDIA H100 80GB HBM3",
                 shared_per_block=227 * KiB, target_config="h100.txtpb"),
    "h200": Chip("h200", "gpu", 150_754_820_096, "NVIDIA H200",
                 shared_per_block=227 * KiB, target_config="h200.txtpb"),
    "b200": Chip("b200", "gpu", 192_265_846_784, "NVIDIA B200",
                 shared_per_block=227 * KiB, target_config="b200.txtpb"),
}
TPU_CHIPS = tuple(name for name, chip in CHIPS.items() if chip.platform == "tpu")
GPU_CHIPS = tuple(name for name, chip in CHIPS.items() if chip.platform == "gpu")


@dataclasses.dataclass(frozen=True)
class Target:
  """Where programs are built: ``name`` ("cpu", "gpu", "tpu" for this machine's devices, or a
  compile target such as ``v5e:2x2`` / ``h100:1x8``), the ``chip``, and the device grid
  (``hosts`` × ``devices_per_host``). ``local``: the devices are this machine's (programs run);
  otherwise they are a topology's abstract devices (programs compile, nothing runs)."""

  name: str
  chip: Chip
  hosts: int = 1
  devices_per_host: int = 1
  local: bool = True

  @property
  def platform(self) -> str:
    """"tpu", "gpu" or "cpu": the compiler programs go through."""
    return self.chip.platform

  @property
  def device_count(self) -> int:
    return self.hosts * self.devices_per_host

  @property
  def memory_per_chip(self) -> int:
    return self.chip.memory

  def devices(self) -> list:
    """The target's devices: this machine's, or the topology's abstract ones."""
    import jax
    return jax.devices() if self.local else list(_topology(self.name).devices)

  def mesh(self, shape: Sequence[int], axis_names: Sequence[str]):
    """A ``jax.sharding.Mesh`` of the target's devices in ``shape`` (its product must be the
    device count)."""
    import jax
    import numpy as np
    devices = self.devices()
    if math.prod(shape) != len(devices):
      raise ValueError(f"a mesh of shape {tuple(shape)} needs {math.prod(shape)} devices; target "
                       f"{self.name} has {len(devices)}.")
    return jax.sharding.Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names))

  def structs(self, tree, device_index: int = 0):
    """``tree`` (arrays or ``ShapeDtypeStruct``\\ s) as ``ShapeDtypeStruct``\\ s placed on one of
    the target's devices: the arguments ``jax.jit(f).lower`` compiles for it."""
    import jax
    sharding = jax.sharding.SingleDeviceSharding(self.devices()[device_index])
    as_struct = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
    return jax.tree_util.tree_map(as_struct, tree)


_CURRENT: contextvars.ContextVar[Optional[Target]] = contextvars.ContextVar(
    "kvm_jax_compile_target", default=None)


def current_target() -> Target:
  """The target programs are being built for: the innermost :func:`compile_target`, else this
  machine's (:func:`~kvm_jax.config.target.local_target`)."""
  target = _CURRENT.get()
  return local_target() if target is None else target


def current_platform() -> str:
  """"cpu", "gpu" or "tpu": the platform of :func:`current_target`."""
  return current_target().platform


def local_target() -> Target:
  """This machine's devices, from JAX's default backend (read here and nowhere else)."""
  import jax
  return _local_target(jax.default_backend())


@functools.lru_cache(maxsize=None)
def _local_target(backend: str) -> Target:
  import jax
  devices = jax.devices()
  kind = devices[0].device_kind
  platform = {"cuda": "gpu", "rocm": "gpu"}.get(backend, backend)
  known = next((c for c in CHIPS.values() if c.platform == platform and c.kind == kind), None)
  stats = _memory_stats(devices[0])
  memory = stats.get("bytes_limit", known.memory if known else 0)
  chip = dataclasses.replace(known, memory=memory) if known else Chip(
      kind.lower().replace(" ", "-"), platform, memory, kind)
  hosts = jax.process_count()
  return Target(platform, chip, hosts, max(1, len(devices) // hosts), local=True)


def _memory_stats(device) -> dict:
  try:
    return device.memory_stats() or {}
  except Exception:  # CPU devices and some plugins have none
    return {}


_GPU_NAME = re.compile(r"^(?P<chip>[a-z0-9]+)(?::(?P<hosts>\d+)x(?P<devices>\d+))?$")
_TPU_NAME = re.compile(r"^(?P<chip>v\d+[a-z]?):(?P<shape>\d+(?:x\d+){1,2})$")


def parse_target(name: Union[str, Target]) -> Target:
  """A :class:`~kvm_jax.config.target.Target` from its name: a TPU topology as JAX spells it (``v5e:2x2``,
  ``v5p:2x2x1``), a GPU as ``CHIP[:HOSTSxDEVICES]`` (``h100:1x8``), or "local" (this machine)."""
  if isinstance(name, Target):
    return name
  text = str(name).strip().lower()
  if text in ("local", "", "host"):
    return local_target()
  tpu = _TPU_NAME.match(text)
  if tpu and tpu["chip"] in TPU_CHIPS:
    chips = math.prod(int(n) for n in tpu["shape"].split("x"))
    return Target(text, CHIPS[tpu["chip"]], 1, chips, local=False)
  gpu = _GPU_NAME.match(text)
  if gpu and gpu["chip"] in GPU_CHIPS:
    hosts, per_host = int(gpu["hosts"] or 1), int(gpu["devices"] or 1)
    if hosts < 1 or per_host < 1:
      raise ValueError(f"target {name!r}: hosts and devices per host must be >= 1.")
    return Target(f"{gpu['chip']}:{hosts}x{per_host}", CHIPS[gpu["chip"]], hosts, per_host,
                  local=False)
  raise ValueError(
      f"unknown target {name!r}; name a TPU topology as JAX spells it (v5e:2x2, v5p:2x2x1, "
      f"v6e:2x2; chips {', '.join(TPU_CHIPS)}), a GPU as CHIP:HOSTSxDEVICES (h100:1x8; chips "
      f"{', '.join(GPU_CHIPS)}), or local.")


def gpu_target_config(chip: str) -> str:
  """The ``GpuTargetConfigProto`` text of a GPU chip of :data:`CHIPS`, shipped with the package."""
  spec = CHIPS[chip]
  if spec.target_config is None:
    raise ValueError(f"{chip} is not a GPU; GPU chips: {', '.join(GPU_CHIPS)}.")
  return resources.files("kvm_jax.config").joinpath("target_configs", spec.target_config).read_text()


@functools.lru_cache(maxsize=None)
def _topology(name: str):
  """The abstract devices of a compile target (cached: a topology is built once per process)."""
  from jax.experimental import topologies
  target = parse_target(name)
  if target.platform == "tpu":
    # libtpu looks for the TPU host it runs on and, finding none, prints several lines of warnings
    # at load; a compile for a named topology needs neither (a real TPU host sets both).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
      return topologies.get_topology_desc(platform="tpu", topology_name=name,
                                          **_small_tpu_host(name))
    except Exception as e:
      raise RuntimeError(f"cannot build the TPU topology {name!r}: {e}. Compiling for TPU needs "
                         "libtpu: pip install 'kvm_jax[compile]' (one process at a time may "
                         "hold it; set ALLOW_MULTIPLE_LIBTPU_LOAD=1 to let a second start).") from e
  try:
    return topologies.get_topology_desc(
        platform="cuda", target_config=gpu_target_config(target.chip.name),
        topology=f"1x{target.hosts}x{target.devices_per_host}")
  except Exception as e:
    raise RuntimeError(f"cannot build the GPU topology {name!r}: {e}. Compiling for GPU needs "
                       "the CUDA compile plugins: pip install 'kvm_jax[compile]'.") from e


#: The chips one TPU host holds by libtpu's default (x, y, z): a topology is laid out as hosts of it.
_DEFAULT_CHIPS_PER_HOST = (2, 2, 1)


def _small_tpu_host(name: str) -> dict:
  """libtpu's topology options for a TPU slice smaller than a host in some dimension (``v5e:1x1``,
  ``v5e:2x1``), which its default host of 2x2 chips does not divide: the host is the slice
  itself there. Empty for every other topology."""
  shape = [int(n) for n in _TPU_NAME.match(name)["shape"].split("x")]
  shape += [1] * (3 - len(shape))
  if all(n % h == 0 for n, h in zip(shape, _DEFAULT_CHIPS_PER_HOST)):
    return {}
  return {"chips_per_host_bounds": [min(n, h) for n, h in zip(shape, _DEFAULT_CHIPS_PER_HOST)]}


def _jit_key_state():
  """A JAX config state holding the compile target's name, part of every ``jit`` cache key: the
  decisions a function makes while it is traced (which kernels, tiles, layouts) depend on the
  target, so a trace made for one target must not be reused for another. JAX offers user states
  only through its internal config module; where that is missing, :func:`compile_target` clears
  JAX's caches on entry and exit instead (correct, slower)."""
  try:
    from jax._src import config as jax_config
    return jax_config.string_state(
        "kvm_jax_compile_target", "", help="the kvm_jax compile target programs are traced for",
        include_in_jit_key=True, include_in_trace_context=True)
  except Exception:  # another jax than the ones tested (0.10.x): fall back to clearing caches
    return None


_TARGET_IN_JIT_KEY = _jit_key_state()


@contextlib.contextmanager
def _in_jit_key(target: Target):
  if _TARGET_IN_JIT_KEY is not None:
    with _TARGET_IN_JIT_KEY(target.name):
      yield
    return
  import jax
  jax.clear_caches()
  try:
    yield
  finally:
    jax.clear_caches()


@contextlib.contextmanager
def compile_target(target: Union[str, Target]) -> Iterator[Target]:
  """Builds programs for ``target`` (a name or a :class:`~kvm_jax.config.target.Target`) inside the
  block: every backend decision reads it through :func:`current_target`, and ``jit`` keeps the
  block's traces apart from those made for other targets. Yields the target (its ``devices()``,
  ``mesh()`` and ``structs()`` place a program's arguments on it)."""
  target = parse_target(target)
  token = _CURRENT.set(target)
  try:
    with _in_jit_key(target), _gpu_lowering_context(target):
      yield target
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def _gpu_lowering_context(target: Target):
  """From jax 0.11 on, the Triton lowering reads the GPU's compute capability from the mesh in
  context (a CPU-only host has no GPU device to ask): a one-axis mesh of the target's devices
  stands in. jax 0.10 needs nothing."""
  import jax
  major_minor = tuple(int(p) for p in jax.__version__.split(".")[:2])
  if target.local or target.platform != "gpu" or major_minor < (0, 11):
    yield
    return
  with jax.set_mesh(target.mesh((target.device_count,), ("devices",))):
    yield


# ----------------------------------------------------------------------------------------------
# Compiling a program and reading its bytes
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
  """One compile's outcome: ``ok``, the compiler's ``error`` (its first lines) if not, the
  seconds it took, and bytes per chip (arguments, outputs, temporaries, aliased)."""

  name: str
  target: str
  ok: bool
  seconds: float
  argument_bytes: int = 0
  output_bytes: int = 0
  temp_bytes: int = 0
  alias_bytes: int = 0
  memory: int = 0
  error: str = ""

  @property
  def total_bytes(self) -> int:
    """Bytes the program holds on a chip at its peak: arguments, outputs and temporaries, less
    the outputs that reuse donated arguments."""
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  @property
  def fits(self) -> bool:
    return self.ok and self.total_bytes <= self.memory

  def line(self) -> str:
    """One line for a report: compiles / fails with the compiler's reason, and the bytes."""
    if not self.ok:
      return f"{self.name:<44} FAILS   {self.seconds:6.1f}s  {self.error}"
    fit = "fits" if self.fits else f"DOES NOT FIT {self.memory / GiB:.2f} GiB"
    return (f"{self.name:<44} compiles {self.seconds:5.1f}s  args {_gib(self.argument_bytes)}  "
            f"temp {_gib(self.temp_bytes)}  out {_gib(self.output_bytes)}  total "
            f"{_gib(self.total_bytes)} ({fit})")


def _gib(n: int) -> str:
  return f"{n / GiB:7.3f} GiB"


def compiler_reason(error: BaseException, limit: int = 300) -> str:
  """The compiler's own words from an exception: the first line naming an error, else the
  first line, cut to ``limit`` characters."""
  lines = [l.strip() for l in str(error).splitlines() if l.strip()]
  key = next((l for l in lines if re.search(r"E\d{4}|RESOURCE_EXHAUSTED|INTERNAL|INVALID|rror",
                                             l)), lines[0] if lines else type(error).__name__)
  return f"{type(error).__name__}: {key}"[:limit]


def compile_program(name: str, fn: Callable, args: Sequence[Any],
                    target: Union[str, Target]) -> CompiledProgram:
  """Compiles ``jax.jit(fn)`` for ``target`` with ``args`` (arrays or ``ShapeDtypeStruct``\\ s,
  placed on the target's first device) and reports it; a compiler error is reported, not
  raised."""
  import jax
  start = time.perf_counter()
  with compile_target(target) as t:
    try:
      compiled = jax.jit(fn).lower(*t.structs(tuple(args))).compile()
    except Exception as e:  # the compiler's refusal is the result
      return CompiledProgram(name, t.name, False, time.perf_counter() - start,
                             memory=t.memory_per_chip, error=compiler_reason(e))
  stats = compiled.memory_analysis()
  return CompiledProgram(name, t.name, True, time.perf_counter() - start,
                         int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
                         int(stats.temp_size_in_bytes), int(stats.alias_size_in_bytes),
                         t.memory_per_chip)


def program_bytes(compiled) -> int:
  """Peak bytes per chip of a ``jax.stages.Compiled``: arguments + outputs + temporaries − aliased."""
  s = compiled.memory_analysis()
  return (s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes
          - s.alias_size_in_bytes)


__all__ = ["CHIPS", "Chip", "CompiledProgram", "GPU_CHIPS", "TPU_CHIPS", "Target",
           "compile_program", "compile_target", "compiler_reason", "current_platform",
           "current_target", "gpu_target_config", "local_target", "parse_target", "program_bytes"]
