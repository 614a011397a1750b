"""Measurement primitives of the speed benchmarks (``kvm-bench``, ``kvm-bench-core``): wall-time
medians after warm-up, per-step decode timings of KVM, of full attention over a preallocated KV
cache and of the OVQ and RWKV-7 baselines (with XLA's count of the bytes the compiled step
accesses), and the strongest stock attention per backend. No timing is ever asserted in a test;
the benchmarks print ratios against a baseline measured in the same run."""

from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from kvm_jax.ops.attention.api import resolve_attention
from kvm_jax.ops.kvm.api import kvm_decode_step, kvm_prefill, resolve_kvm_backend
from kvm_jax.ops.kvm.decode import cached_readout, decode_attention, kvm_init_cache
from kvm_jax.ops.kvm.state import temperatures
from kvm_jax.ops.ovq.decode import ovq_decode_step, ovq_init_cache, ovq_prefill
from kvm_jax.ops.rwkv7.scan import rwkv7_recurrence, rwkv7_step


def wall_ms(fn, *args) -> float:
  """Wall time in ms of one call of ``fn(*args)``, its outputs blocked on."""
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - start) * 1e3


def sample_ms(fn, *args, repeats: int, warmup: int = 1) -> list[float]:
  """Wall times in ms of ``repeats`` calls of ``fn(*args)`` (outputs blocked on) after ``warmup``
  calls."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  return [wall_ms(fn, *args) for _ in range(repeats)]


def interleaved_times(arms: dict[str, Callable[[], object]], repeats: int
                      ) -> dict[str, list[float]]:
  """Every round's ms of each zero-argument ``arms`` function (outputs blocked on), after one
  warm-up call each, the arms timed in turn within every round, so that a shared machine's drift
  lands on all arms alike."""
  for fn in arms.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in arms}
  for _ in range(repeats):
    for name, fn in arms.items():
      times[name].append(wall_ms(fn))
  return times


def median_ms(fn, *args, repeats: int, warmup: int = 1) -> float:
  """Median wall time in ms of ``fn(*args)`` (outputs blocked on) after ``warmup`` calls."""
  return statistics.median(sample_ms(fn, *args, repeats=repeats, warmup=warmup))


def full_attention_impl(q) -> str:
  """``jax.nn.dot_product_attention``'s implementation for the full-attention baseline at
  queries ``q`` (an array or ``jax.ShapeDtypeStruct``, ``[B, T, H, D]``): "cudnn" where the
  library's one backend decision (:func:`kvm_jax.ops.attention.api.resolve_attention`) takes
  cuDNN for them (GPU, bf16/fp16 heads it supports), else "xla", the function's other one."""
  return "cudnn" if resolve_attention("auto", q) == "cudnn" else "xla"


@functools.partial(jax.jit, donate_argnums=(3, 4), static_argnames=("implementation",))
def full_decode_step(q_t, k_t, v_t, k_cache, v_cache, position, implementation="xla"):
  """Full attention decode: write token ``position`` into the cache, attend over [0, position]."""
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_t, position, axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_t, position, axis=1)
  lengths = jnp.full((q_t.shape[0],), position + 1, jnp.int32)
  y = jax.nn.dot_product_attention(q_t, k_cache, v_cache, key_value_seq_lengths=lengths,
                                   implementation=implementation)
  return y, k_cache, v_cache


def bytes_accessed(compiled) -> Optional[float]:
  """XLA's "bytes accessed" of a compiled program (``jax.stages.Compiled``), or None where the
  backend reports no cost analysis. ``cost_analysis()`` is a dict in current JAX and was a list
  holding one dict per program in older versions (the first is the program's)."""
  try:
    costs = compiled.cost_analysis()
  except NotImplementedError:
    return None
  if isinstance(costs, (list, tuple)):
    costs = costs[0] if costs else None
  if not costs or costs.get("bytes accessed") is None:
    return None
  return float(costs["bytes accessed"])


def timed_steps(step, token_args, carry, T, n):
  """Per-step wall times (ms) of ``carry = step(*token_args(t), carry)`` for t in [T, T+n).

  Two warm-up steps run on a copy, so the timed run starts exactly at position T.
  """
  warm = jax.tree_util.tree_map(jnp.copy, carry)
  for t in range(T, T + 2):
    _, warm = step(*token_args(t), warm)
  jax.block_until_ready(warm)
  times = []
  for t in range(T, T + n):
    args_t = jax.block_until_ready(token_args(t))
    start = time.perf_counter()
    y, carry = step(*args_t, carry)
    jax.block_until_ready(y)
    times.append((time.perf_counter() - start) * 1e3)
  return times, carry


def time_kvm_decode(cfg, params, q, k, v, g, T: int, n: int, implementation: str = "xla",
                    return_bytes_accessed: bool = False):
  """(per-step ms, final cache) of n KVM decode steps after prefilling T tokens, plus
  :func:`bytes_accessed` of the compiled step when ``return_bytes_accessed``.

  The step is compiled once, ahead of time, and that executable is both timed and costed."""
  B, _, H, D = q.shape
  cache = kvm_init_cache(cfg, batch=B, kv_heads=k.shape[2], head_dim=D, value_dim=v.shape[3],
                         max_len=T + n, dtype=q.dtype)
  backend = resolve_kvm_backend(cfg, implementation=implementation)
  _, cache = kvm_prefill(q[:, :T], k[:, :T], v[:, :T], g[:, :T], params, cfg, cache,
                         backend=backend)
  step = jax.jit(lambda q, k, v, g, c: kvm_decode_step(q, k, v, g, params, cfg, c,
                                                       backend=backend),
                 donate_argnums=(4,))
  token = lambda t: (q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1])
  compiled = step.lower(*token(T), cache).compile()
  accessed = None
  if return_bytes_accessed:
    accessed = {"step": bytes_accessed(compiled),
                "attend": attend_bytes_accessed(cfg, params, q[:, T:T + 1], cache)}
  times, cache = timed_steps(compiled, token, cache, T, n)
  return (times, cache, accessed) if return_bytes_accessed else (times, cache)


def attend_bytes_accessed(cfg, params, q_t, cache) -> Optional[float]:
  """XLA's bytes accessed by the XLA path's attention of one token over the cache (the cached
  readout and the ring; no fold, no ring write): what every step moves between folds. (The
  compiled step counts both branches of its fold conditional, so its figure is not the
  steady state.)"""
  H, Hkv = q_t.shape[2], cache.window_keys.shape[2]

  def attend(q_t, cache):
    state_keys, state_values = cached_readout(cache, cfg, H // Hkv)
    return decode_attention(q_t, state_keys, state_values, cache.state.num_rows,
                            cache.window_keys, cache.window_values, cache.length,
                            *temperatures(params, cfg, Hkv), cfg)

  return bytes_accessed(jax.jit(attend).lower(q_t, cache).compile())


def time_full_decode(q, k, v, T: int, n: int, return_bytes_accessed: bool = False):
  """(per-step ms, KV-cache bytes at T) of n full-attention decode steps after T tokens, plus
  :func:`bytes_accessed` of the compiled step (compiled once, timed and costed) when
  ``return_bytes_accessed``."""
  B, _, H, D = k.shape
  impl = full_attention_impl(q)
  caches = (jnp.zeros((B, T + n, H, D), k.dtype).at[:, :T].set(k[:, :T]),
            jnp.zeros((B, T + n, H, v.shape[3]), v.dtype).at[:, :T].set(v[:, :T]))

  token = lambda t: (q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], t)
  compiled = full_decode_step.lower(*token(T)[:3], *caches, jnp.int32(T),
                                    implementation=impl).compile()

  def step(q_t, k_t, v_t, t, kv):
    y, k_cache, v_cache = compiled(q_t, k_t, v_t, *kv, jnp.int32(t))
    return y, (k_cache, v_cache)

  times, _ = timed_steps(step, token, caches, T, n)
  cache_bytes = int(k[:, :T].nbytes + v[:, :T].nbytes)
  if return_bytes_accessed:
    return times, cache_bytes, bytes_accessed(compiled)
  return times, cache_bytes


def time_ovq_decode(cfg, q, k, v, beta, T: int, n: int):
  """(per-step ms, final cache, :func:`bytes_accessed` of the compiled step) of n OVQ decode steps
  after prefilling T tokens (``q``, ``k`` L2-normalized ``[B, T + n, H, D]``)."""
  B, _, H, D = q.shape
  cache = ovq_init_cache(cfg, batch=B, heads=H, head_dim=D, value_dim=v.shape[3], max_len=T + n)
  _, cache = jax.jit(ovq_prefill, static_argnums=4)(q[:, :T], k[:, :T], v[:, :T], beta, cfg,
                                                    cache)
  step = jax.jit(lambda q, k, v, c: ovq_decode_step(q, k, v, beta, cfg, c), donate_argnums=(3,))
  token = lambda t: (q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
  compiled = step.lower(*token(T), cache).compile()
  times, cache = timed_steps(compiled, token, cache, T, n)
  return times, cache, bytes_accessed(compiled)


def time_rwkv7_decode(inputs, T: int, n: int, chunk_size: int = 64):
  """(per-step ms, final state, :func:`bytes_accessed` of the compiled step) of n RWKV-7
  recurrence steps after a chunk-parallel prefill of T tokens (``inputs``: r, w, k, v, a, b
  ``[B, T + n, H, ·]``)."""
  _, state = jax.jit(rwkv7_recurrence, static_argnames="chunk_size")(
      *(x[:, :T] for x in inputs), chunk_size=chunk_size)
  step = jax.jit(rwkv7_step, donate_argnums=(6,))
  token = lambda t: tuple(x[:, t] for x in inputs)
  compiled = step.lower(*token(T), state).compile()
  times, state = timed_steps(compiled, token, state, T, n)
  return times, state, bytes_accessed(compiled)
