"""The Gemma family: Gemma 2's and Gemma 3's text models as transformers computes them.

Differences from :mod:`kvm_jax.nn.families.llama`: the embedding is multiplied by √C (rounded to the
parameter dtype, as transformers does), every RMSNorm multiplies by ``1 + w`` in float32, each
branch has a norm before and after it (four per block), the MLP is GeGLU with tanh-approximate
GELU, scores are scaled by ``query_pre_attn_scalar^-1/2``, the head is the embedding's
transpose, and local (sliding-window) and global layers may rotate with different bases
(``local_rope_theta``; RoPE scaling applies to the global layers only). Gemma 3 RMS-norms q and
k per head (``qk_norm``); Gemma 2 instead soft-caps attention scores and the final logits
(``cap · tanh(x / cap)``: ``attention_softcap``, ``final_logit_softcap``). Which
layers are local is the family's ``local_layers``; which mixer each layer runs is
``ModelConfig.mixers`` (a local layer is ``swa``, a global one ``full``, or either converted to
``kvm``, which keeps the layer's RoPE).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.layers import rms_normalized
from kvm_jax.nn.families.llama import (GatedMLP, Llama, LlamaOptions, check_positive, normal_init,
                                       projection_layer)
from kvm_jax.ops.rope import apply_half_rope, half_rope_tables, rope_inverse_frequencies

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class GemmaOptions:
  """Options of the Gemma family (transformers' ``Gemma3TextConfig`` / ``Gemma2Config`` names in
  brackets; the defaults are Gemma 3's).

  Attributes:
    intermediate_size: the MLP's hidden width (``intermediate_size``); None: 4 x the width.
    norm_eps: the RMSNorms' epsilon (``rms_norm_eps``).
    query_pre_attn_scalar: scores are scaled by its inverse square root
      (``query_pre_attn_scalar``); None: the head dim (the usual ``D^-1/2``).
    local_layers: indices of the local (sliding-window) layers (``layer_types``): their RoPE
      base is ``local_rope_theta`` and they take no RoPE scaling.
    local_rope_theta: RoPE base of the local layers (``rope_local_base_freq``).
    rope_scaling / rope_factor: "none" or "linear" RoPE scaling of the global layers.
    attention_bias: biases on the four attention projections (``attention_bias``).
    qk_norm: per-head (1 + w) RMSNorms of q and k before RoPE (Gemma 3; Gemma 2 has none).
    attention_softcap: every scaled attention score becomes ``cap · tanh(s / cap)`` before the
      mask (``attn_logit_softcapping``, Gemma 2: 50), in every layer, ``kvm`` ones included;
      None: no cap.
    final_logit_softcap: the LM head's logits become ``cap · tanh(x / cap)``
      (``final_logit_softcapping``, Gemma 2: 30); None: no cap.
    initializer_range: standard deviation of the weights of a model trained from scratch.
  """

  intermediate_size: Optional[int] = None
  norm_eps: float = 1e-6
  query_pre_attn_scalar: Optional[float] = None
  local_layers: tuple[int, ...] = ()
  local_rope_theta: float = 10000.0
  rope_scaling: str = "none"
  rope_factor: float = 1.0
  attention_bias: bool = False
  qk_norm: bool = True
  attention_softcap: Optional[float] = None
  final_logit_softcap: Optional[float] = None
  initializer_range: float = 0.02

  def __post_init__(self):
    owner = "GemmaOptions"
    if self.intermediate_size is not None:
      check_positive(owner, "intermediate_size", self.intermediate_size, int)
    for name in ("norm_eps", "local_rope_theta", "rope_factor", "initializer_range"):
      check_positive(owner, name, getattr(self, name))
    for name in ("query_pre_attn_scalar", "attention_softcap", "final_logit_softcap"):
      if getattr(self, name) is not None:
        check_positive(owner, name, getattr(self, name))
    if self.rope_scaling not in ("none", "linear"):
      raise ValueError(f"GemmaOptions.rope_scaling={self.rope_scaling!r}; choose 'none' or "
                       "'linear'.")
    object.__setattr__(self, "local_layers", tuple(self.local_layers))
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.local_layers) \
        or len(set(self.local_layers)) != len(self.local_layers):
      raise ValueError(f"GemmaOptions.local_layers={self.local_layers!r} must be distinct layer "
                       "indices.")

  def mlp_width(self, model: ModelConfig) -> int:
    return self.intermediate_size or 4 * model.hidden_size

  def check(self, model: ModelConfig) -> None:
    bad = [i for i in self.local_layers if i >= model.num_layers]
    if bad:
      raise ValueError(f"local_layers {bad} are outside the model's {model.num_layers} layers.")

  def llama_rope(self, local: bool) -> LlamaOptions:
    """The RoPE rule of a local or global layer, as Llama options (the same frequencies)."""
    if local or self.rope_scaling == "none":
      return LlamaOptions()
    return LlamaOptions(rope_scaling="linear", rope_factor=self.rope_factor)


class GemmaRMSNorm(nnx.Module):
  """``x / rms(x) · (1 + w)`` over the last axis, all in float32, cast back to ``x``'s dtype
  (transformers' ``Gemma3RMSNorm``); ``w`` starts at zero."""

  def __init__(self, n: int, epsilon: float, param_dtype):
    self.epsilon = epsilon
    self.scale = nnx.Param(jnp.zeros((n,), param_dtype))

  def __call__(self, x: Array) -> Array:
    scale = 1.0 + self.scale[...].astype(jnp.float32)
    return (rms_normalized(x, self.epsilon) * scale).astype(x.dtype)


class ScaledEmbed(nnx.Embed):
  """An embedding whose rows are multiplied by √C rounded to the parameter dtype (Gemma's
  ``embed_scale``); the tied head reads the unscaled table."""

  def __call__(self, tokens: Array) -> Array:
    scale = jnp.asarray(math.sqrt(self.features), self.param_dtype)
    return super().__call__(tokens) * scale.astype(self.dtype or self.param_dtype)


def gelu_tanh(x: Array) -> Array:
  """transformers' ``gelu_pytorch_tanh``."""
  return jax.nn.gelu(x, approximate=True)


class Gemma(Llama):
  """The family's parts (see :mod:`kvm_jax.nn.families.family`); the projections are Llama's."""

  Options = GemmaOptions
  CHECKPOINT_FORMAT = "transformers"
  HF_BLOCK = {**Llama.HF_BLOCK,
              ("ln_mlp", "scale"): "pre_feedforward_layernorm.weight",
              ("post_attn_norm", "scale"): "post_attention_layernorm.weight",
              ("post_mlp_norm", "scale"): "post_feedforward_layernorm.weight"}

  @classmethod
  def layer_key(cls, cfg: ModelConfig, layer: int):
    """Local and global layers rotate differently: they scan in separate groups."""
    return layer in cfg.family_options.local_layers

  @classmethod
  def norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    del rngs
    return GemmaRMSNorm(n, cfg.family_options.norm_eps, cfg.jnp_param_dtype)

  @classmethod
  def attention_softcap(cls, cfg: ModelConfig) -> Optional[float]:
    return cfg.family_options.attention_softcap

  @classmethod
  def logit_softcap(cls, cfg: ModelConfig) -> Optional[float]:
    return cfg.family_options.final_logit_softcap

  @classmethod
  def post_norm(cls, cfg: ModelConfig, n: int, rngs: nnx.Rngs):
    return cls.norm(cfg, n, rngs)

  @classmethod
  def projection(cls, cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs, role: str):
    return projection_layer(cfg, n_in, n_out, rngs, cfg.family_options.attention_bias)

  @classmethod
  def query_scale(cls, cfg: ModelConfig) -> float:
    """What q is multiplied by so that the kinds' ``D^-1/2`` scores become
    ``query_pre_attn_scalar^-1/2`` ones."""
    scalar = cfg.family_options.query_pre_attn_scalar
    return 1.0 if scalar is None else math.sqrt(cfg.qk_head_dim / scalar)

  @classmethod
  def mlp(cls, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
    return GatedMLP(cfg, gelu_tanh, False, rngs=rngs)

  @classmethod
  def embedding(cls, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    return ScaledEmbed(cfg.vocab_size, cfg.hidden_size, param_dtype=cfg.jnp_param_dtype,
                       dtype=cfg.jnp_compute_dtype, embedding_init=normal_init(cfg), rngs=rngs)

  @classmethod
  def tied_head(cls, cfg: ModelConfig) -> bool:
    return True

  @classmethod
  def rope(cls, cfg: ModelConfig, layer: int, positions: Array):
    options = cfg.family_options
    local = layer in options.local_layers
    theta = options.local_rope_theta if local else cfg.rope_theta
    r = cfg.rope_dims_of(layer)
    return half_rope_tables(positions, r,
                            rope_inverse_frequencies(options.llama_rope(local), r, theta),
                            jnp.dtype(cfg.rope_table_dtype))

  @classmethod
  def rotate(cls, x: Array, tables) -> Array:
    return apply_half_rope(x, *tables)
