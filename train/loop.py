"""The training loop: a jitted AdamC step over ``nnx.split`` state, JSONL metrics, orbax resume.

One step = one global batch; the data reader's position is checkpointed with the parameters, so
``train(cfg, workdir)`` run again on the same workdir continues exactly where the last checkpoint
left off (bitwise on CPU), on one host or many. Each host reads only the rows of each batch its
devices hold. SIGTERM (preemption) makes every host save the same step and return: one host
alone through its own flag, many through JAX's preemption sync point, which picks a step that
all of them reach. Only process 0 writes ``config.json``, metrics and the console.

``train`` composes the parts: the start (:mod:`~kvm_jax.train.start`), the data
(:mod:`~kvm_jax.train.data`), the step (:mod:`~kvm_jax.train.step`, differentiating an objective
of :mod:`~kvm_jax.train.objectives`) and the hooks around it (:mod:`~kvm_jax.train.hooks`); import
their names from them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
from etils import epath
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.nn.model import count_params
from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import CHECKPOINT_DIR, config_history, save_config
from kvm_jax.runs.resume import change_record, check_resume
from kvm_jax.tasks.pipeline import BatchReader
from kvm_jax.train import distill, hooks, sharding
from kvm_jax.train.adamc import PartlyFrozen
from kvm_jax.train.accounting import StepClock, flops_per_token, peak_flops
from kvm_jax.train.data import check_packing_model, check_vocabulary, put_batch, task_dataset
from kvm_jax.train.objectives import FrozenParameters, LMObjective, Objective
from kvm_jax.train.start import (check_workdir, fine_tuned_params, setup, with_init_model,
                                 with_teacher_task)
from kvm_jax.train.step import compile_ahead, kernel_context, make_train_step

def _objective_and_extra(cfg: TrainConfig, objective, teacher_cfg, optimizer, params, shardings,
                         verbose):
  """(objective, step shardings, extra step inputs) of a run: with ``cfg.teacher`` the
  distillation objective (unless ``objective`` is given) and the teacher's parameters as the
  step's undifferentiated input; with a partly frozen optimizer, an objective whose gradient for
  the frozen parameters is zero."""
  extra = ()
  if cfg.teacher:
    teacher = distill.load_teacher(cfg, shardings[2].mesh, teacher_cfg, verbose)
    objective = objective or distill.objective_for(cfg, teacher)
    shardings, extra = (*shardings, teacher.shardings), (teacher.params,)
  if isinstance(optimizer, PartlyFrozen):
    objective = FrozenParameters(objective or LMObjective.of(cfg), optimizer.mask_like(params))
  return objective, shardings, extra


def preflight(cfg: TrainConfig, workdir):
  """The checks a run makes before it builds, compiles or writes anything: a workdir it may
  train in, data ids the model can embed, and a command that can resume what the workdir holds.
  Returns :func:`check_resume`'s answer (None: nothing to resume)."""
  check_workdir(cfg, workdir)
  check_vocabulary(cfg)
  check_packing_model(cfg)
  return check_resume(cfg, workdir)


def describe_run(cfg: TrainConfig, workdir) -> str:
  """One line on what a run trains, printed before anything is built."""
  kinds = "/".join(dict.fromkeys(cfg.model.layer_mixers))
  return (f"{workdir}: {count_params(cfg.model)['total']:,} parameters ({kinds}), {cfg.steps} "
          f"steps of {cfg.batch_size} x {cfg.sequence_length} tokens")


def record_config(cfg: TrainConfig, workdir, resumed, primary: bool, verbose: bool
                  ) -> Optional[dict]:
  """Writes ``config.json`` (process 0) with the run's history of changed settings, announcing
  the change when this resume (``resumed``: :func:`check_resume`'s answer) makes one; returns
  that change's record for metrics.jsonl, or None."""
  changed = change_record(*resumed) if resumed and resumed[1] else None
  if changed and verbose:
    print(f"resuming with changed settings: {', '.join(map(str, resumed[1]))} (recorded in "
          "config.json and metrics.jsonl)", flush=True)
  if primary:
    history = config_history(workdir) if resumed else []
    save_config(cfg, workdir, verbose, history + ([changed] if changed else []))
  return changed


def compile_first(train_step, args: tuple, verbose: bool):
  """``compile_ahead`` of the step for ``args``, saying so (a large model compiles for
  minutes)."""
  if verbose:
    print("compiling the train step...", flush=True)
  compiled, seconds = compile_ahead(train_step, *args)
  if verbose:
    print(f"compiled in {seconds:.1f}s; training", flush=True)
  return compiled, seconds


def train(cfg: TrainConfig, workdir, *, verbose: bool = True,
          profile_steps: Optional[tuple[int, int]] = None,
          objective: Optional[Objective] = None) -> dict[str, Any]:
  """Trains (or resumes) in ``workdir`` (a local or ``gs://`` path); returns the last logged
  metrics plus the final ``params`` and ``graphdef``. On a pod every process calls it with the
  same arguments. ``profile_steps=(A, B)`` writes a ``jax.profiler`` trace of steps A..B to
  ``workdir/profile`` on process 0. ``objective`` replaces the language-model loss (the contract
  is :mod:`kvm_jax.train.objectives`; its ``extra`` is the teacher's parameters when
  ``cfg.teacher`` is set, else None) and its auxiliary metrics join every logged line. With
  ``cfg.teacher`` the default objective is the distillation stage of ``cfg.distill``
  (:mod:`kvm_jax.train.distill`); ``cfg.distill.trainable`` freezes parameters in any run.
  Raises :class:`~kvm_jax.train.hooks.NonFiniteError` when a step's loss or gradient is not
  finite and ``cfg.on_nonfinite == "stop"``."""
  cfg = with_teacher_task(with_init_model(cfg, workdir))
  cfg.validate()
  primary = jax.process_index() == 0
  verbose = verbose and primary
  workdir = epath.Path(workdir)  # save_config and the metrics writer create it (process 0)
  resumed = preflight(cfg, workdir)
  if verbose:
    print(describe_run(cfg, workdir), flush=True)
  teacher_cfg = distill.teacher_config(cfg) if cfg.teacher else None
  trainable = distill.trainable_predicate(cfg, teacher_cfg)
  graphdef, params, opt_state, optimizer, shardings = setup(cfg, trainable=trainable)
  batch_sh = shardings[2]
  rows = sharding.host_rows(batch_sh, cfg.batch_size)
  reader = BatchReader(task_dataset(cfg, "train"), cfg.batch_size, rows)
  saver = hooks.Checkpointing(Checkpointer(workdir / CHECKPOINT_DIR, keep=cfg.keep_checkpoints),
                              reader, workdir, verbose)
  changed = record_config(cfg, workdir, resumed, primary, verbose)
  start, params, opt_state, skipped = saver.restore(params, opt_state) or (
      0, fine_tuned_params(cfg, params, verbose), opt_state, 0)
  objective, shardings, extra = _objective_and_extra(cfg, objective, teacher_cfg, optimizer,
                                                     params, shardings, verbose)
  train_step = make_train_step(graphdef, optimizer, shardings, cfg, objective)
  halted = jax.device_put(jnp.zeros((), bool), NamedSharding(batch_sh.mesh, PartitionSpec()))
  clock = StepClock()
  logger = hooks.Logging(workdir, cfg.steps, start, primary, verbose)
  if changed:
    logger.metrics.note(**changed)
  every_step = [
      *([hooks.Profiling(profile_steps, workdir / "profile", verbose)]
        if primary and profile_steps else []),
      hooks.Preemption(),
      hooks.NonFiniteGuard(cfg.on_nonfinite, saver.ckpt, workdir, verbose, skipped),
      hooks.StepMetrics(clock, cfg.batch_size * cfg.sequence_length,
                        flops_per_token(cfg, params), peak_flops(cfg), cfg.on_nonfinite == "skip"),
      *([hooks.Evaluation(graphdef, cfg, task_dataset(cfg, "eval"), batch_sh)]
        if cfg.eval_every else []),
      logger, saver]
  with contextlib.ExitStack() as stack:
    stack.callback(reader.close)
    for hook in every_step:
      stack.callback(hook.close)
    stack.enter_context(kernel_context(cfg, batch_sh.mesh))
    for step in range(start, cfg.steps):
      t0 = time.perf_counter()
      batch = put_batch(next(reader), batch_sh, rows, cfg.batch_size)
      waited, compile_s = time.perf_counter() - t0, None
      if step == start:  # compiled ahead of the first step, so its time is known exactly
        train_step, compile_s = compile_first(train_step, (params, opt_state, batch, halted,
                                                           *extra), verbose)
      for hook in every_step:
        hook.before_step(step + 1)
      params, opt_state, stats = train_step(params, opt_state, batch, halted, *extra)
      halted = stats["halted"]
      clock.tick(waited)
      if step == start:  # the first step warms up (allocation, autotuning): not timed
        jax.block_until_ready(stats)
        clock.restart()
        logger.progress.steady_from(step + 1)  # the ETA extrapolates the steps after it
      event = hooks.StepEvent(step + 1, cfg, params, opt_state, stats, compile_s)
      for hook in every_step:
        hook.after_step(event)
      if event.sync:
        clock.restart()  # evaluation and checkpointing are not step time
      if event.final:
        break
  return {**logger.last, "params": params, "graphdef": graphdef}
