"""``kvm-check``: verify the KVM implementations against each other on this machine's backend,
and the OVQ and RWKV-7 baselines' fast paths against their oracles.

    kvm-check                 # small shapes, a few seconds on CPU (kernels interpreted)
    kvm-check --size paper    # C=256, D=128, T=2048: run this on a GPU/TPU to verify the kernels
    kvm-check --ops ovq,rwkv7 # only the baselines
    kvm-check --ops "" --kinds all             # every registered mixer kind's model checks
    kvm-check --plugin my_kind.py --kinds mine # a kind registered from outside the package
    kvm-check --target v5e:2x2                 # compile every kernel and op for a TPU v5e
    kvm-check --target h100:1x8 --programs kernels   # the kernels only, for an H100

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

For OVQ (``kvm_jax.ops.ovq``) it compares the oracle with the chunked scan (outputs, the final
dictionary, counts exactly), the scan with prefill + one-token decode, and the gradients of the
scan with the oracle's; for RWKV-7's recurrence (``kvm_jax.ops.rwkv7``) the per-token oracle with
the chunk-parallel form, the chunk-parallel prefill plus one-token steps with the whole sequence,
and the gradients (of every input and the initial state).

``--kinds`` checks whole models of each named mixer kind (any registered one, ``--plugin`` ones
included): forward against prefill + decode, against prefill + parallel pieces, and packed
documents against each alone, as far as the kind's class says it can (``kvm_jax.eval.kind_check``).

``--target`` checks a chip before renting it: it compiles (without running) every kernel and op
of ``kvm_jax.eval.chip_check`` for a TPU topology (``v5e:2x2``, ``v5p:2x2x1``, ``v6e:2x2``) or a
GPU (``h100:1x8``, ``h200:1x8``, ``b200:1x8``) on this machine, and prints one line per program:
compiles (seconds, bytes per chip: arguments, temporaries, outputs, and whether they fit the
chip's memory) or FAILS with the compiler's reason. It needs the compilers, not the chip:
``pip install "kvm_jax[compile]"``. A compile proves the program valid for the chip and its
memory; it says nothing of speed or of numerics on the chip. The exit status is 1 if a program
fails or does not fit.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence

from kvm_jax.util import compilation_cache
from kvm_jax.util import plugins

# JAX and the ops are imported by the functions that use them, so that --help and a bad flag
# answer without them (a test patches an op where it is defined, which these imports then read).
if TYPE_CHECKING:
  from kvm_jax.ops.kvm.cases import Case
  from kvm_jax.ops.ovq import cases as ovq_cases
  from kvm_jax.ops.rwkv7 import cases as rwkv7_cases

SIZES = ("small", "paper")


def cases(size: str) -> list[Case]:
  """The cases ``kvm-check --size size`` runs (tagged ``check-<size>`` in the shared matrix)."""
  from kvm_jax.ops.kvm.cases import select
  if size not in SIZES:
    raise ValueError(f"size={size!r}; choose from {SIZES}.")
  return select(f"check-{size}")


def worst(errors) -> float:
  """The largest of ``errors``, NaN if any is NaN. Python's ``max`` keeps whichever of a NaN and a
  number comes first (every comparison with NaN is false), so it can hide a NaN; ``np.max``
  propagates it."""
  import numpy as np
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


def _timed(timings: dict, name: str, fn):
  import jax
  jax.block_until_ready(fn())  # compile
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  timings[name] = time.perf_counter() - t0
  return out


def _gradient_error(loss_a, loss_b, args, argnums) -> float:
  import jax
  from kvm_jax.ops.kvm.cases import rel_rms
  ga = jax.jit(jax.grad(loss_a, argnums=argnums))(*args)
  gb = jax.jit(jax.grad(loss_b, argnums=argnums))(*args)
  return worst(rel_rms(a, b) for a, b in zip(jax.tree_util.tree_leaves(ga),
                                             jax.tree_util.tree_leaves(gb)))


def check_case(case: Case, grads: bool = True) -> list[dict]:
  """One row per comparison (see :func:`make_row`); the first also holds the run ``timings``."""
  import jax.numpy as jnp
  from kvm_jax.ops.kvm.api import chunk_ops, kvm_decode_step, kvm_prefill, resolve_kvm_backend
  from kvm_jax.ops.kvm.cases import rel_rms, state_rel_error
  from kvm_jax.ops.kvm.decode import kvm_init_cache
  from kvm_jax.ops.kvm.reference import kvm_attention_reference
  from kvm_jax.ops.kvm.scan import kvm_attention_scan, XLA_OPS
  q, k, v, g, params = case.inputs()
  cfg, tol = case.cfg, case.tolerance
  pallas = chunk_ops("pallas")
  rows = []
  timings = {}
  timed = lambda name, fn: _timed(timings, name, fn)
  oracle_y, oracle_state = timed("oracle", lambda: kvm_attention_reference(q, k, v, g, params, cfg))
  xla_y, xla_state, xla_routing = timed("xla", lambda: kvm_attention_scan(
      q, k, v, g, params, cfg=cfg, return_routing=True))
  pal_y, pal_state, pal_routing = timed("pallas", lambda: kvm_attention_scan(
      q, k, v, g, params, cfg=cfg, ops=pallas, return_routing=True))
  routing_same = all(bool(jnp.all(a == b)) for a, b in zip(xla_routing, pal_routing))

  half = case.seq_len // 2
  cache = kvm_init_cache(cfg, batch=case.batch, kv_heads=case.kv_heads, head_dim=case.head_dim,
                         value_dim=case.value_dim, max_len=case.seq_len)
  pallas_backend = resolve_kvm_backend(cfg, implementation="pallas")
  y0, cache = kvm_prefill(q[:, :half], k[:, :half], v[:, :half], g[:, :half], params, cfg,
                          cache, backend=pallas_backend)
  outs = [y0]
  for t in range(half, case.seq_len):
    s = slice(t, t + 1)
    y_t, cache = kvm_decode_step(q[:, s], k[:, s], v[:, s], g[:, s], params, cfg, cache,
                                 backend=pallas_backend)
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

    err = _gradient_error(loss(pallas), loss(XLA_OPS), (q, k, v, g, params), (0, 1, 2, 3, 4))
    rows.append(make_row(case.name, "grads xla vs pallas", err, None, tol["grad"]))
  rows[0]["timings"] = timings
  return rows


def _dictionary_error(state, ref) -> float:
  """Relative error of a final OVQ dictionary (keys and values); inf if any count differs."""
  import numpy as np
  from kvm_jax.ops.kvm.cases import rel_rms
  if not np.array_equal(np.asarray(state.counts), np.asarray(ref.counts)):
    return math.inf
  return worst([rel_rms(state.keys, ref.keys), rel_rms(state.values, ref.values)])


def check_ovq_case(case: "ovq_cases.Case", grads: bool = True) -> list[dict]:
  """The OVQ rows of one case (see :func:`make_row`); the first also holds the ``timings``."""
  import jax
  import jax.numpy as jnp
  from kvm_jax.ops.kvm.cases import TOLERANCE, rel_rms
  from kvm_jax.ops.ovq.decode import ovq_decode_step, ovq_init_cache, ovq_prefill
  from kvm_jax.ops.ovq.reference import ovq_attention_reference
  from kvm_jax.ops.ovq.scan import ovq_attention
  q, k, v, beta = case.inputs()
  # float32, with the KVM checks' relative-RMS tolerances
  cfg, tol = case.cfg, TOLERANCE["float32"]
  timings = {}
  name = f"ovq {case.name}"
  rows = case.row_update
  oracle = jax.jit(ovq_attention_reference, static_argnums=4)
  ref_y, ref_state = _timed(timings, "oracle", lambda: oracle(q, k, v, beta, cfg))
  y, state = _timed(timings, "scan", lambda: ovq_attention(q, k, v, beta, cfg, row_update=rows))
  checks = [make_row(name, "oracle vs scan", rel_rms(y, ref_y), _dictionary_error(state, ref_state),
                     tol["output"])]
  half = case.seq_len // 2
  cache = ovq_init_cache(cfg, batch=case.batch, heads=case.heads, head_dim=case.head_dim,
                         value_dim=case.value_dim, max_len=case.seq_len)
  prefill = jax.jit(ovq_prefill, static_argnums=4, static_argnames="row_update")
  y0, cache = prefill(q[:, :half], k[:, :half], v[:, :half], beta, cfg, cache, row_update=rows)
  step = jax.jit(ovq_decode_step, static_argnums=4, static_argnames="row_update")
  outs = [y0]
  for t in range(half, case.seq_len):
    s = slice(t, t + 1)
    y_t, cache = step(q[:, s], k[:, s], v[:, s], beta, cfg, cache, row_update=rows)
    outs.append(y_t)
  checks.append(make_row(name, "scan vs prefill+decode", rel_rms(jnp.concatenate(outs, 1), y),
                         None, tol["output"]))
  if grads:
    w = jnp.cos(jnp.arange(case.value_dim, dtype=jnp.float32))
    scan = lambda *a: jnp.sum(ovq_attention(*a, cfg, row_update=rows)[0] * w)
    oracle_loss = lambda *a: jnp.sum(ovq_attention_reference(*a, cfg)[0] * w)
    err = _gradient_error(scan, oracle_loss, (q, k, v, beta), (0, 1, 2, 3))
    checks.append(make_row(name, "grads scan vs oracle", err, None, tol["grad"]))
  checks[0]["timings"] = timings
  return checks


def check_rwkv7_case(case: "rwkv7_cases.Case", grads: bool = True) -> list[dict]:
  """The RWKV-7 rows of one case (see :func:`make_row`); the first also holds the ``timings``."""
  import jax
  import jax.numpy as jnp
  from kvm_jax.ops.kvm.cases import TOLERANCE, rel_rms
  from kvm_jax.ops.rwkv7.reference import rwkv7_recurrence_reference
  from kvm_jax.ops.rwkv7.scan import rwkv7_recurrence, rwkv7_step
  inputs, h0 = case.inputs()
  tol = TOLERANCE["float32"]  # as the OVQ checks
  timings = {}
  name = f"rwkv7 {case.name}"
  chunked = jax.jit(rwkv7_recurrence, static_argnames="chunk_size")
  ref_o, ref_h = _timed(timings, "oracle", lambda: jax.jit(rwkv7_recurrence_reference)(
      *inputs, initial_state=h0))
  o, h = _timed(timings, "chunked", lambda: chunked(*inputs, initial_state=h0,
                                                    chunk_size=case.chunk_size))
  rows = [make_row(name, "oracle vs chunked", rel_rms(o, ref_o), rel_rms(h, ref_h), tol["output"])]
  half = case.seq_len // 2
  o0, state = chunked(*(x[:, :half] for x in inputs), initial_state=h0,
                      chunk_size=case.chunk_size)
  step = jax.jit(rwkv7_step)
  outs = [o0]
  for t in range(half, case.seq_len):
    o_t, state = step(*(x[:, t] for x in inputs), state)
    outs.append(o_t[:, None])
  rows.append(make_row(name, "chunked vs prefill+steps", rel_rms(jnp.concatenate(outs, 1), o),
                       rel_rms(state, h), tol["output"]))
  if grads:
    w = jnp.cos(jnp.arange(case.value_dim, dtype=jnp.float32))
    start = h0 if h0 is not None else jnp.zeros(ref_h.shape, jnp.float32)

    def loss(fn):
      return lambda *a: jnp.sum(fn(*a[:6], initial_state=a[6])[0] * w)
    err = _gradient_error(
        loss(lambda *a, initial_state: rwkv7_recurrence(*a, initial_state=initial_state,
                                                        chunk_size=case.chunk_size)),
        loss(rwkv7_recurrence_reference), (*inputs, start), tuple(range(7)))
    rows.append(make_row(name, "grads chunked vs oracle", err, None, tol["grad"]))
  rows[0]["timings"] = timings
  return rows


# Each op's check and how a case is named in the log.
OP_CHECKS = {
    "kvm": (check_case, lambda c: f"{c.name} (T={c.seq_len}, C={c.cfg.chunk_size}, "
                                  f"D={c.head_dim}, {c.dtype})"),
    "ovq": (check_ovq_case, lambda c: f"ovq {c.name} (T={c.seq_len}, C={c.cfg.chunk_size}, "
                                      f"M={c.cfg.max_centroids}, D={c.head_dim})"),
    "rwkv7": (check_rwkv7_case, lambda c: f"rwkv7 {c.name} (T={c.seq_len}, L={c.chunk_size}, "
                                          f"Dk={c.key_dim}, Dv={c.value_dim})"),
}
OPS = tuple(OP_CHECKS)


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


def _chosen_kinds(spec: str) -> list[str]:
  """The kinds ``--kinds`` names (``all``: every registered one), or SystemExit naming the
  unknown ones and the choices."""
  from kvm_jax.nn.registry import registered_mixers
  known = list(registered_mixers())
  kinds = known if spec == "all" else [k for k in spec.split(",") if k]
  unknown = [k for k in kinds if k not in known]
  if unknown:
    raise SystemExit(f"--kinds: unknown {unknown}; registered kinds: {known} (or 'all'; "
                     "--plugin FILE registers more)")
  return kinds


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--size", choices=SIZES, default="small",
                 help="small: KVM C=8, D=16, T=75; OVQ C=8, T=45; RWKV-7 T=150 (seconds, any "
                      "machine); paper: KVM C=256, D=128, T=2048; OVQ C=256, 1024 centroids, "
                      "D=128, T=2048; RWKV-7 D=128, T=2048 (for GPU/TPU)")
  p.add_argument("--no-grads", action="store_true", help="skip the gradient comparisons")
  p.add_argument("--cases", default="",
                 help="comma-separated numbers of the KVM cases to run (1-based; default: all)")
  p.add_argument("--ops", default=",".join(OPS),
                 help="comma-separated ops to check: kvm (the KVM op: oracle, XLA scan, Pallas, "
                      "decode), ovq and rwkv7 (the paper's baselines: oracle, fast path, decode); "
                      "default: all three; \"\" for none (with --kinds)")
  p.add_argument("--kinds", default="",
                 help="comma-separated mixer kinds (registered ones, or 'all') whose tiny models "
                      "to check: forward vs prefill+decode, vs prefill+resume, packed documents "
                      "vs alone, as far as each kind supports them (default: none)")
  p.add_argument("--target", default=None,
                 help="compile instead of run, for this chip: a TPU topology as JAX names it "
                      "(v5e:2x2, v5p:2x2x1, v6e:2x2) or a GPU as CHIP:HOSTSxDEVICES (h100:1x8, "
                      "h200:1x8, b200:1x8); prints one line per program (compiles or fails, "
                      "seconds, bytes per chip). Needs pip install 'kvm_jax[compile]'. The "
                      "persistent compilation cache is off: every program compiles")
  p.add_argument("--programs", default="kernels,ops",
                 help="with --target: which programs to compile, comma-separated: kernels (each "
                      "Pallas kernel at the paper's and small shapes, seconds each), ops (the "
                      "whole op forward/backward, documents, decode: minutes each); default both")
  p.add_argument("--match", default="",
                 help="with --target: only the programs whose name contains this text")
  plugins.add_plugin_flag(p)
  compilation_cache.add_flag(p)
  return p


def compile_for_target(target: str, groups: Sequence[str], match: str = "") -> int:
  """``--target``: compiles the chosen programs for ``target`` and prints one line each, then a
  summary; 1 if any fails or does not fit the chip's memory."""
  from kvm_jax.config import target as targets
  from kvm_jax.eval import chip_check
  from kvm_jax.util.progress import progress
  try:
    t = targets.parse_target(target)
  except ValueError as e:
    raise SystemExit(f"--target: {e}")
  unknown = sorted(set(groups) - {"kernels", "ops"})
  if unknown or not groups:
    raise SystemExit(f"--programs: expected some of kernels, ops; got {','.join(groups)!r}")
  selected = [p for p in chip_check.programs(groups) if match in p.name
              and t.platform in p.platforms]
  print(f"kvm-check --target {t.name}: {t.chip.kind}, {t.device_count} device(s), "
        f"{t.memory_per_chip / 2**30:.2f} GiB per chip; {len(selected)} programs", flush=True)
  results = []
  for program in progress(selected, desc="compiling"):
    results.append(chip_check.compile_one(program, t))
    print(results[-1].line(), flush=True)
  bad = [r for r in results if not r.fits]
  print(f"\n{len(results) - len(bad)}/{len(results)} programs compile and fit {t.name}")
  for r in bad:
    print(f"FAIL {r.name}: {r.error or 'needs more memory than the chip has'}")
  return 1 if bad else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = build_parser().parse_args(argv)
  if args.target is not None:
    # Every program is compiled for real each time: an executable built for abstract devices
    # cannot be loaded back from the persistent cache (XLA: "PjRtCompiler must be constructed
    # with a Client"), so the cache would only cost writes and warnings.
    import jax
    jax.config.update("jax_enable_compilation_cache", False)
    plugins.load_plugins(args)
    return compile_for_target(args.target, [g for g in args.programs.split(",") if g],
                              args.match)
  compilation_cache.enable(args.compilation_cache)
  import jax
  from kvm_jax.eval import kind_check
  from kvm_jax.kernels.backend import default_interpret
  from kvm_jax.ops.common import current_platform
  from kvm_jax.ops.ovq import cases as ovq_cases
  from kvm_jax.ops.rwkv7 import cases as rwkv7_cases
  plugins.load_plugins(args)
  ops = [op for op in args.ops.split(",") if op]
  kinds = _chosen_kinds(args.kinds)
  unknown = sorted(set(ops) - set(OPS))
  if unknown or not (ops or kinds):
    raise SystemExit(f"--ops: expected some of {list(OPS)}, got {args.ops!r} (or name --kinds)")
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
  report = lambda case_rows, what: print(
      f"  checked: {what}; jitted run after compile: "
      + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in case_rows[0]["timings"].items()),
      flush=True)
  # KVM's cases are --size's matrix (--cases picks among them); the baselines' are those their
  # matrices tag check-<size>.
  op_cases = {"kvm": chosen, "ovq": ovq_cases.select(f"check-{args.size}"),
              "rwkv7": rwkv7_cases.select(f"check-{args.size}")}
  for op in (op for op in OPS if op in ops):  # in the table's order, whatever --ops's order
    check, describe = OP_CHECKS[op]
    for case in op_cases[op]:
      case_rows = check(case, grads=not args.no_grads)
      rows.extend(case_rows)
      report(case_rows, describe(case))
  for kind in kinds:
    kind_rows = kind_check.check_kind(kind)
    rows.extend(kind_rows)
    print(f"  checked: kind {kind} ({len(kind_rows)} comparisons)", flush=True)
  print(format_table(rows))
  failed = [r for r in rows if not r["ok"]]
  print(f"\n{len(rows) - len(failed)}/{len(rows)} checks passed")
  for r in failed:
    print(f"FAIL {r['case']} / {r['pair']}: {r.get('why') or 'marked failed'}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
