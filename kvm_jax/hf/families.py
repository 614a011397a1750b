"""transformers-format checkpoints of the Llama (Llama, Qwen2, Qwen3, Mistral) and Gemma (Gemma 2,
Gemma 3 text) families, read exactly.

A directory that transformers' ``save_pretrained`` wrote: ``config.json`` in the layout of
transformers 4.x (``rope_theta``, ``rope_scaling``) or 5.x (``rope_parameters``,
``layer_types``), weights in one safetensors file or shards with an index, float32 or bfloat16.
Every field that changes what the model computes is read or refused by name; nothing is guessed.
docs/pretrained.md has the field table.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.hf.authors_config import ConfigError, ExportError
from kvm_jax.hf.safetensors import CheckpointError
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn import registry
from kvm_jax.nn.families.family import family_of
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.roles import parameter_role
from kvm_jax.nn.families.gemma import GemmaOptions
from kvm_jax.nn.families.llama import LlamaOptions
from kvm_jax.util.progress import ProgressReport

# model_type -> the kvm_jax family that computes it. Their differences are options: Qwen2's q/k/v
# always carry biases (its o_proj never does), Llama and Qwen3 follow ``attention_bias`` for all
# four, Mistral has none; Qwen3 norms q and k per head; Mistral may slide a window.
MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
               "gemma2": "gemma", "gemma3_text": "gemma"}
# Families transformers has that these readers do not (yet) express: refused by name.
NOT_SUPPORTED = {
    "gemma": "Gemma 1",
    "gemma3": "the multimodal Gemma 3 (its text model alone, model_type 'gemma3_text', reads)",
    "qwen2_moe": "Qwen2-MoE (mixture of experts)", "qwen3_moe": "Qwen3-MoE (mixture of experts)",
    "mixtral": "Mixtral (mixture of experts)", "llama4": "Llama 4", "phi3": "Phi-3",
    "gpt2": "GPT-2"}
ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3"}


def _kinds_of_types(types, layers: int) -> tuple[str, ...]:
  """The mixer kind of each of ``layers`` layers named in ``layer_types`` (each kind's own
  ``TRANSFORMERS.layer_type``), or :class:`ConfigError`."""
  kinds = registry.kinds_of_layer_types()
  if len(types) != layers or any(t not in kinds for t in types):
    raise ConfigError(f"config.json: layer_types={types!r} must name one of "
                      f"{sorted(kinds)} for each of the {layers} layers.")
  return tuple(kinds[t] for t in types)


def _sliding(kinds) -> set:
  """The kinds among ``kinds`` whose layers slide a window (``sliding_window``)."""
  return set(kinds) & set(registry.sliding_kinds())


def _field(config: Mapping, name: str, kind=int, default: Any = ..., minimum=None):
  """``config[name]`` checked to be a ``kind`` (>= ``minimum``); ``default`` when absent."""
  if name not in config or config[name] is None:
    if default is ...:
      raise ConfigError(f"config.json lacks {name!r}.")
    return default
  value = config[name]
  ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
        and (kind is float or float(value).is_integer()) and math.isfinite(value))
  if not ok or (minimum is not None and value < minimum):
    what = "a finite number" if kind is float else "an integer"
    bound = f" >= {minimum}" if minimum is not None else ""
    raise ConfigError(f"config.json: {name}={value!r} must be {what}{bound}.")
  return kind(value)


def _rope(config: Mapping) -> tuple[float, dict]:
  """(theta, LlamaOptions RoPE fields) from either layout."""
  params = config.get("rope_parameters")
  if isinstance(params, Mapping) and "rope_theta" not in params and params:
    raise ConfigError("config.json: rope_parameters per layer type (Gemma's layout) are not a "
                      "Llama-family model's.")
  if params is None:  # 4.x: rope_theta at the top, rope_scaling None or a dict
    params = dict(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in ROPE_TYPES:
    raise ConfigError(f"config.json: RoPE type {kind!r} is not supported (supported: "
                      f"{sorted(ROPE_TYPES)}); a model with this scaling cannot be read exactly.")
  factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if factor not in (None, 1, 1.0):
    raise ConfigError(f"config.json: partial_rotary_factor={factor!r}; these families rotate "
                      "every channel of a head (1.0).")
  theta = _field(params, "rope_theta", float, minimum=1.0)
  fields = {"rope_scaling": ROPE_TYPES[kind]}
  if kind in ("linear", "llama3"):
    fields["rope_factor"] = _field(params, "factor", float, minimum=1.0)
  if kind == "llama3":
    fields.update(rope_low_freq_factor=_field(params, "low_freq_factor", float, minimum=0.0),
                  rope_high_freq_factor=_field(params, "high_freq_factor", float, minimum=0.0),
                  rope_original_max_len=_field(params, "original_max_position_embeddings",
                                               minimum=1))
  return theta, fields


def _mixers(config: Mapping, model_type: str, layers: int) -> tuple[tuple[str, ...], Optional[int]]:
  """(mixer kind per layer, sliding window or None)."""
  window = config.get("sliding_window")
  types = config.get("layer_types")
  if model_type in ("qwen2", "qwen3") and config.get("use_sliding_window"):
    raise ConfigError("config.json: use_sliding_window=true (Qwen's sliding window on the layers "
                      "past max_window_layers) is not supported; published Qwen2/Qwen3 "
                      "checkpoints leave it off.")
  if types is None:  # Mistral with a window slides it on every layer
    types = ["sliding_attention" if model_type == "mistral" and window is not None
             else "full_attention"] * layers
  kinds = _kinds_of_types(types, layers)
  sliding = _sliding(kinds)
  if model_type in ("qwen2", "qwen3") and sliding:
    raise ConfigError("config.json: sliding_attention layers in a Qwen model (use_sliding_window)"
                      " are not supported.")
  if sliding:
    window = _field(config, "sliding_window", minimum=1)
  return kinds, (window if sliding else None)


def model_config_from_transformers(config: Mapping, *, dtype: str = "float32") -> ModelConfig:
  """The :class:`~kvm_jax.config.model.ModelConfig` of a transformers ``config.json`` of the Llama
  or Gemma family, or a :class:`ConfigError` naming the field (or model type) it cannot
  express."""
  model_type = config.get("model_type")
  if model_type in NOT_SUPPORTED:
    raise ConfigError(f"model_type={model_type!r} ({NOT_SUPPORTED[model_type]}) is not a family "
                      f"kvm_jax reads yet; it reads {sorted(MODEL_TYPES)}.")
  if model_type not in MODEL_TYPES:
    raise ConfigError(f"model_type={model_type!r} is not a family kvm_jax reads (it reads "
                      f"{sorted(MODEL_TYPES)}, and the authors' RWKV7Backbone format).")
  if MODEL_TYPES[model_type] == "gemma":
    return _gemma_config(config, model_type, dtype)
  act = config.get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"config.json: hidden_act={act!r}; the Llama family's MLP is SwiGLU "
                      "(silu).")
  layers = _field(config, "num_hidden_layers", minimum=1)
  theta, rope_fields = _rope(config)
  kinds, window = _mixers(config, model_type, layers)
  bias = bool(config.get("attention_bias", False))
  qwen2 = model_type == "qwen2"
  options = LlamaOptions(
      intermediate_size=_field(config, "intermediate_size", minimum=1),
      norm_eps=_field(config, "rms_norm_eps", float, minimum=0.0),
      qkv_bias=True if qwen2 else (bias and model_type != "mistral"),
      output_bias=False if qwen2 else (bias and model_type != "mistral"),
      mlp_bias=bool(config.get("mlp_bias", False)) and model_type == "llama",
      qk_norm=model_type == "qwen3",
      tie_embeddings=bool(config.get("tie_word_embeddings", False)),
      initializer_range=_initializer_range(config), **rope_fields)
  return _model_config(config, "llama", options, kinds, window, theta, dtype, head_dim=None)


def _initializer_range(config: Mapping) -> float:
  return _field(config, "initializer_range", float, default=0.02, minimum=0.0) or 0.02


def _model_config(config: Mapping, family: str, options, kinds: tuple[str, ...],
                  window: Optional[int], theta: float, dtype: str,
                  head_dim: Optional[int]) -> ModelConfig:
  """The ModelConfig of ``family`` with ``options``, one mixer kind per layer and the shape
  fields every family shares (``head_dim`` when the family's default is not width / heads)."""
  hidden = _field(config, "hidden_size", minimum=1)
  heads = _field(config, "num_attention_heads", minimum=1)
  kv_heads = _field(config, "num_key_value_heads", default=heads, minimum=1)
  head_dim = _field(config, "head_dim", default=head_dim or hidden // heads, minimum=1)
  try:
    return ModelConfig(
        family=family, family_options=options, vocab_size=_field(config, "vocab_size", minimum=1),
        num_layers=len(kinds), hidden_size=hidden, num_heads=heads,
        num_kv_heads=None if kv_heads == heads else kv_heads,
        head_dim=None if head_dim * heads == hidden else head_dim,
        mixers=kinds[0] if len(set(kinds)) == 1 else kinds,
        options=_window_options(kinds, window) if window else {},
        rope_dims=head_dim, rope_theta=theta, param_dtype=dtype, compute_dtype=dtype)
  except ValueError as e:
    raise ConfigError(f"config.json gives no valid kvm_jax model: {e}") from None


def _window_options(kinds: tuple[str, ...], window: int) -> dict:
  """``{kind: its options with window}`` of the sliding kinds among ``kinds`` (the field their
  ``TRANSFORMERS.window_option`` names)."""
  rows, sliding = registry.transformers_layers(), _sliding(kinds)
  return {kind: registry.mixer_class(kind).Options(**{rows[kind].window_option: window})
          for kind in dict.fromkeys(kinds) if kind in sliding}


def _gemma_rope(config: Mapping) -> tuple[float, float, dict]:
  """(global theta, local theta, GemmaOptions RoPE fields) from either layout."""
  params = config.get("rope_parameters")
  if params is not None:  # 5.x: one entry per layer type
    if not isinstance(params, Mapping) or not {"full_attention", "sliding_attention"} >= set(
        params):
      raise ConfigError(f"config.json: rope_parameters={params!r} must hold full_attention and "
                        "sliding_attention entries (Gemma 3's layout).")
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
  else:  # 4.x: rope_theta and rope_scaling for the global layers, rope_local_base_freq
    full = dict(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    local = {"rope_theta": config.get("rope_local_base_freq", 10_000.0)}
  for name, entry, allowed in (("full_attention", full, ("default", "linear")),
                               ("sliding_attention", local, ("default",))):
    kind = entry.get("rope_type", entry.get("type", "default"))
    if kind not in allowed:
      raise ConfigError(f"config.json: RoPE type {kind!r} of the {name} layers is not supported "
                        f"(supported: {list(allowed)}).")
  fields = {}
  if full.get("rope_type", full.get("type", "default")) == "linear":
    fields = {"rope_scaling": "linear", "rope_factor": _field(full, "factor", float, minimum=1.0)}
  return (_field(full, "rope_theta", float, default=1_000_000.0, minimum=1.0),
          _field(local, "rope_theta", float, default=10_000.0, minimum=1.0), fields)


def _gemma2_rope(config: Mapping) -> tuple[float, float, dict]:
  """(theta, theta, {}): Gemma 2 rotates its local and global layers alike, in Llama's layout
  (``rope_theta``, or one ``rope_parameters`` entry), without scaling."""
  theta, fields = _rope(config)
  if fields["rope_scaling"] != "none":
    raise ConfigError(f"config.json: RoPE scaling {fields['rope_scaling']!r} in a Gemma 2 model "
                      "is not supported (published Gemma 2 checkpoints have none).")
  return theta, theta, {}


def _gemma_layer_types(config: Mapping, model_type: str, layers: int) -> tuple[str, ...]:
  """The mixer kind of each layer: ``layer_types``, else the model type's default pattern
  (Gemma 2: every even layer slides; Gemma 3: every ``sliding_window_pattern``-th is global)."""
  types = config.get("layer_types")
  if types is None and model_type == "gemma2":
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
  elif types is None:
    pattern = _field(config, "sliding_window_pattern", default=6, minimum=1)
    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
             for i in range(layers)]
  return _kinds_of_types(types, layers)


def _softcap(config: Mapping, name: str) -> Optional[float]:
  """A soft-capping field: None or 0 (off), else a positive cap."""
  if config.get(name) in (None, 0, 0.0):
    return None
  return _field(config, name, float, minimum=0.0)


def _gemma_config(config: Mapping, model_type: str, dtype: str) -> ModelConfig:
  """The ModelConfig of a Gemma 2 (``Gemma2ForCausalLM``) or Gemma 3 text model
  (``Gemma3ForCausalLM``)."""
  if config.get("use_bidirectional_attention"):
    raise ConfigError("config.json: use_bidirectional_attention=true; kvm_jax's models are "
                      "causal.")
  if not config.get("tie_word_embeddings", True):
    raise ConfigError("config.json: tie_word_embeddings=false; Gemma's head is its embedding.")
  act = config.get("hidden_activation", config.get("hidden_act", "gelu_pytorch_tanh"))
  if act != "gelu_pytorch_tanh":
    raise ConfigError(f"config.json: hidden_activation={act!r}; Gemma's MLP is GeGLU with "
                      "gelu_pytorch_tanh.")
  layers = _field(config, "num_hidden_layers", minimum=1)
  head_dim = _field(config, "head_dim", default=256, minimum=1)  # both models' default
  kinds = _gemma_layer_types(config, model_type, layers)
  sliding = _sliding(kinds)
  window = _field(config, "sliding_window", minimum=1) if sliding else None
  gemma2 = model_type == "gemma2"
  theta, local_theta, rope_fields = (_gemma2_rope if gemma2 else _gemma_rope)(config)
  options = GemmaOptions(
      intermediate_size=_field(config, "intermediate_size", minimum=1),
      norm_eps=_field(config, "rms_norm_eps", float, minimum=0.0),
      query_pre_attn_scalar=_field(config, "query_pre_attn_scalar", float, default=head_dim,
                                   minimum=0.0),
      local_layers=tuple(i for i, k in enumerate(kinds) if k in sliding),
      local_rope_theta=local_theta, attention_bias=bool(config.get("attention_bias", False)),
      qk_norm=not gemma2, attention_softcap=_softcap(config, "attn_logit_softcapping"),
      final_logit_softcap=_softcap(config, "final_logit_softcapping"),
      initializer_range=_initializer_range(config), **rope_fields)
  return _model_config(config, "gemma", options, kinds, window, theta, dtype, head_dim=head_dim)


# Tensors some checkpoints hold that compute nothing here (RoPE buffers of older exports).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_tensor_table(cfg: ModelConfig, state) -> dict[str, str]:
  """``{kvm_jax path: transformers tensor name}`` of every parameter of ``state``; a parameter
  their format has no tensor for (a KVM layer's own) is a :class:`CheckpointError`."""
  family = family_of(cfg)
  table = {}
  for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
    names = tuple(path_names(path))
    name = family.hf_name(names)
    if name is None:
      raise CheckpointError(f"parameter {'/'.join(names)} has no tensor in the {cfg.family} "
                            "family's transformers format (a KVM layer's own parameters do not "
                            "exist there).")
    table["/".join(names)] = name
  return table


def from_transformers(tensors: Mapping[str, np.ndarray], cfg: ModelConfig,
                      source: str = "the checkpoint", progress: bool = False):
  """(graphdef, parameter state) of ``LM(cfg)`` holding the checkpoint's tensors, cast to
  ``cfg.param_dtype``: every tensor the config implies must be there with its shape, and no
  other (a tied model's ``lm_head.weight`` copy and RoPE buffers excepted), or a
  :class:`CheckpointError` names it."""
  from kvm_jax.hf.params import abstract_model  # the one abstract LM builder
  graphdef, state = abstract_model(cfg)
  table = hf_tensor_table(cfg, state)
  expected = set(table.values())
  ignorable = {"lm_head.weight"} if "lm_head/kernel" not in table else set()
  missing = sorted(expected - set(tensors))
  extra = sorted(n for n in set(tensors) - expected
                 if n not in ignorable and not n.endswith(IGNORED_SUFFIXES))
  if missing or extra:
    parts = ([f"missing {missing[:10]}"] if missing else []) + (
        [f"not explained by config.json: {extra[:10]}"] if extra else [])
    raise CheckpointError(f"{source} does not match its config.json: " + "; ".join(parts) + ".")
  total = sum(tensors[n].nbytes for n in expected)
  report = ProgressReport(total, "load", min_interval=0.2) if progress else None
  done = 0

  def convert(path, leaf):
    nonlocal done
    key = "/".join(path_names(path))
    name = table[key]
    arr = np.asarray(tensors[name])
    if not np.issubdtype(arr.dtype, np.floating) and arr.dtype.name != "bfloat16":
      raise CheckpointError(f"{source}: tensor {name!r} has dtype {arr.dtype}.")
    matrix = parameter_role(path).matrix  # an nn.Linear weight: stored [out, in]
    if matrix:
      arr = arr.T
    if tuple(arr.shape) != tuple(leaf.shape):
      implied = list(leaf.shape)[::-1] if matrix else list(leaf.shape)
      raise CheckpointError(f"{source}: tensor {name!r} has shape {list(np.shape(tensors[name]))}"
                            f" but the config implies {implied}.")
    done += arr.nbytes
    if report:
      report.update(done, name)
    return jnp.asarray(arr.astype(cfg.jnp_param_dtype), cfg.jnp_param_dtype)

  params = jax.tree_util.tree_map_with_path(convert, state)
  if report:
    report.update(total, final=True)
  return graphdef, params


def _model_type(cfg: ModelConfig) -> str:
  """The transformers model type that computes ``cfg`` (Llama-family options and layers), or an
  :class:`ExportError` saying why none does."""
  o, kinds = cfg.family_options, set(cfg.layer_mixers)
  if _without_format(kinds):
    raise ExportError(f"layers {_without_format(kinds)} have no transformers format "
                      "(only full and sliding-window attention do); a converted model exports "
                      "once distilled back into attention, or stays a kvm_jax run.")
  if cfg.kv_sharing != "none" or cfg.value_head_dim not in (None, cfg.qk_head_dim):
    raise ExportError("cross-layer KV sharing and value heads wider than key heads have no "
                      "transformers format in this family.")
  if cfg.residual_scale not in (None, 1.0) or cfg.rope_dims != cfg.qk_head_dim:
    raise ExportError("a residual scale, or RoPE on part of a head, has no transformers format "
                      "in this family.")
  if _sliding(kinds):
    if len(kinds) > 1 or o.qkv_bias or o.output_bias or o.mlp_bias or o.qk_norm \
        or o.rope_scaling != "none":
      raise ExportError("sliding-window layers export as Mistral, whose layers all slide one "
                        "window, with no biases, q/k norms or RoPE scaling.")
    if cfg.rope_dims_of(0) != cfg.rope_dims:
      raise ExportError("Mistral's sliding-window layers rotate every channel.")
    return "mistral"
  if o.qk_norm:
    if o.mlp_bias or o.qkv_bias != o.output_bias:
      raise ExportError("q/k norms export as Qwen3, whose attention biases are all on or all "
                        "off and whose MLP has none.")
    return "qwen3"
  if o.qkv_bias and not o.output_bias:
    if o.mlp_bias:
      raise ExportError("q/k/v biases without an output bias export as Qwen2, whose MLP has no "
                        "biases.")
    return "qwen2"
  if o.output_bias != o.qkv_bias:
    raise ExportError("an output bias without q/k/v biases has no transformers format.")
  return "llama"


def _without_format(kinds) -> list[str]:
  """The kinds among ``kinds`` that transformers' format has no layers for (no ``TRANSFORMERS``
  row), sorted."""
  return sorted(set(kinds) - set(registry.transformers_layers()))


def _sliding_window(cfg: ModelConfig) -> Optional[int]:
  """``sliding_window``: the window of ``cfg``'s sliding layers (the options field their kind's
  ``TRANSFORMERS.window_option`` names), None when no layer slides; :class:`ExportError` for two
  windows (transformers' config holds one)."""
  rows = registry.transformers_layers()
  windows = {getattr(cfg.options_of(kind), rows[kind].window_option)
             for kind in _sliding(cfg.layer_mixers)}
  if len(windows) > 1:
    raise ExportError(f"sliding-window layers of windows {sorted(windows)}: transformers' "
                      "config.json holds one sliding_window.")
  return windows.pop() if windows else None


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def _int_if_whole(x: float):
  """``x`` as an int when it is one (transformers 5.x types Gemma 2's ``query_pre_attn_scalar``
  as an int and refuses 12.0)."""
  return int(x) if float(x).is_integer() else x


def _gemma_model_type(cfg: ModelConfig) -> str:
  """"gemma3_text" for a Gemma-family ``cfg`` with q/k norms, else "gemma2" (one RoPE for every
  layer), or :class:`ExportError`."""
  o = cfg.family_options
  if o.qk_norm:
    return "gemma3_text"
  if o.local_rope_theta != cfg.rope_theta or o.rope_scaling != "none":
    raise ExportError("a Gemma model without q/k norms exports as Gemma 2, whose local and "
                      f"global layers share one RoPE without scaling (local_rope_theta="
                      f"{o.local_rope_theta}, rope_theta={cfg.rope_theta}, rope_scaling="
                      f"{o.rope_scaling!r}).")
  return "gemma2"


def _gemma_export_config(cfg: ModelConfig) -> dict:
  """The Gemma 2 / Gemma 3 text fields of a Gemma-family ``cfg`` (4.x layout), or
  :class:`ExportError`."""
  o, kinds, rows = cfg.family_options, cfg.layer_mixers, registry.transformers_layers()
  if _without_format(kinds):
    raise ExportError(f"layers {_without_format(kinds)} have no transformers "
                      "format (only full and sliding-window attention do).")
  sliding = _sliding(kinds)
  local = tuple(i for i, k in enumerate(kinds) if k in sliding)
  if local != o.local_layers:
    raise ExportError(f"Gemma's sliding-window layers are its local ones: layers {local} slide "
                      f"but local_layers={o.local_layers}.")
  if cfg.kv_sharing != "none" or cfg.value_head_dim not in (None, cfg.qk_head_dim) \
      or cfg.residual_scale not in (None, 1.0) or cfg.rope_dims != cfg.qk_head_dim:
    raise ExportError("cross-layer KV sharing, wider value heads, a residual scale or partial "
                      "RoPE have no transformers format in this family.")
  fields = {
      "layer_types": [rows[k].layer_type for k in kinds],
      "sliding_window": _sliding_window(cfg),
      "query_pre_attn_scalar": _int_if_whole(o.query_pre_attn_scalar or cfg.qk_head_dim),
      "hidden_activation": "gelu_pytorch_tanh", "attention_bias": o.attention_bias,
      "tie_word_embeddings": True, "final_logit_softcapping": o.final_logit_softcap,
      "attn_logit_softcapping": o.attention_softcap}
  if _gemma_model_type(cfg) == "gemma2":
    return fields
  return {**fields, "rope_local_base_freq": o.local_rope_theta,
          "use_bidirectional_attention": False,
          "rope_scaling": ({"rope_type": "linear", "factor": o.rope_factor}
                           if o.rope_scaling == "linear" else None)}


def transformers_config_from_model(cfg: ModelConfig, dtype: str,
                                   max_position_embeddings: int = 4096) -> dict:
  """A transformers ``config.json`` (the 4.x layout, which 5.x reads too) for a Llama- or
  Gemma-family ``cfg``, or :class:`ExportError`."""
  if not hasattr(family_of(cfg), "hf_name"):
    raise ExportError(f"family {cfg.family!r} has no transformers format.")
  gemma = isinstance(cfg.family_options, GemmaOptions)
  model_type = _gemma_model_type(cfg) if gemma else _model_type(cfg)
  o = cfg.family_options
  config = {
      "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.mlp_width, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
      "head_dim": cfg.qk_head_dim, "rms_norm_eps": o.norm_eps, "rope_theta": cfg.rope_theta,
      "initializer_range": o.initializer_range,
      "max_position_embeddings": max_position_embeddings, "torch_dtype": dtype, "dtype": dtype,
      "attention_dropout": 0.0, "use_cache": True}
  if gemma:
    return {**config, **_gemma_export_config(cfg)}
  config.update(hidden_act="silu", rope_scaling=None, tie_word_embeddings=o.tie_embeddings)
  if o.rope_scaling != "none":
    config["rope_scaling"] = {"rope_type": o.rope_scaling, "factor": o.rope_factor}
    if o.rope_scaling == "llama3":
      config["rope_scaling"].update(
          low_freq_factor=o.rope_low_freq_factor, high_freq_factor=o.rope_high_freq_factor,
          original_max_position_embeddings=o.rope_original_max_len)
  if model_type in ("llama", "qwen3"):
    config["attention_bias"] = o.qkv_bias
  if model_type == "llama":
    config["mlp_bias"] = o.mlp_bias
  if model_type == "mistral":
    config["sliding_window"] = _sliding_window(cfg)
  if model_type in ("qwen2", "qwen3"):
    config.update(use_sliding_window=False, sliding_window=None,
                  max_window_layers=cfg.num_layers)
  return config


def to_transformers(params, cfg: ModelConfig, dtype=None) -> dict[str, np.ndarray]:
  """transformers' state dict (numpy, in ``dtype`` or the parameters' own) of a Llama- or
  Gemma-family model's parameters (``nnx.state(model, nnx.Param)``)."""
  table = hf_tensor_table(cfg, params)
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    key = "/".join(path_names(path))
    arr = np.asarray(jax.device_get(leaf))
    arr = arr.astype(dtype) if dtype is not None else arr
    out[table[key]] = np.ascontiguousarray(arr.T if parameter_role(path).matrix else arr)
  return out
