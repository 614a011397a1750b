"""Convert, then distil, at the default job's scale: what notebook 05 runs and plots.

On the main job's MQAR task (``kvm_jax.train.demo``: 64 tokens, 8 pairs, a 16-token exact
window) this trains the full-attention model, converts it to KVM (every layer, and alternate
layers), distils each conversion against the full model, and trains a KVM model from scratch for
the same total number of steps. Each model's recall is split by whether the queried key is in the
exact window or only in the compressed state, measured before conversion, right after it and
after distillation (docs/conversion.md reports the numbers).

Every run is a run directory under ``workdir`` (re-running resumes finished runs).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from flax import nnx

from kvm_jax.runs.train_config import DistillSpec, TrainConfig
from kvm_jax.runs.conversion import write_converted
from kvm_jax.runs.directory import is_run_directory, load_trained
from kvm_jax.train.demo import model_configs, train_config
from kvm_jax.train.evaluation import evaluate
from kvm_jax.train.loop import train

# The recipes compared after conversion: (name, stage, trainable). Each distils for the same
# number of steps against the full-attention teacher.
RECIPES = (("attention", "attention", "kvm_only"), ("logits", "logits", "all"))
CONVERSIONS = (("all", "all"), ("alternate", "odd"))


def _recall(workdir: Path, cfg: TrainConfig) -> dict:
  """Held-out recall of a run directory's newest parameters (the trainer's evaluation stream)."""
  _, model, step = load_trained(workdir)
  graphdef, params = nnx.split(model)
  metrics = evaluate(graphdef, params, dataclasses.replace(cfg, model=model.cfg),
                     cfg.eval_batches)
  return {"step": step, "recall": metrics["recall"],
          "in_window": metrics["recall_in_window"], "state_only": metrics["recall_state_only"],
          "eval_loss": metrics["eval_loss"]}


def _metrics(workdir: Path) -> list[dict]:
  path = workdir / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def family_models(family: str = "gptalpha2") -> dict:
  """The default job's models in backbone ``family`` (its default options: for "llama" RMSNorm,
  SwiGLU, rotate-half RoPE on the same 16 channels, no token shift or value residual)."""
  models = model_configs()
  if family == "gptalpha2":
    return models
  return {name: dataclasses.replace(cfg, family=family, family_options=None)
          for name, cfg in models.items()}


def run_study(workdir, steps: int = 600, distill_steps: int = 200, seed: int = 0,
              verbose: bool = False, family: str = "gptalpha2", from_scratch: bool = True) -> dict:
  """Trains, converts, distils and evaluates (module docstring) models of backbone ``family``
  (``from_scratch=False`` leaves out the KVM models trained from scratch).
  Returns ``{"rows": [...], "curves": {run: metrics lines}}``: one row per model with its recall
  in window / state only, the steps it saw from scratch (``pretrain``) and in distillation
  (``distill``)."""
  workdir = Path(workdir)
  models = family_models(family)
  base = lambda model, n: dataclasses.replace(train_config(model, n, seed), eval_every=0,
                                              checkpoint_every=n)
  teacher_cfg = base(models["full"], steps)
  teacher, rows = _train_teacher(workdir, teacher_cfg, "full attention (teacher)", verbose)
  curves = {}
  for label, layers in CONVERSIONS:
    rows += _convert_and_distill(workdir, label, teacher, teacher_cfg,
                                 base(models["kvm-sqrt"], distill_steps), steps, curves,
                                 layers=layers, verbose=verbose)
  for total in (distill_steps, steps + distill_steps) if from_scratch else ():
    run = workdir / f"kvm-scratch-{total}"
    cfg = base(models["kvm-sqrt"], total)
    train(cfg, run, verbose=verbose)
    rows.append(dict(model=f"KVM from scratch, {total} steps", pretrain=total, distill=0,
                     **_recall(run, cfg)))
  return {"rows": rows, "curves": curves}


def _train_teacher(workdir: Path, cfg: TrainConfig, name: str, verbose: bool
                   ) -> tuple[Path, list[dict]]:
  """Trains the full-attention teacher into ``workdir/full``: (its run, [its row ``name``])."""
  teacher = workdir / "full"
  train(cfg, teacher, verbose=verbose)
  return teacher, [dict(model=name, pretrain=cfg.steps, distill=0, **_recall(teacher, cfg))]


def _convert_and_distill(workdir: Path, label: str, teacher: Path, teacher_cfg: TrainConfig,
                         student_cfg: TrainConfig, steps: int, curves: dict, *, layers,
                         kvm=None, slug: Optional[str] = None, untrained: Optional[str] = None,
                         verbose: bool = False) -> list[dict]:
  """Converts ``teacher``'s ``layers`` (with ``kvm`` options, default: kvm-convert's) into
  ``workdir/converted-{slug}`` (``slug`` default: ``label``), then distils it by each of
  :data:`RECIPES` for ``student_cfg.steps`` steps into ``workdir/{slug}-{recipe}``: one row per
  model (recall against the teacher's task; the untrained one named "converted ({untrained}),
  no training", ``untrained`` default: "{label} layers"), each distillation run's metrics added
  to ``curves``."""
  slug = slug or label
  converted = workdir / f"converted-{slug}"
  if not is_run_directory(converted):
    write_converted(teacher, converted, layers=layers, kvm=kvm, progress=False)
  rows = [dict(model=f"converted ({untrained or label + ' layers'}), no training",
               pretrain=steps, distill=0, **_recall(converted, teacher_cfg))]
  for recipe, stage, trainable in RECIPES:
    run = workdir / f"{slug}-{recipe}"
    cfg = dataclasses.replace(
        student_cfg, init_from=str(converted), teacher=str(teacher),
        distill=DistillSpec(stage=stage, trainable=trainable),
        warmup_steps=min(20, student_cfg.steps // 4))
    train(cfg, run, verbose=verbose)
    rows.append(dict(model=f"converted ({label}) + {recipe} distillation", pretrain=steps,
                     distill=student_cfg.steps, **_recall(run, teacher_cfg)))
    curves[run.name] = _metrics(run)
  return rows


def state_rope_study(workdir, steps: int = 600, distill_steps: int = 200, seed: int = 0,
                     verbose: bool = False) -> dict:
  """What the KVM state keeps of a model that rotates every channel (docs/pretrained.md §3):
  the default job's full-attention model with RoPE on all channels of its heads, trained
  ``steps`` steps, every layer converted with every rotary channel zeroed in the state keys
  (``state_rope_dims=None``, the paper's rule) and with the slower half of the pairs kept
  (``head_dim / 2``, kvm-convert's choice for such models), each distilled by both recipes.
  Returns ``{"rows", "curves"}`` as :func:`run_study`."""
  workdir = Path(workdir)
  models = model_configs()
  rotary = models["full"].qk_head_dim

  def every_channel(cfg):
    kvm = dataclasses.replace(cfg.options_of("kvm"), rope_dims=rotary)
    return dataclasses.replace(cfg, rope_dims=rotary, options={**cfg.options, "kvm": kvm})

  base = lambda model, n: dataclasses.replace(train_config(every_channel(model), n, seed),
                                              eval_every=0, checkpoint_every=n)
  teacher_cfg = base(models["full"], steps)
  teacher, rows = _train_teacher(workdir, teacher_cfg,
                                 "full attention, RoPE on every channel (teacher)", verbose)
  student_cfg = base(models["kvm-sqrt"], distill_steps)
  curves = {}
  for zeroed in (None, rotary // 2):
    kvm = dataclasses.replace(student_cfg.model.options_of("kvm"), state_rope_dims=zeroed)
    label = (f"all layers, state keys zero all {rotary} rotary channels" if zeroed is None else
             f"all layers, state keys keep the {(rotary - zeroed) // 2} slowest rotary pairs")
    rows += _convert_and_distill(workdir, label, teacher, teacher_cfg, student_cfg, steps,
                                 curves, layers="all", kvm=kvm, untrained=label,
                                 slug=f"state-zeroes-{zeroed or rotary}", verbose=verbose)
  return {"rows": rows, "curves": curves}


def markdown_table(rows) -> str:
  lines = ["| model | steps from scratch | distillation steps | recall | in window | state only "
           "| eval loss |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['model']} | {r['pretrain']} | {r['distill']} | {r['recall']:.3f} | "
                 f"{r['in_window']:.3f} | {r['state_only']:.3f} | {r['eval_loss']:.3f} |")
  return "\n".join(lines)


def plot_study(study: dict, path: Optional[str] = None):
  """Recall bars (in window / state only) per model, and the KL to the teacher during each
  distillation run."""
  import matplotlib.pyplot as plt
  rows = study["rows"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
  x = range(len(rows))
  ax1.bar([i - 0.2 for i in x], [r["in_window"] for r in rows], 0.4, label="key in exact window")
  ax1.bar([i + 0.2 for i in x], [r["state_only"] for r in rows], 0.4,
          label="key only in the state")
  ax1.set_xticks(list(x), [r["model"].replace(", ", ",\n").replace(" + ", "\n+ ") for r in rows],
                 fontsize=7, rotation=30, ha="right")
  ax1.set_ylabel("MQAR recall")
  ax1.set_ylim(0, 1.05)
  ax1.legend(fontsize=8)
  for name, lines in study["curves"].items():
    ax2.plot([r["step"] for r in lines], [r["kl"] for r in lines], label=name)
  ax2.set_xlabel("distillation step")
  ax2.set_ylabel("KL(teacher ‖ student) per answer token")
  ax2.set_yscale("log")
  ax2.legend(fontsize=8)
  fig.suptitle("Full attention converted to KVM, then distilled (MQAR, tiny models, CPU)")
  fig.tight_layout()
  if path:
    fig.savefig(path, dpi=120)
  return fig
