"""``kvm-bench``: operator-level speed and memory of KVM vs full attention, measured in one run.

For every context length T, this times (median of ``--repeats`` after a warm-up):

* **prefill**: forward over T tokens (KVM ``kvm_attention`` vs ``jax.nn.dot_product_attention``
  causal, cuDNN on GPU, XLA elsewhere);
* **backward**: gradient of ``sum(y * w)`` with respect to q, k, v;
* **decode**: mean per-token time of ``--decode-steps`` steps after a T-token context (the KVM
  figure includes the state update that fires at a chunk boundary) vs a full-attention step over a
  preallocated KV cache.

With ``--models`` (preset names, e.g. ``kvm256_120m,gpta2_120m``) it also measures whole-model
decoding: a ``--model-context``-token prompt is prefilled, then ``--decode-steps`` greedy tokens are
generated; it prints tokens/s and the decode-cache bytes of every layer, measured from the arrays.

Then it prints ms and speed-ups per budget (``fixed256``: 256 rows; ``sqrt16``: 16·√N, min 256), the
crossover length where KVM prefill first beats full attention, and the decode-cache bytes measured
from the arrays (state + window) against the full KV cache, and the bytes one decode step moves:
XLA's count for the compiled step (``cost_analysis()["bytes accessed"]``) next to the minimum the
step must read and write (:func:`kvm_decode_min_bytes`, :func:`full_decode_min_bytes`).

``--baselines ovq,rwkv7`` adds the paper's two other recurrent arms at the same shapes: OVQ
(``kvm_jax.ops.ovq``: chunks of 256, at most 1024 centroids; its cache is the dictionary plus the
current chunk) and RWKV-7's recurrence (``kvm_jax.ops.rwkv7``: a ``H·D·D`` float32 state whatever
T, so its decode step moves the same bytes at every length; :func:`ovq_decode_min_bytes`,
:func:`rwkv7_decode_min_bytes`).
``--engine`` times the generation engine on a ragged workload against ``kj.generate`` one prompt
at a time and padded static batches, and counts the slots that fit at long context per preset
(:mod:`kvm_jax.eval.bench.engine_speed`).
``--slots --topology=v5e:1x1 --context=32768`` compiles the engine's step for one chip (from
this host, for a chip it need not have) and finds the most concurrent slots of each model that
fit its memory, with the ratio against full attention (:mod:`kvm_jax.eval.bench.slots`).
``--paper`` uses the paper's B=8, H=32, D=128, bf16 (an accelerator is needed for that); CPU
defaults finish in minutes.

``--readout-tokamax`` also times, per T and budget, one chunk's readout as ``kvm_attention`` runs it
(Tq = C = 256 queries, G = 1, the budget's state rows at T, the 2·256-slot window): the XLA readout
(``kvm_jax.ops.common.joint_attention``), the project's Pallas kernel
(``kvm_jax.kernels.readout``; not timed where it would be interpreted, i.e. on CPU) and the same
computation run by tokamax's attention (``kvm_jax.kernels.tokamax_readout``, when tokamax is
installed: ``pip install 'kvm_jax[tokamax]'``), the yardstick: each one's speed relative to it
(tokamax ms / its ms; JSON ``readout_<arm>_vs_anchor``, the key earlier results carry).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from typing import Callable

import kvm_jax as kj  # its names import JAX on first use
from kvm_jax.util import compilation_cache
from kvm_jax.util import plugins
from kvm_jax.eval.bench import documents_speed
from kvm_jax.eval.bench import engine_speed
from kvm_jax.eval.bench import slots as slots_bench
from kvm_jax.config.kvm import KVM_IMPLEMENTATIONS
from kvm_jax.ops.ovq.config import OVQConfig

# JAX, the ops and the kernels are imported by the functions that use them, so that --help and a
# bad flag answer without them.

BUDGETS = {
    "fixed256": lambda: kj.FixedBudget(256),
    "sqrt16": lambda: kj.PowerLawBudget(16.0, 0.5, min_rows=256),
}
OVQ = OVQConfig()  # the paper's layer: chunks of 256, at most 1024 centroids
RWKV7_CHUNK = 64


def bench_rope_dims(head_dim: int) -> int:
  """Half the head's channels rotary (at most 64), as the paper's 64 of 128: the state keys are
  the other half, so routing sees real key content at any head_dim (with every channel rotary,
  prep(k) would be all zeros and every merge would go to the first non-sink row)."""
  return min(64, head_dim // 4 * 2)


def kvm_config(budget: str, head_dim: int) -> kj.KVMConfig:
  return kj.KVMConfig(chunk_size=256, window_chunks=2, sink_rows=1,
                      rope_dims=bench_rope_dims(head_dim), budget=BUDGETS[budget](),
                      max_state_rows=256 * 10000)


def time_prefill_backward(T, args, dtype, phases):
  import jax
  import jax.numpy as jnp
  from kvm_jax.eval.bench.timing import full_attention_impl, median_ms
  from kvm_jax.ops.kvm.cases import random_inputs
  q, k, v, g = random_inputs(T, args.batch, T, args.heads, args.heads, args.head_dim,
                             args.head_dim, dtype)
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape, dtype)
  impl = full_attention_impl(q)
  # Every array is an argument of the timed programs: closed over, it would be a constant of
  # the program (the loss weights alone are 2 GiB at --paper 32K), which XLA:GPU takes minutes
  # to compile.
  arms = {"full": lambda q, k, v, g: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                  implementation=impl)}
  for budget in args.budgets:
    cfg = kvm_config(budget, args.head_dim)
    params = kj.KVMParams.init(args.head_dim, args.heads)
    backend = kj.resolve_kvm_backend(cfg, implementation=args.implementation)
    arms[budget] = (lambda cfg, params, backend: lambda q, k, v, g: kj.kvm_attention(
        q, k, v, g, params, cfg, backend=backend).y)(cfg, params, backend)
  out = {}
  for name, fn in arms.items():
    row = {}
    if "prefill" in phases:
      row["prefill_ms"] = median_ms(jax.jit(fn), q, k, v, g, repeats=args.repeats)
    if "backward" in phases:
      grad = jax.jit(jax.grad(lambda q, k, v, g, w: jnp.sum(fn(q, k, v, g).astype(jnp.float32)
                                                            * w), argnums=(0, 1, 2)))
      row["backward_ms"] = median_ms(grad, q, k, v, g, w, repeats=args.repeats)
    out[name] = row
  return out


def _ovq_inputs(T, args, dtype):
  """OVQ's L2-normalized q, k, its v and beta = 1 at the benchmark's shapes."""
  import jax.numpy as jnp
  from kvm_jax.ops.kvm.cases import random_inputs
  q, k, v, _ = random_inputs(T, args.batch, T, args.heads, args.heads, args.head_dim,
                             args.head_dim, dtype)
  unit = lambda x: (x / jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)
                    ).astype(dtype)
  return unit(q), unit(k), v, jnp.ones((args.heads,), jnp.float32)


def _rwkv7_inputs(T, args, dtype):
  """RWKV-7's r, w, k, v, a, b as its time mix makes them, at the benchmark's shapes."""
  from kvm_jax.ops.rwkv7.cases import time_mix_inputs
  return tuple(x.astype(dtype) for x in time_mix_inputs(
      args.batch, T, args.heads, args.head_dim, args.head_dim, seed=T))


def _ovq_decode(inputs, T: int, n: int, item: int) -> dict:
  """The decode row of OVQ after ``T`` tokens (``n`` steps timed)."""
  from kvm_jax.eval.bench.timing import time_ovq_decode
  from kvm_jax.ops.common import tree_nbytes
  times, cache, accessed = time_ovq_decode(OVQ, *inputs, T, n)
  B, _, H, D = inputs[0].shape
  return {"decode_ms": statistics.fmean(times), "cache_bytes": tree_nbytes(cache),
          "state_rows": OVQ.dictionary_size(T), "decode_bytes_accessed": accessed,
          "decode_min_bytes": ovq_decode_min_bytes(OVQ, T, n, B, H, D, D, item)}


def _rwkv7_decode(inputs, T: int, n: int, item: int) -> dict:
  """The decode row of RWKV-7 after ``T`` tokens (``n`` steps timed)."""
  from kvm_jax.eval.bench.timing import time_rwkv7_decode
  from kvm_jax.ops.common import tree_nbytes
  times, state, accessed = time_rwkv7_decode(inputs, T, n, RWKV7_CHUNK)
  B, _, H, D = inputs[0].shape
  return {"decode_ms": statistics.fmean(times), "cache_bytes": tree_nbytes(state),
          "decode_bytes_accessed": accessed,
          "decode_min_bytes": rwkv7_decode_min_bytes(B, H, D, D, item)}


@dataclasses.dataclass(frozen=True)
class BaselineArm:
  """One ``--baselines`` arm: its inputs ``(T, args, dtype) -> tuple`` at the benchmark's shapes,
  its whole-sequence op ``(*inputs) -> y``, how many leading inputs the backward differentiates,
  its decode row ``(inputs, T, n, itemsize) -> dict`` and what its cache holds ``(row, arm) ->
  str``."""

  inputs: Callable
  op: Callable
  differentiated: int
  decode: Callable
  memory: Callable


def _ovq_op(q, k, v, beta):
  from kvm_jax.ops.ovq.scan import ovq_attention
  return ovq_attention(q, k, v, beta, OVQ)[0]


def _rwkv7_op(*inputs):
  from kvm_jax.ops.rwkv7.scan import rwkv7_recurrence
  return rwkv7_recurrence(*inputs, chunk_size=RWKV7_CHUNK)[0]


#: The ``--baselines`` arms by name (:class:`BaselineArm`).
BASELINE_ARMS = {
    "ovq": BaselineArm(_ovq_inputs, _ovq_op, 3, _ovq_decode,
                       lambda row, arm: f"{row[f'{arm}_state_rows']} centroids"),
    "rwkv7": BaselineArm(_rwkv7_inputs, _rwkv7_op, 6, _rwkv7_decode,
                         lambda row, arm: "fixed-size state"),
}
BASELINES = tuple(BASELINE_ARMS)


def baseline_inputs(arm: str, T, args, dtype):
  """Inputs of one baseline at the benchmark's shapes (:data:`BASELINE_ARMS`)."""
  return BASELINE_ARMS[arm].inputs(T, args, dtype)


def time_baselines_prefill_backward(T, args, dtype, phases):
  """Prefill and backward ms of each ``--baselines`` arm."""
  import jax
  import jax.numpy as jnp
  from kvm_jax.eval.bench.timing import median_ms
  out = {}
  for name in args.baselines:
    arm = BASELINE_ARMS[name]
    fn, inputs = arm.op, arm.inputs(T, args, dtype)
    out[name] = {}
    if "prefill" in phases:
      out[name]["prefill_ms"] = median_ms(jax.jit(fn), *inputs, repeats=args.repeats)
    if "backward" in phases:
      w = jax.random.normal(jax.random.PRNGKey(2), inputs[2].shape, dtype)
      grad = jax.jit(jax.grad(lambda w, *x: jnp.sum(fn(*x).astype(jnp.float32) * w),
                              argnums=tuple(range(1, 1 + arm.differentiated))))
      out[name]["backward_ms"] = median_ms(grad, w, *inputs, repeats=args.repeats)
  return out


def ovq_decode_min_bytes(cfg: OVQConfig, T: int, n: int, B: int, H: int, D: int, Dv: int,
                         itemsize: int) -> float:
  """Bytes one OVQ decode step must read and write, averaged over positions T..T+n-1 (no fold):
  the dictionary rows that exist at the start of the token's chunk (keys, values, counts; float32)
  and the chunk's earlier tokens (float32 keys and values) read once, the token's q, k, v in and
  y out, its k and v written into the chunk buffer."""
  C = cfg.chunk_size
  token = B * H * (2 * D + Dv + Dv) * itemsize + B * H * (D + Dv) * 4
  total = 0.0
  for t in range(T, T + n):
    rows = cfg.dictionary_size(t // C * C)
    total += B * H * (rows * (D + Dv + 1) + (t % C) * (D + Dv)) * 4 + token
  return total / n


def rwkv7_decode_min_bytes(B: int, H: int, K: int, V: int, itemsize: int) -> float:
  """Bytes one RWKV-7 step must read and write whatever the position: the float32 state
  ``[H, K, V]`` read and written, the token's r, w, k, a, b ``[H, K]`` and v ``[H, V]`` in, o
  out."""
  return B * H * (2 * K * V * 4 + (5 * K + 2 * V) * itemsize)


def kvm_prefill_work(cfg: kj.KVMConfig, T: int, B: int, H: int, Hkv: int, D: int, Dv: int,
                     itemsize: int) -> tuple[float, float]:
  """(FLOPs, HBM bytes) of one KVM prefill, counted from the schedule: per chunk the QK and PV
  matmuls over the visible state rows and the nb·C window slots, per update the novelty and merge
  logits and the one-hot accumulation; bytes = q/k/v/output once plus, per chunk, the state rows
  (float32) and the window. A model of the work, so achieved rates are comparable across runs."""
  sched = kj.kvm_schedule(cfg, T)
  C, nb = cfg.chunk_size, cfg.window_chunks
  flops = bytes_ = 0.0
  for c in range(sched.num_chunks):
    rows = sched.rows_before[c] if sched.state_visible[c] else 0
    flops += 2.0 * B * H * C * (rows + nb * C) * (D + Dv)
    bytes_ += B * Hkv * (rows * (D + Dv) * 4 + nb * C * (D + Dv) * itemsize)
    if sched.update_after[c]:
      R = sched.rows_before[c] + sched.n_append[c]
      flops += 2.0 * B * Hkv * C * R * (2 * D + D + Dv)
      bytes_ += 2 * B * Hkv * R * (D + Dv) * 4
  bytes_ += B * T * (2 * H * D + Hkv * D + Hkv * Dv) * itemsize  # q, k, v in; y out (Dv = D)
  return flops, bytes_


def kvm_decode_min_bytes(cfg: kj.KVMConfig, T: int, n: int, rows: int, B: int, H: int, Hkv: int,
                         D: int, Dv: int, itemsize: int) -> float:
  """Bytes one KVM decode step must read and write, averaged over the n steps at positions
  T..T+n-1 (no fold; the state update every C steps is not included).

  Reads: the ``rows`` valid rows of the cache's normalized readout (keys and values in the
  activation dtype, ``KVMCache.readout_keys/values``) once, only at positions the state is
  visible to (t >= L); the window ring's keys and values at the positions the token attends to
  (``[max(0, (t//C + 1)·C - L), t)``); the token's q, k, v and merge gate. Writes: the output y
  and the token's k, v and gate into the ring. Parameters (O(H·D)) are left out."""
  C, L = cfg.chunk_size, cfg.window_len
  row_bytes = (D + Dv) * itemsize
  token = B * (H * D + 2 * Hkv * (D + Dv) + H * Dv) * itemsize + 2 * B * Hkv * 4
  total = 0.0
  for t in range(T, T + n):
    window = t - max(0, (t // C + 1) * C - L)
    state = rows * row_bytes if t >= L else 0
    total += B * Hkv * (state + window * (D + Dv) * itemsize) + token
  return total / n


def full_decode_min_bytes(T: int, n: int, B: int, H: int, Hkv: int, D: int, Dv: int,
                          itemsize: int) -> float:
  """Bytes one full-attention decode step must read and write, averaged over positions
  T..T+n-1: the t cached keys and values once, the token's q, k, v in (k and v written into the
  cache) and y out."""
  token = B * (H * D + 2 * Hkv * (D + Dv) + H * Dv) * itemsize
  return sum(B * Hkv * t * (D + Dv) * itemsize + token for t in range(T, T + n)) / n


def time_decode(T, args, dtype):
  import jax.numpy as jnp
  from kvm_jax.eval.bench.timing import time_full_decode, time_kvm_decode
  from kvm_jax.ops.kvm.cases import random_inputs
  n = args.decode_steps
  q, k, v, g = random_inputs(T + 1, args.batch, T + n, args.heads, args.heads, args.head_dim,
                             args.head_dim, dtype)
  sizes = dict(B=args.batch, H=args.heads, Hkv=args.heads, D=args.head_dim, Dv=args.head_dim,
               itemsize=jnp.dtype(dtype).itemsize)
  out = {}
  for budget in args.budgets:
    cfg = kvm_config(budget, args.head_dim)
    times, cache, accessed = time_kvm_decode(
        cfg, kj.KVMParams.init(args.head_dim, args.heads), q, k, v, g, T, n,
        implementation=args.implementation, return_bytes_accessed=True)
    rows = int(jnp.max(cache.state.num_rows))  # one count per row, all alike here
    out[budget] = {"decode_ms": statistics.fmean(times), "cache_bytes": cache.nbytes()["total"],
                   "state_rows": rows, "decode_bytes_accessed": accessed["step"],
                   "decode_attend_bytes_accessed": accessed["attend"],
                   "decode_min_bytes": kvm_decode_min_bytes(cfg, T, n, rows, **sizes)}
  times, full_bytes, accessed = time_full_decode(q, k, v, T, n, return_bytes_accessed=True)
  out["full"] = {"decode_ms": statistics.fmean(times), "cache_bytes": full_bytes,
                 "decode_bytes_accessed": accessed,
                 "decode_min_bytes": full_decode_min_bytes(T, n, **sizes)}
  for name in BASELINES:  # in this order, whatever order --baselines names them
    if name in args.baselines:
      arm = BASELINE_ARMS[name]
      out[name] = arm.decode(arm.inputs(T + n, args, dtype), T, n, jnp.dtype(dtype).itemsize)
  return out


def tokamax_candidates(platform: str) -> tuple[str, ...]:
  """tokamax implementations tried for the yardstick readout, best first; the first that compiles is timed
  (and named in the output), so a kernel that refuses the shape or the dense mask is seen, not
  silently replaced."""
  return {"gpu": ("mosaic", "triton", "xla"), "tpu": ("mosaic", "xla")}.get(platform, ("xla",))


def readout_inputs(cfg: kj.KVMConfig, T: int, B: int, H: int, D: int, dtype):
  """One chunk's readout arguments as ``kvm_attention`` builds them for the last chunk of a
  T-token sequence (G = 1): the state at its capacity with the rows valid at that chunk, the
  2·C-slot window and its causal mask. Returns (args, valid rows, capacity)."""
  import jax
  import jax.numpy as jnp
  from kvm_jax.ops.common import window_mask
  sched = kj.kvm_schedule(cfg, T)
  C, nb = cfg.chunk_size, cfg.window_chunks
  last = sched.num_chunks - 1
  capacity = sched.final_rows
  rows = sched.rows_before[last] if sched.state_visible[last] else 0
  ks = jax.random.split(jax.random.PRNGKey(T), 7)
  q = jax.random.normal(ks[0], (B, C, H, 1, D), dtype)
  state_keys = jax.random.normal(ks[1], (B, H, capacity, D), jnp.float32)
  state_values = jax.random.normal(ks[2], (B, H, capacity, D), jnp.float32)
  window_keys = jax.random.normal(ks[3], (B, nb * C, H, D), dtype)
  window_values = jax.random.normal(ks[4], (B, nb * C, H, D), dtype)
  state_valid = (jnp.arange(capacity) < rows)[None, :]
  window_valid = jnp.asarray(window_mask(last, C, nb))
  state_temp = jax.random.uniform(ks[5], (H, 1), minval=0.5, maxval=2.0)
  window_temp = jax.random.uniform(ks[6], (H, 1), minval=0.5, maxval=2.0)
  args = (q, state_keys, state_values, state_valid, window_keys, window_values, window_valid,
          state_temp, window_temp)
  return args, rows, capacity


def time_readout(T, args, dtype):
  """Per budget: ms of one chunk's readout by the XLA path, the Pallas kernel (None where it
  would be interpreted) and tokamax's attention (None without tokamax), its implementation, and
  each arm's speed relative to tokamax's (tokamax ms / ms)."""
  import jax
  from kvm_jax.eval.bench.timing import median_ms
  from kvm_jax.kernels import tokamax_readout
  from kvm_jax.kernels.backend import KernelConfig
  from kvm_jax.kernels.readout import joint_attention_pallas
  from kvm_jax.ops.common import joint_attention
  kc = KernelConfig.for_target()
  out = {}
  for budget in args.budgets:
    cfg = kvm_config(budget, args.head_dim)
    inputs, rows, capacity = readout_inputs(cfg, T, args.batch, args.heads, args.head_dim, dtype)
    r = {"readout_rows": rows, "readout_capacity": capacity, "readout_tokamax_impl": None}
    r["readout_xla_ms"] = median_ms(jax.jit(joint_attention), *inputs, repeats=args.repeats)
    r["readout_pallas_ms"] = None if kc.interpret else median_ms(
        jax.jit(functools.partial(joint_attention_pallas, kc=kc)), *inputs, repeats=args.repeats)
    r["readout_tokamax_ms"] = None
    if tokamax_readout.tokamax_available():
      for impl in tokamax_candidates(kc.platform):
        fn = jax.jit(functools.partial(tokamax_readout.joint_attention_tokamax, implementation=impl))
        try:
          compiled = fn.lower(*inputs).compile()
        except Exception as e:  # a kernel refusing this shape or mask: try the next one
          print(f"  tokamax[{impl}] unavailable for this readout ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:120] if str(e) else ''})", flush=True)
          continue
        r["readout_tokamax_impl"] = impl
        r["readout_tokamax_ms"] = median_ms(compiled, *inputs, repeats=args.repeats)
        break
    for arm in ("xla", "pallas"):
      ms, tokamax_ms = r[f"readout_{arm}_ms"], r["readout_tokamax_ms"]
      r[f"readout_{arm}_vs_anchor"] = tokamax_ms / ms if ms and tokamax_ms else None
    out[budget] = r
  return out


def readout_line(T: int, budget: str, r: dict, kc: KernelConfig) -> str:
  """One printed line of ``--readout-tokamax``."""
  from kvm_jax.kernels import tokamax_readout
  cells = []
  if r["readout_tokamax_ms"] is not None:
    cells.append(f"tokamax[{r['readout_tokamax_impl']}] {r['readout_tokamax_ms']:.3f} ms")
  else:
    cells.append("tokamax not timed" + ("" if tokamax_readout.tokamax_available() else
                                        f" (not installed: {tokamax_readout.INSTALL_HINT})"))
  for arm in ("xla", "pallas"):
    ms, ratio = r[f"readout_{arm}_ms"], r[f"readout_{arm}_vs_anchor"]
    if ms is None:
      cells.append(f"{arm} not timed (interpreted on {kc.platform})")
    else:
      cells.append(f"{arm} {ms:.3f} ms" + (f" {ratio:.2f}x" if ratio is not None else ""))
  return (f"  readout T={T:>6} {budget:<9} R={r['readout_rows']}/{r['readout_capacity']}: "
          + " | ".join(cells))


def time_model_decode(name: str, context: int, steps: int, batch: int, dtype: str) -> dict:
  """Whole-model greedy decoding of preset ``name`` after a ``context``-token prompt."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from kvm_jax.generation.generate import prefill_logits, sample_step
  from kvm_jax.ops.common import tree_nbytes
  if name.startswith("tiny-"):  # test-sized models of any registered kind: tiny-kvm, tiny-swa ...
    kind = name[len("tiny-"):]
    if kind not in kj.nn.registered_mixers():
      raise SystemExit(f"--models {name}: no mixer kind {kind!r}; registered: "
                       f"{list(kj.nn.registered_mixers())} (--plugin FILE registers more).")
    cfg = kj.presets.tiny(mixers=kind)
  elif name in kj.presets.PRESETS:
    cfg = kj.presets.PRESETS[name]()
  else:
    raise SystemExit(f"--models: unknown preset {name!r}; choose from "
                     f"{sorted(kj.presets.PRESETS)} or tiny-<mixer>.")
  cfg = dataclasses.replace(cfg, compute_dtype=dtype)
  model = kj.LM(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  caches = model.init_cache(batch, context + steps + 2)
  prompt = jax.random.randint(jax.random.PRNGKey(0), (batch, context), 0, cfg.vocab_size)
  greedy = kj.SamplingConfig(temperature=0.0)
  t0 = time.perf_counter()
  logits, caches = prefill_logits(graphdef, state, prompt, caches)  # what kj.generate runs
  token = jnp.argmax(logits, -1).astype(jnp.int32).block_until_ready()
  prefill_s = time.perf_counter() - t0  # includes compilation
  key = jax.random.PRNGKey(0)
  token, caches = sample_step(graphdef, state, token, caches, key, greedy)  # compile + warm-up
  token.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(steps):
    token, caches = sample_step(graphdef, state, token, caches, key, greedy)
  token.block_until_ready()
  elapsed = time.perf_counter() - t0
  per_layer = [tree_nbytes(c.mixer) for c in caches]
  return {"model": name, "context": context, "batch": batch, "steps": steps,
          "tokens_per_s": batch * steps / elapsed, "ms_per_step": 1e3 * elapsed / steps,
          "prefill_s_incl_compile": prefill_s, "cache_bytes_per_layer": per_layer,
          "cache_bytes": sum(per_layer), "parameters": kj.count_params(cfg)["total"]}


def memory_cell(row: dict, arm: str) -> str:
  """What an arm's decode cache holds at T: KVM state rows, or the baseline's own words (OVQ's
  centroids, RWKV-7's fixed state)."""
  if arm in BASELINE_ARMS:
    return BASELINE_ARMS[arm].memory(row, arm)
  return f"{row[f'{arm}_state_rows']} rows"


def decode_bytes_cell(row: dict, arm: str) -> str:
  measured, minimum = row[f"{arm}_decode_bytes_accessed"], row[f"{arm}_decode_min_bytes"]
  attend = row.get(f"{arm}_decode_attend_bytes_accessed")
  cell = "n/a" if measured is None else f"{measured:,.0f}"
  if attend is not None:
    cell += f" [attend {attend:,.0f}: {attend / minimum:.2f}x]"
  if measured is None:
    return f"{cell} / {minimum:,.0f}"
  return f"{cell} / {minimum:,.0f} ({measured / minimum:.1f}x)"


def _lengths(text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated lengths, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive lengths, got {text!r}")
  return values


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-bench", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--lengths", default=None,
                 help="comma-separated context lengths (default: 512..16384 on CPU, "
                      "512..32768 on accelerators)")
  p.add_argument("--phases", default="prefill,decode,backward",
                 help="subset of prefill,decode,backward (default: %(default)s)")
  p.add_argument("--budgets", default="fixed256,sqrt16",
                 help="KVM budgets to time: fixed256, sqrt16 (default: %(default)s)")
  p.add_argument("--baselines", default="",
                 help="also time the paper's other recurrent arms at the same shapes: ovq "
                      "(chunks of 256, <= 1024 centroids) and/or rwkv7 (RWKV-7's recurrence, an "
                      "O(1) state), comma-separated (default: none)")
  p.add_argument("--implementation", default="xla", choices=KVM_IMPLEMENTATIONS,
                 help="KVM core: the XLA scan or the fused Pallas kernels (compiled on GPU/TPU, "
                      "interpreted — slow, for checking only — on CPU) (default: %(default)s)")
  p.add_argument("--paper", action="store_true",
                 help="the paper's operator setup: B=8, H=32, D=128, bfloat16")
  p.add_argument("--batch", type=int, default=1, help="batch B (default: %(default)s)")
  p.add_argument("--heads", type=int, default=4, help="heads H = Hkv (default: %(default)s)")
  p.add_argument("--head-dim", type=int, default=64, help="head dim D (default: %(default)s)")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="activation dtype (default: %(default)s)")
  p.add_argument("--repeats", type=int, default=3, help="timed repeats, median (default: 3)")
  p.add_argument("--decode-steps", type=int, default=64,
                 help="decode steps averaged after each context (default: %(default)s)")
  p.add_argument("--models", default="",
                 help="comma-separated presets for whole-model decode tokens/s, e.g. "
                      "kvm256_120m,kvm_sqrt16_120m,gpta2_120m, or tiny-<kind> for a test-sized "
                      "model of any registered mixer kind (default: none)")
  plugins.add_plugin_flag(p)
  p.add_argument("--model-context", type=int, default=2048,
                 help="prompt tokens before the whole-model decode timing (default: %(default)s)")
  p.add_argument("--readout-tokamax", action="store_true",
                 help="also time one chunk's readout (XLA, Pallas, and tokamax's attention as the "
                      "yardstick when installed: pip install 'kvm_jax[tokamax]') per T and "
                      "budget")
  g = p.add_argument_group("packed documents (segment_ids); --documents runs only these tables")
  g.add_argument("--documents", action="store_true",
                 help="time the KVM op with segment ids against without, a documents train step "
                 "against cram, and real tokens/s of documents against pad packing (ratios of "
                 "the medians of interleaved rounds, with the ratio of the minima beside them)")
  g.add_argument("--doc-lengths", type=_lengths, default=[4096, 16384], metavar="T,...",
                 help="row lengths of the op comparison (default: 4096,16384)")
  g.add_argument("--doc-median", type=int, default=documents_speed.MEDIAN_LENGTH,
                 help="median document length of the log-normal mix (default: %(default)s tokens)")
  g.add_argument("--doc-step-len", type=int, default=4096,
                 help="row length of the train-step comparison (default: 4096)")
  engine_speed.add_flags(p)
  slots_bench.add_flags(p)
  p.add_argument("--json", default=None, help="write all measurements to this JSON file")
  p.add_argument("--plot", default=None,
                 help="write a PNG to this path: ms vs T (with --engine: tokens/s per arm and "
                      "slots vs context)")
  compilation_cache.add_flag(p)
  return p


def _device_line() -> str:
  """The accelerator, its platform and jax's version: the first words every run prints."""
  import jax
  return f"{jax.devices()[0].device_kind} ({kj.current_platform()}), jax {jax.__version__}"


def _write_json(path: str, payload: dict) -> None:
  """Writes ``payload`` to ``path`` as indented JSON."""
  with open(path, "w") as f:
    json.dump(payload, f, indent=2)


def _run_documents(args) -> int:
  """``--documents``: only the packed-documents tables (and their JSON); returns the exit code."""
  if args.doc_median < 1 or args.doc_step_len < 2:
    raise SystemExit(f"--doc-median must be >= 1 and --doc-step-len >= 2, got "
                     f"{args.doc_median} and {args.doc_step_len}.")
  print(_device_line(), flush=True)
  measured = documents_speed.run(args)
  if args.json:
    _write_json(args.json, {"setup": {k: v for k, v in vars(args).items()},
                            "documents": measured})
  return 0


def _run_engine(args) -> int:
  """``--engine``: only the generation-engine tables (and their JSON); returns the exit code."""
  print(_device_line(), flush=True)
  measured = engine_speed.run(args)
  if args.json:
    _write_json(args.json, {"setup": vars(args), "engine": measured})
  return 0


def _run_slots(args) -> int:
  """``--slots``: only the serving-capacity table (and its JSON); returns the exit code."""
  if args.context < 1 or args.slots_chunk < 1:
    raise SystemExit(f"--context and --slots-chunk must be >= 1, got {args.context} and "
                     f"{args.slots_chunk}.")
  try:
    rows = slots_bench.run(args)
  except (ValueError, RuntimeError) as e:
    raise SystemExit(f"--slots: {e}") from None
  if args.json:
    _write_json(args.json, {"setup": vars(args), "slots": rows})
  return 0


def _operator_plan(args) -> tuple[list[str], set[str], list[int]]:
  """(arms, phases, lengths) of the operator tables, every flag checked before anything is
  timed; ``args.budgets`` and ``args.baselines`` become lists (the JSON's setup records them so)."""
  args.budgets = [b for b in args.budgets.split(",") if b]
  for b in args.budgets:
    if b not in BUDGETS:
      raise SystemExit(f"--budgets: unknown {b!r}; choose from {list(BUDGETS)}.")
  args.baselines = [b for b in args.baselines.split(",") if b]
  for b in args.baselines:
    if b not in BASELINES:
      raise SystemExit(f"--baselines: unknown {b!r}; choose from {list(BASELINES)}.")
  arms = args.budgets + args.baselines
  phases = set(p for p in args.phases.split(",") if p)
  if not phases <= {"prefill", "decode", "backward"}:
    raise SystemExit(f"--phases: unknown {sorted(phases - {'prefill', 'decode', 'backward'})}.")
  if not phases and not args.models and not args.readout_tokamax:
    raise SystemExit("nothing to time: give --phases, --models and/or --readout-tokamax.")
  if args.lengths is None:
    top = 16384 if kj.current_platform() == "cpu" else 32768
    lengths = [512 * 2 ** i for i in range(12) if 512 * 2 ** i <= top]
  else:
    lengths = [int(x) for x in args.lengths.split(",") if x]
  return arms, phases, lengths


def _baseline_impl(args) -> str:
  """The full-attention baseline's implementation for this run's heads and dtype."""
  import jax
  import jax.numpy as jnp
  from kvm_jax.eval.bench.timing import full_attention_impl
  heads = jax.ShapeDtypeStruct((args.batch, 512, args.heads, args.head_dim), jnp.dtype(args.dtype))
  return full_attention_impl(heads)


def _print_setup(args) -> None:
  """Prints the run's device, shapes and implementations (and the readout legend)."""
  print(f"{_device_line()}; B={args.batch} H={args.heads} D={args.head_dim} {args.dtype}; C=256 "
        f"L=512; KVM implementation={args.implementation}; full "
        f"attention: dot_product_attention({_baseline_impl(args)})", flush=True)
  if args.readout_tokamax:
    print("readout of one chunk (Tq=256, G=1, R = valid/allocated state rows, W=512); ratios are "
          "tokamax's ms / the arm's ms (> 1: faster than tokamax)", flush=True)


def _add_arms(row: dict, measured: dict) -> None:
  """Flattens ``{arm: {key: value}}`` into ``row`` as ``arm_key``."""
  for arm, r in measured.items():
    row.update({f"{arm}_{k}": v for k, v in r.items()})


def _measure_length(T: int, args, dtype, phases: set[str]) -> tuple[dict, dict]:
  """(row, readout) at context T: the row holds every phase's figures as ``arm_key``; readout is
  :func:`time_readout`'s per-budget dict ({} without ``--readout-tokamax``), kept apart for its
  printed lines."""
  row = {"T": T}
  if phases & {"prefill", "backward"}:
    _add_arms(row, time_prefill_backward(T, args, dtype, phases))
    _add_arms(row, time_baselines_prefill_backward(T, args, dtype, phases))
  if "decode" in phases:
    _add_arms(row, time_decode(T, args, dtype))
  readout = time_readout(T, args, dtype) if args.readout_tokamax else {}
  _add_arms(row, readout)
  return row, readout


def _speedup_cells(row: dict, arms: list[str]) -> list[str]:
  """Per phase measured: full attention's ms and each arm's speed-up over it."""
  cells = []
  for phase in ("prefill", "backward", "decode"):
    if f"full_{phase}_ms" in row:
      ratios = " ".join(f"{b} {row[f'full_{phase}_ms'] / row[f'{b}_{phase}_ms']:.2f}x"
                        for b in arms)
      cells.append(f"{phase}: full {row[f'full_{phase}_ms']:.2f} ms, {ratios}")
  return cells


def _achieved_cell(row: dict, T: int, args, dtype) -> str:
  """The achieved TFLOP/s and GB/s of each budget's prefill (:func:`kvm_prefill_work` over the
  measured ms), also stored in ``row`` for the JSON."""
  import jax.numpy as jnp
  for b in args.budgets:
    flops, nbytes = kvm_prefill_work(kvm_config(b, args.head_dim), T, args.batch, args.heads,
                                     args.heads, args.head_dim, args.head_dim,
                                     jnp.dtype(dtype).itemsize)
    seconds = row[f"{b}_prefill_ms"] / 1e3
    row[f"{b}_prefill_tflops"] = flops / seconds / 1e12
    row[f"{b}_prefill_gbps"] = nbytes / seconds / 1e9
  return "achieved " + " ".join(
      f"{b} {row[f'{b}_prefill_tflops']:.3f} TFLOP/s {row[f'{b}_prefill_gbps']:.1f} GB/s"
      for b in args.budgets)


def _print_crossovers(rows: list[dict], budgets: list[str]) -> None:
  """Prints, per budget, the first T where KVM prefill beats full attention."""
  for b in budgets:
    wins = [r["T"] for r in rows if r[f"{b}_prefill_ms"] < r["full_prefill_ms"]]
    print(f"crossover ({b} prefill faster than full): "
          f"{'T=' + str(min(wins)) if wins else 'not reached'}")


def _print_decode_tables(rows: list[dict], arms: list[str]) -> None:
  """Prints the decode-cache bytes at each T and the bytes one decode step moves."""
  print("decode cache bytes at T (measured from the arrays):")
  for r in rows:
    print(f"  T={r['T']:>6}  full {r['full_cache_bytes']:>13,}  " + "  ".join(
        f"{b} {r[f'{b}_cache_bytes']:>11,} ({memory_cell(r, b)})" for b in arms))
  print("decode bytes per step: XLA's count for the compiled step (KVM: both branches of the "
        "chunk-boundary fold included) [the token's attention over the cache alone: what a step "
        "between folds moves, and its ratio to the minimum] / the minimum the step must move "
        "(ratio):")
  for r in rows:
    print(f"  T={r['T']:>6}  " + "  ".join(
        f"{arm} {decode_bytes_cell(r, arm)}" for arm in ["full"] + arms))


def _time_models(args) -> list[dict]:
  """:func:`time_model_decode` of each ``--models`` preset, each printed as it finishes."""
  model_rows = []
  for name in (m for m in args.models.split(",") if m):
    r = time_model_decode(name, args.model_context, args.decode_steps, args.batch, args.dtype)
    model_rows.append(r)
    per_layer = sorted(set(r["cache_bytes_per_layer"]))
    print(f"model {name:<20} {r['parameters'] / 1e6:7.1f}M params  decode after "
          f"{r['context']} tokens: {r['tokens_per_s']:9.1f} tok/s ({r['ms_per_step']:.2f} ms/step, "
          f"B={r['batch']})  cache {r['cache_bytes']:,} B (per layer: "
          f"{', '.join(f'{b:,}' for b in per_layer)})", flush=True)
  return model_rows


def _plot(path: str, rows: list[dict], arms: list[str], phases: set[str]) -> None:
  """Writes the PNG of ms vs T, one panel per phase measured."""
  import matplotlib  # imported here: only --plot needs it
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  shown = [p for p in ("prefill", "backward", "decode") if p in phases]
  fig, axes = plt.subplots(1, len(shown), figsize=(5 * len(shown), 4), squeeze=False)
  for ax, phase in zip(axes[0], shown):
    for arm in ["full"] + arms:
      ax.plot([r["T"] for r in rows], [r[f"{arm}_{phase}_ms"] for r in rows], "o-", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context T")
    ax.set_ylabel("ms")
    ax.set_title(phase)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  import jax.numpy as jnp
  from kvm_jax.kernels.backend import KernelConfig
  plugins.load_plugins(args)
  if args.paper:
    args.batch, args.heads, args.head_dim, args.dtype = 8, 32, 128, "bfloat16"
  if args.documents:
    return _run_documents(args)
  if args.engine:
    return _run_engine(args)
  if args.slots:
    return _run_slots(args)
  arms, phases, lengths = _operator_plan(args)
  dtype = jnp.dtype(args.dtype)
  _print_setup(args)
  kc = KernelConfig.for_target()
  rows = []
  for T in (lengths if phases or args.readout_tokamax else []):
    row, readout = _measure_length(T, args, dtype, phases)
    rows.append(row)
    cells = _speedup_cells(row, arms)
    if "prefill" in phases:
      cells.append(_achieved_cell(row, T, args, dtype))
    if cells:
      print(f"T={T:>6}  " + " | ".join(cells), flush=True)
    for budget, r in readout.items():
      print(readout_line(T, budget, r, kc), flush=True)
  if "prefill" in phases:
    _print_crossovers(rows, args.budgets)
  if "decode" in phases:
    _print_decode_tables(rows, arms)
  model_rows = _time_models(args)
  if args.json:
    _write_json(args.json, {"setup": {k: v for k, v in vars(args).items()}, "rows": rows,
                            "models": model_rows})
  if args.plot:
    _plot(args.plot, rows, arms, phases)
  return 0


if __name__ == "__main__":
  sys.exit(main())
