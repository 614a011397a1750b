"""Packed documents train on the Pallas kernels (interpret mode): every path the documents op
takes with kernels differentiates with respect to the inputs and every KVM parameter as the XLA
op does, and so does a model's packed training step.

The kernels always take the "steps" path (``document_path_for``); the XLA op takes "aligned" for
a window of two chunks or more, so these comparisons also set two implementations of the
document rule against each other. The state steps run autodiff through the update, routing
kernels included, where the plain scan replays stored decisions: a tangent reaching a routing
kernel fails there (reverse mode cannot split a Pallas call's JVP into its primal and tangent),
which only a loss differentiated with respect to the KVM parameters, on a budget that appends
rows, shows. Tolerances are float32 rounding (``kvm_jax.ops.kvm.cases.TOLERANCE``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from tests.helpers import make_model
from kvm_jax.config.budget import SaturatingBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.documents import segment_ids_from_lengths
from kvm_jax.ops.kvm.cases import TOLERANCE, random_inputs, random_params, rel_rms
from kvm_jax.ops.kvm.documents import (document_path_for, kvm_attention_documents,
                                       max_state_steps)
from kvm_jax.ops.kvm.scan import XLA_OPS
from kvm_jax.ops.loss import IGNORE
from kvm_jax.train.objectives import LMObjective
from kvm_jax.train.step import objective_and_grads

OUT_TOL, GRAD_TOL = TOLERANCE["float32"]["output"], TOLERANCE["float32"]["grad"]

# C = 4; a budget that appends and merges (both routing kernels run). Documents past the window
# (13 and 18 tokens: state steps with folds) and inside it, boundaries mid-chunk, padding
# between and in front. "window_only": rows no longer than the window, so no state step.
BUDGET = dict(chunk_size=4, rope_dims=2, budget=SaturatingBudget(12, min_rows=1), sink_rows=0)
PATHS = {"steps": (2, True, 32, ([1, 3, 5, 9, -1, 13], [-3, 18, 9, 2])),
         "steps_without_remat": (2, False, 32, ([1, 3, 5, 9, -1, 13], [-3, 18, 9, 2])),
         "one_chunk_window": (1, True, 32, ([1, 3, 5, 9, -1, 13], [-3, 18, 9, 2])),
         "window_only": (2, True, 8, ([3, -1, 4], [8]))}


def kernels_for(cfg: KVMConfig):
  """The Pallas kernels' per-chunk operations for ``cfg`` (interpreted on CPU)."""
  return kj.resolve_kvm_backend(cfg, implementation="pallas", readout="own").chunk_ops()


def document_loss(ops, cfg: KVMConfig, seg, weights, remat: bool):
  """``(q, k, v, g, params) -> float32`` reading every real output and the valid rows of each
  row's final keys and values (so the state's cotangent is exercised too) against ``weights``:
  ``(w_y [B, T, H, Dv], w_keys [B, Hkv, >= R, D], w_values [B, Hkv, >= R, Dv])``."""
  real = (seg != 0)[..., None, None]
  w_y, w_keys, w_values = weights

  def loss(q, k, v, g, params):
    y, state = kvm_attention_documents(q, k, v, g, params, seg, cfg=cfg, ops=ops, remat=remat)
    R = state.capacity
    valid = (jnp.arange(R)[None, :] < state.num_rows[:, None])[:, None, :, None]
    return (jnp.sum(jnp.where(real, y * w_y, 0.0))
            + jnp.sum(jnp.where(valid, state.keys * w_keys[:, :, :R], 0.0))
            + jnp.sum(jnp.where(valid, state.values * w_values[:, :, :R], 0.0)))

  return loss


@pytest.mark.parametrize("name", list(PATHS))
def test_kernel_document_paths_differentiate_as_xla(name):
  """Outputs and gradients with respect to q, k, v, the merge gate and every field of
  ``KVMParams`` of the kernels' path equal the XLA op's; each reference gradient is nonzero, so
  no field passes by being zero on both sides."""
  window_chunks, remat, seq_len, layout = PATHS[name]
  cfg = KVMConfig(window_chunks=window_chunks, **BUDGET)
  kernels = kernels_for(cfg)
  assert document_path_for(cfg, kernels) == "steps"
  assert (max_state_steps(seq_len, cfg) == 0) == (name == "window_only")
  q, k, v, g = random_inputs(1, 2, seq_len, 4, 2, 8, 6)
  params = random_params(1, 8, 4)
  seg = jnp.asarray(segment_ids_from_lengths(layout, seq_len))
  keys = jax.random.split(jax.random.PRNGKey(5), 3)
  weights = tuple(jax.random.normal(key, shape) for key, shape in zip(
      keys, (q.shape[:3] + (6,), (2, 2, 64, 8), (2, 2, 64, 6))))
  results = []
  for ops in (kernels, XLA_OPS):
    loss = document_loss(ops, cfg, seg, weights, remat)
    results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(
        q, k, v, g, params))
  (got_loss, got), (want_loss, want) = results
  assert rel_rms(got_loss, want_loss) < OUT_TOL
  names = ["q", "k", "v", "merge_gate"] + [
      f"params{jax.tree_util.keystr(p)}" for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert len(names) == 8
  # Without a state step no query reads the state and nothing is folded: the state's
  # temperature and the merge gate have no gradient at all.
  unread = {"params.state_temperature", "merge_gate"} if name == "window_only" else set()
  for field, a, e in zip(names, jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    if field in unread:
      assert not np.any(np.asarray(a)) and not np.any(np.asarray(e)), field
      continue
    assert np.any(np.asarray(e) != 0), field
    assert rel_rms(a, e) < GRAD_TOL, field


def test_kernels_refuse_the_aligned_path():
  """The aligned path masks each batch row's window on its own; a kernel's window mask is one
  for the batch, so asking for it with kernels is an error that names the way out."""
  cfg = KVMConfig(window_chunks=2, **BUDGET)
  q, k, v, g = random_inputs(1, 1, 8, 2, 1, 8, 6)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="path='aligned' needs the plain XLA operations.*"
                                       "use path='steps' or 'auto'"):
    kvm_attention_documents(q, k, v, g, random_params(1, 8, 2), seg, cfg=cfg,
                            ops=kernels_for(cfg), path="aligned")


# tiny model: C = 8, window 2 chunks (L = 16); documents past the window (30, 17, 29 tokens),
# inside it, of one token, with padding.
MODEL_T = 48
MODEL_LAYOUT = ([1, 9, -3, 30, 5], [-2, 17, 29])


def packed_batch(vocab_size: int) -> dict:
  """Inputs, next-token labels inside each document (padding and documents' last tokens
  unlabelled) and segment ids of :data:`MODEL_LAYOUT`, as ``packing="documents"`` gives them."""
  seg = segment_ids_from_lengths(MODEL_LAYOUT, MODEL_T)
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(7), seg.shape, 0, vocab_size))
  same = np.zeros_like(seg, bool)
  same[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0)
  labels = np.where(same, np.roll(tokens, -1, axis=1), IGNORE)
  return {"inputs": jnp.asarray(tokens), "labels": jnp.asarray(labels, jnp.int32),
          "segment_ids": jnp.asarray(seg)}


def test_model_packed_training_step_on_kernels_equals_xla():
  """The trainer's loss and gradient (``objective_and_grads`` of the language-model objective
  over packed documents, the trainer's default remat) of a tiny model with
  ``kvm_implementation="pallas"`` equal the XLA model's, parameter by parameter."""
  model = make_model("kvm", num_layers=1)
  _, params = nnx.split(model, nnx.Param)
  batch = packed_batch(model.cfg.vocab_size)
  objective = LMObjective("none", 0, "float32", documents=True)
  results = []
  for implementation in ("pallas", "xla"):
    graphdef, _ = nnx.split(make_model("kvm", num_layers=1, kvm_implementation=implementation),
                            nnx.Param)
    step = jax.jit(functools.partial(objective_and_grads, objective, graphdef))
    loss, _, grads = step(params, batch)
    results.append((loss, grads))
  (got_loss, got), (want_loss, want) = results
  assert np.isfinite(float(got_loss)) and rel_rms(got_loss, want_loss) < OUT_TOL
  leaves = jax.tree_util.tree_leaves_with_path(got)
  want = jax.tree_util.tree_leaves(want)
  assert len(leaves) == len(want) > 0
  for (path, a), e in zip(leaves, want):
    assert rel_rms(a, e) < GRAD_TOL, jax.tree_util.keystr(path)
  # The KVM parameters (both temperatures, LN_s's scale and bias) are among them, and learn.
  kvm = [e for (path, _), e in zip(leaves, want)
         if any(n in jax.tree_util.keystr(path) for n in ("temperature", "ln_s"))]
  assert len(kvm) == 4 and all(np.any(np.asarray(e) != 0) for e in kvm)
