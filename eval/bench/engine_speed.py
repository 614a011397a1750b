"""``kvm-bench --engine``: what the generation engine buys, as ratios measured in one run.

Three tables (``--engine-tables`` picks among them):

* **time to first token at the paper's chunk**: on a tiny KVM model whose chunk is
  ``--engine-ttft-chunk`` tokens (256, the paper's), the seconds from submitting one prompt of
  each ``--engine-ttft-prompts`` length to an idle, warmed-up engine until its first token, with
  the prompt's rest after its whole chunks fed in one lane (``Engine(rest_prefill="lane")``, the
  default) and through the decode step a token per round (``rest_prefill="decode"``, the engine's
  earlier way), the best of ``--engine-ttft-repeats`` each, and their ratio; both engines share
  their compiled programs, so only the feeding differs.

* **throughput on a ragged workload**: ``--engine-requests`` prompts of log-normal lengths
  (median ``--engine-median-prompt`` tokens, σ = 1, at most ``--engine-max-len`` / 2) with output
  budgets drawn uniformly from 1 to ``--engine-max-new``, greedy, on a tiny model of each
  ``--engine-mixers`` pattern. Three arms, each run once to compile and then timed (the best of
  three runs): the engine
  (:func:`kvm_jax.generate_many`, ``--engine-slots`` slots), ``kj.generate`` one prompt at a
  time, and padded static batches (``--engine-slots`` prompts per ``kj.generate`` call, each
  left-padded to the batch's longest prompt and run for the batch's largest budget: what serving
  without per-row caches does; its padded outputs are not exact, only its time is measured).
  Tokens/s counts the tokens each request asked for.
* **concurrency at long context**: for the paper's 120M and 350M presets (``--engine-dtype``
  parameters and caches), the decode-cache bytes of one slot at ``--engine-context`` tokens
  (from the caches' shapes, nothing allocated) and how many slots fit in 16 and 80 GiB beside
  the weights, with each preset's ratio to full attention's count.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

import kvm_jax as kj

GIB = 1024 ** 3
BUDGETS_GIB = (16, 80)
#: The preset families of the concurrency table (the 120M and 350M of each; full attention first,
#: the baseline of the ratios).
FAMILIES = ("gpta2", "bswa", "swa_halfrope", "kvm256", "kvm_sqrt16", "kvm_swa_sat1024",
            "ovq_swa", "rwkv7")


def ragged_workload(count: int, median: int, longest_prompt: int, max_new: int, seed: int = 0):
  """``count`` (prompt ids, budget): log-normal prompt lengths (σ = 1) clipped to
  ``[1, longest_prompt]``, budgets uniform in ``[1, max_new]``, ids from a 256-token range."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(rng.lognormal(np.log(median), 1.0, count).astype(int), 1, longest_prompt)
  return [(rng.integers(0, 256, n).tolist(), int(rng.integers(1, max_new + 1)))
          for n in lengths]


def run_engine(model, workload, slots: int, max_len: int, prefill_chunk: int,
               prefill_bucket, prefill_lanes=None, tokens_per_step: int = 16) -> list:
  return kj.generate_many(model, [p for p, _ in workload], max_new_tokens=[n for _, n in workload],
                          slots=slots, max_len=max_len, prefill_chunk=prefill_chunk,
                          prefill_lanes=prefill_lanes, tokens_per_step=tokens_per_step,
                          prefill_bucket=prefill_bucket)


def run_one_at_a_time(model, workload, max_len: int, prefill_bucket) -> None:
  import jax
  import jax.numpy as jnp
  greedy = kj.SamplingConfig(temperature=0.0)
  for prompt, budget in workload:
    tokens, _ = kj.generate(model, jnp.asarray([prompt], jnp.int32), max_new_tokens=budget,
                            key=jax.random.PRNGKey(0), sampling=greedy, max_len=max_len,
                            prefill_bucket=prefill_bucket)
    jax.block_until_ready(tokens)


def run_padded_batches(model, workload, slots: int, max_len: int, prefill_bucket) -> None:
  import jax
  import jax.numpy as jnp
  greedy = kj.SamplingConfig(temperature=0.0)
  for start in range(0, len(workload), slots):
    batch = workload[start:start + slots]
    width = max(len(p) for p, _ in batch)
    rows = [[0] * (width - len(p)) + p for p, _ in batch]
    budget = max(n for _, n in batch)
    tokens, _ = kj.generate(model, jnp.asarray(rows, jnp.int32), max_new_tokens=budget,
                            key=jax.random.PRNGKey(0), sampling=greedy, max_len=max_len,
                            prefill_bucket=prefill_bucket)
    jax.block_until_ready(tokens)


def timed(fn, repeats: int = 3) -> float:
  """Seconds of ``fn()``, the best of ``repeats`` runs after one untimed call that compiles what
  it needs (the best, as a shared CPU's noise only ever adds time)."""
  fn()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def ttft_model(chunk: int):
  """The tiny KVM model of the time-to-first-token table: chunks of ``chunk`` tokens, two of
  them in the window, a fixed state of one chunk's rows (the paper's kvm256 at ``chunk`` 256)."""
  from flax import nnx
  kvm = kj.KVMConfig(chunk_size=chunk, window_chunks=2, sink_rows=1, rope_dims=8,
                     budget=kj.FixedBudget(chunk))
  return kj.LM(kj.presets.tiny(mixers="kvm", options={"kvm": kvm}), rngs=nnx.Rngs(0))


def first_token_seconds(engine, prompt: list[int], repeats: int) -> tuple[float, int]:
  """The best of ``repeats`` times from submitting ``prompt`` to the idle ``engine`` until its
  first token (the request then cancelled), and the decode rounds one such request runs."""
  best, rounds = float("inf"), 0
  for _ in range(repeats):
    before = engine.decode_rounds
    start = time.perf_counter()
    rid = engine.submit(prompt, max_new_tokens=2)
    while not engine.result(rid).tokens:
      engine.step()
    best = min(best, time.perf_counter() - start)
    rounds = engine.decode_rounds - before
    engine.cancel(rid)
    engine.release(rid)
  return best, rounds


def time_to_first_token(args) -> list[dict]:
  C = args.engine_ttft_chunk
  model = ttft_model(C)
  longest = max(args.engine_ttft_prompts)
  shape = dict(slots=2, max_len=longest + 2, prefill_chunk=2 * C, tokens_per_step=1)
  engines = {how: kj.Engine(model, **shape, rest_prefill=how) for how in ("decode", "lane")}
  for engine in engines.values():
    engine.warm_up()
  rows = []
  for length in args.engine_ttft_prompts:
    prompt = list(np.random.default_rng(length).integers(0, 256, length))
    row = {"chunk": C, "prompt_tokens": length, "rest_tokens": length % C}
    for how, engine in engines.items():
      row[f"{how}_s"], row[f"{how}_rounds"] = first_token_seconds(engine, prompt,
                                                                  args.engine_ttft_repeats)
    row["decode_over_lane"] = row["decode_s"] / row["lane_s"]
    rows.append(row)
    print(f"C={C} prompt {length:5d} (rest {length % C:3d}): first token after "
          f"{row['decode_s'] * 1e3:8.1f} ms with the rest through decode ({row['decode_rounds']} "
          f"rounds), {row['lane_s'] * 1e3:8.1f} ms with it in a lane ({row['lane_rounds']} "
          f"rounds) -> {row['decode_over_lane']:.2f}x", flush=True)
  return rows


def throughput(args) -> list[dict]:
  from flax import nnx
  rows = []
  bucket = args.engine_prefill_bucket or None
  for mixers in args.engine_mixers:
    pattern = tuple(mixers.split("+"))
    model = kj.LM(kj.presets.tiny(mixers=pattern if len(pattern) > 1 else pattern[0]),
                  rngs=nnx.Rngs(0))
    max_len = args.engine_max_len
    work = ragged_workload(args.engine_requests, args.engine_median_prompt, max_len // 2,
                           args.engine_max_new)
    tokens = sum(n for _, n in work)
    engine_s = timed(lambda: run_engine(model, work, args.engine_slots, max_len,
                                        args.engine_prefill_chunk, bucket,
                                        args.engine_prefill_lanes or None,
                                        args.engine_tokens_per_step))
    alone_s = timed(lambda: run_one_at_a_time(model, work, max_len, bucket))
    padded_s = timed(lambda: run_padded_batches(model, work, args.engine_slots, max_len, bucket))
    row = {"mixers": mixers, "requests": len(work), "generated_tokens": tokens,
           "prompt_tokens": sum(len(p) for p, _ in work), "engine_s": engine_s,
           "one_at_a_time_s": alone_s, "padded_batches_s": padded_s,
           "engine_tokens_per_s": tokens / engine_s,
           "vs_one_at_a_time": alone_s / engine_s, "vs_padded_batches": padded_s / engine_s}
    rows.append(row)
    print(f"{mixers:>10}: engine {tokens / engine_s:8.1f} tok/s ({engine_s:.2f} s); one at a "
          f"time {tokens / alone_s:8.1f} tok/s -> engine {row['vs_one_at_a_time']:.2f}x; "
          f"padded batches {tokens / padded_s:8.1f} tok/s -> engine "
          f"{row['vs_padded_batches']:.2f}x", flush=True)
  return rows


def preset_memory(name: str, context: int, dtype: str) -> dict:
  """One slot's decode-cache bytes at ``context`` tokens and the weights' bytes of a preset."""
  import jax.numpy as jnp
  from kvm_jax.nn.registry import cache_bytes
  cfg = getattr(kj.presets, name)()
  cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)
  per_slot = int(sum(cache_bytes(cfg, 1, context)))
  weights = kj.count_params(cfg)["total"] * jnp.dtype(dtype).itemsize
  return {"preset": name, "cache_bytes_per_slot": per_slot, "weight_bytes": int(weights),
          **{f"slots_{gib}gib": max(0, (gib * GIB - weights) // per_slot) for gib in BUDGETS_GIB}}


def concurrency(args) -> list[dict]:
  rows = []
  for size in ("120m", "350m"):
    base = None
    for family in FAMILIES:
      row = preset_memory(f"{family}_{size}", args.engine_context, args.engine_dtype)
      base = base or row
      for gib in BUDGETS_GIB:
        row[f"vs_full_{gib}gib"] = row[f"slots_{gib}gib"] / max(base[f"slots_{gib}gib"], 1)
      rows.append(row)
      print(f"{row['preset']:>22}: {row['cache_bytes_per_slot'] / 2 ** 20:9.1f} MiB per slot at "
            f"{args.engine_context} tokens; slots in 16 GiB {row['slots_16gib']:6d} "
            f"({row['vs_full_16gib']:.1f}x full), in 80 GiB {row['slots_80gib']:6d} "
            f"({row['vs_full_80gib']:.1f}x full)", flush=True)
  return rows


#: Contexts of the concurrency curve (``--plot``), tokens.
CURVE_CONTEXTS = (2048, 4096, 8192, 16384, 32768, 65536, 131072)


def concurrency_curve(size: str, dtype: str, gib: int = 80) -> dict[str, list[int]]:
  """Slots that fit in ``gib`` GiB beside the weights, per preset family of ``size``, at each of
  :data:`CURVE_CONTEXTS` (from the caches' shapes)."""
  return {family: [preset_memory(f"{family}_{size}", T, dtype)[f"slots_{gib}gib"]
                   for T in CURVE_CONTEXTS] for family in FAMILIES}


def plot(measured: dict, curve: dict, path: str, size: str) -> None:
  """Two panels: the ragged workload's tokens/s per arm and model, and slots in 80 GiB against
  context length per preset family."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  rows = measured["throughput"]
  arms = (("engine_s", "engine"), ("one_at_a_time_s", "generate, one at a time"),
          ("padded_batches_s", "padded static batches"))
  for i, (key, label) in enumerate(arms):
    left.bar(np.arange(len(rows)) + (i - 1) * 0.27, [r["generated_tokens"] / r[key] for r in rows],
             0.27, label=label)
  left.set_xticks(np.arange(len(rows)), [r["mixers"] for r in rows])
  left.set_ylabel("generated tokens / s")
  left.set_title("ragged workload (tiny models, this machine)")
  left.legend()
  for family, slots in curve.items():
    right.plot(CURVE_CONTEXTS, np.maximum(slots, 0.5), marker="o", label=family)
  right.set_xscale("log", base=2)
  right.set_yscale("log")
  right.set_xlabel("context (tokens)")
  right.set_ylabel("slots in 80 GiB beside the weights")
  right.set_title(f"concurrency, {size} presets")
  right.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


ENGINE_TABLES = ("ttft", "throughput", "concurrency")


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def add_flags(p) -> None:
  g = p.add_argument_group("the generation engine; --engine runs only these tables")
  g.add_argument("--engine", action="store_true",
                 help="time the engine's first token at the paper's chunk with a prompt's rest "
                      "in a lane and through decode, the engine on a ragged workload against "
                      "generate one prompt at a time and padded static batches, and count the "
                      "slots that fit at long context per preset")
  g.add_argument("--engine-tables", type=lambda s: [t for t in s.split(",") if t],
                 default=list(ENGINE_TABLES), metavar="TABLE,...",
                 help=f"the tables to run, of {','.join(ENGINE_TABLES)} (default: all)")
  g.add_argument("--engine-ttft-chunk", type=int, default=256,
                 help="the KVM chunk of the time-to-first-token table (default: %(default)s)")
  g.add_argument("--engine-ttft-prompts", type=_ints, default=[1, 100, 255, 257, 511],
                 metavar="N,...",
                 help="prompt lengths of the time-to-first-token table (default: "
                      "1,100,255,257,511)")
  g.add_argument("--engine-ttft-repeats", type=int, default=3,
                 help="timings per prompt and arm, the best kept (default: %(default)s)")
  g.add_argument("--engine-mixers", type=lambda s: [m for m in s.split(",") if m],
                 default=["swa+kvm", "kvm", "full"], metavar="PATTERN,...",
                 help="tiny models timed, '+' joining a hybrid's kinds (default: %(default)s)")
  g.add_argument("--engine-requests", type=int, default=32,
                 help="requests in the workload (default: %(default)s)")
  g.add_argument("--engine-median-prompt", type=int, default=48,
                 help="median prompt length, tokens (default: %(default)s)")
  g.add_argument("--engine-max-new", type=int, default=48,
                 help="largest output budget, tokens (default: %(default)s)")
  g.add_argument("--engine-max-len", type=int, default=256,
                 help="tokens per slot; prompts are at most half (default: %(default)s)")
  g.add_argument("--engine-slots", type=int, default=8,
                 help="engine slots, and the padded batches' size (default: %(default)s)")
  g.add_argument("--engine-prefill-chunk", type=int, default=32,
                 help="the engine's prompt tokens per slot and step (default: %(default)s)")
  g.add_argument("--engine-prefill-lanes", type=int, default=0,
                 help="prompts fed in parallel per engine step, 0 for every slot (default: "
                      "%(default)s)")
  g.add_argument("--engine-tokens-per-step", type=int, default=16,
                 help="the most tokens a decoding slot draws per engine step (default: "
                      "%(default)s)")
  g.add_argument("--engine-prefill-bucket", type=int, default=16,
                 help="prefill_bucket of all three arms, 0 for none (default: %(default)s)")
  g.add_argument("--engine-context", type=int, default=32768,
                 help="context of the concurrency table, tokens (default: %(default)s)")
  g.add_argument("--engine-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                 help="parameter and cache dtype of the concurrency table (default: "
                      "%(default)s)")


def run(args) -> dict:
  for name in ("engine_requests", "engine_median_prompt", "engine_max_new", "engine_max_len",
               "engine_slots", "engine_prefill_chunk", "engine_tokens_per_step",
               "engine_context"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.engine_max_new >= args.engine_max_len // 2:
    raise SystemExit(f"--engine-max-new {args.engine_max_new} must be below half of "
                     f"--engine-max-len {args.engine_max_len} (prompts take the other half).")
  unknown = [t for t in args.engine_tables if t not in ENGINE_TABLES]
  if unknown or not args.engine_tables:
    raise SystemExit(f"--engine-tables {','.join(args.engine_tables)!r}: choose one or more of "
                     f"{','.join(ENGINE_TABLES)}.")
  for name in ("engine_ttft_chunk", "engine_ttft_repeats"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if not args.engine_ttft_prompts or min(args.engine_ttft_prompts) < 1:
    raise SystemExit(f"--engine-ttft-prompts {args.engine_ttft_prompts}: give positive "
                     "lengths.")
  measured: dict[str, Optional[list]] = {}
  if "ttft" in args.engine_tables:
    print(f"time to first token, one prompt on an idle engine, tiny KVM model with chunks of "
          f"{args.engine_ttft_chunk}: the prompt's rest through decode vs in a lane", flush=True)
    measured["ttft"] = time_to_first_token(args)
  if "throughput" in args.engine_tables:
    print(f"ragged workload: {args.engine_requests} requests, log-normal prompts (median "
          f"{args.engine_median_prompt}), budgets 1..{args.engine_max_new}, "
          f"{args.engine_slots} slots; tokens/s of the tokens asked for", flush=True)
    measured["throughput"] = throughput(args)
  if "concurrency" in args.engine_tables:
    print(f"decode cache per slot at {args.engine_context} tokens ({args.engine_dtype}) and "
          f"slots beside the weights", flush=True)
    measured["concurrency"] = concurrency(args)
  if args.plot and {"throughput", "concurrency"} <= set(args.engine_tables):
    size = "120m"
    measured["curve"] = {"contexts": list(CURVE_CONTEXTS), "size": size,
                         "slots_80gib": concurrency_curve(size, args.engine_dtype)}
    plot(measured, measured["curve"]["slots_80gib"], args.plot, size)
    print(f"wrote {args.plot}", flush=True)
  return measured
