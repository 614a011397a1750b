"""The stages that are not timings: env, numerics, check, compile and trace (the kernels
pre-flight is :mod:`benchmarks.device.preflight`, the timings :mod:`benchmarks.device.timings`).
Imported only in a stage's process."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import kvm_jax as kj
from kvm_jax.eval import check
from kvm_jax.kernels.backend import default_interpret
from kvm_jax.ops.kvm.cases import TOLERANCE, random_inputs, random_params, rel_rms, \
    state_rel_error

from benchmarks.device.measure import Context, inputs, kernels_of, kvm_config, length_for_rows, \
    memory_fields, prefill_fn, with_batch_fallback
from benchmarks.device.records import CHECK_LOG, DECODE_KERNELS, ENV_REPORT, KERNELS, \
    SCAN_KERNELS, TRACE, Recorder, Task

REPO = Path(__file__).resolve().parents[2]
TRACE_LIMIT_BYTES = 15 * 2**20   # a file over 16 MiB does not come back from the device machine


# ----------------------------------------------------------------------------------------------
# env
# ----------------------------------------------------------------------------------------------


def _report(out: Path, title: str, body) -> None:
  """Appends one section to the environment report (a crash keeps the sections before it)."""
  text = body if isinstance(body, str) else json.dumps(body, indent=2, default=str)
  with open(out / ENV_REPORT, "a", encoding="utf-8") as f:
    f.write(f"## {title}\n\n{text.rstrip()}\n\n")


def stage_env(rec: Recorder, ctx: Context) -> None:
  def versions():
    import jaxlib
    out = {"python": platform.python_version(), "executable": sys.executable,
           "jax": jax.__version__, "jaxlib": getattr(jaxlib, "__version__", None)}
    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt",
                 "numpy", "flax", "optax", "orbax-checkpoint", "chex", "triton", "kvm-jax"):
      try:
        out[dist] = md.version(dist)
      except md.PackageNotFoundError:
        pass
    import kvm_jax.eval
    import kvm_jax.kernels
    out["kvm_jax_files"] = [m.__file__ for m in (kvm_jax, kvm_jax.eval, kvm_jax.kernels)]
    try:
      out["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                  text=True, timeout=10, cwd=REPO).stdout.strip() or None
    except Exception:  # noqa: BLE001
      out["git"] = None
    _report(ctx.out, "versions", out)
    return out

  def devices():
    devs = jax.devices()
    out = {"backend": jax.default_backend(), "device_count": len(devs),
           "devices": [str(d) for d in devs], "device_kind": devs[0].device_kind,
           "platform_version": getattr(devs[0].client, "platform_version", None),
           "pallas_interpret": default_interpret()}
    _report(ctx.out, "devices", out)
    return out

  def memory():
    out = {}
    for d in jax.devices():
      try:
        stats = d.memory_stats()
      except Exception as e:  # noqa: BLE001
        stats = {"error": str(e)}
      out[str(d.id)] = stats
    _report(ctx.out, "memory statistics", out)
    return {"memory_stats": out}

  def config():
    names = ("jax_default_matmul_precision", "jax_enable_x64", "jax_disable_most_optimizations",
             "jax_compilation_cache_dir")
    table = getattr(jax.config, "values", {})
    values = {n: table[n] if n in table else getattr(jax.config, n, None) for n in names}
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("JAX_", "XLA_", "CUDA_", "TF_", "NVIDIA_", "PYTHON"))}
    out = {"jax_config": values, "environment": env}
    _report(ctx.out, "jax configuration and environment", out)
    return out

  def nvidia_smi():
    exe = shutil.which("nvidia-smi")
    if not exe:
      _report(ctx.out, "nvidia-smi", "(not found)")
      return {"status": "skipped", "reason": "nvidia-smi not found"}
    text = subprocess.run([exe], capture_output=True, text=True, timeout=15).stdout
    query = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                            "clocks.sm,temperature.gpu,power.draw", "--format=csv"],
                           capture_output=True, text=True, timeout=15).stdout.strip()
    _report(ctx.out, "nvidia-smi", f"{text}\n{query}")
    return {"gpus": query, "file": ENV_REPORT}

  rec.run([Task("versions", versions), Task("devices", devices), Task("memory", memory),
           Task("config", config), Task("nvidia-smi", nvidia_smi)])


# ----------------------------------------------------------------------------------------------
# numerics
# ----------------------------------------------------------------------------------------------


def stage_numerics(rec: Recorder, ctx: Context) -> None:
  """Pallas vs XLA on random inputs at T=4096: outputs, final state, every routing decision;
  GQA and MHA interleaved, then again under float32 matmul precision."""
  geo = ctx.geo
  B, H, D, T = geo.num_batch, geo.num_heads, geo.head_dim, geo.num_length
  cfg = kvm_config(geo, kj.PowerLawBudget(*geo.num_budget[:2], min_rows=geo.num_budget[2]))
  entries = [(Hkv, dtype, precision) for precision in ("default", "float32")
             for dtype in ("bfloat16", "float32") for Hkv in geo.num_kv_heads]
  tasks = []
  for Hkv, dtype, precision in entries:
    def run(Hkv=Hkv, dtype=dtype, precision=precision):
      q, k, v, g = jax.jit(lambda: random_inputs(0, B, T, H, Hkv, D, D, jnp.dtype(dtype)))()
      params = random_params(0, D, H)
      scope = (jax.default_matmul_precision("float32") if precision == "float32"
               else contextlib.nullcontext())
      with scope:
        yx, sx, rx = kj.kvm_attention(q, k, v, g, params, cfg, return_routing=True,
                                      backend=kj.resolve_kvm_backend(cfg, implementation="xla"))
        jax.block_until_ready((yx, sx, rx))
        yp, sp, rp = kj.kvm_attention(q, k, v, g, params, cfg, return_routing=True,
                                      backend=kj.resolve_kvm_backend(cfg,
                                                                     implementation="pallas"))
        jax.block_until_ready((yp, sp, rp))
      a, e = np.asarray(yp, np.float64), np.asarray(yx, np.float64)
      max_rel = float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-30))
      diff = [int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in zip(rx, rp)]
      total = int(sum(np.asarray(x).size for x in rx))
      rms = rel_rms(a, e)
      tol = TOLERANCE[dtype]["output"]
      ok = rms <= tol and not any(diff)
      return {"output_max_rel": max_rel, "output_rel_rms": rms,
              "state_rel": state_rel_error(sp, sx), "tolerance": tol,
              "within_tolerance": bool(rms <= tol), "routing_same": not any(diff),
              "routing_differences": diff, "routing_decisions": total,
              "state_rows": int(sx.num_rows), "status": "ok" if ok else "failed"}

    tasks.append(Task(f"Hkv={Hkv} {dtype} precision={precision}", run, dict(
        B=B, H=H, Hkv=Hkv, D=D, T=T, dtype=dtype, precision=precision, budget=str(cfg.budget),
        kernels=list(SCAN_KERNELS)), kind="numerics"))
  rec.run(tasks)


# ----------------------------------------------------------------------------------------------
# check
# ----------------------------------------------------------------------------------------------


class _WriteThrough:
  """A text stream that writes every piece to each of ``streams`` and flushes it at once (a
  killed stage keeps the output up to its last line), and keeps a copy of the text."""

  def __init__(self, *streams):
    self.streams, self.parts = streams, []

  def write(self, text: str) -> int:
    self.parts.append(text)
    for s in self.streams:
      s.write(text)
      s.flush()
    return len(text)

  def flush(self) -> None:
    for s in self.streams:
      s.flush()

  def text(self) -> str:
    return "".join(self.parts)


def stage_check(rec: Recorder, ctx: Context) -> None:
  """``kvm-check --size paper`` (smoke: small), one KVM case per entry, then (full runs) the
  OVQ and RWKV-7 baselines as one last entry; the output written through to check.txt (and the
  stage log) as it prints."""
  geo = ctx.geo
  cases = check.cases(geo.check_size)
  n = len(cases) if geo.check_cases is None else min(geo.check_cases, len(cases))
  entries = [(f"case {i}: {cases[i - 1].name}",
              ["--size", geo.check_size, *geo.check_args, "--cases", str(i), "--ops", "kvm"],
              list(KERNELS)) for i in range(1, n + 1)]
  if geo.check_baselines:
    entries.append(("baselines: ovq, rwkv7",
                    ["--size", geo.check_size, *geo.check_args, "--ops", "ovq,rwkv7"], []))
  tasks = []
  for name, argv, kernels in entries:

    def run(argv=argv):
      with open(ctx.out / CHECK_LOG, "a", encoding="utf-8") as log:
        log.write(f"$ kvm-check {' '.join(argv)}\n")
        tee = _WriteThrough(log, sys.stdout)
        with contextlib.redirect_stdout(tee):
          rc = check.main(argv)
        log.write("\n")
      text = tee.text()
      passed = re.search(r"(\d+)/(\d+) checks passed", text)
      fails = [line for line in text.splitlines() if line.startswith("FAIL")]
      return {"status": "ok" if rc == 0 else "failed", "rc": rc,
              "passed": passed.group(0) if passed else None, "fails": fails, "file": CHECK_LOG}

    tasks.append(Task(name, run, dict(argv=argv, kernels=kernels), kind="check"))
  rec.run(tasks)


# ----------------------------------------------------------------------------------------------
# compile
# ----------------------------------------------------------------------------------------------


def stage_compile(rec: Recorder, ctx: Context) -> None:
  """Compile-only matrix (abstract shapes, no data) at the paper's geometry: forward, gradient
  and decode step, Pallas then XLA, MHA and GQA, FixedBudget(R) at the shortest T with a fold
  into a full state of R rows. The smallest R of both head layouts first."""
  geo = ctx.geo
  B, H, D = geo.batch, geo.heads, geo.head_dim
  dt = jnp.dtype(geo.dtype)
  S = jax.ShapeDtypeStruct
  entries = [(impl, Hkv, R, op) for impl in ("pallas", "xla") for R in geo.compile_rows
             for Hkv in geo.kv_heads for op in ("forward", "backward", "decode")]
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  tasks = []
  for impl, Hkv, R, op in entries:
    def run(impl=impl, Hkv=Hkv, R=R, op=op):
      cfg = kvm_config(geo, kj.FixedBudget(R))
      T = length_for_rows(cfg, R)
      params = jax.eval_shape(lambda: kj.KVMParams.init(D, H))
      backend = kj.resolve_kvm_backend(cfg, implementation=impl)
      if op == "decode":
        cache = jax.eval_shape(lambda: kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D,
                                                         value_dim=D, max_len=T, dtype=dt))
        args = (S((B, 1, H, D), dt), S((B, 1, Hkv, D), dt), S((B, 1, Hkv, D), dt),
                S((B, 1, Hkv), jnp.float32), params, cache)
        f = lambda q, k, v, g, p, c: kj.kvm_decode_step(q, k, v, g, p, cfg, c, backend=backend)
      else:
        args = (S((B, T, H, D), dt), S((B, T, Hkv, D), dt), S((B, T, Hkv, D), dt),
                S((B, T, Hkv), jnp.float32), params)
        forward = lambda q, k, v, g, p: kj.kvm_attention(q, k, v, g, p, cfg, backend=backend)
        f = forward if op == "forward" else jax.grad(
            lambda *a: jnp.sum(forward(*a)[0].astype(jnp.float32) * w), argnums=(0, 1, 2, 3))
      t0 = time.perf_counter()
      lowered = jax.jit(f).lower(*args)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      return {"T": T, "lower_s": t1 - t0, "compile_s": t2 - t1, **memory_fields(compiled)}

    kernels = kernels_of(impl, DECODE_KERNELS if op == "decode" else SCAN_KERNELS)
    tasks.append(Task(f"{impl} {op} Hkv={Hkv} R={R}", run, dict(
        impl=impl, op=op, B=B, H=H, Hkv=Hkv, D=D, R=R, dtype=geo.dtype, kernels=kernels),
        kind=(impl, op)))
  rec.run(tasks)


# ----------------------------------------------------------------------------------------------
# trace
# ----------------------------------------------------------------------------------------------


def _pack_trace(folder: Path, dest: Path) -> dict:
  """The profiler's folder as one gzipped tar at ``dest`` (removed again when over the size the
  device machine returns)."""
  files = sorted(p for p in folder.rglob("*") if p.is_file())
  with tarfile.open(dest, "w:gz") as tar:
    for p in files:
      tar.add(p, arcname=str(p.relative_to(folder)))
  size = dest.stat().st_size
  out = {"file": dest.name, "members": [str(p.relative_to(folder)) for p in files][:20],
         "raw_bytes": sum(p.stat().st_size for p in files), "bytes": size}
  if size > TRACE_LIMIT_BYTES:
    dest.unlink()
    return {**out, "file": None, "status": "failed",
            "reason": f"trace {size / 2**20:.1f} MiB compressed, over the "
                      f"{TRACE_LIMIT_BYTES / 2**20:.0f} MiB a file may be; not kept"}
  return out


def stage_trace(rec: Recorder, ctx: Context) -> None:
  """One ``jax.profiler`` trace of a few KVM prefill steps (xla, then pallas), packed into
  trace.tar.gz."""
  geo = ctx.geo
  T = geo.trace_length
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  ready = {}
  tasks = []
  for impl in ("kvm-xla", "kvm-pallas"):
    def prepare(impl=impl):
      if ready and rec.remaining() < 2.5 * rec.last_seconds:
        return {"status": "skipped", "reason": "time (kept for the trace)"}

      def at(B):
        args = inputs(geo, B, T)
        compiled = jax.jit(prefill_fn(impl, cfg)).lower(*args).compile()
        jax.block_until_ready(compiled(*args))  # warm-up, outside the trace
        ready[impl] = (compiled, args)
        return {}
      return with_batch_fallback(geo.batch, at)

    tasks.append(Task(f"prepare {impl}", prepare, dict(
        impl=impl, T=T, kernels=kernels_of(impl)), kind=impl))

  def trace():
    if not ready:
      return {"status": "skipped", "reason": "nothing compiled"}
    with tempfile.TemporaryDirectory(prefix="kvm_trace_") as folder:
      with jax.profiler.trace(folder):
        for impl, (compiled, args) in ready.items():
          for i in range(geo.trace_steps):
            with jax.profiler.TraceAnnotation(f"{impl} prefill T={T} step {i}"):
              jax.block_until_ready(compiled(*args))
      packed = _pack_trace(Path(folder), ctx.out / TRACE)
    return {"traced": list(ready), "steps": geo.trace_steps, **packed}

  tasks.append(Task("trace", trace, dict(T=T), always=True))
  rec.run(tasks)
