"""What the stages share: timing, compiled memory, the KVM config of a geometry, the arms of a
timing stage and their inputs. Imported only in a stage's process (it imports jax)."""

from __future__ import annotations

import dataclasses
import gc
import statistics
from pathlib import Path
from typing import Callable, Optional

import jax
import jax.numpy as jnp

import kvm_jax as kj
from kvm_jax.eval.bench.timing import sample_ms
from kvm_jax.ops.kvm.cases import random_inputs

from benchmarks.device.geometry import Geometry
from benchmarks.device.records import SCAN_KERNELS, is_oom


@dataclasses.dataclass(frozen=True)
class Context:
  """What every stage function gets besides its :class:`~benchmarks.device.records.Recorder`."""

  out: Path
  geo: Geometry
  repeats: int
  fail_kernels: frozenset = frozenset()   # testing: kernels whose pre-flight raises


def median_ms(fn, args, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
  """Median wall time (ms) of ``fn(*args)`` and the samples (``kvm_jax.eval.bench.timing``)."""
  samples = sample_ms(fn, *args, repeats=repeats, warmup=warmup)
  return statistics.median(samples), samples


def memory_fields(compiled) -> dict:
  """The ``*_in_bytes`` fields of a compiled program's memory analysis (empty where none), and
  ``needed_bytes``: arguments + outputs + temporaries - aliased."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - not every backend implements it
    return {}
  if stats is None:
    return {}
  out = {}
  for name in dir(stats):
    if name.endswith("_in_bytes") and not name.startswith("_"):
      value = getattr(stats, name)
      if isinstance(value, int):
        out[name.replace("_in_bytes", "_bytes")] = value
  need = sum(out.get(k, 0) for k in ("argument_size_bytes", "output_size_bytes",
                                     "temp_size_bytes")) - out.get("alias_size_bytes", 0)
  if out:
    out["needed_bytes"] = need
  return out


def device_bytes_limit() -> Optional[int]:
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def kvm_config(geo: Geometry, budget, chunk: Optional[int] = None,
               head_dim: Optional[int] = None) -> kj.KVMConfig:
  return kj.KVMConfig(chunk_size=chunk or geo.chunk, window_chunks=geo.window_chunks,
                      sink_rows=1, rope_dims=min(geo.rope_dims, head_dim or geo.head_dim),
                      budget=budget)


def length_for_rows(cfg: kj.KVMConfig, rows: int, max_chunks: int = 10_000) -> int:
  """The shortest whole-chunk T whose schedule folds a chunk into a full state of ``rows`` rows
  (the state fills up, then a merge runs at capacity): T = R + 3 chunks for FixedBudget(R) with
  a window of 2 chunks."""
  C = cfg.chunk_size
  for n in range(1, max_chunks):
    s = kj.kvm_schedule(cfg, n * C)
    if any(u and r >= rows for u, r in zip(s.update_after, s.rows_before)):
      return n * C
  raise ValueError(f"no T below {max_chunks} chunks reaches {rows} rows with {cfg.budget}")


def batch_fallbacks(batch: int) -> list[int]:
  out = [batch]
  while out[-1] > 1:
    out.append(out[-1] // 2)
  return out


def with_batch_fallback(batch: int, run: Callable[[int], dict]) -> dict:
  """``run(B)`` for B = batch, batch/2, ..., 1 until one does not run out of memory; the result
  says which B ran and why larger ones did not."""
  failures = []
  for B in batch_fallbacks(batch):
    try:
      result = run(B)
    except Exception as e:  # noqa: BLE001
      if not is_oom(e):
        raise
      failures.append(f"B={B}: {type(e).__name__}: {str(e)[:200]}")
      result = None
    if result is None:  # outside the except block: the failed attempt's arrays can be freed
      gc.collect()
      continue
    result.update(batch=B, batch_requested=batch)
    if failures:
      result["oom_fallbacks"] = failures
    return result
  raise RuntimeError("out of memory at every batch size: " + " | ".join(failures))


FULL_ARMS = ("cudnn", "full-xla")


def is_pallas(impl: str) -> bool:
  return impl.endswith("pallas")


def kernels_of(impl: str, kernels=SCAN_KERNELS) -> list[str]:
  """The Pallas kernels an arm runs (none for cuDNN / XLA arms)."""
  return list(kernels) if is_pallas(impl) else []


def prefill_arms() -> tuple[str, ...]:
  """cuDNN (XLA attention too where there is no GPU), then KVM xla, then KVM pallas."""
  base = ("cudnn",) if on_gpu() else FULL_ARMS
  return (*base, "kvm-xla", "kvm-pallas")


def prefill_fn(impl: str, cfg: kj.KVMConfig):
  """``f(q, k, v, g, params) -> y``: causal full attention (cuDNN / XLA) or KVM of ``impl``."""
  if impl in FULL_ARMS:
    name = "cudnn" if impl == "cudnn" else "xla"
    return lambda q, k, v, g, p: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation=name)
  backend = kj.resolve_kvm_backend(cfg, implementation=impl.removeprefix("kvm-"))
  return lambda q, k, v, g, p: kj.kvm_attention(q, k, v, g, p, cfg, backend=backend).y


def inputs(geo: Geometry, B: int, T: int):
  """Random q, k, v, gates (MHA, the geometry's dtype) and default KVM parameters."""
  make = jax.jit(lambda: random_inputs(T, B, T, geo.heads, geo.heads, geo.head_dim,
                                       geo.head_dim, jnp.dtype(geo.dtype)))  # one program
  return (*make(), kj.KVMParams.init(geo.head_dim, geo.heads))


def needs_gpu(impl: str) -> Optional[dict]:
  """A skip record for a cuDNN arm off the GPU, else None."""
  if impl.endswith("cudnn") and not on_gpu():
    return {"status": "skipped", "reason": f"cuDNN needs a GPU (backend: {jax.default_backend()})"}
  return None
