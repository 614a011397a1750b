"""``kvm-core-demo``: a one-minute tour of the KVM core (the main job is ``kvm-demo``).

Runs the KVM core on random data, on CPU, in well under a minute, and shows what the layer does:

1. the state-size schedule of the paper's three budgets (fixed 256, 16·√N, saturating 1024) next to
   the full-attention KV rows, for C = 256, L = 512;
2. one jitted prefill of ``--length`` tokens with a small power-law budget, its final state, and the
   agreement of the three implementations on it (oracle, chunked scan, prefill + decode);
3. state + window bytes of the decode cache measured from the arrays vs a full KV cache.
"""

from __future__ import annotations

import argparse
import sys
import time

import kvm_jax as kj  # its names import JAX on first use, after the arguments are parsed
from kvm_jax.util import compilation_cache


def _schedule_table(lengths) -> str:
  paper = dict(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64,
               max_state_rows=256 * 10000)
  budgets = {
      "fixed 256": kj.FixedBudget(256),
      "16*sqrt(N)": kj.PowerLawBudget(factor=16.0, exponent=0.5, min_rows=256),
      "sat 1024": kj.SaturatingBudget(limit=1024, min_rows=1),
  }
  rows = [f"{'tokens N':>9} {'full KV':>9} " + " ".join(f"{name:>11}" for name in budgets)]
  for n in lengths:
    cells = [kj.state_rows_after(kj.KVMConfig(budget=b, **paper), n) for b in budgets.values()]
    rows.append(f"{n:>9} {n:>9} " + " ".join(f"{c:>11}" for c in cells))
  return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-core-demo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--length", type=int, default=200,
                 help="tokens in the random sequence of part 2 (default: %(default)s)")
  p.add_argument("--chunk-size", type=int, default=16, help="C for part 2 (default: %(default)s)")
  p.add_argument("--window-chunks", type=int, default=2,
                 help="exact window in chunks for part 2 (default: %(default)s)")
  p.add_argument("--growth", type=float, default=4.0,
                 help="power-law budget factor for part 2: rows = factor * sqrt(tokens) "
                      "(default: %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="PRNG seed (default: %(default)s)")
  compilation_cache.add_flag(p)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  import jax
  import jax.numpy as jnp
  print(f"kvm_jax {kj.__version__} on {kj.current_platform()} (jax {jax.__version__})\n")
  print("1) State rows after N tokens (C=256, L=512; the paper's budgets, docs/kvm-spec.md §3):")
  print(_schedule_table([512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]))

  C = args.chunk_size
  cfg = kj.KVMConfig(chunk_size=C, window_chunks=args.window_chunks, sink_rows=1, rope_dims=8,
                     budget=kj.PowerLawBudget(factor=args.growth, exponent=0.5, min_rows=C))
  B, T, H, Hkv, D = 2, args.length, 4, 2, 32
  keys = jax.random.split(jax.random.PRNGKey(args.seed), 4)
  q = jax.random.normal(keys[0], (B, T, H, D))
  k = jax.random.normal(keys[1], (B, T, Hkv, D))
  v = jax.random.normal(keys[2], (B, T, Hkv, D))
  g = 1.0 + jax.nn.elu(jax.random.normal(keys[3], (B, T, Hkv)))
  params = kj.KVMParams.init(D, H)
  sched = kj.kvm_schedule(cfg, T)
  print(f"\n2) Random sequence: B={B} T={T} H={H} Hkv={Hkv} D={D}, C={C}, "
        f"L={cfg.window_len}, budget {args.growth}*sqrt(N) (min {C})")
  print("   rows while each query chunk attends: " + " ".join(map(str, sched.rows_before)))
  start = time.perf_counter()
  y, state = kj.kvm_attention(q, k, v, g, params, cfg)
  y.block_until_ready()
  print(f"   chunked scan: y {tuple(y.shape)}, final state {int(state.num_rows)} rows "
        f"({time.perf_counter() - start:.2f}s incl. compile)")
  y_ref, state_ref = kj.kvm_attention_reference(q, k, v, g, params, cfg)
  cache = kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D, value_dim=D, max_len=T)
  prefix = T // 3
  y_pre, cache = kj.kvm_prefill(q[:, :prefix], k[:, :prefix], v[:, :prefix], g[:, :prefix],
                                params, cfg, cache)
  step = jax.jit(kj.kvm_decode_step, static_argnames=("cfg",))
  outs = [y_pre]
  for t in range(prefix, T):
    y_t, cache = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], params, cfg,
                      cache)
    outs.append(y_t)
  y_dec = jnp.concatenate(outs, axis=1)
  err_ref = float(jnp.max(jnp.abs(y - y_ref)))
  err_dec = float(jnp.max(jnp.abs(y - y_dec)))
  n = int(state.num_rows)
  err_state = float(jnp.max(jnp.abs(state.keys[:, :, :n] - state_ref.keys)))
  print(f"   max |scan - oracle| = {err_ref:.2e} (state keys {err_state:.2e}); "
        f"max |scan - prefill({prefix})+decode| = {err_dec:.2e}")

  sizes = cache.nbytes()
  full = B * T * Hkv * D * 2 * 4
  print(f"\n3) Decode cache after {T} tokens (float32): state {sizes['state']:,} B (with its "
        f"normalized readout) + window {sizes['window']:,} B = {sizes['total']:,} B; "
        f"full-attention KV cache {full:,} B")
  ok = err_ref < 1e-4 and err_dec < 1e-4
  print("\nall three implementations agree" if ok else "\nMISMATCH between implementations")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
