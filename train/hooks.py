"""The training loop's hooks: each owns one concern of what happens around a step.

For every step the loop calls ``before_step(done)`` of each hook in order, runs the step, then
``after_step(event)`` of each in order; ``close()`` of each runs when the loop ends, normally or
not. ``done`` is the 1-based number of the step (as in metrics.jsonl). A hook reads the step's
:class:`StepEvent` and may add to it for the hooks after it, so the order of the list is the
order of operations; ``train`` composes:

1. :class:`Profiling`: a ``jax.profiler`` trace of steps A..B (process 0).
2. :class:`Preemption`: SIGTERM or Ctrl-C (one process) or JAX's preemption sync point
   (many) -> ``preempted``.
3. :class:`NonFiniteGuard`: the host sync of log and checkpoint steps -> ``host``, ``skipped``.
4. :class:`StepMetrics`: the log line's loss, gradient norm, auxiliary metrics, timing, MFU.
5. :class:`Evaluation`: held-out metrics merged into the log line.
6. :class:`Logging`: the line to metrics.jsonl and the console.
7. :class:`Checkpointing`: saves (and, before the loop, restores) the train and data state.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
from typing import Any, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from kvm_jax.util.progress import ProgressBar
from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train.accounting import StepClock, throughput
from kvm_jax.train.evaluation import evaluate, make_eval_step
from kvm_jax.train.metrics import MetricsWriter
from kvm_jax.train.step import STEP_STATS

# Key of the skipped-update count stored next to the data iterator's state in a checkpoint.
SKIPPED_STEPS_KEY = "kvm_skipped_steps"


@dataclasses.dataclass
class StepEvent:
  """One finished step as the hooks see it; hooks earlier in the list fill the later fields.

  ``stats`` are the step's device scalars; ``compile_s`` is set on the first step of the
  process only. ``preempted`` comes from :class:`Preemption`; ``host`` (the host copies of the
  stats of every step since the last sync, at sync steps only) and ``skipped`` from
  :class:`NonFiniteGuard`; ``record`` is the metrics line of a log step."""

  done: int
  cfg: TrainConfig
  params: Any
  opt_state: Any
  stats: dict
  compile_s: Optional[float] = None
  preempted: bool = False
  host: Optional[list[dict]] = None
  skipped: int = 0
  record: dict = dataclasses.field(default_factory=dict)

  @property
  def final(self) -> bool:
    """The loop stops after this step: the last one, or preempted."""
    return self.done == self.cfg.steps or self.preempted

  @property
  def log(self) -> bool:
    return self.done % self.cfg.log_every == 0 or self.final

  @property
  def save(self) -> bool:
    return self.done % self.cfg.checkpoint_every == 0 or self.final

  @property
  def sync(self) -> bool:
    """A log or checkpoint step: the only steps whose stats the host waits for."""
    return self.log or self.save


class Hook:
  """Does nothing; a hook overrides what it needs."""

  def before_step(self, done: int) -> None:
    pass

  def after_step(self, event: StepEvent) -> None:
    pass

  def close(self) -> None:
    pass


def parse_profile_steps(text: str) -> tuple[int, int]:
  """``"A:B"`` -> (A, B): trace steps A through B (1-based, as numbered in metrics.jsonl)."""
  try:
    first, last = (int(x) for x in text.split(":"))
  except ValueError:
    raise ValueError(f"profile steps {text!r} must look like A:B (e.g. 10:15).") from None
  if not 1 <= first <= last:
    raise ValueError(f"profile steps {text!r} need 1 <= A <= B.")
  return first, last


class Profiling(Hook):
  """A ``jax.profiler`` trace of steps ``first``..``last`` written to ``trace_dir``."""

  def __init__(self, steps: tuple[int, int], trace_dir, verbose: bool):
    (self.first, self.last), self.trace_dir, self.verbose = steps, trace_dir, verbose
    self.tracing = False

  def before_step(self, done: int) -> None:
    if done == self.first:
      jax.profiler.start_trace(str(self.trace_dir))
      self.tracing = True

  def after_step(self, event: StepEvent) -> None:
    if self.tracing and event.done == self.last:
      jax.block_until_ready(event.stats)
      self.close()
      if self.verbose:
        print(f"profile of steps {self.first}..{event.done} written to {self.trace_dir}")

  def close(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False


class Preemption(Hook):
  """Sets ``event.preempted`` when the run must save and stop. One process watches SIGTERM and
  SIGINT (Ctrl-C) itself: the first of either finishes the step, saves it and exits cleanly; a
  second Ctrl-C aborts at once. Several processes use JAX's preemption sync point, whose notifier
  catches SIGTERM on any host and gives every host the same step to stop at (every host calls it
  at every step with the same step number: its contract); there Ctrl-C keeps its default, since a
  stop must be agreed on by every host."""

  def __init__(self):
    self.many = jax.process_count() > 1
    self.stop: Optional[str] = None  # "SIGTERM" or "SIGINT", once received
    self.previous: dict = {}
    if not self.many and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self.previous[sig] = signal.signal(sig, self._on_signal)

  def _on_signal(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and self.stop == "SIGINT":
      raise KeyboardInterrupt  # the second Ctrl-C: stop now, without saving
    if name == "SIGINT":
      print("\ninterrupted: finishing this step, saving it and stopping (Ctrl-C again aborts "
            "at once)", file=sys.stderr, flush=True)
    self.stop = self.stop or name

  def after_step(self, event: StepEvent) -> None:
    event.preempted = multihost_utils.reached_preemption_sync_point(event.done) if self.many \
        else self.stop is not None

  def close(self) -> None:
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    self.previous = {}


class NonFiniteError(RuntimeError):
  """A non-finite loss or gradient with ``on_nonfinite="stop"``; the run saved nothing after it."""


def check_finite(policy: str, steps: list[int], stats: list[dict], ckpt: Checkpointer, workdir,
                 verbose: bool) -> int:
  """Host side of the non-finite guard over the ``stats`` of ``steps``: raises
  :class:`NonFiniteError` (``policy`` "stop") or returns how many of them dropped their update
  ("skip")."""
  bad = [(step, s) for step, s in zip(steps, stats) if not s["finite"]]
  if not bad:
    return 0
  step, s = bad[0]
  what = "loss" if not np.isfinite(s["loss"]) else "gradient"
  if policy == "stop":
    last = ckpt.latest_step()
    kept = (f"the newest checkpoint (step {last}) holds the last parameters saved before it"
            if last is not None else "no checkpoint had been written yet")
    raise NonFiniteError(
        f"non-finite {what} at step {step} (loss={s['loss']}, grad_norm={s['grad_norm']}); the "
        f"update was not applied and nothing was saved after it: {kept} in {workdir}. Check "
        "the data of that step or lower the learning rate; --config.grad_clip_norm clips the "
        "gradient and --config.on_nonfinite=skip drops such updates instead of stopping.")
  if verbose:
    steps_text = ", ".join(str(step) for step, _ in bad)
    print(f"skipped the update of step(s) {steps_text}: non-finite {what}", flush=True)
  return len(bad)


class NonFiniteGuard(Hook):
  """Keeps each step's stats on the device until a log or checkpoint step, then copies them to
  the host at once (``event.host``: the only host sync) and applies the non-finite policy;
  ``event.skipped`` counts the updates dropped so far, ``skipped`` of them before this run."""

  def __init__(self, policy: str, ckpt: Checkpointer, workdir, verbose: bool, skipped: int = 0):
    self.policy, self.ckpt, self.workdir, self.verbose = policy, ckpt, workdir, verbose
    self.skipped = skipped
    self.steps: list[int] = []
    self.stats: list[dict] = []

  def after_step(self, event: StepEvent) -> None:
    self.steps.append(event.done)
    self.stats.append({k: v for k, v in event.stats.items() if k != "halted"})
    if event.sync:
      event.host = jax.device_get(self.stats)
      self.skipped += check_finite(self.policy, self.steps, event.host, self.ckpt,
                                   self.workdir, self.verbose)
      self.steps, self.stats = [], []
    event.skipped = self.skipped


class StepMetrics(Hook):
  """The training part of a log step's line (``event.record``): ``step``, ``loss``,
  ``grad_norm`` and the objective's metrics of the step, then the ``clock``'s timing with
  tokens/s and MFU, ``compile_s`` once per process, ``skipped_steps`` with the "skip" policy."""

  def __init__(self, clock: StepClock, tokens_per_step: int, flops_per_token: float,
               peak: float, count_skipped: bool):
    self.clock, self.tokens_per_step = clock, tokens_per_step
    self.flops_per_token, self.peak, self.count_skipped = flops_per_token, peak, count_skipped
    self.compile_s: Optional[float] = None

  def after_step(self, event: StepEvent) -> None:
    if event.compile_s is not None:
      self.compile_s = event.compile_s
    if not event.log:
      return
    stats = event.host[-1]
    event.record.update(step=event.done, loss=float(stats["loss"]),
                        grad_norm=float(stats["grad_norm"]))
    event.record.update({k: float(v) for k, v in stats.items() if k not in STEP_STATS})
    event.record.update(throughput(self.clock.report(), self.tokens_per_step,
                                   self.flops_per_token, self.peak))
    if self.compile_s is not None:  # once per process start: what this run paid to compile
      event.record["compile_s"] = self.compile_s
      self.compile_s = None
    if self.count_skipped:
      event.record["skipped_steps"] = event.skipped


class Evaluation(Hook):
  """Held-out metrics (:func:`evaluate` on the same batches every time) merged into the log line
  of every ``cfg.eval_every``-th step and of the last step, when those are log steps."""

  def __init__(self, graphdef, cfg: TrainConfig, dataset, batch_sharding):
    self.graphdef, self.cfg, self.dataset = graphdef, cfg, dataset
    self.batch_sharding = batch_sharding
    self.eval_step = make_eval_step(graphdef, cfg, batch_sharding)

  def after_step(self, event: StepEvent) -> None:
    if event.log and (event.done % self.cfg.eval_every == 0 or event.done == self.cfg.steps):
      event.record.update(evaluate(self.graphdef, event.params, self.cfg, self.cfg.eval_batches,
                                   self.dataset, self.eval_step, self.batch_sharding))


class Logging(Hook):
  """Writes a log step's line to metrics.jsonl (process 0) and the console: a progress bar on a
  terminal, one line per log step elsewhere. ``last`` is the newest line written."""

  def __init__(self, workdir, steps: int, start: int, primary: bool, verbose: bool):
    self.metrics = MetricsWriter(workdir, resume_step=start, enabled=primary)
    self.progress = ProgressBar(steps, "step", start)
    self.steps, self.verbose = steps, verbose
    self.last: dict[str, Any] = {"step": start}

  def after_step(self, event: StepEvent) -> None:
    if not event.log:
      return
    self.last = dict(event.record)
    self.metrics.write(**self.last)
    extra = f"loss {self.last['loss']:.4f}"
    if "tokens_per_s" in self.last:
      extra += (f"  {self.last['tokens_per_s']:,.0f} tok/s  "
                f"{1e3 * self.last['step_time_s']:.0f} ms/step")
    if "mfu" in self.last:
      extra += f"  MFU {self.last['mfu']:.1%}"
    if self.verbose:
      line = self.progress.draw(event.done, extra)
      if not self.progress.tty:
        print(line, flush=True)

  def close(self) -> None:
    self.metrics.close()
    if self.verbose and self.progress.tty and self.last.get("step", 0) < self.steps:
      print(file=self.progress.stream)  # the bar ends its own line only when it reaches the end


class Checkpointing(Hook):
  """Saves the parameters, optimizer state, data reader's position and skipped-update count at
  every checkpoint step (and the final or preempted one); :meth:`restore` reads them back."""

  def __init__(self, ckpt: Checkpointer, reader, workdir, verbose: bool):
    self.ckpt, self.reader, self.workdir, self.verbose = ckpt, reader, workdir, verbose

  def restore(self, params, opt_state) -> Optional[tuple[int, Any, Any, int]]:
    """(step, params, opt_state, skipped updates) of the newest checkpoint, placed like
    ``params`` and ``opt_state``, with the reader moved to where it was; None without one."""
    if self.ckpt.latest_step() is None:
      return None
    start, state, data_state = self.ckpt.restore(abstract_like({"params": params,
                                                               "opt_state": opt_state}))
    skipped = int(data_state.pop(SKIPPED_STEPS_KEY, 0))
    self.reader.set_state(data_state)
    if self.verbose:
      print(f"resumed from step {start} in {self.workdir}")
    return start, state["params"], state["opt_state"], skipped

  def after_step(self, event: StepEvent) -> None:
    if not event.save:
      return
    self.ckpt.save(event.done, {"params": event.params, "opt_state": event.opt_state},
                   {**self.reader.get_state(), SKIPPED_STEPS_KEY: event.skipped}, force=True)
    if event.preempted and self.verbose:
      print(f"preempted: saved step {event.done} in {self.workdir}; the same command resumes it",
            flush=True)

  def close(self) -> None:
    self.ckpt.close()
