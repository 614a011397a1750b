"""The embedded-default main job (``kvm-demo``): recall vs memory on MQAR, on CPU, in minutes.

Trains four tiny models of identical size on the same synthetic multi-query associative recall
stream (no download) and compares what they remember:

* **full** — causal attention over everything (the upper bound);
* **bswa** — block sliding window of L = 16 tokens, nothing beyond it (the lower bound);
* **kvm-fixed** — the same exact window plus a fixed 8-row compressed state;
* **kvm-sqrt** — the same window plus a state growing as 4·√N rows.

Recall is split by where the queried key sits: *in window* (the key is among the last L tokens, so
the four default models see it exactly) or *state only* (it left the window: only full attention
and the KVM state can still answer among them). ``--models`` can add the paper's two other
recurrent baselines at the same width and depth, for which the split only says how far back the
key is: **ovq-swa** (an SWA layer over L = 16 tokens, then an OVQ layer: chunks of 8, at most 16
centroids) and **rwkv7** (two RWKV-7 layers: a 32 x 32 state per head, no exact window). Writes
``summary.json``, the same numbers as a table in ``report.md``, ``recall.png`` and each model's
``metrics.jsonl`` + checkpoints under ``--workdir``; re-running resumes finished models.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import kvm_jax as kj  # its names import JAX on first use, after the arguments are parsed
from kvm_jax.util import compilation_cache

# The model, task and trainer modules import JAX: each function below imports what it uses, so
# that --help and a bad flag answer without it.
if TYPE_CHECKING:
  from kvm_jax.runs.train_config import TrainConfig

CHUNK, WINDOW_CHUNKS = 8, 2
VALUES = 32  # value vocabulary of the MQAR task: chance recall is 1/32
# What the demo's two reference models must show beyond the window (model name -> (rule on its
# state-only recall, the claim in words)), checked when both ran.
SANITY = {"full": (lambda recall: recall >= 0.9, "full attention state-only recall >= 0.90"),
          "bswa": (lambda recall: abs(recall - 1 / VALUES) <= 0.1,
                   "BSWA within 0.1 of chance beyond its window")}
DEFAULT_MODELS = ("full", "bswa", "kvm-fixed", "kvm-sqrt")


def model_configs() -> dict[str, kj.ModelConfig]:
  from kvm_jax.nn.mixers.bswa import BSWAOptions
  from kvm_jax.nn.mixers.rwkv7 import RWKV7Options
  from kvm_jax.nn.mixers.swa import SWAOptions
  from kvm_jax.ops.ovq.config import OVQConfig
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  # vocab 320 = the byte tokenizer's: MQAR uses ids < 64, and `kvm-eval` can still run the text
  # suites (NIAH, position-wise loss) on these models.
  base = dict(vocab_size=ByteTokenizer.vocab_size, num_layers=2, hidden_size=64, num_heads=2,
              rope_dims=16, mup_base_dim=64)
  kvm = lambda budget: kj.KVMConfig(chunk_size=CHUNK, window_chunks=WINDOW_CHUNKS, sink_rows=1,
                                    rope_dims=16, budget=budget)
  # Every model carries the same KVM options: its window is what splits recall into in-window
  # and state-only for the baselines too.
  options = lambda budget: {"kvm": kvm(budget),
                            "bswa": BSWAOptions(CHUNK, WINDOW_CHUNKS, sink_rows=0)}
  fixed, sqrt = kj.FixedBudget(CHUNK), kj.PowerLawBudget(4.0, 0.5, min_rows=CHUNK)
  baselines = {**options(sqrt), "swa": SWAOptions(window=CHUNK * WINDOW_CHUNKS, rope_dims=16),
               "ovq": OVQConfig(chunk_size=CHUNK, max_centroids=2 * CHUNK),
               "rwkv7": RWKV7Options(chunk_size=16)}
  return {
      "full": kj.presets.tiny(mixers="full", options=options(sqrt), **base),
      "bswa": kj.presets.tiny(mixers="bswa", options=options(sqrt), **base),
      "kvm-fixed": kj.presets.tiny(mixers="kvm", options=options(fixed), **base),
      "kvm-sqrt": kj.presets.tiny(mixers="kvm", options=options(sqrt), **base),
      "ovq-swa": kj.presets.tiny(mixers=("swa", "ovq"), options=baselines, **base),
      "rwkv7": kj.presets.tiny(mixers="rwkv7", options=baselines, **base),
  }


def train_config(model: kj.ModelConfig, steps: int, seed: int) -> TrainConfig:
  from kvm_jax.runs.train_config import TrainConfig
  from kvm_jax.tasks.mqar import MQARSpec
  # 32 sequences per step: the recall each model reaches in 600 steps is that of 64 per step
  # (full and kvm-sqrt 1.00, kvm-fixed 0.97 beyond the window, BSWA near chance), in half the
  # time. The evaluation reads the same 512 held-out sequences (16 batches of 32).
  return TrainConfig(model=model, task="mqar",
                     mqar=MQARSpec(seq_len=64, vocab_size=64, num_pairs=8),
                     batch_size=32, steps=steps, warmup_steps=min(50, steps // 4),
                     learning_rate=3e-3,
                     weight_decay=0.1, seed=seed, log_every=25, eval_every=0,
                     checkpoint_every=max(steps // 4, 1), eval_batches=16)


def plot(results: dict, losses: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  names = list(results)
  x = range(len(names))
  ax1.bar([i - 0.2 for i in x], [results[n]["recall_in_window"] for n in names], 0.4,
          label="key in exact window")
  ax1.bar([i + 0.2 for i in x], [results[n]["recall_state_only"] for n in names], 0.4,
          label="key only in compressed state")
  ax1.axhline(1 / VALUES, color="gray", ls="--", lw=1, label="chance")
  ax1.set_xticks(list(x), [f"{n}\n({results[n]['memory']})" for n in names])
  ax1.set_ylabel("MQAR recall")
  ax1.set_ylim(0, 1.05)
  ax1.legend(fontsize=8)
  for n in names:
    steps, values = zip(*losses[n]) if losses[n] else ((), ())
    ax2.plot(steps, values, label=n)
  ax2.set_xlabel("step")
  ax2.set_ylabel("training loss")
  ax2.set_yscale("log")
  ax2.legend(fontsize=8)
  fig.suptitle("Recall vs memory on MQAR (tiny models, CPU)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _loss_text(loss: float) -> str:
  return "–" if math.isnan(loss) else f"{loss:.4f}"  # NaN: no training line was logged


def summary_report(results: dict) -> str:
  """The demo's results (``summary.json``: model name -> recall, memory, losses, time) as a
  markdown table under a line naming the task."""
  lines = [f"MQAR, seq 64, 8 pairs, exact window L = {CHUNK * WINDOW_CHUNKS} tokens, chance "
           f"{1 / VALUES:.3f}", "",
           "| model | memory beyond the window | recall | in window | state only | eval loss "
           "| last train loss | time (s) |", "|---|---|---|---|---|---|---|---|"]
  for name, r in results.items():
    lines.append(f"| {name} | {r['memory']} | {r['recall']:.3f} | {r['recall_in_window']:.3f} | "
                 f"{r['recall_state_only']:.3f} | {r['eval_loss']:.4f} | "
                 f"{_loss_text(r['final_train_loss'])} | {r['seconds']:.0f} |")
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-demo", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--workdir", default="runs/demo",
                 help="output directory (default: %(default)s); re-running resumes")
  p.add_argument("--steps", type=int, default=600,
                 help="training steps per model (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0, help="initialization and data seed")
  p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                 help="comma-separated models: full, bswa, kvm-fixed, kvm-sqrt (the default "
                      "four), and the paper's other baselines ovq-swa and rwkv7")
  compilation_cache.add_flag(p)
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  compilation_cache.enable(args.compilation_cache)
  from kvm_jax.nn.registry import memory_in_words
  from kvm_jax.train.evaluation import evaluate
  from kvm_jax.train.loop import train
  workdir = Path(args.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  configs = model_configs()
  wanted = [m for m in args.models.split(",") if m]
  unknown = [m for m in wanted if m not in configs]
  if unknown:
    raise SystemExit(f"--models: unknown {unknown}; choose from {list(configs)}.")
  if args.steps < 1:
    raise SystemExit(f"--steps={args.steps}: train at least 1 step (default 600).")
  results, losses = {}, {}
  for name in wanted:
    cfg = train_config(configs[name], args.steps, args.seed)
    print(f"== {name}: {kj.count_params(cfg.model)['total']:,} parameters, "
          f"{args.steps} steps", flush=True)
    start = time.perf_counter()
    out = train(cfg, workdir / name)
    metrics = evaluate(out["graphdef"], out["params"], cfg, cfg.eval_batches)
    lines = (workdir / name / "metrics.jsonl").read_text().splitlines()
    losses[name] = [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]
    options = cfg.model.options_of(cfg.model.layer_mixers[0])
    rows = (kj.state_rows_after(options, cfg.mqar.seq_len) if isinstance(options, kj.KVMConfig)
            else 0)
    results[name] = dict(metrics, state_rows=rows, memory=memory_in_words(cfg.model, cfg.mqar.seq_len),
                         seconds=time.perf_counter() - start,
                         final_train_loss=losses[name][-1][1] if losses[name] else float("nan"))
  report = summary_report(results)
  print("\n" + report)
  (workdir / "summary.json").write_text(json.dumps(results, indent=2))
  (workdir / "report.md").write_text(report)
  plot(results, losses, workdir / "recall.png")
  print(f"wrote {workdir / 'summary.json'}, {workdir / 'report.md'}, {workdir / 'recall.png'} "
        "and per-model metrics.jsonl")
  sane = {name: (rule(results[name]["recall_state_only"]), text)
          for name, (rule, text) in SANITY.items() if name in results}
  if len(sane) == len(SANITY):
    print("sanity: " + "; ".join(f"{text}: {'yes' if ok else 'NO'}" for ok, text in sane.values()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
