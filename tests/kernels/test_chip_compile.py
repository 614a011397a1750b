"""Kernels compiled — not only lowered — for chips this machine does not have.

``jax.jit(f).lower(...)`` for a TPU only serializes a Pallas kernel into a custom call; Mosaic and
Triton run at ``.compile()``. Here every program is compiled for a TPU v5e (libtpu) and an H100
(the CUDA compile plugin with the chip's target config, ``kvm_jax/config/target_configs``) on this
CPU-only machine, through ``kvm_jax.compile_target`` as users do (``kvm-check --target``):

* the kernel set of ``kvm_jax.eval.chip_check`` at the paper's operator shapes (C = 256, D = 128,
  MHA bfloat16 and GQA float32, R = 1 … 4096) and the small corners (C = 8 … 64, windows under
  128 tokens, R < 128), forward and backward, packed documents and decode; the test run compiles a
  set that covers each kernel and corner once, the nightly run (``--runslow``) every program for
  v5e, v5p, v6e, H100 and H200, and the whole ops;
* the resource model against the compilers: the state the model says fits a core's VMEM compiles,
  the next size up, which it says does not, is refused by Mosaic; the decode tiles it picks for a
  GPU compile, a tile it says overflows shared memory is refused by Triton.

Every libtpu compile of a run stays in one xdist worker (one process at a time may hold libtpu).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import jax
import jax.numpy as jnp
import pytest

import kvm_jax as kj
from kvm_jax.config import target as targets
from kvm_jax.eval import chip_check
from kvm_jax.kernels import decode, resources
from kvm_jax.ops.attention.api import resolve_attention_backend

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
try:
  HAS_CUDA_COMPILER = bool(importlib.metadata.version("jax-cuda13-plugin"))
except importlib.metadata.PackageNotFoundError:
  HAS_CUDA_COMPILER = False

needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu: pip install '.[compile]'")
needs_cuda = pytest.mark.skipif(not HAS_CUDA_COMPILER,
                                reason="needs jax-cuda13-plugin: pip install '.[compile]'")
pytestmark = [pytest.mark.chip_compile, pytest.mark.xdist_group("libtpu")]

TPU, GPU = "v5e:2x2", "h100:1x1"
ALL_PROGRAMS = {p.name: p for p in chip_check.kernel_programs()}
# One program per kernel and corner: each kernel forward at the paper's smallest and largest
# states in both head layouts, each backward once, documents, tokamax, and every small corner
# (C = 8, 16, 64; windows of 32, 32, 64 tokens; R = 1 and R = 100, neither a multiple of 8 nor 128).
CI_PROGRAMS = (
    "readout R=1 G=1 bfloat16", "readout R=4096 G=4 float32", "readout R=256 G=1 bfloat16",
    "readout backward R=256 G=1 bfloat16", "decode R=2 G=1 bfloat16", "decode R=4096 G=4 float32",
    "route argmax R=4096", "route novelty R=4096", "add rows R=4096", "add rows backward R=256",
    "readout documents R=1024 G=4 bfloat16", "route argmax documents R=1024",
    "tokamax readout R=256 G=4 bfloat16",
    "readout C=8 W=32 R=1 G=3 float32", "readout C=16 W=32 R=100 G=1 bfloat16",
    "readout C=64 W=64 R=100 G=1 bfloat16", "decode C=16 W=32 R=100 G=3 bfloat16",
    "route argmax C=8 R=100", "add rows C=64 R=1",
)
NIGHTLY_PROGRAMS = tuple(name for name in ALL_PROGRAMS if name not in CI_PROGRAMS)


def _compiles(name: str, target: str) -> targets.CompiledProgram:
  result = chip_check.compile_one(ALL_PROGRAMS[name], target)
  assert result.ok, result.line()
  assert result.fits, result.line()
  assert result.argument_bytes > 0 and result.output_bytes > 0, result.line()
  return result


@needs_libtpu
@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_kernel_compiles_for_tpu_v5e(name):
  _compiles(name, TPU)


@needs_cuda
@pytest.mark.parametrize("name", CI_PROGRAMS)
def test_kernel_compiles_for_h100(name):
  _compiles(name, GPU)


@pytest.mark.slow
@needs_libtpu
@pytest.mark.parametrize("target", ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"])
def test_every_kernel_program_compiles_for_tpus(target):
  failures = [r.line() for r in chip_check.check(target, list(ALL_PROGRAMS.values()))
              if not r.fits]
  assert not failures, "\n".join(failures)


@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("target", ["h100:1x1", "h200:1x1"])
def test_every_kernel_program_compiles_for_gpus(target):
  failures = [r.line() for r in chip_check.check(target, list(ALL_PROGRAMS.values()))
              if not r.fits]
  assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("target", [
    pytest.param("v5e:2x2", marks=needs_libtpu), pytest.param("h100:1x1", marks=needs_cuda)])
def test_every_op_program_compiles(target):
  """The whole op forward (B = 8, T = 8192) and backward on both implementations, packed
  documents' backward and a decode step: each compiles and fits the chip."""
  failures = [r.line() for r in chip_check.check(target, chip_check.op_programs())
              if not r.fits]
  assert not failures, "\n".join(failures)


@pytest.mark.parametrize("platform_target", ["h100:1x1", "v5e:2x2"])
def test_every_op_program_traces(platform_target):
  """Each whole-op program of the check builds and traces for the chip at a small size (the
  nightly run compiles them at full size): a broken program fails here, not only at night."""
  for program in chip_check.op_programs(batch=1, seq_len=1024):
    with kj.compile_target(platform_target):
      fn, args = program.build()
      jax.jit(fn).trace(*args)


# -- the resource model against the compilers -----------------------------------------------------


def _readout_at(rows: int) -> chip_check.Program:
  return chip_check.Program(f"readout R={rows}", "kernels",
                            chip_check.readout_program(1, 2, 1, 256, rows, 512, 128, "bfloat16"))


@needs_libtpu
@pytest.mark.parametrize("chip, fits, too_big", [("v5p:2x2x1", 32768, 49152),
                                                 ("v5e:2x2", 65536, 98304)])
def test_vmem_model_agrees_with_mosaic(chip, fits, too_big):
  """The readout keeps a KV head's whole state in VMEM, double-buffered across heads: a state the
  model says fits a core's VMEM budget (v5p: 64 MiB cores, v5e: 128 MiB) compiles; one half again
  as large, which the model says does not fit, Mosaic refuses for VMEM. (With one program per
  array, B = Hkv = 1, Mosaic keeps a single buffer and accepts twice the state: two heads here.)"""
  limits = resources.LIMITS[targets.parse_target(chip).chip.name]
  model = lambda R: resources.working_set("readout", H=2, Hkv=2, D=128, C=256, R=R,  # noqa: E731
                                           dtype=jnp.bfloat16, target="tpu")
  assert resources.fits(model(fits), limits) and not resources.fits(model(too_big), limits)
  assert chip_check.compile_one(_readout_at(fits), chip).ok
  refused = chip_check.compile_one(_readout_at(too_big), chip)
  assert not refused.ok and "vmem" in refused.error.lower(), refused.line()


@needs_cuda
def test_shared_memory_model_agrees_with_triton():
  """The decode tiles the model picks for an H100 compile; a state tile the model puts past the
  block's shared memory (512 float32 rows of 128 keys and values, double-buffered: 1 MiB) is
  refused by Triton."""
  D, L, G, R = 128, 512, 4, 4096
  picked = decode.decode_blocks(R, L, G, D, D, jnp.bfloat16, "gpu")
  limits = resources.LIMITS["h100"]
  too_big = dict(picked, state_block=512, state_split=max(512, picked["state_split"]))
  too_big["working_set_bytes"] = decode.working_set_bytes(too_big, D, D, jnp.bfloat16, "gpu")
  assert picked["working_set_bytes"] <= limits.shared < too_big["working_set_bytes"]
  for blocks, ok in ((picked, True), (too_big, False)):
    program = chip_check.Program("decode", "kernels", chip_check.decode_program(
        1, 2, G, R, 256, 2, D, "bfloat16", blocks=blocks))
    result = chip_check.compile_one(program, GPU)
    assert result.ok == ok, result.line()
    if not ok:
      assert "shared memory" in result.error.lower(), result.line()


# -- kvm-check --target ----------------------------------------------------------------------------


@needs_libtpu
def test_kvm_check_compiles_for_a_target(capsys):
  from kvm_jax.eval import check
  cache = jax.config.jax_enable_compilation_cache  # --target turns the persistent cache off
  try:
    assert check.main(["--target", "v6e:2x2", "--programs", "kernels",
                       "--match", "readout C=8 W=32 R=1 G=1"]) == 0
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  out = capsys.readouterr().out
  assert "kvm-check --target v6e:2x2: TPU v6 lite" in out
  assert "readout C=8 W=32 R=1 G=1 bfloat16" in out and "compiles" in out
  assert "1/1 programs compile and fit v6e:2x2" in out


def test_kvm_check_refuses_an_unknown_target():
  from kvm_jax.eval import check
  with pytest.raises(SystemExit, match="unknown target 'v9:2x2'.*v5e:2x2.*h100:1x8"):
    check.main(["--target", "v9:2x2"])
  with pytest.raises(SystemExit, match="--programs: expected some of kernels, ops"):
    check.main(["--target", "v5e:2x2", "--programs", "everything"])


@needs_libtpu
def test_a_program_that_does_not_fit_is_reported():
  """The compiler's refusal is the result: a program needing more HBM than a v5e has is a line
  with the compiler's words, not an exception."""
  big = jax.ShapeDtypeStruct((2**15, 2**15), jnp.float32)  # 4 GiB
  result = targets.compile_program("too big", lambda x: sum(jnp.sin(x * i) @ x for i in range(8)),
                                   [big], TPU)
  assert not result.ok and "RESOURCE_EXHAUSTED" in result.error and "HBM" in result.error
  assert "FAILS" in result.line()


def test_compile_target_is_what_backend_decisions_read():
  """Inside compile_target every decision is the chip's: the KVM backend, the kernels (compiled,
  not interpreted, with the chip's VMEM), the attention backend; outside it, this machine's."""
  from kvm_jax.kernels.backend import KernelConfig
  cfg = kj.KVMConfig(chunk_size=256, window_chunks=2, budget=kj.FixedBudget(256))
  here = kj.current_target()
  with kj.compile_target("v5p:2x2x1") as t:
    assert kj.current_platform() == "tpu" and t.device_count == 4
    kc = KernelConfig.for_target()
    assert (kc.platform, kc.interpret, kc.vmem) == ("tpu", False, 64 * 2**20)
    assert kj.resolve_kvm_backend(cfg) == kj.resolve_kvm_backend(cfg, platform="tpu")
    pallas = kj.resolve_kvm_backend(cfg, implementation="pallas")
    assert pallas == kj.resolve_kvm_backend(cfg, implementation="pallas", platform="tpu")
    assert not pallas.kernel_config.interpret and pallas.kernel_config.vmem == 64 * 2**20
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    assert resolve_attention_backend("auto", q).implementation == "splash"
    with kj.compile_target("h200:2x8") as gpu:
      assert (gpu.platform, gpu.device_count, gpu.hosts) == ("gpu", 16, 2)
      assert KernelConfig.for_target().triton
    assert kj.current_target() is t
  assert kj.current_target() == here and kj.current_platform() == jax.default_backend()


def test_a_trace_for_one_target_is_not_reused_for_another():
  """Decisions are made while a function is traced: the same jitted function traced for this
  machine and inside compile_target gives two traces, each with its own target's decision."""
  decide = jax.jit(lambda x: x + (1.0 if kj.current_platform() == "tpu" else 2.0))
  x = jnp.zeros(3)
  here = str(decide.trace(x).jaxpr)
  with kj.compile_target("v5e:2x2"):
    there = str(decide.trace(x).jaxpr)
  assert "2.0" in here and "1.0" in there
  assert "2.0" in str(decide.trace(x).jaxpr)
