"""``python -m kvm_jax.eval.device_check``: the one prepared check of a GPU machine (<= 8 minutes
on one NVIDIA H200), driven by ``scripts/device_check.sh``.

Stages, in order, each in its own child process under its own wall-clock budget, so that a hung
compile or a crash loses only the entry it was running:

  env       jax/jaxlib versions, devices, backend, memory statistics (and nvidia-smi when present);
  compile   compile-only matrix (abstract shapes, no data): ``kvm_attention`` forward, its gradient
            and ``kvm_decode_step``, implementation "pallas" then "xla", at the paper's geometry
            (B=8, H=32, Hkv in {32, 8}, D=128, bf16, chunk 256, window 2 chunks) with
            FixedBudget(R), R in {256, 1024, 4096}, at the shortest T with a fold into a full
            state of R rows (T = R + 3 chunks);
  numerics  "pallas" vs "xla" outputs, final state and routing decisions on random inputs (B=2,
            H=8, D=128, T=4096, float32 and bfloat16), at the default matmul precision and again
            under ``jax.default_matmul_precision("float32")``;
  check     ``kvm-check --size paper`` (kvm_jax.eval.check), one case at a time, its output in
            check_<size>.txt;
  prefill   forward time at T = 4K..32K: cuDNN attention (causal), KVM-pallas, KVM-xla, B=8,
            H=32, D=128, bf16, FixedBudget(256) (halving B on out-of-memory, recorded);
  decode    64 decode steps at a 32K context inside one jitted ``lax.fori_loop``: KVM xla/pallas
            (the cache is filled with random contents of the right shapes and length 32768, not
            by a real prefill) and full attention over a 32K KV cache (cuDNN and XLA);
  backward  gradient memory (compiled ``memory_analysis``) and time at T = 8K..32K where it fits:
            KVM xla/pallas and cuDNN attention;
  trace     one ``jax.profiler`` trace (in trace/) of a few KVM prefill steps at 16K.

Timings are medians of a few runs after a warm-up, outputs blocked on; prefill and backward try
the longest T first, so that a stage cut short by its budget loses the middle of the range. A
stage's child is a fresh ``python -m kvm_jax.eval.device_check --child STAGE`` in a full run and a
fork of the parent (which imports kvm_jax once and touches no device) with ``--smoke``.

Every measurement is appended to ``results.jsonl`` as it is made (one JSON object a line,
flushed): ``kind`` is "run" (the first line), "plan" (the entries a stage will try), "entry" (one
measurement: ``status`` ok / failed / error / skipped, with ``reason`` "time" when the stage ran
out of time) or "stage" (one per stage, written by the parent: ok / error / timeout / crashed /
skipped). ``summary.md`` is built from results.jsonl at the end (``--summarize`` rebuilds it).
Each stage's stdout and stderr go to logs/<stage>.log.

``--smoke`` runs the whole pipeline at tiny shapes (B=1, H=2, D=16, chunk 16, T <= 256, R in
{16, 32}) on whatever backend is present: on CPU the Pallas kernels run interpreted and cuDNN is
recorded as skipped. The exit status is 0 when every stage finished (even if some of its entries
failed), 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

# No jax import at module level: the parent process only schedules children (and ``--help`` and
# ``--summarize`` stay instant). The children import jax, kvm_jax and run the stages.

STAGES = ("env", "compile", "numerics", "check", "prefill", "decode", "backward", "trace")

# Seconds per stage. Full: 460 s in all, plus the grace below, inside 8 minutes on an H200.
BUDGETS = {"env": 15, "compile": 140, "numerics": 55, "check": 60, "prefill": 80, "decode": 40,
           "backward": 45, "trace": 25}
# Smoke: each stage's first entries (one compile or two, interpreted Pallas on CPU), ~30 s on two
# idle cores; a busy machine cuts stages short, which the records say.
SMOKE_BUDGETS = {"env": 10, "compile": 5, "numerics": 5, "check": 15, "prefill": 5, "decode": 5,
                 "backward": 5, "trace": 5}
TOTAL_BUDGET = {"full": 460.0, "smoke": 60.0}
GRACE = {"full": 10.0, "smoke": 8.0}

RESULTS, SUMMARY = "results.jsonl", "summary.md"
FAIL_ENV, HANG_ENV = "KVM_DEVICE_CHECK_FAIL", "KVM_DEVICE_CHECK_HANG"


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Every shape of one mode (paper or smoke)."""

  batch: int
  heads: int
  kv_heads: tuple[int, ...]       # compile matrix: MHA and a GQA variant
  head_dim: int
  dtype: str
  chunk: int
  window_chunks: int
  rope_dims: int
  compile_rows: tuple[int, ...]
  # numerics
  num_batch: int
  num_heads: int
  num_kv_heads: tuple[int, ...]
  num_length: int
  num_budget: tuple[float, float, int]   # PowerLawBudget(factor, exponent, min_rows)
  # kvm-check
  check_size: str
  check_args: tuple[str, ...]
  check_cases: Optional[int]     # None: every case of the size
  # timings (KVM: FixedBudget(timing_rows), MHA)
  timing_rows: int
  prefill_lengths: tuple[int, ...]
  decode_context: int
  decode_steps: int
  backward_lengths: tuple[int, ...]
  trace_length: int
  trace_steps: int
  repeats: int


PAPER = Geometry(batch=8, heads=32, kv_heads=(32, 8), head_dim=128, dtype="bfloat16", chunk=256,
                 window_chunks=2, rope_dims=64, compile_rows=(256, 1024, 4096),
                 num_batch=2, num_heads=8, num_kv_heads=(8, 2), num_length=4096,
                 num_budget=(16.0, 0.5, 256), check_size="paper", check_args=(),
                 check_cases=None, timing_rows=256,
                 prefill_lengths=(4096, 8192, 16384, 32768), decode_context=32768,
                 decode_steps=64, backward_lengths=(8192, 16384, 32768), trace_length=16384,
                 trace_steps=3, repeats=3)
SMOKE = Geometry(batch=1, heads=2, kv_heads=(2, 1), head_dim=16, dtype="bfloat16", chunk=16,
                 window_chunks=2, rope_dims=8, compile_rows=(16, 32),
                 num_batch=1, num_heads=2, num_kv_heads=(2, 1), num_length=256,
                 num_budget=(2.0, 0.5, 16), check_size="small", check_args=("--no-grads",),
                 check_cases=1, timing_rows=32, prefill_lengths=(128, 256), decode_context=256,
                 decode_steps=8, backward_lengths=(128, 256), trace_length=256, trace_steps=2,
                 repeats=2)


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------


def _plain(x: Any) -> Any:
  """``x`` as strict JSON: NaN/inf become strings, numpy scalars and tuples plain Python."""
  if isinstance(x, dict):
    return {str(k): _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  if isinstance(x, bool) or x is None or isinstance(x, str):
    return x
  if isinstance(x, int):
    return int(x)
  if isinstance(x, float):
    return x if math.isfinite(x) else str(x)
  if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:  # numpy / jax scalars
    return _plain(x.item())
  return str(x)


def append_record(path: Path, record: dict) -> None:
  """Appends one JSON line and flushes it to disk (a killed stage keeps what it wrote)."""
  line = json.dumps(_plain(record), allow_nan=False, sort_keys=False)
  with open(path, "a", encoding="utf-8") as f:
    f.write(line + "\n")
    f.flush()
    os.fsync(f.fileno())


def read_records(path: Path) -> list[dict]:
  """The records of a results.jsonl; a torn last line (a stage killed mid-write) is skipped."""
  records = []
  if not path.exists():
    return records
  for line in path.read_text(encoding="utf-8").splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def is_oom(err: BaseException) -> bool:
  text = f"{type(err).__name__}: {err}"
  return any(s in text for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "OOM"))


@dataclasses.dataclass
class Task:
  """One entry of a stage: ``fn() -> dict`` of measurements, described by ``fields``."""

  name: str
  fn: Callable[[], Optional[dict]]
  fields: dict = dataclasses.field(default_factory=dict)
  always: bool = False
  kind: Any = None  # entries of one kind take about as long as each other (time estimates)


class Recorder:
  """Writes one stage's records and keeps its clock.

  :meth:`entry` runs one measurement under an exception guard. An entry is skipped for time when
  the stage's deadline has passed or what is left is shorter than the entry is expected to take
  (as long as the last entry of its kind, else half as long as the last entry); from then on
  every later entry of the stage is skipped too ("skipped: time")."""

  def __init__(self, path: Path, stage: str, deadline: float):
    self.path, self.stage, self.deadline = path, stage, deadline
    self.last_seconds = 0.0
    self.seconds_by_kind: dict = {}
    self.time_up = False

  def remaining(self) -> float:
    return self.deadline - time.monotonic()

  def write(self, **record) -> None:
    append_record(self.path, {"stage": self.stage, "time": round(time.time(), 3), **record})

  def run(self, tasks: Sequence["Task"]) -> None:
    """Records the plan (every entry, with its fields, so that a killed stage's parent can
    account for the ones never reached), then runs the entries in order."""
    self.write(kind="plan", entries=[t.name for t in tasks],
               fields={t.name: t.fields for t in tasks})
    for t in tasks:
      self.entry(t.name, t.fn, always=t.always, kind=t.kind, **t.fields)

  def _entry(self, name: str, status: str, fields: dict, extra: dict) -> None:
    self.write(**{**fields, **extra, "kind": "entry", "entry": name, "status": status})

  def entry(self, name: str, fn: Callable[[], Optional[dict]], always: bool = False,
            kind: Any = None, **fields) -> Optional[dict]:
    """Runs ``fn`` (returns a dict of measurements, or None) and records it; ``fields`` describe
    the entry and are recorded whatever happens. ``fn`` may return ``status``/``reason`` itself
    (e.g. ``status="skipped"`` where cuDNN is absent, ``status="failed"`` for a failed check).
    ``always``: run even when the stage's time is up (it is still killed at budget + grace).
    ``kind``: entries of one kind are expected to take as long as each other."""
    expected = self.seconds_by_kind.get(kind, 0.5 * self.last_seconds)
    if not self.time_up and (self.remaining() <= 0 or self.remaining() < expected):
      self.time_up = True
    if self.time_up and not always:
      self._entry(name, "skipped", fields, {"reason": "time"})
      return None
    print(f"[{self.stage}] {name} ...", flush=True)
    start = time.monotonic()
    try:
      result = dict(fn() or {})
      status = result.pop("status", "ok")
      self._entry(name, status, fields, {"seconds": time.monotonic() - start, **result})
      print(f"[{self.stage}] {name}: {status} {json.dumps(_plain(result))[:300]}", flush=True)
      return result
    except Exception as e:  # noqa: BLE001 - one entry's failure is a result, not the end
      self._entry(name, "error", fields, {"seconds": time.monotonic() - start,
                                          "error": f"{type(e).__name__}: {e}"[:2000],
                                          "oom": is_oom(e)})
      print(f"[{self.stage}] {name}: error\n{traceback.format_exc()}", flush=True)
      return None
    finally:
      self.last_seconds = self.seconds_by_kind[kind] = time.monotonic() - start
      gc.collect()


# ----------------------------------------------------------------------------------------------
# Helpers of the stages (jax imported inside)
# ----------------------------------------------------------------------------------------------


def median_ms(fn, args, repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
  """Median wall time (ms) of ``fn(*args)`` and the samples (``kvm_jax.eval.timing``)."""
  from kvm_jax.eval.timing import sample_ms
  samples = sample_ms(fn, *args, repeats=repeats, warmup=warmup)
  return statistics.median(samples), samples


def memory_fields(compiled) -> dict:
  """The ``*_in_bytes`` fields of a compiled program's memory analysis (empty where none)."""
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
  import jax
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # noqa: BLE001
    return None
  return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def on_gpu() -> bool:
  import jax
  return jax.default_backend() == "gpu"


def kvm_config(geo: Geometry, budget):
  import kvm_jax as kj
  return kj.KVMConfig(chunk_size=geo.chunk, window_chunks=geo.window_chunks, sink_rows=1,
                      rope_dims=min(geo.rope_dims, geo.head_dim), budget=budget)


def length_for_rows(cfg, rows: int, max_chunks: int = 10_000) -> int:
  """The shortest whole-chunk T whose schedule folds a chunk into a full state of ``rows`` rows
  (the state fills up, then a merge runs at capacity): T = R + 3 chunks for FixedBudget(R) with
  a window of 2 chunks."""
  import kvm_jax as kj
  C = cfg.chunk_size
  for n in range(1, max_chunks):
    s = kj.kvm_schedule(cfg, n * C)
    if any(u and r >= rows for u, r in zip(s.update_after, s.rows_before)):
      return n * C
  raise ValueError(f"no T below {max_chunks} chunks reaches {rows} rows with {cfg.budget}")


def longest_first(lengths: Sequence[int]) -> list[int]:
  """The longest length, then the others ascending: when a stage runs out of time it loses the
  middle of the range, not its most telling end."""
  rest = sorted(lengths)
  return rest[-1:] + rest[:-1]


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


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
  out: Path
  geo: Geometry
  smoke: bool
  repeats: int


def stage_env(rec: Recorder, ctx: Context) -> None:
  import importlib.metadata as md
  import platform
  import shutil

  import jax

  def versions():
    import jaxlib
    out = {"python": platform.python_version(), "jax": jax.__version__,
           "jaxlib": getattr(jaxlib, "__version__", None)}
    for dist in ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-cuda12-pjrt", "jax-cuda13-pjrt",
                 "numpy", "flax", "optax", "orbax-checkpoint", "chex", "kvm-jax"):
      try:
        out[dist] = md.version(dist)
      except md.PackageNotFoundError:
        pass
    import kvm_jax
    import kvm_jax.eval
    import kvm_jax.kernels
    out["kvm_jax_files"] = [m.__file__ for m in (kvm_jax, kvm_jax.eval, kvm_jax.kernels)]
    try:
      out["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                                  text=True, timeout=10, cwd=Path(__file__).resolve().parent
                                  ).stdout.strip() or None
    except Exception:  # noqa: BLE001
      out["git"] = None
    return out

  def devices():
    from kvm_jax.kernels.backend import default_interpret
    devs = jax.devices()
    return {"backend": jax.default_backend(), "device_count": len(devs),
            "devices": [str(d) for d in devs], "device_kind": devs[0].device_kind,
            "platform_version": getattr(devs[0].client, "platform_version", None),
            "pallas_interpret": default_interpret()}

  def memory():
    out = {}
    for d in jax.devices():
      try:
        stats = d.memory_stats()
      except Exception as e:  # noqa: BLE001
        stats = {"error": str(e)}
      out[str(d.id)] = stats
    return {"memory_stats": out}

  def config():
    names = ("jax_default_matmul_precision", "jax_enable_x64", "jax_disable_most_optimizations",
             "jax_compilation_cache_dir")
    values = {}
    table = getattr(jax.config, "values", {})
    for n in names:
      if n in table:
        values[n] = table[n]
      elif hasattr(jax.config, n):
        values[n] = getattr(jax.config, n)
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("JAX_", "XLA_", "CUDA_", "TF_", "NVIDIA_"))}
    return {"jax_config": values, "environment": env}

  def nvidia_smi():
    exe = shutil.which("nvidia-smi")
    if not exe:
      return {"status": "skipped", "reason": "nvidia-smi not found"}
    text = subprocess.run([exe], capture_output=True, text=True, timeout=15).stdout
    (ctx.out / "nvidia-smi.txt").write_text(text)
    query = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                            "--format=csv,noheader"], capture_output=True, text=True,
                           timeout=15).stdout.strip()
    return {"gpus": query, "file": "nvidia-smi.txt"}

  rec.run([Task("versions", versions), Task("devices", devices), Task("memory", memory),
           Task("config", config), Task("nvidia-smi", nvidia_smi)])


def stage_compile(rec: Recorder, ctx: Context) -> None:
  import jax
  import jax.numpy as jnp

  import kvm_jax as kj

  geo = ctx.geo
  B, H, D = geo.batch, geo.heads, geo.head_dim
  dt = jnp.dtype(geo.dtype)
  S = jax.ShapeDtypeStruct
  entries = [(impl, Hkv, R, kind) for impl in ("pallas", "xla") for Hkv in geo.kv_heads
             for R in geo.compile_rows for kind in ("forward", "backward", "decode")]
  name = lambda impl, Hkv, R, kind: f"{impl} {kind} Hkv={Hkv} R={R}"
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  tasks = []
  for impl, Hkv, R, kind in entries:
    def run(impl=impl, Hkv=Hkv, R=R, kind=kind):
      cfg = kvm_config(geo, kj.FixedBudget(R))
      T = length_for_rows(cfg, R)
      params = jax.eval_shape(lambda: kj.KVMParams.init(D, H))
      if kind == "decode":
        cache = jax.eval_shape(lambda: kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D,
                                                         value_dim=D, max_len=T, dtype=dt))
        args = (S((B, 1, H, D), dt), S((B, 1, Hkv, D), dt), S((B, 1, Hkv, D), dt),
                S((B, 1, Hkv), jnp.float32), params, cache)
        f = lambda q, k, v, g, p, c: kj.kvm_decode_step(q, k, v, g, p, cfg, c,
                                                        implementation=impl)
      else:
        args = (S((B, T, H, D), dt), S((B, T, Hkv, D), dt), S((B, T, Hkv, D), dt),
                S((B, T, Hkv), jnp.float32), params)
        forward = lambda q, k, v, g, p: kj.kvm_attention(q, k, v, g, p, cfg,
                                                         implementation=impl)
        if kind == "forward":
          f = forward
        else:
          f = jax.grad(lambda *a: jnp.sum(forward(*a)[0].astype(jnp.float32) * w),
                       argnums=(0, 1, 2, 3))
      t0 = time.perf_counter()
      lowered = jax.jit(f).lower(*args)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
      return {"T": T, "lower_s": t1 - t0, "compile_s": t2 - t1, **memory_fields(compiled)}

    tasks.append(Task(name(impl, Hkv, R, kind), run, dict(impl=impl, op=kind, B=B, H=H,
                                                          Hkv=Hkv, D=D, R=R, dtype=geo.dtype),
                      kind=(impl, kind)))
  rec.run(tasks)


def stage_numerics(rec: Recorder, ctx: Context) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import kvm_jax as kj
  from kvm_jax.ops.kvm.cases import TOLERANCE, random_inputs, random_params, rel_rms, \
      state_rel_error

  geo = ctx.geo
  B, H, D, T = geo.num_batch, geo.num_heads, geo.head_dim, geo.num_length
  cfg = kvm_config(geo, kj.PowerLawBudget(*geo.num_budget[:2], min_rows=geo.num_budget[2]))
  entries = [(Hkv, dtype, precision) for Hkv in geo.num_kv_heads
             for precision in ("default", "float32") for dtype in ("float32", "bfloat16")]
  name = lambda Hkv, dtype, precision: f"Hkv={Hkv} {dtype} precision={precision}"
  tasks = []
  for Hkv, dtype, precision in entries:
    def run(Hkv=Hkv, dtype=dtype, precision=precision):
      q, k, v, g = jax.jit(lambda: random_inputs(0, B, T, H, Hkv, D, D, jnp.dtype(dtype)))()
      params = random_params(0, D, H)
      scope = (jax.default_matmul_precision("float32") if precision == "float32"
               else contextlib.nullcontext())
      with scope:
        yx, sx, rx = kj.kvm_attention(q, k, v, g, params, cfg, implementation="xla",
                                      return_routing=True)
        yp, sp, rp = kj.kvm_attention(q, k, v, g, params, cfg, implementation="pallas",
                                      return_routing=True)
        jax.block_until_ready((yx, sx, rx, yp, sp, rp))
      a, e = np.asarray(yp, np.float64), np.asarray(yx, np.float64)
      max_rel = float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-30))
      diff = [int(np.sum(np.asarray(x) != np.asarray(y))) for x, y in zip(rx, rp)]
      total = int(sum(np.asarray(x).size for x in rx))
      rms = rel_rms(a, e)
      tol = TOLERANCE[dtype]["output"]
      return {"output_max_rel": max_rel, "output_rel_rms": rms,
              "state_rel": state_rel_error(sp, sx), "tolerance": tol,
              "within_tolerance": bool(rms <= tol), "routing_same": not any(diff),
              "routing_differences": diff, "routing_decisions": total,
              "state_rows": int(sx.num_rows)}

    tasks.append(Task(name(Hkv, dtype, precision), run, dict(
        B=B, H=H, Hkv=Hkv, D=D, T=T, dtype=dtype, precision=precision, budget=str(cfg.budget))))
  rec.run(tasks)


def stage_check(rec: Recorder, ctx: Context) -> None:
  from kvm_jax.eval import check

  geo = ctx.geo
  cases = check.cases(geo.check_size)
  n = len(cases) if geo.check_cases is None else min(geo.check_cases, len(cases))
  log = ctx.out / f"check_{geo.check_size}.txt"
  tasks = []
  for i in range(1, n + 1):
    argv = ["--size", geo.check_size, *geo.check_args, "--cases", str(i)]

    def run(argv=argv):
      buf = io.StringIO()
      try:
        with contextlib.redirect_stdout(buf):
          rc = check.main(argv)
      finally:  # what it printed is kept even when it raised
        text = buf.getvalue()
        with open(log, "a", encoding="utf-8") as f:
          f.write(f"$ python -m kvm_jax.eval.check {' '.join(argv)}\n{text}\n")
      passed = re.search(r"(\d+)/(\d+) checks passed", text)
      fails = [line for line in text.splitlines() if line.startswith("FAIL")]
      return {"status": "ok" if rc == 0 else "failed", "rc": rc,
              "passed": passed.group(0) if passed else None, "fails": fails,
              "file": log.name}

    tasks.append(Task(f"case {i}: {cases[i - 1].name}", run, dict(argv=argv)))
  rec.run(tasks)


def _prefill_fn(impl: str, cfg):
  """``f(q, k, v, g, params) -> y``: cuDNN causal attention or KVM of ``impl``."""
  import jax

  import kvm_jax as kj
  if impl == "cudnn":
    return lambda q, k, v, g, p: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="cudnn")
  if impl == "full-xla":
    return lambda q, k, v, g, p: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                              implementation="xla")
  kvm_impl = impl.removeprefix("kvm-")
  return lambda q, k, v, g, p: kj.kvm_attention(q, k, v, g, p, cfg, implementation=kvm_impl)[0]


def _arms(kvm_first: bool = False) -> tuple[str, ...]:
  """cuDNN and KVM (xla, pallas); XLA attention as the baseline where there is no GPU."""
  base = ("cudnn",) if on_gpu() else ("cudnn", "full-xla")
  kvm = ("kvm-pallas", "kvm-xla")
  return kvm + base if kvm_first else base + kvm


def _inputs(geo: Geometry, B: int, T: int):
  import jax
  import jax.numpy as jnp

  import kvm_jax as kj
  from kvm_jax.ops.kvm.cases import random_inputs
  make = jax.jit(lambda: random_inputs(T, B, T, geo.heads, geo.heads, geo.head_dim,
                                       geo.head_dim, jnp.dtype(geo.dtype)))  # one program
  return (*make(), kj.KVMParams.init(geo.head_dim, geo.heads))


def _needs_gpu(impl: str) -> Optional[dict]:
  if impl.endswith("cudnn") and not on_gpu():
    import jax
    return {"status": "skipped", "reason": f"cuDNN needs a GPU (backend: {jax.default_backend()})"}
  return None


def stage_prefill(rec: Recorder, ctx: Context) -> None:
  import jax

  import kvm_jax as kj

  geo = ctx.geo
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  entries = [(T, impl) for T in longest_first(geo.prefill_lengths) for impl in _arms()]
  tasks = []
  for T, impl in entries:
    def run(T=T, impl=impl):
      skip = _needs_gpu(impl)
      if skip:
        return skip

      def at(B):
        args = _inputs(geo, B, T)
        t0 = time.perf_counter()
        compiled = jax.jit(_prefill_fn(impl, cfg)).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        ms, samples = median_ms(compiled, args, ctx.repeats)
        return {"ms": ms, "samples_ms": samples, "ms_per_seq": ms / B, "compile_s": compile_s}

      return with_batch_fallback(geo.batch, at)

    tasks.append(Task(f"{impl} T={T}", run, dict(
        impl=impl, T=T, H=geo.heads, D=geo.head_dim, dtype=geo.dtype,
        rows=None if impl in ("cudnn", "full-xla") else geo.timing_rows), kind=impl))
  rec.run(tasks)


def stage_decode(rec: Recorder, ctx: Context) -> None:
  import jax
  import jax.numpy as jnp

  import kvm_jax as kj

  geo = ctx.geo
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  T0, n = geo.decode_context, geo.decode_steps
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  arms = ("kvm-pallas", "kvm-xla", "full-cudnn", "full-xla")
  folds = sum(1 for t in range(T0, T0 + n) if t % cfg.chunk_size == 0 and t >= cfg.window_len
              + cfg.chunk_size)

  def tokens(Hkv, key):
    kq, kk, kv, kg = jax.random.split(key, 4)
    return (jax.random.normal(kq, (n, B, 1, H, D), dt),
            jax.random.normal(kk, (n, B, 1, Hkv, D), dt),
            jax.random.normal(kv, (n, B, 1, Hkv, D), dt),
            1.0 + jax.nn.elu(jax.random.normal(kg, (n, B, 1, Hkv), jnp.float32)))

  def kvm(impl):
    params = kj.KVMParams.init(D, H)
    empty = jax.eval_shape(lambda: kj.kvm_init_cache(cfg, batch=B, kv_heads=H, head_dim=D,
                                                     value_dim=D, max_len=T0 + n, dtype=dt))
    rows = kj.kvm_schedule(cfg, T0).final_rows

    @jax.jit
    def random_cache(key):
      """Random contents for every array of the cache, whatever fields it has: normal, positive
      for radii and gates, and the integers: ``length`` = T0 and ``num_rows`` = the rows the
      schedule holds after T0 tokens."""
      leaves, treedef = jax.tree_util.tree_flatten_with_path(empty)
      keys = jax.random.split(key, len(leaves))
      filled = []
      for (path, leaf), k in zip(leaves, keys):
        name = jax.tree_util.keystr(path)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
          value = T0 if "length" in name else rows if "num_rows" in name else 0
          filled.append(jnp.full(leaf.shape, value, leaf.dtype))
        elif "radius" in name or "gate" in name:
          filled.append((0.5 + jnp.abs(jax.random.normal(k, leaf.shape))).astype(leaf.dtype))
        else:
          filled.append(jax.random.normal(k, leaf.shape, leaf.dtype))
      return jax.tree_util.tree_unflatten(treedef, filled)

    def loop(cache, toks):
      qs, ks, vs, gs = toks

      def body(i, carry):
        cache, acc = carry
        y, cache = kj.kvm_decode_step(qs[i], ks[i], vs[i], gs[i], params, cfg, cache,
                                      implementation=impl)
        return cache, acc + jnp.sum(y.astype(jnp.float32))

      return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))

    cache = random_cache(jax.random.PRNGKey(0))
    toks = tokens(H, jax.random.PRNGKey(1))
    t0 = time.perf_counter()
    compiled = jax.jit(loop, donate_argnums=(0,)).lower(cache, toks).compile()
    compile_s = time.perf_counter() - t0
    restart = lambda c: dataclasses.replace(c, length=jnp.asarray(T0, jnp.int32))
    cache, _ = jax.block_until_ready(compiled(restart(cache), toks))  # warm-up
    samples = []
    for _ in range(ctx.repeats):
      cache = jax.block_until_ready(restart(cache))
      start = time.perf_counter()
      cache, acc = jax.block_until_ready(compiled(cache, toks))
      samples.append((time.perf_counter() - start) * 1e3)
    return {"ms_per_step": statistics.median(samples) / n, "samples_ms": samples,
            "compile_s": compile_s,
            "cache_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)),
            "finite": bool(jnp.isfinite(acc)), "state_rows": rows}

  def full(impl):
    kk, kv = jax.random.split(jax.random.PRNGKey(2))
    caches = (jax.random.normal(kk, (B, T0 + n, H, D), dt),
              jax.random.normal(kv, (B, T0 + n, H, D), dt))
    toks = tokens(H, jax.random.PRNGKey(1))[:3]

    def loop(kc, vc, toks, p0):
      qs, ks, vs = toks

      def body(i, carry):
        kc, vc, acc = carry
        pos = p0 + i
        kc = jax.lax.dynamic_update_slice_in_dim(kc, ks[i], pos, axis=1)
        vc = jax.lax.dynamic_update_slice_in_dim(vc, vs[i], pos, axis=1)
        lengths = jnp.full((B,), pos + 1, jnp.int32)
        y = jax.nn.dot_product_attention(qs[i], kc, vc, key_value_seq_lengths=lengths,
                                         implementation=impl)
        return kc, vc, acc + jnp.sum(y.astype(jnp.float32))

      return jax.lax.fori_loop(0, n, body, (kc, vc, jnp.float32(0)))

    p0 = jnp.asarray(T0, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(loop, donate_argnums=(0, 1)).lower(*caches, toks, p0).compile()
    compile_s = time.perf_counter() - t0
    kc, vc, _ = jax.block_until_ready(compiled(*caches, toks, p0))  # warm-up
    samples = []
    for _ in range(ctx.repeats):
      start = time.perf_counter()
      kc, vc, acc = jax.block_until_ready(compiled(kc, vc, toks, p0))
      samples.append((time.perf_counter() - start) * 1e3)
    return {"ms_per_step": statistics.median(samples) / n, "samples_ms": samples,
            "compile_s": compile_s, "cache_bytes": int(kc.nbytes + vc.nbytes),
            "finite": bool(jnp.isfinite(acc))}

  note = (f"KVM cache filled with random contents (length {T0}, {n} steps from there), not by a "
          f"real prefill; {folds} of the {n} steps folds a chunk into the state (one in every "
          f"{cfg.chunk_size} steps in a long decode)")
  tasks = []
  for impl in arms:
    def run(impl=impl):
      skip = _needs_gpu(impl)
      if skip:
        return skip
      return kvm(impl.removeprefix("kvm-")) if impl.startswith("kvm-") else full(
          impl.removeprefix("full-"))

    tasks.append(Task(impl, run, dict(
        impl=impl, B=B, H=H, D=D, context=T0, steps=n, dtype=geo.dtype,
        note=note if impl.startswith("kvm-") else "KV cache of random contents"), kind=impl))
  rec.run(tasks)


def stage_backward(rec: Recorder, ctx: Context) -> None:
  import jax
  import jax.numpy as jnp

  import kvm_jax as kj

  geo = ctx.geo
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  arms = ("kvm-pallas", "kvm-xla", "cudnn") if on_gpu() else (
      "kvm-pallas", "kvm-xla", "cudnn", "full-xla")
  entries = [(T, impl) for T in longest_first(geo.backward_lengths) for impl in arms]
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  limit = device_bytes_limit()
  tasks = []
  for T, impl in entries:
    def run(T=T, impl=impl):
      skip = _needs_gpu(impl)
      if skip:
        return skip
      f = _prefill_fn(impl, cfg)
      argnums = (0, 1, 2) if impl in ("cudnn", "full-xla") else (0, 1, 2, 3)
      grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w),
                              argnums=argnums))
      S = jax.ShapeDtypeStruct
      abstract = (S((B, T, H, D), dt), S((B, T, H, D), dt), S((B, T, H, D), dt),
                  S((B, T, H), jnp.float32), jax.eval_shape(lambda: kj.KVMParams.init(D, H)))
      t0 = time.perf_counter()
      compiled = grad.lower(*abstract).compile()
      out = {"compile_s": time.perf_counter() - t0, **memory_fields(compiled),
             "bytes_limit": limit}
      need = out.get("needed_bytes")
      if limit and need and need > 0.95 * limit:
        return {**out, "status": "skipped",
                "reason": f"does not fit: needs {need / 2**30:.1f} GiB of {limit / 2**30:.1f}"}
      args = _inputs(geo, B, T)
      out["ms"], out["samples_ms"] = median_ms(compiled, args, ctx.repeats)
      return out

    tasks.append(Task(f"{impl} T={T}", run, dict(
        impl=impl, T=T, B=B, H=H, D=D, dtype=geo.dtype,
        rows=None if impl in ("cudnn", "full-xla") else geo.timing_rows), kind=impl))
  rec.run(tasks)


def stage_trace(rec: Recorder, ctx: Context) -> None:
  import jax

  import kvm_jax as kj

  geo = ctx.geo
  T = geo.trace_length
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  trace_dir = ctx.out / "trace"
  ready = {}
  tasks = []
  for impl in ("kvm-pallas", "kvm-xla"):
    def prepare(impl=impl):
      if ready and rec.remaining() < 2.5 * rec.last_seconds:
        return {"status": "skipped", "reason": "time (kept for the trace)"}

      def at(B):
        args = _inputs(geo, B, T)
        compiled = jax.jit(_prefill_fn(impl, cfg)).lower(*args).compile()
        jax.block_until_ready(compiled(*args))  # warm-up, outside the trace
        ready[impl] = (compiled, args)
        return {}
      return with_batch_fallback(geo.batch, at)

    tasks.append(Task(f"prepare {impl}", prepare, dict(impl=impl, T=T), kind=impl))

  def trace():
    if not ready:
      return {"status": "skipped", "reason": "nothing compiled"}
    with jax.profiler.trace(str(trace_dir)):
      for impl, (compiled, args) in ready.items():
        for i in range(geo.trace_steps):
          with jax.profiler.TraceAnnotation(f"{impl} prefill T={T} step {i}"):
            jax.block_until_ready(compiled(*args))
    files = [p for p in trace_dir.rglob("*") if p.is_file()]
    return {"dir": "trace", "traced": list(ready), "steps": geo.trace_steps,
            "files": [str(p.relative_to(ctx.out)) for p in files][:20],
            "bytes": sum(p.stat().st_size for p in files)}

  tasks.append(Task("trace", trace, dict(T=T), always=True))
  rec.run(tasks)


STAGE_FUNCTIONS = {"env": stage_env, "compile": stage_compile, "numerics": stage_numerics,
                   "check": stage_check, "prefill": stage_prefill, "decode": stage_decode,
                   "backward": stage_backward, "trace": stage_trace}


# ----------------------------------------------------------------------------------------------
# Child and parent
# ----------------------------------------------------------------------------------------------


def _planted(flag: Optional[str], env: str) -> set[str]:
  names = set(filter(None, (flag or "").split(","))) | set(
      filter(None, os.environ.get(env, "").split(",")))
  return names


def run_stage(stage: str, args, deadline: float, redirect: bool) -> int:
  """Body of a stage's child process: runs the stage until ``deadline`` (``time.time()``; no
  entry starts after it), returns its exit code (0 finished, 1 the stage itself raised; entries'
  errors are recorded and do not count)."""
  out = Path(args.out)
  if redirect:  # fork: the child's fds 1 and 2 (Python's and XLA's output) go to its log
    sys.stdout.flush()
    sys.stderr.flush()
    log = os.open(out / "logs" / f"{stage}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
  rec = Recorder(out / RESULTS, stage, time.monotonic() + (deadline - time.time()))
  try:
    if stage in _planted(args.hang_stage, HANG_ENV):
      print(f"[{stage}] planted hang (--hang-stage)", flush=True)
      while True:
        time.sleep(1.0)
    if stage in _planted(args.fail_stage, FAIL_ENV):
      raise RuntimeError(f"planted failure of stage {stage!r} (--fail-stage / {FAIL_ENV})")
    import jax
    if args.fast_compile:
      jax.config.update("jax_disable_most_optimizations", True)
    if args.compile_cache:
      jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    geo = SMOKE if args.smoke else PAPER
    ctx = Context(out=out, geo=geo, smoke=args.smoke, repeats=args.repeats or geo.repeats)
    STAGE_FUNCTIONS[stage](rec, ctx)
    return 0
  except Exception as e:  # noqa: BLE001
    rec.write(kind="entry", entry="(stage)", status="error",
              error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-4000:])
    traceback.print_exc()
    return 1
  finally:
    sys.stdout.flush()
    sys.stderr.flush()


def _fork_target(stage, args, deadline):
  sys.exit(run_stage(stage, args, deadline, redirect=True))


def _launch(stage: str, args, argv: Sequence[str], soft: float, hard: float) -> tuple[str, Any]:
  """Runs one stage in a child; ``(status, exit code)`` with status ok / error / timeout /
  crashed."""
  out = Path(args.out)
  deadline = time.time() + soft  # the child's clock starts now, not after its imports
  if args.isolation == "fork":
    import multiprocessing
    proc = multiprocessing.get_context("fork").Process(target=_fork_target,
                                                       args=(stage, args, deadline))
    proc.start()
    proc.join(hard)
    if proc.is_alive():
      proc.terminate()
      proc.join(3)
      if proc.is_alive():
        proc.kill()
        proc.join()
      return "timeout", None
    code = proc.exitcode
  else:
    cmd = [sys.executable, "-m", "kvm_jax.eval.device_check", *argv, "--child", stage,
           "--child-deadline", f"{deadline:.3f}"]
    with open(out / "logs" / f"{stage}.log", "ab") as log:
      try:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=hard).returncode
      except subprocess.TimeoutExpired:
        return "timeout", None
  if code == 0:
    return "ok", 0
  if code == 1:
    return "error", 1
  return (f"crashed (signal {-code})" if code < 0 else f"crashed (exit {code})"), code


def _stage_counts(records: list[dict], stage: str) -> dict:
  counts: dict[str, int] = {}
  for r in records:
    if r.get("stage") == stage and r.get("kind") == "entry" and r.get("entry") != "(stage)":
      counts[r["status"]] = counts.get(r["status"], 0) + 1
  return counts


def run_all(args, argv: Sequence[str]) -> int:
  out = Path(args.out)
  (out / "logs").mkdir(parents=True, exist_ok=True)
  results = out / RESULTS
  if results.exists():
    results.replace(out / "results.previous.jsonl")
  mode = "smoke" if args.smoke else "full"
  budgets = dict(SMOKE_BUDGETS if args.smoke else BUDGETS)
  budgets.update(args.timeouts)
  total = args.total_budget if args.total_budget is not None else TOTAL_BUDGET[mode]
  grace = args.grace if args.grace is not None else GRACE[mode]
  stages = args.stages
  append_record(results, {"kind": "run", "mode": mode, "stages": stages, "budgets_s": budgets,
                          "total_budget_s": total, "grace_s": grace, "isolation": args.isolation,
                          "fast_compile": args.fast_compile, "argv": list(argv),
                          "time": round(time.time(), 3)})
  if args.isolation == "fork":
    # Imported once here (no device is touched: no backend starts before the fork), shared by
    # every forked stage instead of being imported eight times.
    import kvm_jax  # noqa: F401
    import kvm_jax.eval.check  # noqa: F401
    import kvm_jax.ops.kvm.cases  # noqa: F401
  start = time.monotonic()
  all_ok = True
  for stage in stages:
    left = total - (time.monotonic() - start)
    soft = min(float(budgets[stage]), left - grace)
    if soft < 1.0:
      append_record(results, {"kind": "stage", "stage": stage, "status": "skipped",
                              "reason": "time", "seconds": 0.0})
      print(f"== {stage}: skipped (time)", flush=True)
      all_ok = False
      continue
    print(f"== {stage} (budget {soft:.0f} s, log logs/{stage}.log)", flush=True)
    t0 = time.monotonic()
    status, code = _launch(stage, args, argv, soft, soft + grace)
    seconds = time.monotonic() - t0
    records = read_records(results)
    if status != "ok":
      all_ok = False
    if status not in ("ok", "error"):  # killed or crashed: the entries it never reached
      plans = [r for r in records if r.get("stage") == stage and r.get("kind") == "plan"]
      done = {r.get("entry") for r in records if r.get("stage") == stage
              and r.get("kind") == "entry"}
      plan = plans[-1] if plans else {}
      missing = [e for e in plan.get("entries", []) if e not in done]
      fields = plan.get("fields") or {}
      for i, e in enumerate(missing):
        if i == 0:  # the entry that was running when the stage was killed or crashed
          outcome = {"status": "error", "error": f"stage {status} during this entry" + (
              f" (killed at {soft + grace:.0f} s)" if status == "timeout" else "")}
        else:
          outcome = {"status": "skipped",
                     "reason": "time" if status == "timeout" else f"stage {status}"}
        append_record(results, {"stage": stage, **fields.get(e, {}), "kind": "entry",
                                "entry": e, **outcome})
      records = read_records(results)
    counts = _stage_counts(records, stage)
    note = None
    if status == "error":
      errs = [r for r in records if r.get("stage") == stage and r.get("entry") == "(stage)"]
      note = errs[-1].get("error") if errs else None
    elif status == "timeout":
      note = f"killed after {seconds:.0f} s"
    append_record(results, {"kind": "stage", "stage": stage, "status": status, "exit_code": code,
                            "seconds": seconds, "budget_s": soft, "entries": counts,
                            "note": note})
    print(f"== {stage}: {status} in {seconds:.1f} s; entries {counts}"
          + (f"; {note}" if note else ""), flush=True)
  text = write_summary(out)
  print(text, flush=True)
  return 0 if all_ok else 1


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


def _fmt(x: Any) -> str:
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  if isinstance(x, float):
    if x == 0:
      return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
      return f"{x:.2e}"
    return f"{x:.4g}"
  return str(x).replace("|", "\\|").replace("\n", " ")


def _gib(x) -> Optional[float]:
  return None if x is None else x / 2**30


def _status(r: dict) -> str:
  s = r.get("status", "?")
  if s == "skipped":
    return f"skipped: {r.get('reason', '?')}"
  if s in ("error", "failed"):
    why = r.get("error") or "; ".join(r.get("fails") or []) or ""
    return f"{s}: {why[:160]}" if why else s
  return s


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
  return lines


def _ratio(a, b) -> Optional[float]:
  try:
    return float(a) / float(b) if a is not None and b else None
  except (TypeError, ValueError):
    return None


def _env_line(env: dict) -> str:
  dev, ver = env.get("devices", {}), env.get("versions", {})
  mode = {True: "interpreted", False: "compiled"}.get(dev.get("pallas_interpret"), "?")
  return (f"jax {ver.get('jax', '?')}, jaxlib {ver.get('jaxlib', '?')}; backend "
          f"{dev.get('backend', '?')}, {dev.get('device_count', '?')} x "
          f"{dev.get('device_kind', '?')}; Pallas kernels {mode}")


def _baselines(recs: list[dict], key: str, per_seq: bool) -> dict:
  """Per T: the full-attention figure (cuDNN, else XLA attention) the KVM rows are divided by."""
  base = {}
  for r in recs:
    if r.get("impl") in ("cudnn", "full-xla") and isinstance(r.get(key), (int, float)):
      if r.get("impl") == "cudnn" or r.get("T") not in base:
        value = r[key] / (r.get("batch") or r.get("B") or 1) if per_seq else r[key]
        base[r.get("T")] = (r.get("impl"), value)
  return base


def summary_text(records: list[dict]) -> str:
  """The markdown report of a run, from its records alone (see the module docstring)."""
  run = next((r for r in records if r.get("kind") == "run"), {})
  stage_recs = {r["stage"]: r for r in records if r.get("kind") == "stage"}
  entries: dict[str, list[dict]] = {}
  failures = []
  for r in records:
    if r.get("kind") == "entry":
      (failures if r.get("entry") == "(stage)" else entries.setdefault(r.get("stage", "?"), [])
       ).append(r)
  env = {r.get("entry"): r for r in entries.get("env", [])}
  lines = [f"# KVM device check ({run.get('mode', '?')})", "", _env_line(env), "",
           "Ratios are baseline time ÷ this time: above 1, this arm is faster than full "
           "attention (cuDNN; XLA attention where there is no GPU).", "", "## Stages", ""]
  rows = []
  for stage in run.get("stages") or list(dict.fromkeys(list(stage_recs) + list(entries))):
    st = stage_recs.get(stage, {})
    c = st.get("entries") or {}
    rows.append([stage, st.get("status", "not recorded"), st.get("seconds"), c.get("ok", 0),
                 c.get("failed", 0), c.get("error", 0), c.get("skipped", 0), st.get("note")])
  lines += _table(["stage", "status", "seconds", "ok", "failed", "error", "skipped", "note"],
                  rows)

  def section(title: str, header: Sequence[str], make_row: Callable[[dict], list], stage: str,
              extra: Optional[Callable[[list], list]] = None):
    lines.extend(["", f"## {title}", ""])
    recs = entries.get(stage, [])
    if not recs:
      lines.append("(no entries)")
      return
    try:
      lines.extend(_table(header, [make_row(r) for r in recs]))
      if extra:
        lines.extend(extra(recs))
    except Exception as e:  # noqa: BLE001 - a malformed record must not cost the report
      lines.append(f"(could not render: {type(e).__name__}: {e})")

  section("env", ["entry", "status", "values"],
          lambda r: [r.get("entry"), _status(r), json.dumps(
              {k: v for k, v in r.items()
               if k not in ("stage", "time", "kind", "entry", "status", "seconds")})[:400]],
          "env")

  section("compile (compile only, abstract shapes; seconds)",
          ["impl", "op", "Hkv", "R", "T", "status", "lower s", "compile s", "temp GiB"],
          lambda r: [r.get("impl"), r.get("op"), r.get("Hkv"), r.get("R"), r.get("T"),
                     _status(r), r.get("lower_s"), r.get("compile_s"),
                     _gib(r.get("temp_size_bytes"))], "compile")

  section("numerics: pallas vs xla",
          ["Hkv", "dtype", "precision", "status", "out max rel", "out rel rms", "tol",
           "state rel", "routing same", "routing diffs"],
          lambda r: [r.get("Hkv"), r.get("dtype"), r.get("precision"), _status(r),
                     r.get("output_max_rel"), r.get("output_rel_rms"), r.get("tolerance"),
                     r.get("state_rel"), r.get("routing_same"),
                     None if r.get("routing_differences") is None else
                     f"{sum(r['routing_differences'])}/{r.get('routing_decisions')}"],
          "numerics")

  section("kvm-check", ["case", "status", "passed", "seconds"],
          lambda r: [r.get("entry"), _status(r), r.get("passed"), r.get("seconds")], "check")

  base = _baselines(entries.get("prefill", []), "ms", per_seq=True)
  section("prefill (forward; ms, median after warm-up)",
          ["T", "impl", "B", "status", "ms", "ms/seq", "baseline", "baseline ÷ this",
           "compile s"],
          lambda r: [r.get("T"), r.get("impl"), r.get("batch"), _status(r), r.get("ms"),
                     r.get("ms_per_seq"), base.get(r.get("T"), (None, None))[0],
                     _ratio(base.get(r.get("T"), (None, None))[1], r.get("ms_per_seq")),
                     r.get("compile_s")], "prefill")

  fulls = [r.get("ms_per_step") for r in entries.get("decode", [])
           if str(r.get("impl", "")).startswith("full-")
           and isinstance(r.get("ms_per_step"), (int, float))]
  best_full = min(fulls, default=None)
  section("decode (ms per step, steps inside one jitted fori_loop)",
          ["impl", "B", "context", "steps", "status", "ms/step", "best full ÷ this",
           "cache GiB", "compile s"],
          lambda r: [r.get("impl"), r.get("B"), r.get("context"), r.get("steps"), _status(r),
                     r.get("ms_per_step"), _ratio(best_full, r.get("ms_per_step")),
                     _gib(r.get("cache_bytes")), r.get("compile_s")], "decode",
          extra=lambda recs: ["", next((r["note"] for r in recs if r.get("note")
                                        and str(r.get("impl", "")).startswith("kvm-")), "")])

  base = _baselines(entries.get("backward", []), "ms", per_seq=False)
  section("backward (gradient; ms and compiled memory)",
          ["T", "impl", "B", "status", "ms", "baseline ÷ this", "temp GiB", "needed GiB",
           "compile s"],
          lambda r: [r.get("T"), r.get("impl"), r.get("B"), _status(r), r.get("ms"),
                     _ratio(base.get(r.get("T"), (None, None))[1], r.get("ms")),
                     _gib(r.get("temp_size_bytes")), _gib(r.get("needed_bytes")),
                     r.get("compile_s")], "backward")

  section("trace", ["entry", "status", "dir", "traced", "MiB"],
          lambda r: [r.get("entry"), _status(r), r.get("dir"),
                     ",".join(r.get("traced") or []) or None,
                     None if r.get("bytes") is None else r["bytes"] / 2**20], "trace")

  if failures:
    lines += ["", "## Stage failures", ""]
    lines += [f"- {r.get('stage')}: {r.get('error')}" for r in failures]
  return "\n".join(lines) + "\n"


def write_summary(out: Path) -> str:
  text = summary_text(read_records(out / RESULTS))
  (out / SUMMARY).write_text(text, encoding="utf-8")
  return text


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def _timeouts(text: str) -> dict:
  out = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in STAGES or not value:
      raise argparse.ArgumentTypeError(f"--timeouts: {item!r}; expected STAGE=SECONDS with "
                                       f"STAGE one of {', '.join(STAGES)}")
    out[name] = float(value)
  return out


def _stages(text: str) -> list:
  names = [s for s in text.split(",") if s]
  bad = [s for s in names if s not in STAGES]
  if bad:
    raise argparse.ArgumentTypeError(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
  return [s for s in STAGES if s in names]  # always in pipeline order


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m kvm_jax.eval.device_check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=os.environ.get("OUT", "device_out"),
                 help="output folder: results.jsonl, summary.md, logs/, check_*.txt, trace/ "
                      "(default: $OUT, else ./device_out)")
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes (B=1, H=2, D=16, chunk 16, T <= 256, R in {16, 32}) and "
                      "short budgets on whatever backend is present (CPU: Pallas interpreted, "
                      "cuDNN skipped): the whole pipeline in well under a minute")
  p.add_argument("--stages", type=_stages, default=list(STAGES),
                 help=f"comma-separated stages to run, always in pipeline order (default: all "
                      f"of {','.join(STAGES)})")
  p.add_argument("--timeouts", type=_timeouts, default={},
                 help="per-stage wall-clock budgets in seconds, e.g. 'compile=100,prefill=60' "
                      f"(defaults: full {BUDGETS}; smoke {SMOKE_BUDGETS}). A stage starts no "
                      "entry past its budget (the rest are recorded 'skipped: time') and is "
                      "killed at budget + --grace")
  p.add_argument("--total-budget", type=float, default=None,
                 help="wall-clock budget of all stages together, in seconds (default: "
                      f"{TOTAL_BUDGET['full']:.0f} full, {TOTAL_BUDGET['smoke']:.0f} smoke); "
                      "a stage gets at most what is left, minus the grace")
  p.add_argument("--grace", type=float, default=None,
                 help="seconds a stage may overrun its budget to finish the entry in progress "
                      f"before it is killed (default: {GRACE['full']:.0f} full, "
                      f"{GRACE['smoke']:.0f} smoke)")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed runs after the warm-up of every timing, reported as their median "
                      f"(default: {PAPER.repeats} full, {SMOKE.repeats} smoke)")
  p.add_argument("--isolation", choices=("auto", "fork", "subprocess"), default="auto",
                 help="how a stage's child process starts: 'subprocess' (a fresh 'python -m "
                      "kvm_jax.eval.device_check --child STAGE': a full run pays ~2 s of "
                      "imports per stage, and no state of the parent can leak into a GPU "
                      "stage), 'fork' (the parent imports kvm_jax once, touching no device, "
                      "and forks: saves the imports, for CPU runs) or 'auto' (default: fork "
                      "with --smoke, subprocess otherwise)")
  p.add_argument("--fast-compile", action=argparse.BooleanOptionalAction, default=None,
                 help="set jax_disable_most_optimizations in the stages (default: on with "
                      "--smoke, off otherwise; timings with it on mean little)")
  p.add_argument("--compile-cache", default=None, metavar="DIR",
                 help="persistent compilation cache folder shared by the stages (default: "
                      "none, so every compile time is a real compile)")
  p.add_argument("--fail-stage", default=None, metavar="STAGES",
                 help=f"testing: these comma-separated stages raise at their start (also "
                      f"${FAIL_ENV}); shows that a failed stage does not stop the next ones")
  p.add_argument("--hang-stage", default=None, metavar="STAGES",
                 help=f"testing: these stages hang until killed at their budget (also "
                      f"${HANG_ENV})")
  p.add_argument("--summarize", action="store_true",
                 help="only rebuild summary.md from OUT/results.jsonl and print it")
  p.add_argument("--child", choices=STAGES, default=None, metavar="STAGE",
                 help="internal (--isolation subprocess): run only this stage, in this process, "
                      "appending to OUT/results.jsonl")
  p.add_argument("--child-deadline", type=float, default=None, metavar="EPOCH",
                 help="internal: when the --child stage starts no more entries, in seconds "
                      "since the epoch (default: now + its full-run budget)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parser().parse_args(argv)
  if args.fast_compile is None:
    args.fast_compile = args.smoke
  if args.isolation == "auto":
    args.isolation = "fork" if args.smoke else "subprocess"
  out = Path(args.out)
  if args.summarize:
    print(write_summary(out), end="")
    return 0
  if args.child:  # --isolation subprocess: this process is one stage
    deadline = args.child_deadline or time.time() + BUDGETS[args.child]
    return run_stage(args.child, args, deadline, redirect=False)
  return run_all(args, argv)


if __name__ == "__main__":
  sys.exit(main())
