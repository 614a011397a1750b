"""The train step differentiates the objective it is given: the default one is the language-model
loss, a custom one's loss is what moves the parameters and its metrics reach ``stats`` and
metrics.jsonl, extra inputs pass through undifferentiated, frozen parameters get no gradient."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.ops.loss import IGNORE
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.train import loop
from kvm_jax.train.objectives import masked_loss
from kvm_jax.train.step import global_norm, loss_and_grads
from kvm_jax.train.main import load_config
from kvm_jax.train.objectives import FrozenParameters, LMObjective
from kvm_jax.train.step import objective_and_grads

from tests.helpers import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
  """(cfg, graphdef, params, batch): the tiny MQAR model, 4 rows of 32 tokens, 2 micro-batches
  (one row's labels ignored, so micro-batches hold different token counts)."""
  cfg = load_config(str(ROOT / "train/configs/tiny_mqar.py"))
  cfg = dataclasses.replace(cfg, batch_size=4, grad_accum_steps=2,
                            mqar=dataclasses.replace(cfg.mqar, seq_len=32, num_pairs=4))
  graphdef, params, *_ = loop.setup(cfg)
  batch = next(batched_iterator(loop.task_dataset(cfg, "train"), cfg.batch_size))
  labels = np.asarray(batch["labels"]).copy()
  labels[1] = IGNORE
  batch = {"inputs": jnp.asarray(batch["inputs"]), "labels": jnp.asarray(labels)}
  return cfg, graphdef, params, batch


@dataclasses.dataclass(frozen=True)
class Doubled:
  """Twice the language-model loss, reporting the plain loss as an auxiliary metric."""

  base: LMObjective

  def __call__(self, graphdef, params, batch, extra, total):
    loss, _ = self.base(graphdef, params, batch, extra, total)
    return 2.0 * loss, {"lm_loss": loss}


def leaves(tree):
  return jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, tree))


def test_the_default_objective_is_the_language_model_loss(tiny):
  cfg, graphdef, params, batch = tiny
  loss, grads = jax.jit(lambda p: loss_and_grads(graphdef, p, batch, cfg))(params)
  got_loss, aux, got = jax.jit(lambda p: objective_and_grads(
      LMObjective.of(cfg), graphdef, p, batch, None, cfg.grad_accum_steps))(params)
  assert aux == {}
  assert float(got_loss) == float(loss)
  for a, b in zip(leaves(got), leaves(grads)):
    np.testing.assert_array_equal(a, b)
  # ... and that loss is the mean cross-entropy over every labelled token of the batch.
  logits = jax.jit(lambda p: nnx.merge(graphdef, p)(batch["inputs"]))(params)
  assert float(loss) == pytest.approx(float(masked_loss(logits, batch["labels"])), rel=1e-5)


def test_the_step_differentiates_its_objective_and_reports_its_metrics(tiny):
  """Plain SGD (Adam would hide a scaled gradient): the step with the doubled objective moves
  the parameters by twice the default objective's gradient; its metric, summed over the two
  micro-batches, is the batch's loss."""
  cfg, graphdef, params, batch = tiny
  loss, grads = jax.jit(lambda p: loss_and_grads(graphdef, p, batch, cfg))(params)
  sgd = optax.sgd(1.0)
  step = loop.make_train_step(graphdef, sgd, None, cfg, Doubled(LMObjective.of(cfg)))
  start = jax.tree_util.tree_map(jnp.copy, params)
  new, _, stats = step(start, sgd.init(start), batch, jnp.zeros((), bool))
  assert float(stats["loss"]) == pytest.approx(2 * float(loss), rel=1e-6)
  assert float(stats["lm_loss"]) == pytest.approx(float(loss), rel=1e-6)
  assert float(stats["grad_norm"]) == pytest.approx(2 * float(global_norm(grads)), rel=1e-5)
  scale = max(float(np.max(np.abs(g))) for g in leaves(grads))
  for p0, p1, g in zip(leaves(params), leaves(new), leaves(grads)):
    np.testing.assert_allclose(p0 - p1, 2 * g, rtol=0, atol=1e-6 * scale)


def test_extra_inputs_reach_the_objective_undifferentiated_on_the_mesh(tiny):
  """A distillation objective: the teacher's parameters are the step's fifth argument, sharded
  like the student's (the fourth entry of ``shardings``). A teacher equal to the student gives
  zero KL, and the student's gradient is the plain loss's."""
  cfg, graphdef, params, batch = tiny
  _, student, opt_state, optimizer, shardings = loop.setup(cfg)

  def distill(graphdef, params, batch, teacher, total):
    loss, _ = LMObjective.of(cfg)(graphdef, params, batch, None, total)
    log_p = jax.nn.log_softmax(nnx.merge(graphdef, teacher)(batch["inputs"]))
    log_q = jax.nn.log_softmax(nnx.merge(graphdef, params)(batch["inputs"]))
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), -1)
    return loss, {"kl": jnp.sum(jnp.where(batch["labels"] != IGNORE, kl, 0.0)) / total}

  step = loop.make_train_step(graphdef, optimizer, (*shardings, shardings[0]), cfg, distill)
  teacher = jax.tree_util.tree_map(jnp.copy, student)
  placed = loop.put_batch({k: np.asarray(v) for k, v in batch.items()}, shardings[2])
  _, _, stats = step(student, opt_state, placed, jnp.zeros((), bool), teacher)
  assert abs(float(stats["kl"])) < 1e-5
  loss, grads = jax.jit(lambda p: loss_and_grads(graphdef, p, batch, cfg))(params)
  assert float(stats["loss"]) == pytest.approx(float(loss), rel=1e-6)
  assert float(stats["grad_norm"]) == pytest.approx(float(global_norm(grads)), rel=1e-5)


def test_frozen_parameters_get_no_gradient(tiny):
  cfg, graphdef, params, batch = tiny
  trainable = jax.tree_util.tree_map_with_path(
      lambda path, _: "embed" not in jax.tree_util.keystr(path), params)
  assert not all(jax.tree_util.tree_leaves(trainable))  # the mask freezes something
  objective = FrozenParameters(LMObjective.of(cfg), trainable)
  _, _, got = jax.jit(lambda p: objective_and_grads(objective, graphdef, p, batch, None,
                                                    cfg.grad_accum_steps))(params)
  _, want = jax.jit(lambda p: loss_and_grads(graphdef, p, batch, cfg))(params)
  # The two programs differ (the frozen leaves' gradients are not computed), so XLA may fuse and
  # order the shared sums differently: the trainable leaves agree to float32 rounding (measured
  # 2.4e-7 at most on gradients of size ~0.1); a frozen leaf's gradient is exactly zero.
  for keep, a, b in zip(jax.tree_util.tree_leaves(trainable), leaves(got), leaves(want)):
    if keep:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    else:
      np.testing.assert_array_equal(a, np.zeros_like(b))


def test_metrics_of_an_objective_may_not_shadow_the_steps_own(tiny):
  cfg, graphdef, params, batch = tiny
  clash = lambda graphdef, params, batch, extra, total: (jnp.zeros(()), {"grad_norm": 0.0})
  step = loop.make_train_step(graphdef, optax.sgd(1.0), None, cfg, clash)
  with pytest.raises(ValueError, match=r"\['grad_norm'\].*rename"):
    step(params, optax.sgd(1.0).init(params), batch, jnp.zeros((), bool))


def test_an_objectives_metrics_reach_metrics_jsonl(tmp_path, tiny):
  cfg, *_ = tiny
  run = dataclasses.replace(cfg, steps=2, log_every=1, checkpoint_every=2, eval_every=0,
                            warmup_steps=1)
  loop.train(run, tmp_path, verbose=False, objective=Doubled(LMObjective.of(run)))
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [list(r)[:4] for r in lines] == [["step", "loss", "grad_norm", "lm_loss"]] * 2
  assert all(r["loss"] == pytest.approx(2 * r["lm_loss"], rel=1e-6) for r in lines)
