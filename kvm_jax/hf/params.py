"""Parameter names and layouts: kvm_jax's ``LM`` and the authors' ``RWKV7BackboneForCausalLM``
state dict (docs/checkpoints.md has the table).

Their ``nn.Linear`` stores ``weight [out, in]``, kvm_jax's ``nnx.Linear`` ``kernel [in, out]``:
every projection is transposed. Their LayerNorms (and RWKV-7's GroupNorm) hold ``weight``/``bias``,
kvm_jax's ``scale``/``bias``. ``v_gate0``, the MLP's ``x_k`` and RWKV-7's per-channel vectors carry
two leading singleton axes in their code.
Their value-residual layers without token shift (every kind but RWKV-7) also hold an ``attn.x_v`` of
zeros that nothing reads; it is written on export and required (its values ignored) on import.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.hf.safetensors import CheckpointError
from kvm_jax.model_config import ModelConfig
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.model import LM
from kvm_jax.progress import ProgressReport

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


def layout_of(names: list[str], shape: tuple[int, ...], kind: Optional[str] = None) -> Layout:
  """The :class:`Layout` of the kvm_jax parameter at path ``names`` (``["blocks", "3", "attn",
  "c_q", "kernel"]``) with shape ``shape``; ``kind`` is the mixer kind of the block it belongs
  to (RWKV-7 layers name their tensors differently)."""
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
  raise CheckpointError(f"parameter {'/'.join(names)} has no counterpart in the authors' model "
                        "(cross-layer KV sharing weights, for example).")


def abstract_model(cfg: ModelConfig):
  """(graphdef, abstract parameter state) of ``LM(cfg)``, without allocating anything."""
  return nnx.split(nnx.eval_shape(lambda: LM(cfg, rngs=nnx.Rngs(0))))


def unused_zeros(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Tensors their model holds that compute nothing: ``attn.x_v`` of a value-residual layer
  without token shift (their mixin creates it as zeros so that one code path serves both; their
  RWKV-7 layer is no such mixin)."""
  if not cfg.value_residual or cfg.tokenshift_attention:
    return {}
  dv = cfg.kv_heads * cfg.v_head_dim
  return {f"transformer.h.{i}.attn.x_v": (dv,) for i in range(cfg.num_layers)
          if cfg.layer_mixers[i] != "rwkv7"}


def layouts(cfg: ModelConfig, state=None) -> dict[str, Layout]:
  """``{kvm_jax path "blocks/0/attn/c_q/kernel": Layout}`` of every parameter of ``LM(cfg)``
  (``state``: its abstract parameters, when already at hand)."""
  if state is None:
    _, state = abstract_model(cfg)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = path_names(path)
    kind = cfg.layer_mixers[int(names[1])] if names[0] == "blocks" else None
    out["/".join(names)] = layout_of(names, tuple(leaf.shape), kind)
  return out


def authors_shapes(cfg: ModelConfig, table: Optional[dict[str, Layout]] = None
                   ) -> dict[str, tuple[int, ...]]:
  """``{their tensor name: shape}`` of the state dict their model holds for ``cfg``."""
  shapes = {lay.name: lay.shape for lay in (table or layouts(cfg)).values()}
  shapes.update(unused_zeros(cfg))
  return shapes


def to_authors(params: Any, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
  """Their state dict (numpy, in ``dtype`` or the parameters' own) from kvm_jax parameters
  (``nnx.state(model, nnx.Param)`` or the pure dict of it)."""
  table = layouts(cfg)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = "/".join(path_names(path))
    if key not in table:
      raise CheckpointError(f"parameter {key} is not part of LM({cfg!r}).")
    arr = np.asarray(jax.device_get(leaf))
    out[table[key].name] = np.require(
        table[key].to_authors(arr.astype(dtype) if dtype is not None else arr))
  missing = sorted(set(lay.name for lay in table.values()) - set(out))
  if missing:
    raise CheckpointError(f"the parameters lack {missing[:8]} for this config.")
  some = next(iter(out.values()))
  for name, shape in unused_zeros(cfg).items():
    out[name] = np.zeros(shape, some.dtype)
  return out


def from_authors(tensors: Mapping[str, np.ndarray], cfg: ModelConfig,
                 source: str = "the checkpoint", progress: bool = False):
  """(graphdef, parameter state) of ``LM(cfg)`` holding their tensors, cast to
  ``cfg.param_dtype``. Every tensor their model would hold must be there with its exact shape, and
  nothing else: a missing, extra or misshapen tensor is a :class:`CheckpointError` naming it.
  With ``progress`` a bar counts the bytes read (memory-mapped tensors are read here)."""
  graphdef, state = abstract_model(cfg)
  table = layouts(cfg, state)
  expected = authors_shapes(cfg, table)
  missing = sorted(set(expected) - set(tensors))
  extra = sorted(set(tensors) - set(expected))
  if missing or extra:
    parts = []
    if missing:
      parts.append(f"missing {len(missing)} tensor(s) the config implies: {missing[:10]}"
                   + (" ..." if len(missing) > 10 else ""))
    if extra:
      parts.append(f"{len(extra)} tensor(s) the config does not explain: {extra[:10]}"
                   + (" ..." if len(extra) > 10 else ""))
    raise CheckpointError(f"{source} does not match its config.json: " + "; ".join(parts)
                          + ". Is config.json the one saved with these weights?")
  for name, shape in expected.items():
    got = tuple(tensors[name].shape)
    if got != shape:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {list(got)} but the config "
                            f"implies {list(shape)}.")
  for name in expected:
    if not jnp.issubdtype(tensors[name].dtype, jnp.floating):
      raise CheckpointError(f"{source}: tensor {name!r} has dtype {tensors[name].dtype}; "
                            "parameters must be floating point.")
  dtype = cfg.jnp_param_dtype
  total = sum(tensors[name].nbytes for name in expected)
  report = ProgressReport(total, "load", min_interval=0.2) if progress else None
  done = 0

  def convert(path, leaf):
    nonlocal done
    lay = table["/".join(path_names(path))]
    arr = jnp.asarray(lay.from_authors(np.asarray(tensors[lay.name])).astype(dtype), dtype)
    done += tensors[lay.name].nbytes
    if report:
      report.update(done, lay.name)
    return arr

  params = jax.tree_util.tree_map_with_path(convert, state)
  if report:
    report.update(total, final=True)
  return graphdef, params
