"""Held-out evaluation on the trainer's shardings: a jitted step that returns only sums."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from kvm_jax.ops.loss import IGNORE
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks import mqar
from kvm_jax.tasks.pipeline import BatchReader
from kvm_jax.train import sharding
from kvm_jax.train.data import put_batch, task_dataset
from kvm_jax.train.objectives import loss_sums
from kvm_jax.train.step import micro_batches


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """What the eval step's program depends on besides the model (hashable: a static argument)."""

  task: str
  window: int
  grad_accum_steps: int
  loss_slice_len: int
  compute_dtype: str
  batch_sharding: Any = None
  documents: bool = False  # the model reads the batch's segment_ids (packing="documents")

  @classmethod
  def of(cls, cfg: TrainConfig, batch_sharding=None) -> "EvalSpec":
    return cls(cfg.task, cfg.model.options_of("kvm").window_len, cfg.grad_accum_steps,
               cfg.loss_slice_len, cfg.model.compute_dtype, batch_sharding,
               cfg.packing == "documents")


@functools.partial(jax.jit, static_argnums=(0, 1))
def eval_sums(graphdef, spec: EvalSpec, params, batch: dict) -> dict:
  """Sums of one eval batch, computed where the batch and parameters live (their shardings
  propagate; only scalars come back): ``loss_sum``, ``tokens``; MQAR: ``hits_*``/``answers_*`` of
  all answers, those whose key is within the exact window and those beyond it; NIAH: ``exact``
  answers and ``examples``. The batch runs in ``grad_accum_steps`` micro-batches and the loss
  over ``loss_slice_len`` slices, like training. Compiled once per model, spec and shape."""

  def sums(batch):
    loss, count, pred = loss_sums(graphdef, params, batch["inputs"], batch["labels"],
                                  remat="none", slice_len=spec.loss_slice_len,
                                  compute_dtype=spec.compute_dtype,
                                  predictions=spec.task in ("mqar", "niah"),
                                  segment_ids=batch["segment_ids"] if spec.documents else None)
    out = {"loss_sum": loss, "tokens": count}
    labels = batch["labels"]
    valid = labels != IGNORE
    if spec.task == "mqar":
      correct = (pred == labels) & valid
      near = valid & (batch["distance"] < spec.window)
      for name, mask in (("all", valid), ("in_window", near), ("state_only", valid & ~near)):
        out[f"hits_{name}"] = jnp.sum(correct & mask).astype(jnp.int32)
        out[f"answers_{name}"] = jnp.sum(mask).astype(jnp.int32)
    elif spec.task == "niah":  # teacher-forced: every answer token right
      wrong = ((pred != labels) & valid).any(axis=1)
      out["exact"] = jnp.sum(~wrong).astype(jnp.int32)
      out["examples"] = jnp.asarray(labels.shape[0], jnp.int32)
    return out

  if spec.grad_accum_steps == 1:
    return sums(batch)
  split = {k: micro_batches(v, spec.grad_accum_steps, spec.batch_sharding)
           for k, v in batch.items()}
  return jax.tree_util.tree_map(lambda x: jnp.sum(x, 0), jax.lax.map(sums, split))


def make_eval_step(graphdef, cfg: TrainConfig, batch_sharding=None):
  """``(params, batch) -> sums`` (:func:`eval_sums`) for ``cfg``'s task; micro-batches keep
  ``batch_sharding`` (the training batch sharding)."""
  spec = EvalSpec.of(cfg, batch_sharding if cfg.grad_accum_steps > 1 else None)
  return functools.partial(eval_sums, graphdef, spec)


def evaluate(graphdef, params, cfg: TrainConfig, batches: int, dataset=None,
             eval_step=None, batch_sharding=None) -> dict[str, float]:
  """Held-out loss (mean over every labelled token) on the same first ``batches`` batches every
  time; for MQAR also recall split by where the queried key lives, for NIAH the exact-answer
  rate. ``dataset`` avoids rebuilding the held-out split, ``eval_step`` (:func:`make_eval_step`)
  recompiling; ``batch_sharding`` places each batch like training's."""
  if batch_sharding is None:  # parameters on a trainer's mesh: batches split like training's
    leaf = jax.tree_util.tree_leaves(params)[0]
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
      batch_sharding = sharding.batch_sharding(leaf.sharding.mesh)
  eval_step = eval_step or make_eval_step(graphdef, cfg, batch_sharding)
  rows = None if batch_sharding is None else sharding.host_rows(batch_sharding, cfg.batch_size)
  reader = BatchReader(dataset or task_dataset(cfg, "eval"), cfg.batch_size, rows,
                       prefetch=False)
  total: dict[str, int | float] = {}
  for index in range(batches):
    batch = reader.read(index)
    batch = {k: v for k, v in batch.items()
             if k in ("inputs", "labels", "distance", "segment_ids")}
    if batch_sharding is not None:
      batch = put_batch(batch, batch_sharding, rows, cfg.batch_size)
    for k, v in jax.device_get(eval_step(params, batch)).items():
      total[k] = total.get(k, 0) + v.item()
  out = {"eval_loss": total["loss_sum"] / max(total["tokens"], 1)}
  if cfg.task == "mqar":
    out.update(mqar.recall_ratios({name: np.array([total[f"hits_{name}"],
                                                   total[f"answers_{name}"]])
                                   for name in ("all", "in_window", "state_only")}))
  elif cfg.task == "niah":
    out["answer_exact"] = total["exact"] / total["examples"]
  return out
