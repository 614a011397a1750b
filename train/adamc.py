"""AdamC: AdamW whose decoupled weight decay follows the learning-rate schedule
(docs/kvm-spec.md §8).

The authors' trainer sets, before every step, ``weight_decay_t = wd_peak * lr_t / lr_peak`` on a
``torch.optim.AdamW`` (``update_weight_decay_for_current_lr``), so the per-step decay is
``lr_t * wd_t = wd_peak * lr_t**2 / lr_peak``. With per-parameter μP multipliers (``lr_scale`` s,
``wd_scale`` w) one step is, exactly like torch's AdamW order (decay, then the Adam step)::

    theta <- theta * (1 - lr_t*s * wd_t*w) - lr_t*s * m_hat / (sqrt(v_hat) + eps)

Moments are float32. :func:`with_float32_master` keeps float32 master weights for bf16 parameters
(the authors step fp32 copies and copy back).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

Schedule = Callable[[jax.Array], jax.Array]


class AdamCState(NamedTuple):
  count: jax.Array
  mu: Any
  nu: Any


def adamc(learning_rate: Schedule, *, peak_learning_rate: float, weight_decay: float,
          b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, lr_scale: Any = None,
          wd_scale: Any = None) -> optax.GradientTransformation:
  """AdamC as one optax transformation (returns the *updates*, to add to the parameters).

  Args:
    learning_rate: schedule ``step -> lr_t`` (step counts from 0 at the first update).
    peak_learning_rate: lr_peak, the normalizer of the decay schedule.
    weight_decay: wd_peak.
    lr_scale / wd_scale: optional pytrees (like the params, or prefixes of them) of per-parameter
      multipliers: μP ratios, and 0 to exempt a parameter from decay. ``None`` means 1.
  """
  if peak_learning_rate <= 0:
    raise ValueError(f"peak_learning_rate must be > 0, got {peak_learning_rate}.")

  def init(params):
    zeros = lambda p: jnp.zeros(p.shape, jnp.float32)
    return AdamCState(count=jnp.zeros((), jnp.int32), mu=jax.tree_util.tree_map(zeros, params),
                      nu=jax.tree_util.tree_map(zeros, params))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("adamc needs the parameters (decoupled weight decay).")
    count = state.count
    lr = jnp.asarray(learning_rate(count), jnp.float32)
    wd = weight_decay * lr / peak_learning_rate
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
    mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    t = (count + 1).astype(jnp.float32)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t
    ls = lr_scale if lr_scale is not None else jax.tree_util.tree_map(lambda _: 1.0, params)
    ws = wd_scale if wd_scale is not None else jax.tree_util.tree_map(lambda _: 1.0, params)

    def one(p, m, v, s, w):
      step_lr = lr * s
      adam = (m / c1) / (jnp.sqrt(v / c2) + eps)
      p32 = p.astype(jnp.float32)
      new = p32 * (1 - step_lr * wd * w) - step_lr * adam
      return new - p32

    updates = jax.tree_util.tree_map(one, params, mu, nu, ls, ws)
    return updates, AdamCState(count=count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


class MasterState(NamedTuple):
  master: Any
  inner: Any


def with_float32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """Runs ``inner`` on float32 master copies of the parameters.

  The returned updates are ``cast(master) - param``; for float32 parameters ``apply_updates`` is
  then exact, for bf16 ones use :func:`params_from_master` (exactly ``cast(master)``), which is what
  ``train.step`` does, so no bit the master holds is ever lost to a low-precision add.
  """

  def init(params):
    master = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
    return MasterState(master=master, inner=inner.init(master))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("with_float32_master needs the parameters.")
    inner_updates, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, inner_updates)
    updates = jax.tree_util.tree_map(
        lambda m, p: (m - p.astype(jnp.float32)).astype(p.dtype), master, params)
    return updates, MasterState(master=master, inner=inner_state)

  return optax.GradientTransformation(init, update)


def params_from_master(state: MasterState, params: Any) -> Any:
  """The parameters as the cast of the float32 masters (exact for any parameter dtype)."""
  return jax.tree_util.tree_map(lambda m, p: m.astype(p.dtype), state.master, params)


def pick_leaves(tree: Any, mask: Sequence[bool]) -> list:
  """The leaves of ``tree`` whose flag in ``mask`` (one per leaf, in leaf order) is True."""
  return [x for x, keep in zip(jax.tree_util.tree_leaves(tree), mask) if keep]


class PartlyFrozen(NamedTuple):
  """An optimizer that updates only some parameters (``optax.GradientTransformation``'s
  ``init``/``update`` plus the mask). Its state and updates cover the trainable leaves alone,
  as a list in the parameters' leaf order: a frozen parameter has no optimizer state, and
  :func:`kvm_jax.train.step.apply_update` returns it as it was, bit for bit (even weight decay
  never reaches it)."""

  init: Callable
  update: Callable
  trainable: tuple[bool, ...]

  def pick(self, tree: Any) -> list:
    """The trainable leaves of a tree shaped like the parameters, in leaf order."""
    return pick_leaves(tree, self.trainable)

  def mask_like(self, params: Any) -> Any:
    """The trainable flags as a tree shaped like ``params``."""
    return jax.tree_util.tree_structure(params).unflatten(self.trainable)

  def put(self, tree: Any, trained: Sequence) -> Any:
    """``tree`` with its trainable leaves replaced by ``trained`` (in leaf order)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    it = iter(trained)
    return treedef.unflatten([next(it) if keep else x for x, keep in zip(leaves, self.trainable)])


def partly_frozen(inner: optax.GradientTransformation, trainable: Sequence[bool]) -> PartlyFrozen:
  """``inner`` (built over the trainable leaves: give it per-leaf scales as lists picked the same
  way) restricted to the leaves whose ``trainable`` flag is True (one flag per parameter leaf)."""
  mask = tuple(bool(x) for x in trainable)
  if not any(mask):
    raise ValueError("every parameter is frozen: nothing would train.")

  def init(params):
    return inner.init(pick_leaves(params, mask))

  def update(grads, state, params=None):
    return inner.update(pick_leaves(grads, mask), state,
                        None if params is None else pick_leaves(params, mask))

  return PartlyFrozen(init, update, mask)
