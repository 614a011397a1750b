"""``kvm-check``: verify the KVM implementations against each other on this machine's backend.

    kvm-check                 # small shapes, a few seconds on CPU (kernels interpreted)
    kvm-check --size paper    # C=256, D=128, T=2048: run this on a GPU/TPU to verify the kernels

For each configuration (budgets, sinks, GQA, float32 and bfloat16) it runs, jitted, on the same
inputs:

* **oracle** — ``kvm_attention_reference``, token-level loops in the authors' layout;
* **xla** — the chunked ``lax.scan`` (``implementation="xla"``);
* **pallas** — the same scan with the fused readout and routing/update kernels (native on
  GPU/TPU, interpret mode elsewhere);
* **decode** — ``kvm_prefill`` of the first half, then ``kvm_decode_step`` token by token with
  the Pallas kernels;

and prints, per pair, the relative RMS error of the outputs and final state, whether the routing
decisions (appended tokens, merge targets) agree exactly, and the relative error of the Pallas
gradients against the XLA path's, with the tolerance used and PASS/FAIL. The exit status is 1 if
anything fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import kvm_jax as kj
from kvm_jax.ops.kvm import kvm_attention_xla

# Relative RMS tolerances. float32: different summation orders only (observed <= 1e-6).
# bfloat16: activations, probabilities and outputs are rounded to bf16 (2^-9 relative) at the same
# points on every path, but the differently ordered sums move individual roundings.
TOLERANCE = {"float32": {"output": 2e-5, "grad": 1e-4},
             "bfloat16": {"output": 2e-2, "grad": 5e-2}}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  cfg: kj.KVMConfig
  batch: int
  seq_len: int
  heads: int
  kv_heads: int
  head_dim: int
  dtype: str


def cases(size: str) -> list[Case]:
  if size == "small":
    geometry = dict(chunk_size=8, window_chunks=2, rope_dims=8)
    shape = dict(batch=2, seq_len=75, head_dim=16)
    fixed, sqrt = kj.FixedBudget(12), kj.PowerLawBudget(4.0, 0.5, min_rows=8)
  else:  # the paper's operator geometry
    geometry = dict(chunk_size=256, window_chunks=2, rope_dims=64)
    shape = dict(batch=1, seq_len=2048, head_dim=128)
    fixed, sqrt = kj.FixedBudget(256), kj.PowerLawBudget(16.0, 0.5, min_rows=256)
  mk = lambda name, budget, sink, H, Hkv, dtype: Case(
      name, kj.KVMConfig(**geometry, sink_rows=sink, budget=budget), heads=H, kv_heads=Hkv,
      dtype=dtype, **shape)
  return [mk("fixed, sink 1", fixed, 1, 4, 4, "float32"),
          mk("sqrt16, GQA 4:2", sqrt, 1, 4, 2, "float32"),
          mk("sqrt16, no sink, MQA", sqrt, 0, 4, 1, "float32"),
          mk("fixed, GQA, bf16", fixed, 1, 4, 2, "bfloat16")]


def _inputs(case: Case, seed: int = 0):
  B, T, H, Hkv, D = case.batch, case.seq_len, case.heads, case.kv_heads, case.head_dim
  ks = jax.random.split(jax.random.PRNGKey(seed), 8)
  dtype = jnp.dtype(case.dtype)
  q = jax.random.normal(ks[0], (B, T, H, D)).astype(dtype)
  k = jax.random.normal(ks[1], (B, T, Hkv, D)).astype(dtype)
  v = jax.random.normal(ks[2], (B, T, Hkv, D)).astype(dtype)
  g = 1.0 + jax.nn.elu(jax.random.normal(ks[3], (B, T, Hkv)))
  params = kj.KVMParams(ln_scale=1.0 + 0.2 * jax.random.normal(ks[4], (D,)),
                        ln_bias=0.2 * jax.random.normal(ks[5], (D,)),
                        window_temperature=1.0 + 0.3 * jax.random.uniform(ks[6], (H,), minval=-1),
                        state_temperature=1.0 + 0.3 * jax.random.uniform(ks[7], (H,), minval=-1))
  return q, k, v, g, params


def rel_rms(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b * b)), 1e-30))


def _state_error(s, ref) -> float:
  n = int(ref.num_rows)
  if int(s.num_rows) != n:
    return float("inf")
  return max(rel_rms(getattr(s, f)[:, :, :n], getattr(ref, f)[:, :, :n])
             for f in ("keys", "values", "radius"))


def check_case(case: Case, grads: bool = True) -> list[dict]:
  """One row per comparison: ``{"case", "pair", "output", "state", "routing", "tolerance", "ok"}``."""
  q, k, v, g, params = _inputs(case)
  cfg, tol = case.cfg, TOLERANCE[case.dtype]
  rows = []
  timings = {}

  def timed(name, fn):
    jax.block_until_ready(fn())  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    timings[name] = time.perf_counter() - t0
    return out

  oracle_y, oracle_state = timed("oracle", lambda: kj.kvm_attention_reference(q, k, v, g, params, cfg))
  xla_y, xla_state, xla_routing = timed("xla", lambda: kvm_attention_xla(
      q, k, v, g, params, cfg=cfg, return_routing=True))
  pal_y, pal_state, pal_routing = timed("pallas", lambda: kvm_attention_xla(
      q, k, v, g, params, cfg=cfg, return_routing=True, implementation="pallas"))
  routing_same = all(bool(jnp.all(a == b)) for a, b in zip(xla_routing, pal_routing))

  half = case.seq_len // 2
  cache = kj.kvm_init_cache(cfg, batch=case.batch, kv_heads=case.kv_heads,
                            head_dim=case.head_dim, value_dim=case.head_dim,
                            max_len=case.seq_len)
  y0, cache = kj.kvm_prefill(q[:, :half], k[:, :half], v[:, :half], g[:, :half], params, cfg,
                             cache, implementation="pallas")
  outs = [y0]
  for t in range(half, case.seq_len):
    s = slice(t, t + 1)
    y_t, cache = kj.kvm_decode_step(q[:, s], k[:, s], v[:, s], g[:, s], params, cfg, cache,
                                    implementation="pallas")
    outs.append(y_t)
  decode_y = jnp.concatenate(outs, axis=1)

  def row(pair, y, ref_y, state, ref_state, routing="-"):
    out_err = rel_rms(jnp.asarray(y, jnp.float32), jnp.asarray(ref_y, jnp.float32))
    state_err = _state_error(state, ref_state) if state is not None else float("nan")
    ok = out_err <= tol["output"] and not state_err > tol["output"] and routing in ("-", "same")
    rows.append({"case": case.name, "pair": pair, "output": out_err, "state": state_err,
                 "routing": routing, "tolerance": tol["output"], "ok": ok})

  row("oracle vs xla", xla_y, oracle_y, xla_state, oracle_state)
  row("xla vs pallas", pal_y, xla_y, pal_state, xla_state,
      "same" if routing_same else "DIFFERENT")
  row("pallas vs prefill+decode", decode_y, pal_y, cache.state, pal_state)

  if grads:
    w = jnp.cos(jnp.arange(case.head_dim, dtype=jnp.float32))

    def loss(impl):
      return lambda *a: jnp.sum(kvm_attention_xla(*a, cfg=cfg, implementation=impl)[0]
                                .astype(jnp.float32) * w)

    gx = jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
    gp = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
    err = max(rel_rms(a, b) for a, b in zip(jax.tree_util.tree_leaves(gp),
                                            jax.tree_util.tree_leaves(gx)))
    rows.append({"case": case.name, "pair": "grads xla vs pallas", "output": err,
                 "state": float("nan"), "routing": "-", "tolerance": tol["grad"],
                 "ok": err <= tol["grad"]})
  rows[0]["timings"] = timings
  return rows


def format_table(rows: Sequence[dict]) -> str:
  head = (f"{'case':<24} {'comparison':<26} {'output rel':>11} {'state rel':>10} "
          f"{'routing':>9} {'tol':>7}  result")
  lines = [head, "-" * len(head)]
  for r in rows:
    state = "-" if np.isnan(r["state"]) else f"{r['state']:.2e}"
    lines.append(f"{r['case']:<24} {r['pair']:<26} {r['output']:>11.2e} {state:>10} "
                 f"{r['routing']:>9} {r['tolerance']:>7.0e}  {'PASS' if r['ok'] else 'FAIL'}")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="kvm-check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=["small", "paper"], default="small",
                 help="small: C=8, D=16, T=75 (seconds, any machine); paper: C=256, D=128, "
                      "T=2048 (for GPU/TPU)")
  p.add_argument("--no-grads", action="store_true", help="skip the gradient comparison")
  p.add_argument("--cases", default="",
                 help="comma-separated case numbers to run (1-based; default: all)")
  args = p.parse_args(argv)
  from pallas_kernels import backend
  all_cases = cases(args.size)
  chosen = all_cases
  if args.cases:
    try:
      chosen = [all_cases[int(i) - 1] for i in args.cases.split(",") if i]
    except (ValueError, IndexError):
      raise SystemExit(f"--cases: expected numbers in 1..{len(all_cases)}, got {args.cases!r}")
  mode = "interpret mode" if backend.default_interpret() else "compiled"
  print(f"kvm-check on {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
        f"{jax.__version__}; Pallas kernels {mode}; size {args.size}", flush=True)
  rows = []
  for case in chosen:
    case_rows = check_case(case, grads=not args.no_grads)
    rows.extend(case_rows)
    times = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in case_rows[0]["timings"].items())
    print(f"  checked: {case.name} (T={case.seq_len}, C={case.cfg.chunk_size}, "
          f"D={case.head_dim}, {case.dtype}); jitted run after compile: {times}", flush=True)
  print(format_table(rows))
  failed = [r for r in rows if not r["ok"]]
  print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed"
        + ("" if not failed else f"; FAILED: {[(r['case'], r['pair']) for r in failed]}"))
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
