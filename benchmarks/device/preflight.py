"""The ``kernels`` stage: each Pallas kernel once, at a small real shape, against its XLA op.

One entry per (kernel, dtype, G): the readout and the decode kernel for every G (query heads per
KV head), the routing kernels (novelty, merge target) and the row accumulation once per dtype
(they score and sum in float32 whatever the model's dtype; "bfloat16" gives them the
bf16-rounded keys a bf16 model routes). Paper geometry: B=1, Hkv=2, C=256, D=128, R=256, two
window chunks. A kernel whose entry raises (or crashes the process) is recorded with its error,
and every later entry that uses it is skipped (:func:`benchmarks.device.records.broken_kernels`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import kvm_jax as kj
from kvm_jax.kernels.backend import KernelConfig
from kvm_jax.kernels.decode import decode_attention_pallas
from kvm_jax.kernels.readout import joint_attention_heads_pallas
from kvm_jax.kernels.update import add_rows, first_argmax_rows, max_scores
from kvm_jax.ops.common import joint_attention_heads, window_mask
from kvm_jax.ops.kvm.cases import TOLERANCE, rel_rms
from kvm_jax.ops.kvm.decode import decode_attention
from kvm_jax.ops.kvm.state import add_rows_scatter, merge_targets, novelty_scores

from benchmarks.device.measure import Context, kvm_config
from benchmarks.device.records import KERNELS, Recorder, Task

GROUPED = ("readout", "decode")   # kernels whose shapes depend on G


def _normal(key, shape, dtype=jnp.float32):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Comparison:
  """One pre-flight entry: ``kernel(*args)`` against ``xla(*args)`` (both jitted), within
  ``tolerance`` (relative RMS) or, when ``exact``, index for index."""

  kernel: Callable
  xla: Callable
  args: tuple
  tolerance: float
  exact: bool = False

  def run(self) -> dict:
    """The kernel's compile time and its error against the XLA op (relative RMS, or the count
    of differing integers when ``exact``); ``status`` failed when out of tolerance or not
    finite."""
    t0 = time.perf_counter()
    compiled = jax.jit(self.kernel).lower(*self.args).compile()
    compile_s = time.perf_counter() - t0
    got = np.asarray(jax.block_until_ready(compiled(*self.args)))
    want = np.asarray(jax.jit(self.xla)(*self.args))
    out = {"compile_s": compile_s, "shape": list(got.shape)}
    if self.exact:
      differ = int(np.sum(got != want))
      return {**out, "differences": differ, "compared": int(want.size),
              "status": "ok" if differ == 0 else "failed"}
    err = rel_rms(got, want)
    finite = bool(np.isfinite(got).all())
    return {**out, "rel_rms": err, "tolerance": self.tolerance, "finite": finite,
            "status": "ok" if finite and err <= self.tolerance else "failed"}


def _shapes(geo, G: int):
  return dict(B=1, Hkv=geo.kernel_kv_heads, G=G, C=geo.kernel_chunk, D=geo.kernel_head_dim,
              R=geo.kernel_rows)


def readout(geo, G: int, dtype, kc: KernelConfig) -> Comparison:
  """One chunk's softmax over [state ; window] (a chunk past the front: causal window, 4 in 5
  state rows valid) vs :func:`kvm_jax.ops.common.joint_attention_heads`."""
  s = _shapes(geo, G)
  B, Hkv, C, D, R = s["B"], s["Hkv"], s["C"], s["D"], s["R"]
  nb = geo.window_chunks
  ks = jax.random.split(jax.random.PRNGKey(G), 7)
  args = (_normal(ks[0], (B, Hkv, G, C, D), dtype), _normal(ks[1], (B, Hkv, R, D)),
          _normal(ks[2], (B, Hkv, R, D)), jnp.asarray(np.arange(R) < R - R // 5)[None, :],
          _normal(ks[3], (B, Hkv, nb * C, D), dtype), _normal(ks[4], (B, Hkv, nb * C, D), dtype),
          jnp.asarray(window_mask(nb + 1, C, nb)),
          1.0 + 0.1 * _normal(ks[5], (Hkv, G)), 1.0 + 0.1 * _normal(ks[6], (Hkv, G)))
  return Comparison(functools.partial(joint_attention_heads_pallas, kc=kc),
                    joint_attention_heads, args, TOLERANCE[jnp.dtype(dtype).name]["output"])


def routing_inputs(geo, dtype):
  """Token keys ``[B, Hkv, C, D]`` (float32, rounded to ``dtype`` first), state rows
  ``[B, Hkv, R, D]`` and the valid row count (4 in 5)."""
  s = _shapes(geo, 1)
  B, Hkv, C, D, R = s["B"], s["Hkv"], s["C"], s["D"], s["R"]
  ks = jax.random.split(jax.random.PRNGKey(7), 2)
  tokens = _normal(ks[0], (B, Hkv, C, D), dtype).astype(jnp.float32)
  rows = _normal(ks[1], (B, Hkv, R, D))
  return tokens, rows, jnp.asarray(R - R // 5, jnp.int32)


def novelty(geo, dtype, kc: KernelConfig) -> Comparison:
  """Per token, the max score over the valid rows vs ``state.novelty_scores`` (float32)."""
  return Comparison(functools.partial(max_scores, kc=kc), novelty_scores,
                    routing_inputs(geo, dtype), TOLERANCE["float32"]["output"])


def merge_target(geo, dtype, kc: KernelConfig, first_row: int = 1) -> Comparison:
  """Per token, the first argmax over rows [1, num_rows) vs ``state.merge_targets``: every
  index must be equal (``first_row`` other than 1 plants a wrong kernel, for the tests)."""
  return Comparison(lambda x, r, n: first_argmax_rows(x, r, first_row, n, kc=kc),
                    lambda x, r, n: merge_targets(x, r, 1, n), routing_inputs(geo, dtype), 0.0,
                    exact=True)


def add_rows_entry(geo, dtype, kc: KernelConfig) -> Comparison:
  """``rows[index[c]] += updates[c]`` (one index in eight out of range: dropped) vs XLA's
  scatter-add."""
  tokens, rows, _ = routing_inputs(geo, dtype)
  B, Hkv, C, _ = tokens.shape
  R = rows.shape[2]
  index = jax.random.randint(jax.random.PRNGKey(3), (B, Hkv, C), 0, R + R // 8, jnp.int32)
  return Comparison(functools.partial(add_rows, kc=kc), add_rows_scatter, (rows, index, tokens),
                    TOLERANCE["float32"]["output"])


def decode(geo, G: int, dtype, kc: KernelConfig) -> Comparison:
  """One token (mid-chunk, past the window: state and ring both visible) against the readout
  state and the ring vs ``decode.decode_attention``."""
  s = _shapes(geo, G)
  B, Hkv, C, D, R = s["B"], s["Hkv"], s["C"], s["D"], s["R"]
  cfg = kvm_config(geo, kj.FixedBudget(R), chunk=C, head_dim=D)
  L = cfg.window_len
  ks = jax.random.split(jax.random.PRNGKey(10 + G), 7)
  args = (_normal(ks[0], (B, 1, Hkv * G, D), dtype), _normal(ks[1], (B, Hkv, R, D), dtype),
          _normal(ks[2], (B, Hkv, R, D), dtype), jnp.asarray(R - R // 5, jnp.int32),
          _normal(ks[3], (B, L, Hkv, D), dtype), _normal(ks[4], (B, L, Hkv, D), dtype),
          jnp.asarray(L + C + C // 3, jnp.int32),
          1.0 + 0.1 * _normal(ks[5], (Hkv, G)), 1.0 + 0.1 * _normal(ks[6], (Hkv, G)))
  return Comparison(lambda *a: decode_attention_pallas(*a, cfg, kc=kc),
                    lambda *a: decode_attention(*a, cfg), args,
                    TOLERANCE[jnp.dtype(dtype).name]["output"])


def comparison(kernel: str, geo, G: int, dtype, kc: KernelConfig) -> Comparison:
  """The pre-flight of ``kernel`` (one of :data:`~benchmarks.device.records.KERNELS`)."""
  if kernel in GROUPED:
    return {"readout": readout, "decode": decode}[kernel](geo, G, dtype, kc)
  return {"novelty": novelty, "merge_target": merge_target,
          "add_rows": add_rows_entry}[kernel](geo, dtype, kc)


def stage_kernels(rec: Recorder, ctx: Context) -> None:
  geo = ctx.geo
  kc = KernelConfig.for_target()
  tasks = []
  for dtype in ("bfloat16", "float32"):
    for kernel in KERNELS:
      for G in (geo.kernel_groups if kernel in GROUPED else geo.kernel_groups[:1]):
        def run(kernel=kernel, G=G, dtype=dtype):
          if kernel in ctx.fail_kernels:
            raise RuntimeError(f"planted failure of kernel {kernel!r} (--fail-kernel)")
          return comparison(kernel, geo, G, jnp.dtype(dtype), kc).run()

        name = f"{kernel} {dtype}" + (f" G={G}" if kernel in GROUPED else "")
        tasks.append(Task(name, run, dict(kernel=kernel, dtype=dtype, **_shapes(geo, G),
                                          interpret=kc.interpret, platform=kc.platform),
                          kind=kernel))
  rec.run(tasks)
