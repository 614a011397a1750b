"""The Llama family: Llama 2/3, Qwen2, Qwen3 and Mistral, as transformers computes them.

RMSNorm before each branch and at the end, no embedding norm, a SwiGLU MLP
(``down(silu(gate(x)) · up(x))``), RoPE on the two halves of each head (the "rotate half" layout;
``rope_scaling`` "linear" or "llama3"), optional q/k/v (and output) biases (Qwen2), optional
per-head q/k RMSNorms before RoPE (Qwen3), tied or untied embeddings. Mistral's sliding window is
the ``swa`` mixer kind with its window; every other kind (``kvm`` above all) sits in these blocks
with this front end.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig
from kvm_jax.ops.rope import (apply_half_rope, half_rope_pair_order, half_rope_tables,
                              rope_inverse_frequencies)
from kvm_jax.nn.families.family import Family
from kvm_jax.nn.layers import RMSNorm

Array = jax.Array

ROPE_SCALINGS = ("none", "linear", "llama3")


def check_positive(owner: str, name: str, value, kind=(int, float)) -> None:
  """A ValueError naming ``owner.name`` unless ``value`` is a positive ``kind``."""
  if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
    raise ValueError(f"{owner}.{name} must be positive, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class LlamaOptions:
  """Options of the Llama family (transformers' ``LlamaConfig`` names in brackets).

  Attributes:
    intermediate_size: the MLP's hidden width (``intermediate_size``); None: 8/3 of the model
      width rounded up to a multiple of 32.
    norm_eps: the RMSNorms' epsilon (``rms_norm_eps``).
    qkv_bias: biases on the q, k and v projections (Qwen2; Llama's ``attention_bias``).
    output_bias: a bias on the attention's output projection (Llama's ``attention_bias``).
    mlp_bias: biases on the MLP's three projections (``mlp_bias``).
    qk_norm: per-head RMSNorms of q and k before RoPE (Qwen3).
    tie_embeddings: the LM head is the embedding's transpose (``tie_word_embeddings``).
    rope_scaling: "none", "linear" (every frequency divided by ``rope_factor``) or "llama3"
      (Llama 3.1's rule: low frequencies divided by ``rope_factor``, high ones kept, a smooth
      ramp between; ``rope_low_freq_factor``, ``rope_high_freq_factor``,
      ``rope_original_max_len``).
    initializer_range: standard deviation of the weights of a model trained from scratch.
  """

  intermediate_size: Optional[int] = None
  norm_eps: float = 1e-6
  qkv_bias: bool = False
  output_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  tie_embeddings: bool = False
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  initializer_range: float = 0.02

  def __post_init__(self):
    owner = "LlamaOptions"
    if self.intermediate_size is not None:
      check_positive(owner, "intermediate_size", self.intermediate_size, int)
    for name in ("norm_eps", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                 "initializer_range"):
      check_positive(owner, name, getattr(self, name))
    check_positive(owner, "rope_original_max_len", self.rope_original_max_len, int)
    if self.rope_scaling not in ROPE_SCALINGS:
      raise ValueError(f"LlamaOptions.rope_scaling={self.rope_scaling!r}; choose from "
                       f"{ROPE_SCALINGS}.")
    if self.rope_scaling == "llama3" and self.rope_high_freq_factor <= self.rope_low_freq_factor:
      raise ValueError(f"LlamaOptions: llama3 RoPE scaling needs rope_high_freq_factor "
                       f"({self.rope_high_freq_factor}) > rope_low_freq_factor "
                       f"({self.rope_low_freq_factor}).")

  def mlp_width(self, model: ModelConfig) -> int:
    if self.intermediate_size is not None:
      return self.intermediate_size
    return -(-8 * model.hidden_size // 3 // 32) * 32


def normal_init(cfg: ModelConfig):
  """N(0, initializer_range²) in float32, cast to the parameter dtype (transformers' init)."""
  std = cfg.family_options.initializer_range
  return lambda key, shape, dtype: (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def projection_layer(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs,
                     bias: bool) -> nnx.Linear:
  """A projection (with a bias when ``bias``) in the model's dtypes, drawn by
  :func:`normal_init`."""
  return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=cfg.jnp_param_dtype,
                    dtype=cfg.jnp_compute_dtype, kernel_init=normal_init(cfg), rngs=rngs)


class GatedMLP(nnx.Module):
  """``c_proj(act(c_gate(x)) · c_fc(x))`` (transformers' gate, up and down projections): SwiGLU
  with ``act`` = SiLU (Llama), GeGLU with the tanh GELU (Gemma)."""

  def __init__(self, cfg: ModelConfig, activation, bias: bool, *, rngs: nnx.Rngs):
    C, F = cfg.hidden_size, cfg.mlp_width
    self.activation = activation
    self.c_gate = projection_layer(cfg, C, F, rngs, bias)
    self.c_fc = projection_layer(cfg, C, F, rngs, bias)
    self.c_proj = projection_layer(cfg, F, C, rngs, bias)

  def __call__(self, x: Array, prev: Optional[Array] = None,
               starts: Optional[Array] = None) -> Array:
    """``x [B, T, C]`` -> ``[B, T, C]`` (a per-token map: ``prev`` and ``starts`` unused)."""
    del prev, starts
    return self.c_proj(self.activation(self.c_gate(x)) * self.c_fc(x))


class Llama(Family):
  """The family's parts (see :mod:`kvm_jax.nn.families.family`)."""

  Options = LlamaOptions
  # The checkpoint format its models export to (kvm_jax.hf.families), via ``hf_name``.
  CHECKPOINT_FORMAT = "transformers"
  MLP_AXES = {"c_gate": ("embed", "mlp"), "c_fc": ("embed", "mlp"), "c_proj": ("mlp", "embed")}
  LOGICAL_AXES = {"wte": ("vocab", "embed"), "lm_head": ("embed", "vocab")}

  @classmethod
  def norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    del rngs
    return RMSNorm(n, cfg.family_options.norm_eps, cfg.jnp_param_dtype)

  @classmethod
  def head_norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    return cls.norm(cfg, n, rngs) if cfg.family_options.qk_norm else None

  @classmethod
  def projection(cls, cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, role: str):
    options = cfg.family_options
    return projection_layer(cfg, n_in, n_out, rngs,
                   options.output_bias if role == "o" else options.qkv_bias)

  @classmethod
  def mlp(cls, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    return GatedMLP(cfg, jax.nn.silu, cfg.family_options.mlp_bias, rngs=rngs)

  @classmethod
  def embedding(cls, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=cfg.jnp_param_dtype,
                     dtype=cfg.jnp_compute_dtype, embedding_init=normal_init(cfg), rngs=rngs)

  @classmethod
  def tied_head(cls, cfg: ModelConfig) -> bool:
    return cfg.family_options.tie_embeddings

  @classmethod
  def head(cls, cfg: ModelConfig, rngs: nnx.Rngs):
    return projection_layer(cfg, cfg.hidden_size, cfg.vocab_size, rngs, False)

  @classmethod
  def rope(cls, cfg: ModelConfig, layer: int, positions: Array):
    r = cfg.rope_dims_of(layer)
    return half_rope_tables(positions, r,
                            rope_inverse_frequencies(cfg.family_options, r, cfg.rope_theta),
                            jnp.dtype(cfg.rope_table_dtype))

  @classmethod
  def rotate(cls, x: Array, tables) -> Array:
    return apply_half_rope(x, *tables)

  @classmethod
  def state_channel_order(cls, cfg: ModelConfig, layer: int) -> np.ndarray:
    """Pairs of the "rotate half" layout side by side, fastest first (every scaling rule here
    keeps the frequencies falling with the channel index)."""
    return half_rope_pair_order(cfg.qk_head_dim, cfg.rope_dims_of(layer))

  # transformers' tensor names: the parts outside the blocks, and a block's parameters by their
  # path inside it ("model.layers.{i}." + the name). A ``kernel`` is the transpose of its
  # ``nn.Linear`` weight.
  HF_OUTSIDE = {("wte", "embedding"): "model.embed_tokens.weight",
                ("ln_head", "scale"): "model.norm.weight", ("lm_head", "kernel"): "lm_head.weight"}
  HF_BLOCK = {("ln_attn", "scale"): "input_layernorm.weight",
              ("ln_mlp", "scale"): "post_attention_layernorm.weight",
              ("attn", "ln_q", "scale"): "self_attn.q_norm.weight",
              ("attn", "ln_k", "scale"): "self_attn.k_norm.weight",
              **{("attn", ours, leaf): f"self_attn.{theirs}_proj.{hf_leaf}"
                 for ours, theirs in (("c_q", "q"), ("c_k", "k"), ("c_v", "v"), ("c_proj", "o"))
                 for leaf, hf_leaf in (("kernel", "weight"), ("bias", "bias"))},
              **{("mlp", ours, leaf): f"mlp.{theirs}_proj.{hf_leaf}"
                 for ours, theirs in (("c_gate", "gate"), ("c_fc", "up"), ("c_proj", "down"))
                 for leaf, hf_leaf in (("kernel", "weight"), ("bias", "bias"))}}

  @classmethod
  def hf_name(cls, names: tuple[str, ...]) -> Optional[str]:
    """transformers' name of the parameter at ``names`` (``("blocks", "0", "attn", "c_q",
    "kernel")``), or None when their format has no such tensor (a KVM layer's own)."""
    if names[0] == "blocks":
      name = cls.HF_BLOCK.get(tuple(names[2:]))
      return None if name is None else f"model.layers.{names[1]}.{name}"
    return cls.HF_OUTSIDE.get(tuple(names))
