"""The timing stages: prefill, decode and backward of KVM (FixedBudget(256), MHA, bf16) against
full attention (cuDNN on a GPU; XLA attention elsewhere). In each stage every baseline and KVM-XLA
entry runs, and is recorded, before the first Pallas entry. Imported only in a stage's
process."""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

import kvm_jax as kj

from benchmarks.device.geometry import baselines_first, longest_first
from benchmarks.device.measure import FULL_ARMS, Context, device_bytes_limit, inputs, \
    is_pallas, kernels_of, kvm_config, median_ms, memory_fields, needs_gpu, prefill_arms, \
    prefill_fn, with_batch_fallback
from benchmarks.device.records import DECODE_KERNELS, Recorder, Task


def _timing_fields(geo, impl: str, T: int) -> dict:
  return dict(impl=impl, T=T, H=geo.heads, D=geo.head_dim, dtype=geo.dtype,
              rows=None if impl in FULL_ARMS else geo.timing_rows,
              kernels=kernels_of(impl))


def _length_arms(lengths) -> list[tuple[int, str]]:
  """``(T, arm)`` of a prefill or backward stage: the longest T first, every baseline and
  KVM-XLA entry before any Pallas entry."""
  return baselines_first([(T, impl) for T in longest_first(lengths) for impl in prefill_arms()],
                         lambda e: is_pallas(e[1]))


def stage_prefill(rec: Recorder, ctx: Context) -> None:
  """Forward time at T = 4K..32K (longest first), B=8 (halved on out-of-memory, recorded)."""
  geo = ctx.geo
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  tasks = []
  for T, impl in _length_arms(geo.prefill_lengths):
    def run(T=T, impl=impl):
      skip = needs_gpu(impl)
      if skip:
        return skip

      def at(B):
        args = inputs(geo, B, T)
        t0 = time.perf_counter()
        compiled = jax.jit(prefill_fn(impl, cfg)).lower(*args).compile()
        compile_s = time.perf_counter() - t0
        ms, samples = median_ms(compiled, args, ctx.repeats)
        return {"ms": ms, "samples_ms": samples, "ms_per_seq": ms / B, "compile_s": compile_s}

      return with_batch_fallback(geo.batch, at)

    fields = _timing_fields(geo, impl, T)
    tasks.append(Task(f"{impl} T={T}", run, fields, kind=impl))
  rec.run(tasks)


def _decode_tokens(geo, n: int, key):
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  kq, kk, kv, kg = jax.random.split(key, 4)
  return (jax.random.normal(kq, (n, B, 1, H, D), dt),
          jax.random.normal(kk, (n, B, 1, H, D), dt),
          jax.random.normal(kv, (n, B, 1, H, D), dt),
          1.0 + jax.nn.elu(jax.random.normal(kg, (n, B, 1, H), jnp.float32)))


def _timed_loop(compiled, state, toks, repeats: int, restart=lambda s: s) -> tuple:
  """``(state, acc, samples_ms)``: one warm-up, then ``repeats`` timed calls of the jitted loop
  (``restart`` resets what the loop advanced, outside the timed region)."""
  state, _ = jax.block_until_ready(compiled(restart(state), toks))
  samples = []
  for _ in range(repeats):
    state = jax.block_until_ready(restart(state))
    start = time.perf_counter()
    state, acc = jax.block_until_ready(compiled(state, toks))
    samples.append((time.perf_counter() - start) * 1e3)
  return state, acc, samples


def _kvm_decode(ctx: Context, impl: str) -> dict:
  """``steps`` KVM decode steps from a cache of random contents at length ``context``."""
  geo = ctx.geo
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  T0, n = geo.decode_context, geo.decode_steps
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
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
                                    backend=kj.resolve_kvm_backend(cfg, implementation=impl))
      return cache, acc + jnp.sum(y.astype(jnp.float32))

    return jax.lax.fori_loop(0, n, body, (cache, jnp.float32(0)))

  cache = random_cache(jax.random.PRNGKey(0))
  toks = _decode_tokens(geo, n, jax.random.PRNGKey(1))
  t0 = time.perf_counter()
  compiled = jax.jit(loop, donate_argnums=(0,)).lower(cache, toks).compile()
  compile_s = time.perf_counter() - t0
  restart = lambda c: dataclasses.replace(c, length=jnp.asarray(T0, jnp.int32))
  cache, acc, samples = _timed_loop(compiled, cache, toks, ctx.repeats, restart)
  return {"ms_per_step": statistics.median(samples) / n, "samples_ms": samples,
          "compile_s": compile_s,
          "cache_bytes": sum(x.nbytes for x in jax.tree_util.tree_leaves(cache)),
          "finite": bool(jnp.isfinite(acc)), "state_rows": rows}


def _full_decode(ctx: Context, impl: str) -> dict:
  """``steps`` full-attention decode steps over a KV cache of random contents."""
  geo = ctx.geo
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  T0, n = geo.decode_context, geo.decode_steps
  kk, kv = jax.random.split(jax.random.PRNGKey(2))
  caches = (jax.random.normal(kk, (B, T0 + n, H, D), dt),
            jax.random.normal(kv, (B, T0 + n, H, D), dt))
  toks = _decode_tokens(geo, n, jax.random.PRNGKey(1))[:3]

  def loop(kv_cache, toks):
    qs, ks, vs = toks

    def body(i, carry):
      (kc, vc), acc = carry
      pos = T0 + i
      kc = jax.lax.dynamic_update_slice_in_dim(kc, ks[i], pos, axis=1)
      vc = jax.lax.dynamic_update_slice_in_dim(vc, vs[i], pos, axis=1)
      lengths = jnp.full((B,), pos + 1, jnp.int32)
      y = jax.nn.dot_product_attention(qs[i], kc, vc, key_value_seq_lengths=lengths,
                                       implementation=impl)
      return (kc, vc), acc + jnp.sum(y.astype(jnp.float32))

    return jax.lax.fori_loop(0, n, body, (kv_cache, jnp.float32(0)))

  t0 = time.perf_counter()
  compiled = jax.jit(loop, donate_argnums=(0,)).lower(caches, toks).compile()
  compile_s = time.perf_counter() - t0
  caches, acc, samples = _timed_loop(compiled, caches, toks, ctx.repeats)
  return {"ms_per_step": statistics.median(samples) / n, "samples_ms": samples,
          "compile_s": compile_s, "cache_bytes": int(sum(c.nbytes for c in caches)),
          "finite": bool(jnp.isfinite(acc))}


def stage_decode(rec: Recorder, ctx: Context) -> None:
  """``steps`` decode steps at a 32K context inside one jitted ``lax.fori_loop``: full attention
  over a 32K KV cache (cuDNN, XLA), then KVM xla, then KVM pallas (the KVM cache is filled with
  random contents of the right shapes, not by a real prefill)."""
  geo = ctx.geo
  T0, n = geo.decode_context, geo.decode_steps
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  folds = sum(1 for t in range(T0, T0 + n) if t % cfg.chunk_size == 0
              and t >= cfg.window_len + cfg.chunk_size)
  note = (f"KVM cache filled with random contents (length {T0}, {n} steps from there), not by a "
          f"real prefill; {folds} of the {n} steps folds a chunk into the state (one in every "
          f"{cfg.chunk_size} steps in a long decode)")
  tasks = []
  for impl in ("full-cudnn", "full-xla", "kvm-xla", "kvm-pallas"):
    def run(impl=impl):
      skip = needs_gpu(impl)
      if skip:
        return skip
      name = impl.split("-", 1)[1]
      return _kvm_decode(ctx, name) if impl.startswith("kvm-") else _full_decode(ctx, name)

    tasks.append(Task(impl, run, dict(
        impl=impl, B=geo.batch, H=geo.heads, D=geo.head_dim, context=T0, steps=n,
        dtype=geo.dtype, kernels=kernels_of(impl, DECODE_KERNELS),
        note=note if impl.startswith("kvm-") else "KV cache of random contents"), kind=impl))
  rec.run(tasks)


def stage_backward(rec: Recorder, ctx: Context) -> None:
  """Gradient memory (compiled ``memory_analysis``) and time at T = 8K..32K where it fits."""
  geo = ctx.geo
  B, H, D, dt = geo.batch, geo.heads, geo.head_dim, jnp.dtype(geo.dtype)
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  w = jnp.cos(jnp.arange(D, dtype=jnp.float32))
  limit = device_bytes_limit()
  tasks = []
  for T, impl in _length_arms(geo.backward_lengths):
    def run(T=T, impl=impl):
      skip = needs_gpu(impl)
      if skip:
        return skip
      f = prefill_fn(impl, cfg)
      argnums = (0, 1, 2) if impl in FULL_ARMS else (0, 1, 2, 3)
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
      args = inputs(geo, B, T)
      out["ms"], out["samples_ms"] = median_ms(compiled, args, ctx.repeats)
      return out

    fields = {**_timing_fields(geo, impl, T), "B": B}
    tasks.append(Task(f"{impl} T={T}", run, fields, kind=impl))
  rec.run(tasks)
