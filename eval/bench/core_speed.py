"""Operator-level speed of the KVM core vs full causal attention, measured in one run.

Both arms take q/k/v in ``[batch, time, heads, dim]`` (projections, RoPE and output projection
excluded, as in the authors' benchmark, docs/kvm-spec.md §10):

* prefill: ``kvm_attention`` forward vs ``jax.nn.dot_product_attention(is_causal=True)``
  (cuDNN on GPU, XLA elsewhere);
* decode: one token after a context of T tokens, ``kvm_decode_step`` on a KVM cache vs a full
  attention step that writes the token into a preallocated KV cache and attends over it. KVM's
  figure is the mean over ``--decode-steps`` consecutive steps starting at position T, which
  includes the state update that fires at the chunk boundary (amortized, as a user would see it);
  the median step and the update step are printed too.

Run ``kvm-bench-core --help``. Defaults: C=256, L=512, fixed 256 rows, B=1, H=4, D=64, float32
(a CPU-sized setup; ``kvm-bench`` covers more lengths, budgets and the paper's shapes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import kvm_jax as kj  # its names import JAX on first use, after the arguments are parsed
from kvm_jax.util import compilation_cache

# JAX and the timing helpers are imported by the functions that use them: --help needs neither.


def bench_prefill(T, args, cfg, params, dtype):
  import jax
  from kvm_jax.eval.bench.timing import full_attention_impl, median_ms
  from kvm_jax.ops.kvm.cases import random_inputs
  q, k, v, g = random_inputs(T, args.batch, T, args.heads, args.heads, args.head_dim,
                             args.head_dim, dtype)
  kvm = jax.jit(lambda q, k, v, g: kj.kvm_attention(q, k, v, g, params, cfg)[0])
  full = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=full_attention_impl(q)))
  t_kvm = median_ms(kvm, q, k, v, g, repeats=args.repeats)
  t_full = median_ms(full, q, k, v, repeats=args.repeats)
  return t_kvm, t_full


def bench_decode(T, args, cfg, params, dtype):
  from kvm_jax.eval.bench.timing import time_full_decode, time_kvm_decode
  from kvm_jax.ops.kvm.cases import random_inputs
  n = args.decode_steps
  q, k, v, g = random_inputs(T + 1, args.batch, T + n, args.heads, args.heads, args.head_dim,
                             args.head_dim, dtype)
  kvm_steps, cache = time_kvm_decode(cfg, params, q, k, v, g, T, n)
  full_steps, full_bytes = time_full_decode(q, k, v, T, n)
  return {
      "kvm_mean_ms": statistics.fmean(kvm_steps), "kvm_median_ms": statistics.median(kvm_steps),
      "kvm_max_ms": max(kvm_steps), "full_mean_ms": statistics.fmean(full_steps),
      "full_median_ms": statistics.median(full_steps), "kvm_cache_bytes": cache.nbytes()["total"],
      "full_cache_bytes_at_T": full_bytes,
  }


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="kvm-bench-core", description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", default="2048,8192,16384",
                 help="comma-separated prefill lengths T (default: %(default)s)")
  p.add_argument("--decode-context", type=int, default=16384,
                 help="context length before the timed decode steps (default: %(default)s)")
  p.add_argument("--decode-steps", type=int, default=256,
                 help="consecutive decode steps timed after the context; 256 = one chunk, so "
                      "exactly one state update is included (default: %(default)s)")
  p.add_argument("--batch", type=int, default=1, help="batch size B (default: %(default)s)")
  p.add_argument("--heads", type=int, default=4, help="heads H = Hkv (default: %(default)s)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim D = Dv (default: %(default)s)")
  p.add_argument("--chunk-size", type=int, default=256, help="KVM chunk C (default: %(default)s)")
  p.add_argument("--window-chunks", type=int, default=2,
                 help="exact window in chunks, L = C * this (default: %(default)s)")
  p.add_argument("--state-rows", type=int, default=256,
                 help="FixedBudget rows (default: %(default)s)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="activation dtype (default: %(default)s)")
  p.add_argument("--repeats", type=int, default=5,
                 help="timed repetitions per prefill measurement; the median is reported "
                      "(default: %(default)s)")
  p.add_argument("--json", default=None, help="also write the results to this JSON file")
  compilation_cache.add_flag(p)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  import jax
  import jax.numpy as jnp
  from kvm_jax.eval.bench.speed import bench_rope_dims
  dtype = jnp.dtype(args.dtype)
  cfg = kj.KVMConfig(chunk_size=args.chunk_size, window_chunks=args.window_chunks, sink_rows=1,
                     rope_dims=bench_rope_dims(args.head_dim),
                     budget=kj.FixedBudget(rows=args.state_rows))
  params = kj.KVMParams.init(args.head_dim, args.heads)
  print(f"device: {jax.devices()[0].device_kind} ({kj.current_platform()}), jax {jax.__version__}; "
        f"B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}; C={cfg.chunk_size} "
        f"L={cfg.window_len} fixed {args.state_rows} rows")
  results = {"prefill": [], "decode": None, "setup": vars(args)}
  lengths = [int(x) for x in args.lengths.split(",") if x]
  if lengths:
    print(f"\n{'prefill T':>10} {'KVM ms':>10} {'full ms':>10} {'speed-up':>9}")
  for T in lengths:
    t_kvm, t_full = bench_prefill(T, args, cfg, params, dtype)
    results["prefill"].append({"T": T, "kvm_ms": t_kvm, "full_ms": t_full})
    print(f"{T:>10} {t_kvm:>10.2f} {t_full:>10.2f} {t_full / t_kvm:>8.2f}x", flush=True)
  if args.decode_context > 0:
    d = bench_decode(args.decode_context, args, cfg, params, dtype)
    results["decode"] = d
    T = args.decode_context
    print(f"\ndecode after T={T} ({args.decode_steps} steps; KVM mean includes the chunk-boundary "
          f"update)")
    print(f"  KVM  mean {d['kvm_mean_ms']:.3f} ms  median {d['kvm_median_ms']:.3f} ms  "
          f"update step {d['kvm_max_ms']:.3f} ms")
    print(f"  full mean {d['full_mean_ms']:.3f} ms  median {d['full_median_ms']:.3f} ms")
    print(f"  speed-up (mean) {d['full_mean_ms'] / d['kvm_mean_ms']:.2f}x   "
          f"(median) {d['full_median_ms'] / d['kvm_median_ms']:.2f}x")
    print(f"  cache bytes: KVM {d['kvm_cache_bytes']:,} (state + window, measured from the arrays)"
          f" vs full KV {d['full_cache_bytes_at_T']:,}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
