"""CompleteP / μP parameter groups and the learning-rate schedule, as the authors train
(docs/kvm-spec.md §8).

Rules and their sources (the authors' ``train.py``, ``trainer.py``, ``utils/opt.py``, configs):

* **Groups** (``set_label``): ``matrix_params`` = every Linear weight (attention projections, W_g,
  value-residual LoRA, MLP); ``lm_head``; ``wte_embed``; ``scalars`` = LayerNorms (incl. LN_s),
  temperatures, token-shift mixes, ``v_gate0``.
* **Width (μP)**: ratio = hidden_size / mup_base_dim (768): ``matrix_params`` and ``lm_head`` get
  lr / ratio and wd · ratio; the value-residual LoRA output (``v_gate2``) uses its own ratio
  lora / lora_base (1 for 768 and 1024). ``wte_embed``: no μP, weight decay **on**. ``scalars``:
  no μP, no weight decay.
* **Depth**: ``residual_scale = 12 / num_layers`` on both block branches (a model-config field; the
  presets set it), no other depth-dependent learning rate.
* **Schedule**: linear warm-up ``(step + 1) / 200`` for 200 steps, then linear decay
  ``(N - step) / (N - 200)`` to 0 (``get_lr_ratio``).
* **Defaults**: lr 2e-3 and wd 0.2 at 3B tokens, lr ∝ 1/sqrt(tokens) and wd = 100·lr
  (7.5B: 1.26491e-3 / 0.126491; 15B: 8.94427e-4 / 0.0894427); betas (0.9, 0.95), eps 1e-8, no
  gradient clipping.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn import registry
from kvm_jax.nn.families.family import family_param_groups
from kvm_jax.nn.roles import parameter_role

GROUPS = registry.PARAM_GROUP_NAMES


def reference_lr(tokens: float) -> float:
  """Peak learning rate for a token budget: 2e-3 at 3B tokens, scaled by 1/sqrt(tokens)."""
  return 2e-3 * math.sqrt(3e9 / tokens)


def reference_wd(tokens: float) -> float:
  """Peak weight decay: 100 × the peak learning rate."""
  return 100.0 * reference_lr(tokens)


def lr_schedule(peak: float, total_steps: int, warmup_steps: int = 200):
  """``step -> lr``: linear warm-up then linear decay to 0 (the authors' ``get_lr_ratio``)."""
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
  if total_steps <= warmup_steps:
    raise ValueError(f"total_steps={total_steps} must exceed warmup_steps={warmup_steps}.")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = (step + 1) / warmup_steps
    decay = (total_steps - step) / (total_steps - warmup_steps)
    return peak * jnp.clip(jnp.where(step < warmup_steps, warm, decay), 0.0, 1.0)

  return schedule


def group_of(path) -> str:
  """The authors' label of one parameter, from its role (kvm_jax.nn.roles): the family's label
  for its embedding and head, a mixer's own label for it (``PARAM_GROUPS`` of its class,
  kvm_jax.nn.registry), or the default rule (a weight matrix is "matrix_params", the rest
  "scalars")."""
  role = parameter_role(path)
  if role.part in ("token_embedding", "head"):
    return family_param_groups()[role.owner]
  if role.part == "mixer" and role.owner in registry.param_groups():
    return registry.param_groups()[role.owner]
  return "matrix_params" if role.matrix else "scalars"


def group_tree(params: Any) -> Any:
  """A pytree like ``params`` holding each parameter's group name."""
  return jax.tree_util.tree_map_with_path(lambda path, _: group_of(path), params)


def mup_ratio(path, cfg: ModelConfig) -> float:
  """The μP width ratio of one parameter: hidden_size / mup_base_dim, unless its mixer gives the
  parameter its own (``mup_d_in_ratios`` of the layer's class: a LoRA's output projection reads
  ``lora`` channels, not the model width)."""
  role = parameter_role(path)
  if role.part == "mixer":
    own = registry.mixer_class(cfg.layer_mixers[role.layer]).mup_d_in_ratios(cfg)
    if role.owner in own:
      return float(own[role.owner])
  return cfg.hidden_size / cfg.mup_base_dim


def mup_scales(params: Any, cfg: ModelConfig) -> tuple[Any, Any]:
  """Per-parameter (lr_scale, wd_scale) pytrees implementing the groups above."""

  def scales(path, _):
    group = group_of(path)
    r = mup_ratio(path, cfg)
    if group in ("matrix_params", "lm_head"):
      return (1.0 / r, r)
    if group == "wte_embed":
      return (1.0, 1.0)
    return (1.0, 0.0)  # scalars: no μP, no decay

  both = jax.tree_util.tree_map_with_path(scales, params)
  is_pair = lambda x: isinstance(x, tuple)
  return (jax.tree_util.tree_map(lambda s: s[0], both, is_leaf=is_pair),
          jax.tree_util.tree_map(lambda s: s[1], both, is_leaf=is_pair))
