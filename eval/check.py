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
gradients against the XLA path's, with the tolerance used and PASS/FAIL, and why each FAIL failed.
A NaN or inf error is a FAIL. The exit status is 1 if anything fails.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.kernels.backend import default_interpret
from kvm_jax.ops.common import current_platform
from kvm_jax.ops.kvm.api import chunk_ops, kvm_decode_step, kvm_prefill
from kvm_jax.ops.kvm.cases import Case, rel_rms, select, state_rel_error
from kvm_jax.ops.kvm.decode import kvm_init_cache
from kvm_jax.ops.kvm.reference import kvm_attention_reference
from kvm_jax.ops.kvm.scan import XLA_OPS, kvm_attention_scan

SIZES = ("small", "paper")


def cases(size: str) -> list[Case]:
  """The cases ``kvm-check --size size`` runs (tagged ``check-<size>`` in the shared matrix)."""
  if size not in SIZES:
    raise ValueError(f"size={size!r}; choose from {SIZES}.")
  return select(f"check-{size}")


def worst(errors) -> float:
  """The largest of ``errors``, NaN if any is NaN. Python's ``max`` keeps whichever of a NaN and a
  number comes first (every comparison with NaN is false), so it can hide a NaN; ``np.max``
  propagates it."""
  return float(np.max(np.asarray(list(errors), np.float64)))


def verdict(output: float, state: Optional[float], tolerance: float,
            routing: str = "-") -> tuple[bool, str]:
  """``(ok, why)`` of one comparison; ``why`` says what failed ("" when it passes).

  Each error must be finite and within ``tolerance``: a NaN or inf error fails, because it means
  a result held NaN/inf (or, for the state, the row counts differed), never agreement. Written as
  ``err <= tolerance`` after a finiteness test, not ``not err > tolerance``, which a NaN passes.
  ``state=None``: no state was compared (gradient rows). ``routing``: "-" (not compared), "same"
  or anything else (a routing difference, which fails)."""
  problems = []
  for name, err in (("output", output), ("state", state)):
    if err is None:
      continue
    if math.isnan(err):
      problems.append(f"{name} error is NaN (NaN in a result)")
    elif math.isinf(err):
      cause = "the state row counts differ" if name == "state" else "inf in a result"
      problems.append(f"{name} error is inf ({cause})")
    elif not err <= tolerance:
      problems.append(f"{name} error {err:.2e} exceeds the tolerance {tolerance:.0e}")
  if routing not in ("-", "same"):
    problems.append(f"routing decisions {routing}")
  return not problems, "; ".join(problems)


def make_row(case: str, pair: str, output: float, state: Optional[float], tolerance: float,
             routing: str = "-") -> dict:
  """One row of the table: ``{"case", "pair", "output", "state", "routing", "tolerance", "ok",
  "why"}`` (``state`` None where no state is compared)."""
  ok, why = verdict(output, state, tolerance, routing)
  return {"case": case, "pair": pair, "output": output, "state": state, "routing": routing,
          "tolerance": tolerance, "ok": ok, "why": why}


def check_case(case: Case, grads: bool = True) -> list[dict]:
  """One row per comparison (see :func:`make_row`); the first also holds the run ``timings``."""
  q, k, v, g, params = case.inputs()
  cfg, tol = case.cfg, case.tolerance
  pallas = chunk_ops("pallas")
  rows = []
  timings = {}

  def timed(name, fn):
    jax.block_until_ready(fn())  # compile
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    timings[name] = time.perf_counter() - t0
    return out

  oracle_y, oracle_state = timed("oracle", lambda: kvm_attention_reference(q, k, v, g, params, cfg))
  xla_y, xla_state, xla_routing = timed("xla", lambda: kvm_attention_scan(
      q, k, v, g, params, cfg=cfg, return_routing=True))
  pal_y, pal_state, pal_routing = timed("pallas", lambda: kvm_attention_scan(
      q, k, v, g, params, cfg=cfg, ops=pallas, return_routing=True))
  routing_same = all(bool(jnp.all(a == b)) for a, b in zip(xla_routing, pal_routing))

  half = case.seq_len // 2
  cache = kvm_init_cache(cfg, batch=case.batch, kv_heads=case.kv_heads, head_dim=case.head_dim,
                         value_dim=case.value_dim, max_len=case.seq_len)
  y0, cache = kvm_prefill(q[:, :half], k[:, :half], v[:, :half], g[:, :half], params, cfg,
                          cache, implementation="pallas")
  outs = [y0]
  for t in range(half, case.seq_len):
    s = slice(t, t + 1)
    y_t, cache = kvm_decode_step(q[:, s], k[:, s], v[:, s], g[:, s], params, cfg, cache,
                                 implementation="pallas")
    outs.append(y_t)
  decode_y = jnp.concatenate(outs, axis=1)

  def row(pair, y, ref_y, state, ref_state, routing="-"):
    out_err = rel_rms(jnp.asarray(y, jnp.float32), jnp.asarray(ref_y, jnp.float32))
    rows.append(make_row(case.name, pair, out_err, state_rel_error(state, ref_state),
                         tol["output"], routing))

  row("oracle vs xla", xla_y, oracle_y, xla_state, oracle_state)
  row("xla vs pallas", pal_y, xla_y, pal_state, xla_state,
      "same" if routing_same else "DIFFERENT")
  row("pallas vs prefill+decode", decode_y, pal_y, cache.state, pal_state)

  if grads:
    w = jnp.cos(jnp.arange(case.head_dim, dtype=jnp.float32))

    def loss(ops):
      return lambda *a: jnp.sum(kvm_attention_scan(*a, cfg=cfg, ops=ops)[0]
                                .astype(jnp.float32) * w)

    gx = jax.jit(jax.grad(loss(XLA_OPS), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
    gp = jax.jit(jax.grad(loss(pallas), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
    err = worst(rel_rms(a, b) for a, b in zip(jax.tree_util.tree_leaves(gp),
                                              jax.tree_util.tree_leaves(gx)))
    rows.append(make_row(case.name, "grads xla vs pallas", err, None, tol["grad"]))
  rows[0]["timings"] = timings
  return rows


def format_table(rows: Sequence[dict]) -> str:
  width = max([24] + [len(r["case"]) for r in rows])
  head = (f"{'case':<{width}} {'comparison':<26} {'output rel':>11} {'state rel':>10} "
          f"{'routing':>9} {'tol':>7}  result")
  lines = [head, "-" * len(head)]
  for r in rows:
    state = "-" if r["state"] is None else f"{r['state']:.2e}"
    lines.append(f"{r['case']:<{width}} {r['pair']:<26} {r['output']:>11.2e} {state:>10} "
                 f"{r['routing']:>9} {r['tolerance']:>7.0e}  {'PASS' if r['ok'] else 'FAIL'}")
  return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = argparse.ArgumentParser(prog="kvm-check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=SIZES, default="small",
                 help="small: C=8, D=16, T=75 (seconds, any machine); paper: C=256, D=128, "
                      "T=2048 (for GPU/TPU)")
  p.add_argument("--no-grads", action="store_true", help="skip the gradient comparison")
  p.add_argument("--cases", default="",
                 help="comma-separated case numbers to run (1-based; default: all)")
  args = p.parse_args(argv)
  all_cases = cases(args.size)
  chosen = all_cases
  if args.cases:
    try:
      chosen = [all_cases[int(i) - 1] for i in args.cases.split(",") if i]
    except (ValueError, IndexError):
      raise SystemExit(f"--cases: expected numbers in 1..{len(all_cases)}, got {args.cases!r}")
  mode = "interpret mode" if default_interpret() else "compiled"
  print(f"kvm-check on {jax.devices()[0].device_kind} ({current_platform()}), jax "
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
  print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed")
  for r in failed:
    print(f"FAIL {r['case']} / {r['pair']}: {r.get('why') or 'marked failed'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
