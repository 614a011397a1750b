"""``kvm-eval``: evaluate trained run directories on NIAH, MQAR and position-wise loss; one report.

    kvm-eval --checkpoint runs/demo --suite niah,mqar,position_loss --out runs/demo/eval

``--checkpoint`` takes run directories (a ``kvm-train`` workdir, or a directory of them such as the
``kvm-demo`` workdir, whose sub-directories are each one model). For each model it runs

* **niah** — RULER single-needle S1 / S2-style / S3-style (``kvm_jax.tasks.niah``) at each
  ``--niah-lengths`` and ``--niah-depths`` needle depths, greedy generation, RULER's string-match
  score (0–100);
* **mqar** — MQAR recall per number of pairs, split by whether the queried key is inside the
  model's longest exact window (its own: an swa model's window, a KVM model's ``L``; reported) or
  only in a compressed state (``kvm_jax.eval.mqar``);
* **position_loss** — the text loss of held-out documents (the paper's validation by default:
  documents of at least 4096 characters, each from its first token over its first 4096 tokens;
  ``--packing`` pad / documents / cram) and its mean per ``--position-bucket`` positions
  (``kvm_jax.eval.position_loss``), plotted with one curve per model;

and writes ``results.json`` (everything, per depth and per bucket) and ``report.md`` (one row per
model, the paper's Table 2 layout: NIAH columns per length, MQAR recall, loss at the first and last
buckets) to ``--out``. A suite a model cannot run (e.g. a text task on a model whose vocabulary is
smaller than the tokenizer's) is recorded as skipped, with the reason, not silently dropped.

``--kvm.FIELD=VALUE`` evaluates every model's ``kvm`` layers under another schedule (the same
parameters: ``kj.with_kvm``), and ``--budget-sweep fixed:64,sqrt:16,...`` under each of several
budgets, adding a table of recall and loss against state rows to ``report.md`` and
``budget_sweep.png`` (docs/conversion.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from kvm_jax.util import compilation_cache
from kvm_jax.config.budget import budget_label, parse_budget, state_rows_after
from kvm_jax.eval import position_loss as position_lib
from kvm_jax.config.kvm import add_kvm_flag
from kvm_jax.runs import launch
from kvm_jax.tasks import niah
from kvm_jax.tasks.tokenizers import tokenizer

# JAX, the model and the suites are imported by the functions that use them, so that --help and a
# bad flag answer without them.
if TYPE_CHECKING:
  from kvm_jax.config.model import ModelConfig

SUITES = ("niah", "mqar", "position_loss")


# ----------------------------------------------------------------------------------------------
# Run directories
# ----------------------------------------------------------------------------------------------


def mqar_window(model_cfg: ModelConfig) -> tuple[Optional[int], str]:
  """Where MQAR recall splits into in-window / state-only for this model, and how to name it:
  the longest exact window of its layers (:func:`kvm_jax.nn.registry.exact_window`), so that
  "state only" means no layer still holds the queried key exactly. None: a full-attention layer
  sees every key, and every answer counts as in-window."""
  from kvm_jax.nn.registry import exact_window
  window = exact_window(model_cfg)
  kinds = "/".join(sorted(set(model_cfg.layer_mixers)))
  if window is None:
    return None, f"none (a full-attention layer sees every key; {kinds})"
  return window, f"{window} tokens (the longest exact window of its {kinds} layers)"


def find_runs(paths: Sequence[str]) -> list[Path]:
  """Run directories named by ``paths``: each path is a run (has ``config.json``) or holds runs."""
  from kvm_jax.runs.directory import is_run_directory
  runs = []
  for p in map(Path, paths):
    if is_run_directory(p):
      runs.append(p)
    elif p.is_dir() and any(is_run_directory(c) for c in p.iterdir()):
      runs.extend(sorted(c for c in p.iterdir() if is_run_directory(c)))
    else:
      raise SystemExit(f"--checkpoint {str(p)!r}: not a run directory (no config.json) and holds "
                       "none; point it at a kvm-train/kvm-demo --workdir.")
  return runs


def evaluate_run(run: Path, args) -> list[dict[str, Any]]:
  """The results of one run directory: one entry, or with ``--budget-sweep`` one per budget
  (a model without kvm layers is evaluated once, unchanged)."""
  from kvm_jax.nn.convert import describe_kvm, has_kvm_layers, with_kvm
  from kvm_jax.runs.directory import load_trained
  cfg, model, step = load_trained(run)
  fields = args.kvm_fields
  if not has_kvm_layers(cfg.model):
    return [evaluate_model(run.name, run, cfg, model, step, args,
                           note="no kvm layers: evaluated as trained" if fields or args.budget_sweep
                           else None)]
  budgets = args.budget_sweep or [None]
  results = []
  for budget in budgets:
    changes = dict(fields, **({} if budget is None else {"budget": budget}))
    try:
      changed = with_kvm(model, **changes) if changes else model
    except ValueError as e:
      raise SystemExit(f"{run}: {e}") from None
    name = run.name if budget is None else f"{run.name} @ {budget_label(budget)}"
    result = evaluate_model(name, run, dataclasses.replace(cfg, model=changed.cfg), changed,
                            step, args, budget=budget_label(changed.cfg.kvm.budget))
    if changes:
      result["kvm_overrides"] = describe_kvm(changed.cfg.kvm, only=changes)
    results.append(result)
  return results


def evaluate_model(name: str, run: Path, cfg, model, step: int, args,
                   budget: Optional[str] = None, note: Optional[str] = None) -> dict[str, Any]:
  from kvm_jax.nn.convert import describe_kvm, has_kvm_layers
  from kvm_jax.eval import mqar as mqar_eval, niah as niah_eval
  from kvm_jax.nn.model import count_params
  from kvm_jax.runs.directory import logits_fn
  from kvm_jax.tasks import mqar, text
  out: dict[str, Any] = {"model": name, "run": str(run), "step": step,
                         "mixers": list(cfg.model.layer_mixers),
                         "parameters": count_params(cfg.model)["total"]}
  if has_kvm_layers(cfg.model):
    out["kvm"] = describe_kvm(cfg.model.kvm)
    out["budget"] = budget or out["kvm"]["budget"]
  if note:
    out["note"] = note
  tok = tokenizer(cfg.tokenizer_file)
  text_ok = tok.vocab_size <= cfg.model.vocab_size
  no_text = (f"model vocabulary {cfg.model.vocab_size} is smaller than the tokenizer's "
             f"{tok.vocab_size} (trained on a synthetic task, cannot read text)")
  count = lambda text: len(tok.encode(text))
  say = (lambda what: print(f"{name}: {what}", flush=True)) if getattr(args, "verbose", False) \
      else (lambda what: None)
  if "niah" in args.suite:
    say("niah")
    t0 = time.perf_counter()
    if not text_ok:
      out["niah"] = {"skipped": no_text}
    else:
      predictor = niah_eval.EnginePredictor(model, tok, args.niah_gen_tokens,
                                            slots=args.niah_slots)
      out["niah"] = niah_eval.run_niah(
          predictor, count,
          tasks=args.niah_tasks, lengths=args.niah_lengths,
          depths=niah_eval.pick_depths(args.niah_depths), generation_budget=args.niah_gen_tokens,
          seed=args.seed, desc=f"{name} niah")
    out["niah_seconds"] = time.perf_counter() - t0
  if "mqar" in args.suite:
    say("mqar")
    spec = cfg.mqar if cfg.task == "mqar" else mqar.MQARSpec(
        seq_len=args.mqar_seq_len or 256, vocab_size=min(cfg.model.vocab_size, 256))
    seq_len = args.mqar_seq_len or spec.seq_len
    pairs, bad = [], []
    for n in args.mqar_pairs:
      try:
        mqar.MQARSpec(seq_len=seq_len, vocab_size=spec.vocab_size, num_pairs=n)
        pairs.append(n)
      except ValueError as e:
        bad.append(f"{n}: {e}")
    window, window_text = mqar_window(cfg.model)
    rows = mqar_eval.mqar_recall(logits_fn(model), seq_len=seq_len,
                                vocab_size=spec.vocab_size, pairs=pairs,
                                window=seq_len + 1 if window is None else window,
                                seed=args.seed + 10_000, batches=args.mqar_batches,
                                batch_size=args.mqar_batch_size)
    out["mqar"] = {"seq_len": seq_len, "vocab_size": spec.vocab_size, "window": window,
                   "window_note": window_text, "rows": rows, "skipped_pairs": bad}
    if has_kvm_layers(cfg.model):
      out["state_rows"] = state_rows_after(cfg.model.kvm, seq_len)
  if "position_loss" in args.suite:
    say("position_loss")
    if not text_ok:
      out["position_loss"] = {"skipped": no_text}
    else:
      docs = (text.read_documents(args.text_files) if args.text_files
              else text.embedded_corpus())
      try:
        token_docs = position_lib.eval_documents(docs, tok, args.position_context,
                                                 args.position_docs, args.text_min_chars)
      except ValueError as e:
        raise SystemExit(f"kvm-eval position_loss: {e}") from None
      try:
        loss = position_lib.text_loss(logits_fn(model), token_docs, args.position_context,
                                      args.position_bucket, args.packing, tok.eos_id)
      except ValueError as e:  # e.g. "documents" on a model with shared KVM routing
        out["position_loss"] = {"skipped": f"{args.packing} packing: {e}"}
      else:
        out["position_loss"] = dict(loss, bucket=args.position_bucket,
                                    context=args.position_context,
                                    min_chars=args.text_min_chars)
  return out


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

_SHORT = {"niah_single_1": "S1", "niah_single_2": "S2", "niah_single_3": "S3"}


def _length_label(n: int) -> str:
  return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _mean(values) -> float:
  import numpy as np
  values = [v for v in values if v is not None and not (isinstance(v, float) and np.isnan(v))]
  return float(np.mean(values)) if values else float("nan")


def sweep_rows(results: Sequence[dict]) -> list[dict]:
  """One row per evaluated (model, budget): state rows at the MQAR length, MQAR recall (all /
  in window / state only) and answer NLL averaged over the pair counts, and the mean text NLL."""
  rows = []
  for res in results:
    mq = (res.get("mqar") or {}).get("rows", [])
    pos = res.get("position_loss") or {}
    rows.append({
        "model": res["model"], "run": res["run"], "budget": res.get("budget"),
        "state_rows": res.get("state_rows"),
        "recall": _mean(r["recall"] for r in mq),
        "recall_in_window": _mean(r["recall_in_window"] for r in mq),
        "recall_state_only": _mean(r["recall_state_only"] for r in mq),
        "answer_nll": _mean(r.get("answer_nll") for r in mq),
        "text_nll": pos.get("text_nll", float("nan"))})
  return rows


def sweep_report(rows: Sequence[dict]) -> str:
  """The budget sweep as a markdown table."""
  import numpy as np
  fmt = lambda x: "–" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3f}"
  lines = ["| run | budget | state rows | MQAR recall | in window | state only | MQAR answer NLL "
           "| text NLL |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {Path(r['run']).name} | {r['budget'] or '– (no kvm layers)'} | "
                 f"{r['state_rows'] if r['state_rows'] is not None else '–'} | "
                 f"{fmt(r['recall'])} | {fmt(r['recall_in_window'])} | "
                 f"{fmt(r['recall_state_only'])} | {fmt(r['answer_nll'])} | "
                 f"{fmt(r['text_nll'])} |")
  return "\n".join(lines) + "\n"


def plot_sweep(rows: Sequence[dict], path: str) -> None:
  """State-only MQAR recall and MQAR answer NLL against state rows, one line per run."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  runs = dict.fromkeys(r["run"] for r in rows if r["state_rows"] is not None)
  for run in runs:
    mine = sorted((r for r in rows if r["run"] == run), key=lambda r: r["state_rows"])
    rows_x = [r["state_rows"] for r in mine]
    ax1.plot(rows_x, [r["recall_state_only"] for r in mine], "o-", label=Path(run).name)
    ax2.plot(rows_x, [r["answer_nll"] for r in mine], "o-", label=Path(run).name)
    for r in mine:
      ax1.annotate(r["budget"], (r["state_rows"], r["recall_state_only"]), fontsize=7,
                   textcoords="offset points", xytext=(3, 3))
  for r in rows:  # models without kvm layers: a horizontal reference
    if r["state_rows"] is None:
      ax1.axhline(r["recall_state_only"], ls="--", lw=1, color="gray")
      ax1.annotate(Path(r["run"]).name, (0, r["recall_state_only"]), fontsize=7, color="gray")
  ax1.set_xlabel("state rows at the MQAR length")
  ax1.set_ylabel("MQAR recall, key only in the state")
  ax1.set_ylim(0, 1.05)
  ax2.set_xlabel("state rows at the MQAR length")
  ax2.set_ylabel("MQAR answer NLL")
  for ax in (ax1, ax2):
    ax.legend(fontsize=8)
  fig.suptitle("One trained model under several test-time KVM budgets")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def schedule_text(res: dict) -> str:
  """The KVM schedule a result was evaluated under, and what the command changed of it."""
  kvm = res["kvm"]
  text = (f"KVM schedule: budget {kvm['budget']}, window {kvm['window_chunks']} chunks of "
          f"{kvm['chunk_size']} tokens, {kvm['sink_rows']} sink row(s), max_state_rows "
          f"{kvm['max_state_rows']}")
  changed = res.get("kvm_overrides")
  if changed:
    text += " (set for this evaluation: " + ", ".join(f"{k}={v}" for k, v in changed.items()) + ")"
  return text


def markdown_report(results: Sequence[dict]) -> str:
  """One row per model: NIAH score per task and length, MQAR recall, first/last-bucket NLL."""
  import numpy as np
  niah_cols = sorted({(r["task"], r["length"]) for res in results
                      for r in (res.get("niah") if isinstance(res.get("niah"), list) else [])},
                     key=lambda c: (c[0], c[1]))
  mqar_pairs = sorted({r["pairs"] for res in results
                       for r in (res.get("mqar") or {}).get("rows", [])})
  header = ["model", "mixers", "params"]
  header += [f"NIAH-{_SHORT[t]} {_length_label(n)}" for t, n in niah_cols]
  header += [f"MQAR {p} pairs (all / state-only)" for p in mqar_pairs]
  header += ["text NLL", "NLL first bucket", "NLL last bucket"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  fmt = lambda x: "–" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3f}"
  for res in results:
    row = [res["model"], "/".join(sorted(set(res["mixers"]))), f"{res['parameters'] / 1e6:.2f}M"]
    niah = res.get("niah")
    scores = {(r["task"], r["length"]): r["score"] for r in niah} if isinstance(niah, list) else {}
    row += [f"{scores[c]:.1f}" if c in scores else "skipped" if niah else "–" for c in niah_cols]
    mq = {r["pairs"]: r for r in (res.get("mqar") or {}).get("rows", [])}
    row += [f"{fmt(mq[p]['recall'])} / {fmt(mq[p]['recall_state_only'])}" if p in mq else "–"
            for p in mqar_pairs]
    pos = res.get("position_loss") or {}
    row += ([fmt(pos["text_nll"]), fmt(pos["nll"][0]), fmt(pos["nll"][-1])] if "nll" in pos
            else ["–", "–", "–"])
    lines.append("| " + " | ".join(row) + " |")
  notes = [f"- {res['model']}: {suite} skipped — {res[suite]['skipped']}"
           for res in results for suite in SUITES
           if isinstance(res.get(suite), dict) and "skipped" in res[suite]]
  notes += [f"- {res['model']}: {res['note']}" for res in results if res.get("note")]
  notes += [f"- {res['model']}: {schedule_text(res)}" for res in results if res.get("kvm")]
  notes += [f"- {res['model']}: MQAR state-only = queried key farther back than "
            f"{res['mqar']['window_note']}" for res in results if "window_note" in
            (res.get("mqar") or {})]
  notes += [f"- {res['model']}: text NLL over {res['position_loss']['tokens']} tokens of "
            f"{res['position_loss']['documents']} documents of >= "
            f"{res['position_loss']['min_chars']} characters (first "
            f"{res['position_loss']['context'] + 1} tokens each), "
            f"{res['position_loss']['packing']} packing" for res in results
            if "nll" in (res.get("position_loss") or {})]
  table = "\n".join(lines)
  return table + ("\n\n" + "\n".join(notes) if notes else "") + "\n"


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
  try:
    values = [int(x) for x in re.split(r"[,\s]+", text.strip()) if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
  return values


def _names(choices: Sequence[str]):
  def parse(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in choices]
    if bad or not names:
      raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; choose from {list(choices)}")
    return names
  return parse


def _budgets(text: str) -> list:
  try:
    budgets = [parse_budget(x) for x in text.split(",") if x.strip()]
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  if not budgets:
    raise argparse.ArgumentTypeError(f"no budget in {text!r}")
  return budgets


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-eval", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", action="append", required=True,
                 help="run directory, or a directory of run directories (repeatable)")
  p.add_argument("--suite", type=_names(SUITES), default=list(SUITES),
                 help="comma-separated suites (default: niah,mqar,position_loss)")
  p.add_argument("--out", default=None,
                 help="output directory for results.json/report.md (default: a new folder "
                      "<first checkpoint>/eval/<date-time> for every evaluation; an --out that "
                      "holds an earlier evaluation is replaced, and the command says so)")
  p.add_argument("--seed", type=int, default=0, help="seed of every generated example")
  g = p.add_argument_group("several processes (a pod): every process runs the same command and "
                           "computes the same results; process 0 writes and prints them")
  launch.add_flags(g)
  g = p.add_argument_group(
      "test-time KVM schedules (the kvm layers of every model; models without any are evaluated "
      "as trained)")
  add_kvm_flag(g, "the kvm layers' (for the evaluation; the parameters unchanged: kj.with_kvm)")
  g.add_argument("--budget-sweep", type=_budgets, default=None, metavar="SPEC,...",
                 help="evaluate every kvm model under each of these budgets (e.g. "
                      "fixed:64,fixed:256,sqrt:16,sat:1024); report.md gains a table of recall "
                      "and loss against state rows and budget_sweep.png plots them.")
  g = p.add_argument_group("NIAH")
  g.add_argument("--niah-tasks", type=_names(niah.TASKS), default=list(niah.TASKS),
                 help="RULER tasks (default: all three single-needle tasks)")
  g.add_argument("--niah-lengths", type=_ints, default=None,
                 help="target lengths in tokens, prompt + generation (default: the paper's "
                      "4K,8K,16K,32K on a GPU or TPU; 512,1K,2K on a CPU, where the paper's "
                      "take hours)")
  g.add_argument("--niah-depths", type=int, default=None,
                 help="needle depths per length, spread over RULER's 40 (default: 40 on a GPU "
                      "or TPU, 5 on a CPU)")
  g.add_argument("--niah-gen-tokens", type=int, default=128,
                 help="generation budget in tokens, reserved in the length (default: 128)")
  g.add_argument("--niah-slots", type=int, default=8,
                 help="examples generated together, the slots of the generation engine "
                      "(kj.Engine; default: 8); every example's text is the one it gets alone")
  g = p.add_argument_group("MQAR")
  g.add_argument("--mqar-pairs", type=_ints, default=[4, 8, 16],
                 help="numbers of key-value pairs (default: 4,8,16)")
  g.add_argument("--mqar-seq-len", type=int, default=0,
                 help="sequence length (default: the run's MQAR length, 256 for text runs)")
  g.add_argument("--mqar-batches", type=int, default=4, help="batches per pair count")
  g.add_argument("--mqar-batch-size", type=int, default=16, help="sequences per batch")
  g = p.add_argument_group("text loss and position-wise loss (suite position_loss)")
  g.add_argument("--position-context", type=int, default=4096,
                 help="positions scored per document: each is cut to its first N + 1 tokens "
                 "(default: 4096, the paper's validation)")
  g.add_argument("--position-bucket", type=int, default=1024,
                 help="bucket size in tokens (default: 1024, as in the paper)")
  g.add_argument("--position-docs", type=int, default=8,
                 help="held-out documents scored (the first N long enough; default 8)")
  g.add_argument("--text-min-chars", type=int, default=position_lib.PAPER_MIN_CHARS,
                 help="score only documents of at least this many characters (default 4096, "
                 "the paper's validation)")
  g.add_argument("--packing", choices=("pad", "documents", "cram"), default="pad",
                 help="how documents fill rows for the text loss: 'pad' (default, the paper's "
                 "validation: each document alone from its first token), 'documents' (packed "
                 "with segment ids; equals 'pad' exactly, in fewer rows), 'cram' (concatenated, "
                 "as the authors train: state and window carry across documents; positions are "
                 "row positions)")
  g.add_argument("--text-files", nargs="*", default=(),
                 help="local .txt/.jsonl documents (default: the embedded corpus)")
  compilation_cache.add_flag(p)
  return p


# NIAH sizes: the paper's (Table 2) and what a CPU evaluates in minutes.
NIAH_SIZES = {"accelerator": ([4096, 8192, 16384, 32768], 40), "cpu": ([512, 1024, 2048], 5)}


def resolve_niah_sizes(args, platform: str) -> None:
  """Fills ``--niah-lengths`` / ``--niah-depths`` left unset with the platform's defaults."""
  lengths, depths = NIAH_SIZES["cpu" if platform == "cpu" else "accelerator"]
  args.niah_lengths = args.niah_lengths or lengths
  args.niah_depths = args.niah_depths or depths


def niah_plan(args) -> str:
  """What the NIAH suite will generate, and the flags that change it."""
  lengths = ",".join(_length_label(n) for n in args.niah_lengths)
  count = len(args.niah_tasks) * len(args.niah_lengths) * args.niah_depths
  return (f"niah: {len(args.niah_tasks)} tasks x lengths {lengths} x {args.niah_depths} depths = "
          f"{count} generations of up to {args.niah_gen_tokens} tokens per model "
          "(--niah-tasks, --niah-lengths, --niah-depths, --niah-gen-tokens change it)")


def output_dir(args) -> Path:
  """``--out``, or a new ``<first checkpoint>/eval/<date-time>`` folder; says when an earlier
  evaluation there is replaced."""
  if args.out:
    out = Path(args.out)
    if (out / "results.json").exists():
      print(f"note: {out} holds an earlier evaluation; its results are replaced", flush=True)
    return out
  out = Path(args.checkpoint[0]) / "eval" / time.strftime("%Y%m%d-%H%M%S")
  while out.exists():  # two evaluations in one second
    out = out.with_name(out.name + "-1")
  return out


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = build_parser()
  args, rest = parser.parse_known_args(argv)
  compilation_cache.enable(args.compilation_cache)
  import jax
  from kvm_jax.nn.convert import kvm_flags
  from kvm_jax.ops.common import current_platform
  try:
    args.kvm_fields = kvm_flags(args, rest)
  except ValueError as e:
    parser.error(str(e))
  if args.budget_sweep and "budget" in args.kvm_fields:
    parser.error("--kvm.budget and --budget-sweep both set the budget; give one.")
  for name in ("niah_gen_tokens", "niah_slots", "mqar_batches", "mqar_batch_size", "position_docs"):
    if getattr(args, name) < 1:
      raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.text_min_chars < 0:
    raise SystemExit(f"--text-min-chars must be >= 0, got {args.text_min_chars}.")
  if args.position_context % args.position_bucket:
    raise SystemExit(f"--position-context {args.position_context} is not a multiple of "
                     f"--position-bucket {args.position_bucket}.")
  launch.check_flags(args)
  launch.load_plugins(args)
  launch.start(args)
  resolve_niah_sizes(args, current_platform())
  primary = jax.process_index() == 0
  args.verbose = primary
  runs = find_runs(args.checkpoint)
  out_dir = output_dir(args) if primary else None
  if primary and "niah" in args.suite:
    print(niah_plan(args), flush=True)
  results = []
  for run in runs:
    if primary:
      print(f"== {run}", flush=True)
    try:
      results.extend(evaluate_run(run, args))
    except ValueError as e:  # a run that cannot be read (no checkpoint, a damaged one)
      raise SystemExit(f"kvm-eval: {e}") from None
  if not primary:
    return 0
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "results.json").write_text(json.dumps(
      {"args": {k: v for k, v in vars(args).items()}, "results": results}, indent=2,
      default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)))
  report = markdown_report(results)
  if args.budget_sweep:
    rows = sweep_rows(results)
    report += "\n## Test-time budgets\n\n" + sweep_report(rows)
    plot_sweep(rows, str(out_dir / "budget_sweep.png"))
  (out_dir / "report.md").write_text(report)
  curves = {r["model"]: r["position_loss"]["nll"] for r in results
            if "nll" in (r.get("position_loss") or {})}
  if curves:
    position_lib.plot(curves, args.position_bucket, str(out_dir / "position_loss.png"),
                      args.packing)
  print("\n" + report)
  plots = ([str(out_dir / "position_loss.png")] if curves else []) + (
      [str(out_dir / "budget_sweep.png")] if args.budget_sweep else [])
  print(f"wrote {out_dir / 'results.json'} and {out_dir / 'report.md'}"
        + "".join(f" and {p}" for p in plots))
  return 0


if __name__ == "__main__":
  sys.exit(main())
