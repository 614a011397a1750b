"""The GPTAlpha-2 family's checkpoint mapping: kvm_jax's parameter paths and the authors'
``RWKV7BackboneForCausalLM`` state dict (docs/checkpoints.md has the table; reading and writing
files is :mod:`kvm_jax.hf.params`).

Their ``nn.Linear`` stores ``weight [out, in]``, kvm_jax's ``nnx.Linear`` ``kernel [in, out]``:
every projection is transposed. Their LayerNorms (and RWKV-7's GroupNorm) hold ``weight``/``bias``,
kvm_jax's ``scale``/``bias``. ``v_gate0``, the MLP's ``x_k`` and RWKV-7's per-channel vectors carry
two leading singleton axes in their code.
Their value-residual layers without token shift (every kind but RWKV-7) also hold an ``attn.x_v`` of
zeros that nothing reads; it is written on export and required (its values ignored) on import.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from kvm_jax.model_config import ModelConfig

# kvm_jax leaf names -> theirs, per module kind.
_PROJECTIONS = {"c_q", "c_k", "c_v", "c_proj", "v_gate1", "v_gate2", "key_weighting", "c_fc",
                "lm_head"}
_LN_LEAVES = {"scale": "weight", "bias": "bias"}
_LAYER_NORMS = {"ln_attn": "ln_attn", "ln_mlp": "ln_mlp", "ln_q": "ln_q", "ln_k": "ln_k",
                "ln_s": "ln_s_k", "ln_emb": "ln_emb", "ln_head": "ln_head"}
_VECTORS = {"x_q": "x_q", "x_k": "x_k", "x_v": "x_v", "window_temperature": "front_head_temp",
            "state_temperature": "state_head_temp", "v_gate0": "v_gate0", "beta": "beta"}
# RWKV-7 time mix (their model/rwkv7_mixer.py): projections, the per-channel vectors (stored with
# two leading singleton axes), r_k [H, N] and the GroupNorm ln_x.
_RWKV7_PROJECTIONS = {"receptance", "key", "value", "output", "w1", "w2", "a1", "a2", "v1", "v2",
                      "g1", "g2"}
_RWKV7_VECTORS = {"x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"}


@dataclasses.dataclass(frozen=True)
class AuthorsMixer:
  """How the authors' code names one kvm_jax mixer kind.

  Attributes:
    token_mixers: their ``token_mixer`` / ``alt_token_mixer`` names for it; the first is what an
      export writes ("kvm_triton" selects their Triton KVM class through their
      "model.<name>_mixer" rule).
    class_paths: their ``*_class_path`` values for it (the Triton kernels and the fp32-routing
      variant hold the eager layer's parameters and compute the same function, their own numerics
      aside).
    mode_prefix: which ``<prefix>_value_residual_mode`` / ``_token_shift_mode`` fields it reads;
      None for a mixer without the shared attention front end (RWKV-7's time mix: its token shift
      follows ``use_tokenshift_att`` alone and its value residual is always on).
    rotates: whether their layer applies RoPE (their OVQ layer never does, whatever
      ``rope_partial_dim`` says; RWKV-7 has none).

  A kind their code has declares its row as the class attribute ``AUTHORS``.
  """

  token_mixers: tuple[str, ...]
  class_paths: tuple[str, ...]
  mode_prefix: Optional[str]
  rotates: bool = True


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one kvm_jax parameter is stored in their state dict: ``name``, ``shape`` there, and the
  two maps between the layouts."""

  name: str
  shape: tuple[int, ...]
  to_authors: Callable
  from_authors: Callable


def _same(x):
  return x


def _transpose(x):
  return np.swapaxes(x, -1, -2)


def _leading_ones(x):
  return x.reshape((1, 1) + x.shape)


def _drop_leading_ones(x):
  return x.reshape(x.shape[2:])


def _rwkv7_layout(prefix: str, owners: list[str], leaf: str, shape) -> Optional[Layout]:
  """The layout of an ``rwkv7`` layer's own parameter (None for the block's shared ones)."""
  if owners == ["attn"] and leaf in _RWKV7_VECTORS:
    return Layout(f"{prefix}attn.{leaf}", (1, 1) + tuple(shape), _leading_ones,
                  _drop_leading_ones)
  if owners == ["attn"] and leaf == "r_k":
    return Layout(f"{prefix}attn.r_k", tuple(shape), _same, _same)
  if owners == ["attn", "ln_x"] and leaf in _LN_LEAVES:
    return Layout(f"{prefix}attn.ln_x.{_LN_LEAVES[leaf]}", tuple(shape), _same, _same)
  if len(owners) == 2 and owners[1] in _RWKV7_PROJECTIONS and leaf == "kernel":
    return Layout(f"{prefix}attn.{owners[1]}.weight", tuple(shape)[::-1], _transpose, _transpose)
  return None


def layout_of(names: list[str], shape: tuple[int, ...],
              kind: Optional[str] = None) -> Optional[Layout]:
  """The :class:`Layout` of the kvm_jax parameter at path ``names`` (``["blocks", "3", "attn",
  "c_q", "kernel"]``) with shape ``shape``, or None when their model has no such tensor;
  ``kind`` is the mixer kind of the block it belongs to (RWKV-7 layers name their tensors
  differently)."""
  if names[0] == "blocks" and len(names) >= 4:
    prefix, path = f"transformer.h.{names[1]}.", names[2:]
  else:
    prefix, path = ("" if names[0] == "lm_head" else "transformer."), names
  *owners, leaf = path
  if kind == "rwkv7":
    layout = _rwkv7_layout(prefix, owners, leaf, shape)
    if layout is not None:
      return layout
  if owners and owners[-1] in _LAYER_NORMS and leaf in _LN_LEAVES:
    name = ".".join(owners[:-1] + [_LAYER_NORMS[owners[-1]], _LN_LEAVES[leaf]])
    return Layout(prefix + name, shape, _same, _same)
  if owners and owners[-1] in _PROJECTIONS and leaf == "kernel":
    return Layout(prefix + ".".join(owners + ["weight"]), shape[::-1], _transpose, _transpose)
  if path == ["wte", "embedding"]:
    return Layout("transformer.wte.weight", shape, _same, _same)
  if owners in (["attn"], ["mlp"]) and leaf in _VECTORS:
    name = prefix + f"{owners[0]}.{_VECTORS[leaf]}"
    if (owners[0], leaf) in (("attn", "v_gate0"), ("mlp", "x_k")):
      return Layout(name, (1, 1) + tuple(shape), _leading_ones, _drop_leading_ones)
    return Layout(name, shape, _same, _same)
  return None  # no counterpart (cross-layer KV sharing weights, for example)


def unused_zeros(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Tensors their model holds that compute nothing: ``attn.x_v`` of a value-residual layer
  without token shift (their mixin creates it as zeros so that one code path serves both; their
  RWKV-7 layer is no such mixin)."""
  if not cfg.value_residual or cfg.tokenshift_attention:
    return {}
  dv = cfg.kv_heads * cfg.v_head_dim
  return {f"transformer.h.{i}.attn.x_v": (dv,) for i in range(cfg.num_layers)
          if cfg.layer_mixers[i] != "rwkv7"}
