"""Backbone families as plug-ins: what a family owns and the one list of families.

A family (``ModelConfig.family``) is a class with only classmethods (usually a subclass of
:class:`Family`, which answers what most families share), registered with
:func:`register_family`. The generic :class:`kvm_jax.nn.model.LM`, its blocks and the attention
front end of every mixer kind ask it for the parts that differ between GPTAlpha-2, Llama and their
relatives, and never test a family's name:

* ``Options``: its frozen options dataclass (``ModelConfig.family_options``);
* ``norm(cfg, n, rngs)``: the block and final norms; ``head_norm(cfg, d, rngs)``: the per-head
  q/k norm of its attention, or None;
* ``layer_key(cfg, layer)``: what, besides its mixer kind, makes a layer compute differently
  from another (Gemma's local or global RoPE): layers run as one scanned group only when both
  agree;
* ``post_norm(cfg, n, rngs)``: a norm applied to each branch's output before the residual
  (Gemma's post-attention and post-feedforward norms), or None;
* ``query_scale(cfg)``: a constant the queries are multiplied by after RoPE, so that the kinds'
  ``D^-1/2`` scores take the family's scale (1.0 for most);
* ``attention_softcap(cfg)`` / ``logit_softcap(cfg)``: the cap of attention scores and of the
  LM head's logits (``cap · tanh(x / cap)``, Gemma 2's soft-capping), or None;
* ``projection(cfg, n_in, n_out, rngs, role)``: the attention's projections (``role`` "q", "k",
  "v" or "o": biases and initializations differ by role);
* ``mlp(cfg, layer, rngs)``: the channel mixer, called as ``mlp(x, prev, starts)``;
* ``embedding(cfg, rngs)``, ``embedding_norm(cfg, rngs)`` (a norm right after the embedding, or
  None), ``tied_head(cfg)`` (the head reads the embedding) and ``head(cfg, rngs)`` (an untied
  head's projection);
* ``rope(cfg, layer, positions)`` -> tables and ``rotate(x, tables)``: its RoPE style;
* ``state_channel_order(cfg, layer)``: the permutation of q/k channels that puts rotary pairs
  first, fastest first (what the KVM state's ``state_rope_dims`` counts in), or None when its
  layout already is (interleaved RoPE);
* ``MLP_AXES`` / ``LOGICAL_AXES`` / ``PARAM_GROUPS``: the sharding axes of the 2-D parameters of
  its MLP and of the rest it owns outside the mixers (embedding, head), and their μP/CompleteP
  groups where the default rule is not right (kvm_jax.train.sharding and kvm_jax.train.completep
  ask through :func:`family_logical_axes` and :func:`family_param_groups`);
* ``CHECKPOINT_FORMAT``: "authors" (the paper's RWKV7Backbone format) or "transformers" (what
  ``kvm-export`` writes);
* ``hf_name(names)``: transformers' tensor name of the parameter at path ``names`` (a
  ``kernel`` stored transposed, as ``nn.Linear`` weights are), or None where their format has
  none; only families that read transformers checkpoints (:mod:`kvm_jax.hf.families`).
"""

from __future__ import annotations

from kvm_jax.config.families import register_family_options
from kvm_jax.config.model import ModelConfig

_FAMILIES: dict[str, type] = {}


class Family:
  """What most families share: pre-norm blocks (no norm after a branch), no norm after the
  embedding, the kinds' own score scale, layers that differ only by kind, and the μP groups of
  the embedding and head. A family subclasses it (or a built-in family) and gives the rest."""

  PARAM_GROUPS = {"wte": "wte_embed", "lm_head": "lm_head"}

  @classmethod
  def layer_key(cls, cfg: ModelConfig, layer: int):
    """Every layer of one mixer kind computes alike (layers scan in groups by kind)."""
    return None

  @classmethod
  def post_norm(cls, cfg: ModelConfig, n: int, rngs):
    """No norm after a branch (pre-norm blocks)."""
    return None

  @classmethod
  def embedding_norm(cls, cfg: ModelConfig, rngs):
    """No norm after the embedding."""
    return None

  @classmethod
  def query_scale(cls, cfg: ModelConfig) -> float:
    """Scores are the kinds' own ``D^-1/2`` ones."""
    return 1.0

  @classmethod
  def state_channel_order(cls, cfg: ModelConfig, layer: int):
    """Rotary channels come in adjacent pairs, fastest first (interleaved RoPE)."""
    return None

  @classmethod
  def attention_softcap(cls, cfg: ModelConfig):
    """Attention scores are not soft-capped."""
    return None

  @classmethod
  def logit_softcap(cls, cfg: ModelConfig):
    """The LM head's logits are not soft-capped."""
    return None

_REQUIRED = ("Options", "MLP_AXES", "LOGICAL_AXES", "PARAM_GROUPS", "norm", "head_norm",
             "layer_key", "post_norm", "query_scale", "attention_softcap", "logit_softcap",
             "projection", "mlp",
             "embedding", "embedding_norm", "tied_head", "head", "rope", "rotate",
             "state_channel_order",
             "CHECKPOINT_FORMAT")


def register_family(name: str, cls: type) -> type:
  """Makes ``name`` a value of ``ModelConfig.family`` whose parts come from ``cls``; returns
  ``cls``. Re-registering the same class is a no-op."""
  missing = [member for member in _REQUIRED if not hasattr(cls, member)]
  if missing:
    raise TypeError(f"family class {getattr(cls, '__name__', cls)!r} lacks {missing}; subclass "
                    "kvm_jax.nn.families.gptalpha2.GPTAlpha2 or kvm_jax.nn.families.llama.Llama.")
  known = _FAMILIES.get(name)
  if known is not None and known is not cls:
    raise ValueError(f"family {name!r} is already registered to {known.__name__}.")
  register_family_options(name, cls.Options)
  _FAMILIES[name] = cls
  return cls


def family_of(cfg: ModelConfig) -> type:
  """The family class of ``cfg``."""
  if cfg.family not in _FAMILIES:
    raise ValueError(f"unknown backbone family {cfg.family!r}; registered: {tuple(_FAMILIES)}.")
  return _FAMILIES[cfg.family]


def registered_families() -> dict[str, type]:
  """``{name: class}`` of every registered family (a copy)."""
  return dict(_FAMILIES)


def family_logical_axes(mlp: bool) -> dict[str, tuple]:
  """Logical axes of the 2-D parameters the families own outside the mixers, by owner name:
  those inside a block's ``mlp`` (``mlp=True``), or the embedding's and head's."""
  out: dict[str, tuple] = {}
  for cls in _FAMILIES.values():
    out.update(cls.MLP_AXES if mlp else cls.LOGICAL_AXES)
  return out


def family_param_groups() -> dict[str, str]:
  """μP/CompleteP groups the families give the parameters they own, by owner name."""
  out: dict[str, str] = {}
  for cls in _FAMILIES.values():
    out.update(cls.PARAM_GROUPS)
  return out
