"""What a train step differentiates: the objective contract and the language-model loss.

An **objective** is any callable ``objective(graphdef, params, batch, extra, total) -> (loss,
aux)``, traced inside the jitted step once per micro-batch:

* ``graphdef``, ``params``: the model as ``nnx.split`` gives it; the step differentiates the
  loss with respect to ``params`` and nothing else.
* ``batch``: one micro-batch, every key of the step's batch with rows
  ``[batch_size / grad_accum_steps, ...]`` (the whole batch without accumulation).
* ``extra``: the step's non-differentiated inputs, its fifth argument (``None`` when the caller
  gives none), e.g. a frozen teacher's parameters for distillation. On a mesh their sharding is
  the fourth entry of ``make_train_step``'s ``shardings`` (a teacher of the student's shape:
  the student's parameter shardings).
* ``total``: float32 scalar, the number of labelled tokens in the *whole* batch (at least 1).

It returns ``loss``, this micro-batch's share of the batch loss as a float32 scalar (the step sums
it over micro-batches, so a loss *sum* divided by ``total`` makes the batch's mean), and ``aux``, a
dict of float32 scalar metrics summed over micro-batches the same way; they appear in the step's
``stats`` and in every logged metrics line. Their names must differ from the step's own stats
(``loss``, ``grad_norm``, ``finite``, ``halted``).

Frozen parameters need no change to the step: :class:`FrozenParameters` makes their gradient
exactly zero, and an optimizer that leaves them alone (``optax.multi_transform`` with
``optax.set_to_zero()`` for them; weight decay would move them even without a gradient) keeps
them fixed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.ops.loss import cross_entropy_sums, sliced_loss_sums
from kvm_jax.runs.train_config import TrainConfig


class Objective(Protocol):
  """The contract of the module docstring: ``(graphdef, params, batch, extra, total) ->
  (loss, aux)``."""

  def __call__(self, graphdef, params, batch: dict, extra: Any, total: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


def masked_loss(logits, labels):
  """Mean cross-entropy over positions whose label is not -100."""
  loss, count = cross_entropy_sums(logits, labels)
  return loss / jnp.maximum(count, 1)


def loss_sums(graphdef, params, inputs, labels, *, remat: str, slice_len: int, compute_dtype,
              predictions: bool = False, segment_ids=None):
  """(loss sum, token count, argmax or None) of one (micro-)batch: the model's features with
  ``remat`` (over packed documents with ``segment_ids``), then the LM head and cross-entropy over
  ``slice_len`` slices."""
  model = nnx.merge(graphdef, params)
  features = model.features(inputs, remat, segment_ids=segment_ids)
  return sliced_loss_sums(features, model.head_kernel(), labels,
                          compute_dtype=compute_dtype, slice_len=slice_len,
                          predictions=predictions, softcap=model.logit_softcap)


@dataclasses.dataclass(frozen=True)
class LMObjective:
  """The trainer's default objective: next-token cross-entropy summed over the micro-batch's
  labelled positions and divided by the whole batch's count, so the step's loss is the mean over
  every labelled token of the batch. No auxiliary metrics. With ``documents`` the model reads
  the batch's ``segment_ids`` (``packing="documents"``)."""

  remat: str
  slice_len: int
  compute_dtype: str
  documents: bool = False

  @classmethod
  def of(cls, cfg: TrainConfig) -> "LMObjective":
    """The objective with ``cfg``'s remat policy, loss slicing, compute dtype and packing."""
    return cls(cfg.remat, cfg.loss_slice_len, cfg.model.compute_dtype,
               cfg.packing == "documents")

  def __call__(self, graphdef, params, batch: dict, extra: Any, total: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    loss_sum = loss_sums(graphdef, params, batch["inputs"], batch["labels"], remat=self.remat,
                         slice_len=self.slice_len, compute_dtype=self.compute_dtype,
                         segment_ids=batch["segment_ids"] if self.documents else None)[0]
    return loss_sum / total, {}


@dataclasses.dataclass(frozen=True, eq=False)
class FrozenParameters:
  """``objective`` with the parameters whose ``trainable`` leaf is False entering as constants
  (``stop_gradient``): their gradient is exactly zero. ``trainable`` is a tree of bools shaped
  like the parameters (e.g. ``jax.tree_util.tree_map_with_path`` over them)."""

  objective: Objective
  trainable: Any

  def __call__(self, graphdef, params, batch: dict, extra: Any, total: jax.Array
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    params = jax.tree_util.tree_map(lambda p, keep: p if keep else jax.lax.stop_gradient(p),
                                    params, self.trainable)
    return self.objective(graphdef, params, batch, extra, total)
