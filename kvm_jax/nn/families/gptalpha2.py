"""The GPTAlpha-2 family, the paper's backbone (docs/kvm-spec.md §4): LayerNorms with bias, an
embedding LayerNorm, a token-shifted squared-ReLU MLP, interleaved partial RoPE, bias-free
projections, token shift and the value residual in the attention front end, an untied head."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.families.family import Family
from kvm_jax.nn.layers import (depth_ratio, float32_init, layer_norm, linear, token_shift,
                               zeros_init)
from kvm_jax.ops.rope import apply_rope, rope_tables

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GPTAlpha2Options:
  """Options of the GPTAlpha-2 backbone (the authors' ``MixerConfig`` names in brackets).

  Attributes:
    ffn_expansion: MLP width factor; width = int(ffn_expansion·C)//32·32 (``ffn_expansion``).
    tokenshift_attention / tokenshift_mlp / value_residual: the front-end options of
      docs/kvm-spec.md §4 (``use_tokenshift_att``, ``use_tokenshift_ffn``,
      ``use_value_residual``).
    share_value_anchor: every layer uses layer 0's value anchor (``alt_share_v0``); otherwise each
      mixer kind anchors on its own first layer (the paper's hybrids).
  """

  ffn_expansion: float = 4.0
  tokenshift_attention: bool = True
  tokenshift_mlp: bool = True
  value_residual: bool = True
  share_value_anchor: bool = False

  def __post_init__(self):
    value = self.ffn_expansion
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
      raise ValueError(f"GPTAlpha2Options.ffn_expansion must be a positive number, got "
                       f"{self.ffn_expansion!r}.")

  def mlp_width(self, model: ModelConfig) -> int:
    width = int(self.ffn_expansion * model.hidden_size) // 32 * 32
    if width < 1:
      raise ValueError(f"ffn_expansion={self.ffn_expansion} gives an MLP of width {width} at "
                       f"hidden_size={model.hidden_size} (widths round down to multiples of 32).")
    return width


class MLP(nnx.Module):
  """Token-shifted squared-ReLU channel mixer (docs/kvm-spec.md §4)."""

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg = cfg
    C = cfg.hidden_size
    self.c_fc = linear(cfg, C, cfg.mlp_width, rngs,
                       init=float32_init(jax.nn.initializers.orthogonal(1.0)))
    self.c_proj = linear(cfg, cfg.mlp_width, C, rngs, init=zeros_init)
    if cfg.tokenshift_mlp:
      self.x_k = nnx.Param(jnp.asarray(1.0 - np.power(np.arange(C) / C,
                                                      depth_ratio(cfg, layer) ** 4),
                                       cfg.jnp_param_dtype))

  def __call__(self, x: Array, prev: Optional[Array] = None,
               starts: Optional[Array] = None) -> Array:
    """``x [B, T, C]`` -> ``[B, T, C]``; ``prev [B, 1, C]``: the previous token's input (decode);
    ``starts [B, T]``: packed documents' first tokens, where the shift restarts."""
    if self.cfg.tokenshift_mlp:
      x = token_shift(x, self.x_k[...], prev, "zero", starts)
    return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x))))


class GPTAlpha2(Family):
  """The family's parts (see :mod:`kvm_jax.nn.families.family`)."""

  Options = GPTAlpha2Options
  # The checkpoint format its models export to (kvm_jax.hf): the authors' RWKV7Backbone.
  CHECKPOINT_FORMAT = "authors"
  # Axes of the 2-D parameters inside a block's ``mlp``, and of the embedding and head (the
  # mixers declare their own).
  MLP_AXES = {"c_fc": ("embed", "mlp"), "c_proj": ("mlp", "embed")}
  LOGICAL_AXES = {"wte": ("vocab", "embed"), "lm_head": ("embed", "vocab")}

  @classmethod
  def norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    return layer_norm(cfg, n, rngs)

  @classmethod
  def head_norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    """QK-LayerNorm over each head's channels (the authors' ``qk_norm``)."""
    return layer_norm(cfg, n, rngs)

  @classmethod
  def projection(cls, cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, role: str):
    """Bias-free; the output projection starts at zero (the authors' init)."""
    return linear(cfg, n_in, n_out, rngs, init=zeros_init if role == "o" else None)

  @classmethod
  def mlp(cls, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    return MLP(cfg, layer, rngs=rngs)

  @classmethod
  def embedding(cls, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=cfg.jnp_param_dtype,
                     dtype=cfg.jnp_compute_dtype,
                     embedding_init=lambda k, s, d: jax.random.uniform(k, s, d, -1e-4, 1e-4),
                     rngs=rngs)

  @classmethod
  def embedding_norm(cls, cfg: ModelConfig, rngs: nnx.Rngs):
    return layer_norm(cfg, cfg.hidden_size, rngs)

  @classmethod
  def tied_head(cls, cfg: ModelConfig) -> bool:
    return False

  @classmethod
  def head(cls, cfg: ModelConfig, rngs: nnx.Rngs):
    C, V = cfg.hidden_size, cfg.vocab_size
    return linear(cfg, C, V, rngs,
                  init=float32_init(jax.nn.initializers.orthogonal(scale=0.5 * math.sqrt(V / C))))

  @classmethod
  def rope(cls, cfg: ModelConfig, layer: int, positions: Array):
    """Interleaved partial RoPE with the authors' frequencies (docs/kvm-spec.md §5)."""
    return rope_tables(positions, cfg.qk_head_dim, cfg.rope_dims_of(layer), cfg.rope_theta,
                       jnp.dtype(cfg.rope_table_dtype))

  @classmethod
  def rotate(cls, x: Array, tables) -> Array:
    return apply_rope(x, *tables)
