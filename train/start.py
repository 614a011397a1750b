"""Where a run starts: its model and optimizer, sharded; fine-tuning's model and parameters.

Resuming from the run's own checkpoint is the checkpoint hook's (:mod:`kvm_jax.train.hooks`),
which also writes them.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

import jax
import optax
from etils import epath
from flax import nnx

from kvm_jax.config import io as config_io
from kvm_jax.hf.load import checkpoint_kind
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.model import LM
from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.train_config import TEACHER_TASK, TrainConfig
from kvm_jax.runs.directory import (CHECKPOINT_DIR, CONVERSION_RECORD, IMPORT_RECORD,
                                    is_run_directory, load_config)
from kvm_jax.train import adamc as adamc_lib
from kvm_jax.train import completep, sharding

#: Model fields a fine-tuning run (TrainConfig.init_from) takes from its own config; every other
#: field comes from the run it starts from, whose parameters fix the architecture.
FINE_TUNE_FIELDS = ("param_dtype", "compute_dtype", "kvm_implementation",
                    "attention_implementation")


def make_optimizer(cfg: TrainConfig, params, trainable: Optional[Callable[[Any], bool]] = None
                   ) -> optax.GradientTransformation:
  """AdamC with CompleteP's per-group learning-rate and weight-decay scales and ``cfg``'s
  schedule; a float32 master copy of the parameters when they are stored in lower precision.
  ``trainable`` (``path -> bool`` over the parameters' state paths) freezes the parameters it
  rejects: the optimizer then keeps state for the others only
  (:func:`~kvm_jax.train.adamc.partly_frozen`)."""
  lr_scale, wd_scale = completep.mup_scales(params, cfg.model)
  mask = None
  if trainable is not None:
    mask = [bool(trainable(path)) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    lr_scale, wd_scale = (adamc_lib.pick_leaves(t, mask) for t in (lr_scale, wd_scale))
  schedule = completep.lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps)
  opt = adamc_lib.adamc(schedule, peak_learning_rate=cfg.learning_rate,
                        weight_decay=cfg.weight_decay, lr_scale=lr_scale, wd_scale=wd_scale)
  if cfg.model.param_dtype != "float32":
    opt = adamc_lib.with_float32_master(opt)
  return opt if mask is None else adamc_lib.partly_frozen(opt, mask)


def with_init_model(cfg: TrainConfig, workdir=None) -> TrainConfig:
  """``cfg`` with ``model`` taken from ``cfg.init_from``'s run directory (except
  :data:`FINE_TUNE_FIELDS`), or from ``workdir``'s own config once the fine-tuning run has
  started there (so resuming does not need ``init_from`` any more); ``cfg`` itself when it starts
  from scratch. The fields of ``cfg.model`` this replaces with other values are named on stderr
  (:func:`replaced_model_fields`): a ``--config.model.FIELD`` has no effect here."""
  if not cfg.init_from:
    return cfg
  if workdir is not None and is_run_directory(workdir):
    source, owner = load_config(workdir).model, f"the run in {workdir}"
  elif not is_run_directory(cfg.init_from):
    raise ValueError(f"init_from={cfg.init_from!r} is not a run directory (no config.json); give "
                     "a kvm-train workdir or a kvm-import output (kvm-import converts the "
                     "authors' checkpoints).")
  elif checkpoint_kind(cfg.init_from) != "run":
    raise ValueError(f"init_from={cfg.init_from!r} is a checkpoint in the authors' format; "
                     f"convert it first: kvm-import {cfg.init_from} RUN_DIR, then "
                     "--config.init_from=RUN_DIR.")
  else:
    source, owner = load_config(cfg.init_from).model, f"init_from={cfg.init_from}"
  model = dataclasses.replace(source, **{f: getattr(cfg.model, f) for f in FINE_TUNE_FIELDS})
  replaced = replaced_model_fields(cfg.model, model)
  if replaced:
    # Said, not refused: a config file's model may only stand in for the run's (distill.py),
    # but a --config.model.FIELD that the run's model overrides must not vanish without a word.
    print(f"note: the model is {owner}'s, which replaces this config's "
          f"{', '.join(replaced)} (only {', '.join(FINE_TUNE_FIELDS)} are this config's).",
          file=sys.stderr, flush=True)
  return dataclasses.replace(cfg, model=model)


def replaced_model_fields(mine: ModelConfig, theirs: ModelConfig) -> list[str]:
  """``"model.FIELD=MINE → THEIRS"`` for each model field (dotted, as ``--config.model.FIELD``
  names it) whose value in ``mine`` a fine-tuning run's model ``theirs`` replaces."""
  a, b = config_io.flat_fields(mine), config_io.flat_fields(theirs)
  return [f"model.{f}={config_io.value_text(a.get(f))} → {config_io.value_text(b.get(f))}"
          for f in dict.fromkeys([*a, *b]) if a.get(f) != b.get(f)]


#: What a run trains on: the task, its spec, the corpus and the tokenizer. ``TrainConfig.task =
#: "teacher"`` (the distillation configs' default) takes all of them from the teacher's run (a KL
#: compares the two models on the same ids); the text sequence length stays the student's own
#: choice (distillation usually runs past the window the teacher was trained at).
DATA_FIELDS = ("task", "mqar", "niah", "text_files", "tokenizer_file", "hf_dataset", "hf_split",
               "hf_text_field", "data_dir")


def with_teacher_task(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` with ``task="teacher"`` replaced by the task and data of the teacher's run
  (:data:`DATA_FIELDS`); ``cfg`` itself for any other task."""
  if cfg.task != TEACHER_TASK:
    return cfg
  if not cfg.teacher:
    raise ValueError("task='teacher' trains on the teacher run's task, but no teacher is set: "
                     "give --config.teacher=RUN_DIR, or a task ('mqar', 'niah' or 'text').")
  if not is_run_directory(cfg.teacher):
    raise ValueError(f"teacher={cfg.teacher!r} is not a run directory (no config.json); give a "
                     "kvm-train workdir or a kvm-import output.")
  source = load_config(cfg.teacher)
  return dataclasses.replace(cfg, **{f: getattr(source, f) for f in DATA_FIELDS})


def check_workdir(cfg: TrainConfig, workdir: epath.Path) -> None:
  """Refuses a ``workdir`` that cannot hold this run: a kvm-import output (parameters without
  an optimizer state) or the directory a fine-tuning run starts from."""
  for record, tool in ((IMPORT_RECORD, "kvm-import"), (CONVERSION_RECORD, "kvm-convert")):
    if (workdir / record).exists():
      raise ValueError(f"{workdir} was written by {tool}: it holds parameters without an "
                       f"optimizer state. Fine-tune from it in a new directory: "
                       f"--config.init_from={workdir} --workdir=NEW_DIR.")
  if cfg.teacher and epath.Path(cfg.teacher).resolve() == workdir.resolve():
    raise ValueError(f"teacher={cfg.teacher!r} is the workdir itself; the student writes to "
                     "another directory.")
  if cfg.init_from and epath.Path(cfg.init_from).resolve() == workdir.resolve():
    raise ValueError(f"init_from={cfg.init_from!r} is the workdir itself; write the fine-tuning "
                     "run to another directory.")


def setup(cfg: TrainConfig, mesh=None, trainable: Optional[Callable[[Any], bool]] = None):
  """Model, optimizer and sharded initial state: (graphdef, params, opt_state, optimizer,
  shardings), with ``shardings = (params, opt_state, batch)``. ``trainable`` freezes parameters
  (:func:`make_optimizer`)."""
  mesh = mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  if jax.process_count() > 1:
    sharding.check_processes(mesh)
  sharding.check_batch(cfg.batch_size, mesh, cfg.grad_accum_steps)
  model = LM(cfg.model, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model)
  optimizer = make_optimizer(cfg, params, trainable)
  p_sh = sharding.param_shardings(params, mesh)
  params = jax.device_put(params, p_sh)
  opt_state = optimizer.init(params)
  # A partly frozen optimizer's state is shaped like the list of trainable leaves.
  like = optimizer.pick(p_sh) if isinstance(optimizer, adamc_lib.PartlyFrozen) else p_sh
  o_sh = sharding.like_params_shardings(opt_state, like, mesh)
  opt_state = jax.device_put(opt_state, o_sh)
  return graphdef, params, opt_state, optimizer, (p_sh, o_sh, sharding.batch_sharding(mesh))


def fine_tuned_params(cfg: TrainConfig, params, verbose: bool):
  """``params`` replaced by those of ``cfg.init_from``'s newest checkpoint, restored onto their
  shardings and dtype (``params`` itself when the run starts from scratch)."""
  if not cfg.init_from:
    return params
  source = Checkpointer(epath.Path(cfg.init_from) / CHECKPOINT_DIR)
  try:
    init_step, params = source.restore_params(abstract_like(params))
  finally:
    source.close()
  if verbose:
    print(f"fine-tuning from {cfg.init_from} (step {init_step}): its model and parameters, a "
          "fresh optimizer and data stream")
  return params
