"""Which settings a run may change when it resumes, and the check made before anything is written.

Re-running ``kvm-train`` on a workdir that holds checkpoints resumes it. That is only sound when
the new command trains the same model on the same data: the checkpoint's parameters must fit the
model, and the data reader's saved position must mean the same stream. Everything else (how long
to train, the schedule, logging, evaluation and checkpoint cadence, the memory settings of the
step, the mesh) may change; such a change is announced and recorded in the run's ``config.json``
history and in ``metrics.jsonl``.

:func:`check_resume` compares the new :class:`TrainConfig` with the one ``config.json`` records
and refuses, before any file is touched, a command that differs in a field that must not change,
naming each difference (old → new) and the two ways out.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvm_jax.config import io as config_io
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import checkpoint_steps, is_run_directory, load_config

# Fields (dotted paths of the TrainConfig) that a resumed run may change: length and schedule,
# logging and evaluation cadence, checkpoint retention, how the step is computed (remat,
# accumulation, loss slices, activation dtype, kernels) and where it runs (mesh, MFU peak), the
# non-finite policy and gradient clipping. Every other field (the model, the task and its data, the batch, the
# seed, the teacher and distillation stage) fixes what the checkpoint and the data position mean.
RESUMABLE = (
    "steps", "warmup_steps", "learning_rate", "weight_decay", "log_every", "eval_every",
    "checkpoint_every", "eval_batches", "keep_checkpoints", "mesh_data", "mesh_fsdp",
    "mesh_tensor", "peak_tflops_per_device", "remat", "grad_accum_steps", "loss_slice_len",
    "grad_clip_norm", "on_nonfinite", "init_from", "model.compute_dtype",
    "model.kvm_implementation", "model.attention_implementation")


@dataclasses.dataclass(frozen=True)
class Difference:
  """One config field that differs: its dotted path and both values as JSON-able data."""

  field: str
  old: Any
  new: Any

  @property
  def resumable(self) -> bool:
    return self.field in RESUMABLE

  def __str__(self) -> str:
    return f"{self.field}: {self.old!r} → {self.new!r}"


def config_differences(old: TrainConfig, new: TrainConfig) -> list[Difference]:
  """The fields whose values differ between two configs, in field order (a field only one of
  them has, such as a mixer kind's options, counts with None on the other side). The specs of a
  task neither config trains on (``mqar``, ``niah``) are not compared."""
  a, b = config_io.flat_fields(old), config_io.flat_fields(new)
  unused = {task for task in ("mqar", "niah") if task not in (old.task, new.task)}
  return [Difference(field, a.get(field), b.get(field)) for field in dict.fromkeys([*a, *b])
          if a.get(field) != b.get(field) and field.split(".")[0] not in unused]


def check_resume(cfg: TrainConfig, workdir) -> Optional[tuple[int, list[Difference]]]:
  """For a ``workdir`` that holds a run with checkpoints: ``(step it resumes from, the resumable
  fields this config changes)``; None when there is nothing to resume. A config that differs
  in any other field is refused with a ValueError that names each such field (old → new) and the
  two ways out; nothing has been written when it is raised."""
  steps = checkpoint_steps(workdir)
  if not steps or not is_run_directory(workdir):
    return None
  differences = config_differences(load_config(workdir), cfg)
  fixed = [d for d in differences if not d.resumable]
  if fixed:
    lines = "\n".join(f"  {d}" for d in fixed)
    raise ValueError(
        f"{workdir} holds a run (checkpoints up to step {steps[-1]}) that this command cannot "
        f"resume: it differs in what the checkpoint and the data position depend on:\n{lines}\n"
        "Nothing was written. Train this config in a new directory (--workdir=NEW_DIR), or start "
        f"a new run from this one's weights (--config.init_from={workdir} --workdir=NEW_DIR).")
  return steps[-1], differences


def change_record(step: int, differences: list[Difference]) -> dict:
  """What ``config.json``'s history and ``metrics.jsonl`` keep of a resume with changes."""
  return {"step": step, "config_changed": {d.field: [d.old, d.new] for d in differences}}
