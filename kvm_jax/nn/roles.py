"""What a parameter is, read from its path: the one place outside the modules themselves that
knows how parameters are named, so that sharding, μP groups, distillation's trainable sets,
conversion and the checkpoint mappings ask roles instead of matching names.

``parameter_role(path)`` -> :class:`ParamRole`: its part of the model ("token_embedding",
"embedding_norm", "final_norm", "head", and in a block "mixer", "mlp" or "block" for the block's
own norms), its layer, its owner (the module or vector holding it inside that part: ``c_q``,
``ln_s``, ``window_temperature``, ``c_fc``, ``ln_attn``, ``wte``) and whether it is a weight
matrix (an ``nnx.Linear`` kernel).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.mixers.kvm import KVMAttention
from kvm_jax.nn.layers import path_names

# Parts outside the blocks, by the LM attribute that holds them.
_OUTSIDE = {"wte": "token_embedding", "ln_emb": "embedding_norm", "ln_head": "final_norm",
            "lm_head": "head"}
# Parts of a block, by the Block attribute that holds them ("block": its own norms).
_IN_BLOCK = {"attn": "mixer", "mlp": "mlp"}


@dataclasses.dataclass(frozen=True)
class ParamRole:
  """See the module docstring."""

  part: str
  layer: Optional[int]
  owner: str
  matrix: bool


def parameter_role(path) -> ParamRole:
  """The role of the parameter at NNX state path ``path`` (or its names)."""
  names = path_names(path)
  matrix = names[-1] == "kernel"
  if names[0] == "blocks":
    part = _IN_BLOCK.get(names[2], "block")
    owner = names[3] if part != "block" and len(names) > 3 else names[2]
    return ParamRole(part, int(names[1]), owner, matrix)
  return ParamRole(_OUTSIDE.get(names[0], names[0]), None, names[0], matrix)


def is_kvm_only(role: ParamRole, cfg: ModelConfig) -> bool:
  """A parameter that a ``kvm`` layer has and the attention layer it was converted from has not
  (LN_s, W_g, the two temperatures: :attr:`KVMAttention.OWN_PARAMETERS`)."""
  return (role.part == "mixer" and cfg.is_kvm(role.layer)
          and role.owner in KVMAttention.OWN_PARAMETERS)


def conversion_value(role: ParamRole, leaf: str) -> Optional[float]:
  """The value a converted layer's new parameter starts at, so that in-window logits are the
  source's (:attr:`KVMAttention.CONVERSION_VALUES`); None for a parameter conversion never
  makes."""
  if role.part != "mixer":
    return None
  key = (role.owner,) if role.owner == leaf else (role.owner, leaf)
  return KVMAttention.CONVERSION_VALUES.get(key)
