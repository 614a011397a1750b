"""Every KVM kernel and op compiled for a chip this machine does not have (``kvm-check --target``).

A *program* is one jitted function and its argument shapes, built inside
``kvm_jax.compile_target(target)`` so that every backend decision (the kernels' platform and
tiles, the scan's layouts) is the chip's. :func:`check` compiles each program for real (XLA:TPU
and Mosaic, or XLA:GPU and Triton) and reports it: compiles or fails with the compiler's reason,
the seconds it took and its bytes per chip (:class:`kvm_jax.config.target.CompiledProgram`).

Two groups:

* ``kernels`` — each Pallas kernel on its own, forward and backward, at the paper's operator
  shapes (C = 256, two window chunks, D = 128, H = 32 as MHA in bfloat16 and as GQA with 4 query
  heads per KV head in float32, state rows R from 1 to 4096) and at small ones (C = 8, 16, 64,
  windows under 128 tokens, R under 128), packed documents (a state per batch row) and decode.
  Each compiles in seconds; the test run compiles them for one TPU chip and one H100.
* ``ops`` — the whole KVM op (the chunked scan with its state updates) forward and backward on
  both implementations, the packed-documents op and a decode step: tens of seconds to minutes
  each (the nightly run and ``kvm-check --target`` compile them).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp

from kvm_jax.config import target as targets

PAPER = dict(chunk_size=256, window_chunks=2, rope_dims=32)


@dataclasses.dataclass(frozen=True)
class Program:
  """One program of the check: ``build()`` (called inside the compile target) returns the
  function and its arguments (``ShapeDtypeStruct``\\ s or arrays). ``group``: "kernels" or
  "ops"; ``platforms``: where it applies (the tokamax readout only where tokamax has a kernel)."""

  name: str
  group: str
  build: Callable[[], tuple[Callable, tuple]]
  platforms: tuple[str, ...] = ("tpu", "gpu")


def _spec(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _grad_of(fn: Callable, argnums: Sequence[int]) -> Callable:
  """The gradient of ``sum(fn(...))`` (in float32) with respect to ``argnums``."""
  return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=tuple(argnums))


# ----------------------------------------------------------------------------------------------
# Kernels, one at a time
# ----------------------------------------------------------------------------------------------


def readout_program(B, Hkv, G, Tq, R, W, D, dtype, *, backward=False, per_row_state=False):
  """The fused readout (``kvm_jax.kernels.readout``) for one chunk of ``Tq`` queries against
  ``R`` state rows and a window of ``W`` slots (causal over the last ``Tq``)."""
  def build():
    from kvm_jax.kernels.backend import KernelConfig
    from kvm_jax.kernels.readout import joint_attention_heads_pallas
    kc = KernelConfig.for_target()

    def readout(q, sk, sv, wk, wv, st, wt, rows):
      window_valid = jnp.tril(jnp.ones((Tq, W), bool), W - Tq)
      if per_row_state:  # packed documents: each batch row's state has its own row count
        state_valid = (jnp.arange(R) < rows[:, None])[:, None, None, None, :]
      else:
        state_valid = jnp.arange(R)[None, :] < rows[0]
      return joint_attention_heads_pallas(q, sk, sv, state_valid, wk, wv, window_valid, st, wt,
                                          kc=kc)

    args = (_spec(B, Hkv, G, Tq, D, dtype=dtype), _spec(B, Hkv, R, D, dtype=jnp.float32),
            _spec(B, Hkv, R, D, dtype=jnp.float32), _spec(B, Hkv, W, D, dtype=dtype),
            _spec(B, Hkv, W, D, dtype=dtype), _spec(Hkv, G, dtype=jnp.float32),
            _spec(Hkv, G, dtype=jnp.float32), _spec(B, dtype=jnp.int32))
    return (_grad_of(readout, range(7)) if backward else readout), args
  return build


def routing_program(B, Hkv, C, R, D, argmax: bool, *, per_row: bool = False):
  """A routing-score kernel (``kvm_jax.kernels.update``): first argmax or max over R rows; with
  ``per_row``, a row range per batch row (packed documents' states)."""
  def build():
    from kvm_jax.kernels import update
    from kvm_jax.kernels.backend import KernelConfig
    kc = KernelConfig.for_target()
    if argmax:
      fn = lambda x, rows, n: update.first_argmax_rows(x, rows, n // 2, n, kc=kc)  # noqa: E731
    else:
      fn = lambda x, rows, n: update.max_scores(x, rows, n, kc=kc)  # noqa: E731
    bounds = _spec(B, dtype=jnp.int32) if per_row else _spec(dtype=jnp.int32)
    return fn, (_spec(B, Hkv, C, D, dtype=jnp.float32), _spec(B, Hkv, R, D, dtype=jnp.float32),
                bounds)
  return build


def add_rows_program(B, Hkv, C, R, X, *, backward=False):
  """The row accumulation (``kvm_jax.kernels.update.add_rows``) and its gradient."""
  def build():
    from kvm_jax.kernels import update
    from kvm_jax.kernels.backend import KernelConfig
    kc = KernelConfig.for_target()
    fn = lambda rows, index, updates: update.add_rows(rows, index, updates, kc=kc)  # noqa: E731
    args = (_spec(B, Hkv, R, X, dtype=jnp.float32), _spec(B, Hkv, C, dtype=jnp.int32),
            _spec(B, Hkv, C, X, dtype=jnp.float32))
    return (_grad_of(fn, (0, 2)) if backward else fn), args
  return build


def decode_program(B, Hkv, G, R, C, window_chunks, D, dtype, blocks=None):
  """The decode kernel (``kvm_jax.kernels.decode``): one token against R rows and the ring
  (``blocks``: a tiling of ``decode.decode_blocks``'s form instead of the one it picks)."""
  def build():
    from kvm_jax.kernels.backend import KernelConfig
    from kvm_jax.kernels.decode import decode_attention_pallas
    from kvm_jax.config.kvm import KVMConfig
    from kvm_jax.config.budget import FixedBudget
    kc = KernelConfig.for_target()
    cfg = KVMConfig(chunk_size=C, window_chunks=window_chunks, rope_dims=min(32, D),
                    budget=FixedBudget(R))
    L = cfg.window_len

    def step(q, sk, sv, n, wk, wv, t, st, wt):
      return decode_attention_pallas(q, sk, sv, n, wk, wv, t, st, wt, cfg, kc=kc, blocks=blocks)

    return step, (_spec(B, 1, Hkv * G, D, dtype=dtype), _spec(B, Hkv, R, D, dtype=jnp.float32),
                  _spec(B, Hkv, R, D, dtype=jnp.float32), _spec(dtype=jnp.int32),
                  _spec(B, L, Hkv, D, dtype=dtype), _spec(B, L, Hkv, D, dtype=dtype),
                  _spec(dtype=jnp.int32), _spec(Hkv, G, dtype=jnp.float32),
                  _spec(Hkv, G, dtype=jnp.float32))
  return build


def tokamax_readout_program(B, Hkv, G, Tq, R, W, D, dtype):
  """The readout by tokamax's attention kernels (``kvm_jax.kernels.tokamax_readout``)."""
  def build():
    from kvm_jax.kernels.backend import KernelConfig
    from kvm_jax.kernels.tokamax_readout import joint_attention_tokamax
    kc = KernelConfig.for_target()

    def readout(q, sk, sv, wk, wv, st, wt):
      window_valid = jnp.tril(jnp.ones((Tq, W), bool), W - Tq)
      return joint_attention_tokamax(q, sk, sv, jnp.ones((Tq, R), bool), wk, wv, window_valid,
                                     st, wt, kc=kc)

    return readout, (_spec(B, Tq, Hkv, G, D, dtype=dtype), _spec(B, Hkv, R, D, dtype=jnp.float32),
                     _spec(B, Hkv, R, D, dtype=jnp.float32), _spec(B, W, Hkv, D, dtype=dtype),
                     _spec(B, W, Hkv, D, dtype=dtype), _spec(Hkv, G, dtype=jnp.float32),
                     _spec(Hkv, G, dtype=jnp.float32))
  return build


def attention_program(implementation: str, B, T, H, Hkv, D, window, dtype, *, backward=False):
  """Softmax attention (``kvm_jax.ops.attention.api.causal_attention``), the baselines' and the
  hybrids' attention layers: splash on TPU, the chunked XLA form, tokamax's kernels."""
  def build():
    from kvm_jax.ops.attention.api import causal_attention
    fn = lambda q, k, v: causal_attention(q, k, v, window=window,  # noqa: E731
                                          implementation=implementation)
    args = (_spec(B, T, H, D, dtype=dtype), _spec(B, T, Hkv, D, dtype=dtype),
            _spec(B, T, Hkv, D, dtype=dtype))
    return (_grad_of(fn, range(3)) if backward else fn), args
  return build


def attention_programs() -> list[Program]:
  """Softmax attention at T = 2048, H = 32 over 8 KV heads, D = 128, a 512-token window, bf16.
  cuDNN's fused attention is not among them: JAX asks the local cuDNN library for its version
  while tracing, so it compiles only where cuDNN is installed (a GPU host)."""
  shape = (1, 2048, 32, 8, 128, 512, "bfloat16")
  out = []
  for impl, platforms in (("splash", ("tpu",)), ("chunked", ("tpu", "gpu")),
                          ("tokamax", ("tpu", "gpu"))):
    out += [Program(f"attention {impl} window=512", "kernels",
                    attention_program(impl, *shape), platforms),
            Program(f"attention {impl} window=512 backward", "kernels",
                    attention_program(impl, *shape, backward=True), platforms)]
  return out


# The paper's heads as (KV heads, query heads per KV head, dtype): MHA in bfloat16, GQA in float32.
MHA_BF16, GQA_F32 = (32, 1, "bfloat16"), (8, 4, "float32")
PAPER_ROWS = (1, 256, 1024, 4096)
# Small chunks: (C, window chunks); windows of 32, 64 and 128 tokens.
SMALL_CHUNKS = ((8, 4), (16, 2), (64, 1))


def kernel_programs(rows: Sequence[int] = PAPER_ROWS) -> list[Program]:
  """Every kernel at the paper's operator shapes (B = 8, D = 128, C = 256, two window chunks) for
  each state size in ``rows``, and at the small shapes."""
  B, D, C, nb = 8, 128, 256, 2
  out = []
  for R in rows:
    for Hkv, G, dtype in (MHA_BF16, GQA_F32):
      tag = f"R={R} G={G} {dtype}"
      out += [Program(f"readout {tag}", "kernels", readout_program(B, Hkv, G, C, R, nb * C, D, dtype)),
              Program(f"readout backward {tag}", "kernels",
                      readout_program(B, Hkv, G, C, R, nb * C, D, dtype, backward=True)),
              Program(f"decode {tag.replace('R=1 ', 'R=2 ')}", "kernels",
                      decode_program(B, Hkv, G, max(R, 2), C, nb, D, dtype))]
    out += [Program(f"route argmax R={R}", "kernels", routing_program(B, 8, C, R, D, True)),
            Program(f"route novelty R={R}", "kernels", routing_program(B, 8, C, R, D, False)),
            Program(f"add rows R={R}", "kernels", add_rows_program(B, 8, C, R, D)),
            Program(f"add rows backward R={R}", "kernels", add_rows_program(B, 8, C, R, D,
                                                                     backward=True))]
  out.append(Program("readout documents R=1024 G=4 bfloat16", "kernels",
                      readout_program(B, 8, 4, C, 1024, nb * C, D, "bfloat16", per_row_state=True)))
  out.append(Program("readout documents backward R=1024 G=4 bfloat16", "kernels",
                     readout_program(B, 8, 4, C, 1024, nb * C, D, "bfloat16", per_row_state=True,
                              backward=True)))
  out += [Program("route argmax documents R=1024", "kernels",
                  routing_program(B, 8, C, 1024, D, True, per_row=True)),
          Program("route novelty documents R=1024", "kernels",
                  routing_program(B, 8, C, 1024, D, False, per_row=True))]
  out.append(Program("tokamax readout R=256 G=4 bfloat16", "kernels",
                     tokamax_readout_program(B, 8, 4, C, 256, nb * C, D, "bfloat16")))
  return out + small_kernel_programs() + attention_programs()


def small_kernel_programs() -> list[Program]:
  """The kernels at small chunks (C = 8, 16, 64; windows of 32–128 tokens) and small states
  (R = 1, 8, 64, 100): the corners where tile rules bite."""
  out = []
  for C, nb in SMALL_CHUNKS:
    for R in (1, 64, 100):
      tag = f"C={C} W={C * nb} R={R}"
      out += [Program(f"readout {tag} G=1 bfloat16", "kernels",
                      readout_program(2, 2, 1, C, R, C * nb, 64, "bfloat16")),
              Program(f"readout {tag} G=3 float32", "kernels",
                      readout_program(2, 2, 3, C, R, C * nb, 64, "float32")),
              Program(f"route argmax C={C} R={R}", "kernels", routing_program(2, 2, C, R, 64, True)),
              Program(f"add rows C={C} R={R}", "kernels", add_rows_program(2, 2, C, R, 64)),
              Program(f"decode C={C} W={C * nb} R={max(R, 2)} G=3 bfloat16", "kernels",
                      decode_program(2, 2, 3, max(R, 2), C, nb, 64, "bfloat16"))]
  return out


# ----------------------------------------------------------------------------------------------
# Whole ops
# ----------------------------------------------------------------------------------------------


def kvm_op_program(implementation: str, B: int, T: int, H: int, Hkv: int, R: int, dtype: str,
            *, backward: bool = False, documents: bool = False):
  """The whole KVM op (``kvm_jax.kvm_attention``) on ``implementation`` at the paper's chunking."""
  def build():
    import kvm_jax as kj
    cfg = kj.KVMConfig(**PAPER, budget=kj.FixedBudget(R))
    backend = kj.resolve_kvm_backend(cfg, implementation=implementation)
    D = 128
    params = jax.eval_shape(lambda: kj.KVMParams.init(D, H))

    def op(q, k, v, g, p, segment_ids):
      return kj.kvm_attention(q, k, v, g, p, cfg, backend=backend,
                              segment_ids=segment_ids if documents else None).y

    args = (_spec(B, T, H, D, dtype=dtype), _spec(B, T, Hkv, D, dtype=dtype),
            _spec(B, T, Hkv, D, dtype=dtype), _spec(B, T, Hkv, dtype=jnp.float32), params,
            _spec(B, T, dtype=jnp.int32))
    return (_grad_of(op, range(5)) if backward else op), args
  return build


def kvm_decode_program(implementation: str, B: int, max_len: int, H: int, Hkv: int, R: int,
                   dtype: str):
  """One decode step of the KVM op (``kvm_jax.kvm_decode_step``) with a cache of ``max_len``."""
  def build():
    import kvm_jax as kj
    cfg = kj.KVMConfig(**PAPER, budget=kj.FixedBudget(R))
    backend = kj.resolve_kvm_backend(cfg, implementation=implementation)
    D = 128
    params = jax.eval_shape(lambda: kj.KVMParams.init(D, H))
    cache = jax.eval_shape(lambda: kj.kvm_init_cache(
        cfg, batch=B, kv_heads=Hkv, head_dim=D, value_dim=D, max_len=max_len,
        dtype=jnp.dtype(dtype)))

    def step(q, k, v, g, p, c):
      return kj.kvm_decode_step(q, k, v, g, p, cfg, c, backend=backend).y

    return step, (_spec(B, 1, H, D, dtype=dtype), _spec(B, 1, Hkv, D, dtype=dtype),
                  _spec(B, 1, Hkv, D, dtype=dtype), _spec(B, 1, Hkv, dtype=jnp.float32), params,
                  cache)
  return build


def op_programs(batch: int = 8, seq_len: int = 8192) -> list[Program]:
  """The whole op at the paper's operator shape (H = 32, D = 128, C = 256, two window chunks,
  256 state rows, bfloat16) on both implementations: forward, backward, packed documents and a
  decode step (GQA with 8 KV heads for the documents and decode)."""
  out = []
  for impl in ("xla", "pallas"):
    out += [Program(f"kvm op {impl} forward B={batch} T={seq_len}", "ops",
                    kvm_op_program(impl, batch, seq_len, 32, 32, 256, "bfloat16")),
            Program(f"kvm op {impl} backward B=1 T={seq_len}", "ops",
                    kvm_op_program(impl, 1, seq_len, 32, 32, 256, "bfloat16", backward=True)),
            Program(f"kvm documents {impl} backward B=2 T=4096 R=1024", "ops",
                    kvm_op_program(impl, 2, 4096, 32, 8, 1024, "bfloat16", backward=True,
                            documents=True)),
            Program(f"kvm decode step {impl} B={batch} max_len={seq_len}", "ops",
                    kvm_decode_program(impl, batch, seq_len, 32, 8, 256, "bfloat16"))]
  return out


def programs(groups: Iterable[str] = ("kernels", "ops")) -> list[Program]:
  """The check's programs of ``groups``."""
  groups = tuple(groups)
  return ([p for p in kernel_programs() if "kernels" in groups]
          + [p for p in op_programs() if "ops" in groups])


def compile_one(program: Program, target) -> targets.CompiledProgram:
  """Builds ``program`` inside the compile target and compiles it (a failure is reported)."""
  import time
  t = targets.parse_target(target)
  start = time.perf_counter()
  with targets.compile_target(t):
    try:
      fn, args = program.build()
    except Exception as e:  # a refusal before the compiler (e.g. a size rule) is a result too
      return targets.CompiledProgram(program.name, t.name, False, time.perf_counter() - start,
                                     memory=t.memory_per_chip,
                                     error=targets.compiler_reason(e))
    return targets.compile_program(program.name, fn, args, t)


def check(target, selected: Sequence[Program], on_result: Optional[Callable] = None
          ) -> list[targets.CompiledProgram]:
  """Compiles each program of ``selected`` that applies to the target's platform; calls
  ``on_result(result)`` after each (a progress line)."""
  t = targets.parse_target(target)
  results = []
  for program in selected:
    if t.platform not in program.platforms:
      continue
    result = compile_one(program, t)
    results.append(result)
    if on_result is not None:
      on_result(result)
  return results


__all__ = ["PAPER", "Program", "add_rows_program", "attention_program", "attention_programs", "check", "compile_one", "decode_program",
           "kernel_programs", "kvm_decode_program", "kvm_op_program", "op_programs", "programs",
           "readout_program", "routing_program", "small_kernel_programs",
           "tokamax_readout_program"]
