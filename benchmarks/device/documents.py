"""The documents stage: the KVM op over packed documents (``segment_ids``) on the device.

Exactness first (float32, float32 matmuls): every document of two packed rows against the same
document run alone on the XLA scan. Then time: the op with segment ids against the same op
without them, forward and forward + backward, at the paper's shape, for rows holding one
document each (the plain scan's work) and rows packed from a log-normal mix of document lengths
(median 600 tokens). Last, the Pallas kernels on the exactness rows against the XLA document
path (outputs and each row's state row count). Imported only in a stage's process. The mix is
``kvm-bench --documents``'s (the same rows at the same T), packed by
:func:`kvm_jax.config.row_plan.plan_rows`, which needs no grain.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvm_jax as kj
from kvm_jax.eval.bench.documents_speed import MEDIAN_LENGTH, mixed_rows
from kvm_jax.eval.bench.timing import interleaved_times
from kvm_jax.ops.documents import documents_alone, segment_ids_from_lengths
from kvm_jax.ops.kvm.cases import TOLERANCE, random_inputs, random_params, rel_rms

from benchmarks.device.measure import Context, kvm_config
from benchmarks.device.records import SCAN_KERNELS, Recorder, Task


def exact_layout(T: int, C: int) -> tuple[list[int], list[int]]:
  """Two rows of document lengths (negative: padding) summing to ``T`` (at least ``10·C``):
  documents of 1, C-1, C, C+1 tokens and one past a two-chunk window, padding between, and long
  documents (past several folds) whose boundaries fall mid-chunk."""
  if T < 10 * C:
    raise ValueError(f"the exactness rows need T >= 10·C, got T={T}, C={C}")
  row0 = [1, C - 1, C, C + 1, int(2.3 * C), -(C // 2)]
  row1 = [-max(1, C // 5), int(5.7 * C), int(3.1 * C) + 5]
  return row0 + [T - sum(map(abs, row0))], row1 + [T - sum(map(abs, row1))]


@functools.lru_cache(maxsize=None)
def _packed_op(cfg: kj.KVMConfig, implementation: str):
  """The jitted op with segment ids (cached: the exactness entries share one XLA program)."""
  # Packed documents read with the op's own readout (tokamax takes one state mask per batch).
  backend = kj.resolve_kvm_backend(cfg, implementation=implementation, readout="own")
  return jax.jit(lambda q, k, v, g, p, s: kj.kvm_attention(q, k, v, g, p, cfg, segment_ids=s,
                                                           backend=backend))


def _exact_inputs(ctx: Context):
  """The exactness rows, float32 inputs (the numerics' shapes, GQA) and parameters."""
  geo = ctx.geo
  B, H, Hkv, D, T = geo.num_batch, geo.num_heads, geo.num_kv_heads[-1], geo.head_dim, \
      geo.num_length
  rows = exact_layout(T, geo.chunk)[:max(1, B)]
  q, k, v, g = random_inputs(0, len(rows), T, H, Hkv, D, D, jnp.float32)
  return rows, (q, k, v, g), random_params(0, D, H), jnp.asarray(segment_ids_from_lengths(rows, T))


def _exact_xla(ctx: Context) -> dict:
  """Each packed document's outputs (XLA) against the document run alone: worst rel RMS."""
  cfg = kvm_config(ctx.geo, kj.FixedBudget(ctx.geo.timing_rows))
  rows, (q, k, v, g), params, seg = _exact_inputs(ctx)
  with jax.default_matmul_precision("float32"):
    y, state = jax.block_until_ready(_packed_op(cfg, "xla")(q, k, v, g, params, seg))
    docs, alone_in = documents_alone(rows, q, k, v, g, fills=(0, 0, 0, 1))
    alone = jax.jit(lambda *a: kj.kvm_attention(*a, params, cfg)[0])(*alone_in)
  errors = [rel_rms(y[b, t:t + n], alone[i, :n]) for i, (b, t, n) in enumerate(docs)]
  tol = TOLERANCE["float32"]["output"]
  worst = max(errors)
  return {"status": "ok" if worst <= tol else "failed", "rel_rms": worst, "tolerance": tol,
          "documents": len(docs), "lengths": [n for _, _, n in docs],
          "state_rows": np.asarray(state.num_rows).tolist()}


def _exact_pallas(ctx: Context) -> dict:
  """The Pallas document path against the XLA one on the same rows: outputs and state rows."""
  cfg = kvm_config(ctx.geo, kj.FixedBudget(ctx.geo.timing_rows))
  _, (q, k, v, g), params, seg = _exact_inputs(ctx)
  with jax.default_matmul_precision("float32"):
    y, state = jax.block_until_ready(_packed_op(cfg, "xla")(q, k, v, g, params, seg))
    yp, sp = jax.block_until_ready(_packed_op(cfg, "pallas")(q, k, v, g, params, seg))
  tol = TOLERANCE["float32"]["output"]
  rms = rel_rms(yp, y)
  same_rows = bool(np.array_equal(np.asarray(sp.num_rows), np.asarray(state.num_rows)))
  return {"status": "ok" if rms <= tol and same_rows else "failed", "rel_rms": rms,
          "tolerance": tol, "rows_same": same_rows}


def _timing(ctx: Context, backward: bool) -> dict:
  """Median ms of interleaved rounds: without segment ids, one document per row, the mix."""
  geo = ctx.geo
  B, H, D, T = geo.batch, geo.heads, geo.head_dim, geo.doc_length
  cfg = kvm_config(geo, kj.FixedBudget(geo.timing_rows))
  q, k, v, g = jax.jit(lambda: random_inputs(T, B, T, H, H, D, D, jnp.dtype(geo.dtype)))()
  params = kj.KVMParams.init(D, H)
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
  one = jnp.ones((B, T), jnp.int32)
  mix = jnp.asarray(mixed_rows(B, T))
  # Every array is an argument: closed over, it would be a constant of the program (gigabytes
  # here, which XLA:GPU takes minutes to compile).
  if backward:
    def loss(q, k, v, g, w, s):
      y = kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=s)[0]
      return jnp.sum(y.astype(jnp.float32) * w)
    with_ids = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    without = jax.jit(jax.grad(lambda q, k, v, g, w: loss(q, k, v, g, w, None), argnums=(0, 1, 2)))
    arms = {"plain": lambda: without(q, k, v, g, w), "one": lambda: with_ids(q, k, v, g, w, one),
            "mix": lambda: with_ids(q, k, v, g, w, mix)}
  else:
    with_ids = jax.jit(lambda q, k, v, g, s: kj.kvm_attention(q, k, v, g, params, cfg,
                                                              segment_ids=s)[0])
    without = jax.jit(lambda q, k, v, g: kj.kvm_attention(q, k, v, g, params, cfg)[0])
    arms = {"plain": lambda: without(q, k, v, g), "one": lambda: with_ids(q, k, v, g, one),
            "mix": lambda: with_ids(q, k, v, g, mix)}
  t0 = time.perf_counter()
  times = interleaved_times(arms, ctx.repeats)   # its warm-up calls compile every arm
  ms = {name: statistics.median(t) for name, t in times.items()}
  mix_ids = np.asarray(mix)
  return {"plain_ms": ms["plain"], "one_ms": ms["one"], "mix_ms": ms["mix"],
          "one_ratio": ms["one"] / ms["plain"], "mix_ratio": ms["mix"] / ms["plain"],
          "samples_ms": times, "seconds_with_compile": time.perf_counter() - t0,
          "documents_in_mix": int(np.sum(np.diff(mix_ids, axis=1) != 0) + B)}


def stage_documents(rec: Recorder, ctx: Context) -> None:
  geo = ctx.geo
  exact_fields = dict(B=geo.num_batch, H=geo.num_heads, Hkv=geo.num_kv_heads[-1],
                      D=geo.head_dim, T=geo.num_length, dtype="float32", precision="float32",
                      rows=geo.timing_rows)
  timing_fields = dict(B=geo.batch, H=geo.heads, D=geo.head_dim, T=geo.doc_length,
                       dtype=geo.dtype, rows=geo.timing_rows, median_length=MEDIAN_LENGTH)
  rec.run([
      Task("exact: xla packed vs alone", lambda: _exact_xla(ctx), exact_fields, kind="exact"),
      Task("forward", lambda: _timing(ctx, backward=False), timing_fields, kind="forward"),
      Task("forward+backward", lambda: _timing(ctx, backward=True), timing_fields,
           kind="backward"),
      # last, as in every stage: a Pallas entry that aborts the process costs no other entry
      Task("exact: pallas vs xla packed", lambda: _exact_pallas(ctx),
           dict(exact_fields, kernels=list(SCAN_KERNELS)), kind="exact-pallas")])

