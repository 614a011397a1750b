"""The jitted train step: an objective's gradient over micro-batches, clipping, the guarded update.

The step does not know what it differentiates: it takes an objective
(:mod:`kvm_jax.train.objectives`), by default the language-model cross-entropy of the config.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.ops.attention.api import runs_pallas
from kvm_jax.ops.kvm.api import kernel_sharding
from kvm_jax.ops.loss import IGNORE
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train import adamc as adamc_lib
from kvm_jax.train import sharding
from kvm_jax.train.objectives import LMObjective, Objective

# Names of the step's own stats, which an objective's auxiliary metrics may not take.
STEP_STATS = ("loss", "grad_norm", "finite", "halted")


def micro_batches(x: jax.Array, count: int, batch_sharding=None) -> jax.Array:
  """``[B, ...]`` -> ``[count, B / count, ...]``: micro-batch j holds rows j, j + count, ...

  Interleaving keeps every device's rows in every micro-batch: a batch split over devices in
  contiguous blocks stays split the same way inside each micro-batch."""
  B = x.shape[0]
  out = jnp.swapaxes(x.reshape(B // count, count, *x.shape[1:]), 0, 1)
  if batch_sharding is not None:
    spec = PartitionSpec(None, *batch_sharding.spec)
    out = jax.lax.with_sharding_constraint(out, NamedSharding(batch_sharding.mesh, spec))
  return out


def global_norm(tree) -> jax.Array:
  """sqrt(sum of squares) of every leaf, in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree_util.tree_leaves(tree)))


def clip_to_norm(grads, norm: jax.Array, max_norm: float):
  """``grads`` scaled by ``min(1, max_norm / norm)`` (``norm`` their global norm)."""
  factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
  return jax.tree_util.tree_map(lambda g: (g * factor).astype(g.dtype), grads)


def objective_and_grads(objective: Objective, graphdef, params, batch: dict, extra: Any = None,
                        accum: int = 1, batch_sharding=None):
  """(loss, aux, gradient of the loss) of ``objective`` over ``batch``, run as ``accum``
  interleaved micro-batches (:func:`micro_batches` of every key, under a ``lax.scan``).

  The objective gets the whole batch's labelled-token count, so summing its micro-batch losses
  and gradients gives exactly the large batch's even when micro-batches hold different numbers
  of labelled tokens. Accumulated losses, metrics and gradients are float32."""
  total = jnp.maximum(jnp.sum(batch["labels"] != IGNORE), 1).astype(jnp.float32)
  value_and_grad = jax.value_and_grad(
      lambda p, b: objective(graphdef, p, b, extra, total), has_aux=True)
  if accum == 1:
    (loss, aux), grads = value_and_grad(params, batch)
    return loss, aux, grads

  def one(carry, micro):
    (loss, aux), grads = value_and_grad(params, micro)
    add = lambda a, x: a + jnp.asarray(x).astype(jnp.float32)
    return (carry[0] + loss, jax.tree_util.tree_map(add, carry[1], aux),
            jax.tree_util.tree_map(add, carry[2], grads)), None

  split = {k: micro_batches(v, accum, batch_sharding) for k, v in batch.items()}
  one_micro = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in split.items()}
  zeros = lambda tree: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)
  aux_shape = jax.eval_shape(lambda p, b: objective(graphdef, p, b, extra, total)[1],
                             params, one_micro)
  (loss, aux, grads), _ = jax.lax.scan(
      one, (jnp.zeros((), jnp.float32), zeros(aux_shape), zeros(params)), split)
  return loss, aux, grads


def loss_and_grads(graphdef, params, batch: dict, cfg: TrainConfig, batch_sharding=None):
  """(mean loss over every labelled token of ``batch``, its gradient): :func:`objective_and_grads`
  of ``cfg``'s language-model objective (remat, loss slicing) over ``cfg.grad_accum_steps``
  micro-batches."""
  loss, _, grads = objective_and_grads(LMObjective.of(cfg), graphdef, params, batch, None,
                                       cfg.grad_accum_steps, batch_sharding)
  return loss, grads


def apply_update(optimizer, params, opt_state, grads):
  """(new params, new optimizer state) of one optimizer update (a float32 master copy, when the
  optimizer keeps one, gives the parameters)."""
  updates, opt_state = optimizer.update(grads, opt_state, params)
  frozen = isinstance(optimizer, adamc_lib.PartlyFrozen)
  trained = optimizer.pick(params) if frozen else params  # frozen leaves are never touched
  if isinstance(opt_state, adamc_lib.MasterState):
    trained = adamc_lib.params_from_master(opt_state, trained)
  else:
    trained = optax.apply_updates(trained, updates)
  return (optimizer.put(params, trained) if frozen else trained), opt_state


def make_train_step(graphdef, optimizer, shardings=None, cfg: TrainConfig | None = None,
                    objective: Optional[Objective] = None):
  """A jitted step ``(params, opt_state, batch, halted[, extra]) -> (params, opt_state, stats)``.

  ``objective`` (the contract is :mod:`kvm_jax.train.objectives`; default: ``cfg``'s
  :class:`LMObjective`, the mean cross-entropy over every labelled token of the whole batch,
  however it is split) is differentiated with respect to ``params``; ``extra`` is handed to it
  undifferentiated. ``cfg`` gives remat, ``grad_accum_steps``, ``loss_slice_len``,
  ``grad_clip_norm`` and ``on_nonfinite`` (default: a plain step). ``stats`` holds device
  scalars: ``loss``, ``grad_norm`` (before clipping), ``finite`` (this step's loss and
  gradients), ``halted``, which the caller feeds back as the next ``halted`` (after a non-finite
  step with ``on_nonfinite="stop"`` every later update is dropped, so the parameters stay those
  of the last good step until the host sees the flag), and the objective's auxiliary metrics.
  With ``shardings = (params, opt_state, batch)`` the step is partitioned over a mesh; a fourth
  entry, the sharding of ``extra``, makes ``extra`` a required argument.
  """
  cfg = cfg or TrainConfig()
  objective = objective or LMObjective.of(cfg)
  batch_sharding = None if shardings is None else shardings[2]

  def step(params, opt_state, batch, halted, extra=None):
    loss, aux, grads = objective_and_grads(objective, graphdef, params, batch, extra,
                                           cfg.grad_accum_steps, batch_sharding)
    taken = sorted(set(aux) & set(STEP_STATS))
    if taken:
      raise ValueError(f"the objective's auxiliary metrics {taken} reuse names of the step's "
                       f"own stats {STEP_STATS}; rename them.")
    norm = global_norm(grads)
    if cfg.grad_clip_norm > 0:
      grads = clip_to_norm(grads, norm, cfg.grad_clip_norm)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)
    # A conditional, not a select: its untaken branch returns the donated buffers unchanged, so
    # no second copy of the parameters and optimizer state is ever alive.
    params, opt_state = jax.lax.cond(finite & ~halted, lambda *a: apply_update(optimizer, *a),
                                     lambda p, o, g: (p, o), params, opt_state, grads)
    if cfg.on_nonfinite == "stop":
      halted = halted | ~finite
    stats = {"loss": loss, "grad_norm": norm, "finite": finite, "halted": halted, **aux}
    if "segment_ids" in batch:  # packed rows: how much of the step is documents, not padding
      stats["real_token_fraction"] = jnp.mean((batch["segment_ids"] != 0).astype(jnp.float32))
    return params, opt_state, stats

  if shardings is None:
    return jax.jit(step, donate_argnums=(0, 1))
  p_sh, o_sh, b_sh, *extra_sh = shardings
  replicated = NamedSharding(b_sh.mesh, PartitionSpec())
  return jax.jit(step, donate_argnums=(0, 1),
                 in_shardings=(p_sh, o_sh, b_sh, replicated, *extra_sh),
                 out_shardings=(p_sh, o_sh, replicated))


def compile_ahead(train_step, *args):
  """(``train_step`` compiled for ``args``, seconds it took): the first step's compile time,
  known exactly because it happens before the step runs."""
  t0 = time.perf_counter()
  compiled = train_step.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def kernel_context(cfg: TrainConfig, mesh) -> contextlib.ExitStack:
  """The context the step runs in: when the model runs Pallas kernels, the trainer's ``mesh``
  and its batch and KV-head axes, over which the kernels run per shard (``shard_map``); when
  it runs XLA alone and the mesh splits KV heads, those axes without the mesh (the KVM scan
  then keeps heads whole in its TPU layout pins); otherwise empty."""
  contexts = contextlib.ExitStack()
  head_axis = sharding.LOGICAL_RULES["kv_heads"]
  kernels = (cfg.model.kvm_implementation != "xla"
             or runs_pallas(cfg.model.attention_implementation))
  if kernels:
    contexts.enter_context(jax.set_mesh(mesh))
  if kernels or dict(mesh.shape).get(head_axis, 1) > 1:
    contexts.enter_context(kernel_sharding(batch_axes=sharding.BATCH, head_axis=head_axis))
  return contexts
