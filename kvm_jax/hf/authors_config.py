"""The authors' model configuration (``config.json`` of their Hugging Face checkpoints) and
:class:`kvm_jax.ModelConfig`, translated both ways (docs/checkpoints.md).

Their ``MixerConfig`` (``model/rwkv7_backbone.py`` of featherless-ai/KVM-paper) is a flat list of
fields. :data:`AUTHORS_DEFAULTS` lists every one of them with its default, and each is either
*mapped* onto a kvm_jax field, *checked* (it selects something kvm_jax does not implement, which
is an error naming the field and the value, unless the value is the one kvm_jax implements), or
*inert* (it cannot change what the model computes: options of mixers the model does not use,
kernel switches, fields their eager code never reads).

A model alternates two mixers when ``alt_layer_every = e >= 2``: layer i runs the *alt* mixer when
``i % e == 0`` and the main ``token_mixer`` otherwise (the paper's hybrids: e = 2, SWA on the even
layers). Each mixer kind takes its value-residual anchor from its first layer, as kvm_jax does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from kvm_jax.config.kvm import KVMConfig
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import (AuthorsMixer, AuthorsReading, AuthorsWriting, ConfigError,
                                       ExportError)
from kvm_jax.nn.authors_format import read_flag as _flag
from kvm_jax.nn.authors_format import read_float as _float
from kvm_jax.nn.authors_format import read_int as _int
from kvm_jax.nn.authors_format import read_opt_int as _opt_int
from kvm_jax.nn.families.gptalpha2 import GPTAlpha2Options
from kvm_jax.nn.mixers.kvm import NO_CAP_ROWS  # noqa: F401  (its former home; the KVM layer's cap)
from kvm_jax.nn.registry import own_members, registered_mixers

MODEL_CLASS_PATH = "model.rwkv7_backbone.RWKV7BackboneForCausalLM"
MODEL_TYPE = "rwkv7backbone"
ARCHITECTURE = "RWKV7BackboneForCausalLM"
NUMERICS = ("authors", "float32")
DTYPES = ("float32", "bfloat16")

#: Every field of the authors' MixerConfigDataclass (and its RWKV7BackboneConfigDataclass base),
#: with its default, as of featherless-ai/KVM-paper commit 6bd7dfd.
AUTHORS_DEFAULTS: dict[str, Any] = {
    "model_class_path": MODEL_CLASS_PATH,
    "vocab_size": 50304, "num_hidden_layers": 12, "num_attention_heads": 6,
    "num_key_value_heads": None, "d_qk_head": None, "d_v_head": None, "d_head": None,
    "hidden_size": 768, "mup_base_dim": 768, "rope_theta": 10000.0, "rope_partial_dim": 64,
    "alt_rope_theta": 10000.0, "alt_rope_partial_dim": 64, "alt_share_v0": 0,
    "ffn_expansion": 4.0, "token_mixer": "rwkv7", "token_mixer_class_path": None,
    "alt_token_mixer": "swa", "alt_token_mixer_class_path": None, "alt_layer_every": -1,
    "use_tokenshift_ffn": 0, "use_block_lambdas": 0, "use_skip_connections": 0,
    "use_l2wrap": 0, "logit_softcap": 0.0, "residual_scale": None,
    "use_value_residual": 1, "gptalpha_value_residual_mode": "rwkv",
    "gptalpha_token_shift_mode": "rwkv", "kvm_value_residual_mode": "rwkv",
    "kvm_token_shift_mode": "rwkv", "kvm_apply_merge_gate_to_initial_state": 0,
    "kvm_apply_merge_gate_to_appends": 0, "kvm_use_merge_gate_keys": 1,
    "kvm_use_merge_gate_values": 1, "kvm_use_head_temps": 1, "kvm_use_vlens": 1,
    "kvm_aotriton_forward_attention": 1, "kvm_aotriton_precompiled_forward": 0,
    "ovq_value_residual_mode": "rwkv", "ovq_token_shift_mode": "rwkv", "use_tokenshift_att": 0,
    "swa_value_residual_mode": "rwkv", "swa_token_shift_mode": "rwkv", "swa_window_size": -1,
    "ovq_window_size": 128, "ovq_chunk_size": 128, "ovq_max_centroids": 2048,
    "ovq_normalize_centroids": 0, "ovq_use_min_state_size": 0, "ovq_use_counts_for_lr_only": 0,
    "ovq_use_delta_rule": 0, "kda_expand_k": 1.0, "kda_expand_v": 1.0, "kda_conv_size": 4,
    "kda_conv_bias": 0, "kda_allow_neg_eigval": 0, "kda_token_shift_mode": "none",
    "kda_value_residual_mode": "none", "gated_deltanet_expand_k": 0.75,
    "gated_deltanet_expand_v": 1.5, "gated_deltanet_num_kv_heads": None,
    "gated_deltanet_conv_size": 4, "gated_deltanet_conv_bias": 0,
    "gated_deltanet_use_mamba_gate": 1, "gated_deltanet_token_shift_mode": "none",
    "gated_deltanet_value_residual_mode": "none", "sink_len": 1, "chunk_len": 256,
    "n_max_d_chunks": 1, "n_bswa_chunks": 2, "state_budget_mode": "fixed",
    "state_growth_factor": 1.0, "state_growth_exponent": 0.5, "state_round_down": 1,
    "state_min_len": -1, "state_saturation_n": None, "use_overflow_v_key_weighting": 1,
    "use_state_deltarule": 0, "use_state_decay": 0, "lact_value_residual_mode": "rwkv",
    "lact_token_shift_mode": "rwkv", "lact_actual_rope_partial_dim": -1,
    "lact_lact_window_size": -1, "lact_chunk_size": -1, "lact_num_fw_heads": -1,
    "lact_inter_multi": 1.0, "lact_norm_eps": 1e-6, "lact_attn_qk_norm": 0,
    "lact_w0_w2_low_rank": 32, "lact_fw_init_gain": 0.5, "lact_ttt_lag": 0, "lact_factor": 1.0,
    "lact_use_muon": 0, "lact_learnable_muon_lr": 0, "lact_muon_lr_reduce_exp": 2,
    "lact_use_momentum": 1, "lact_ttt_prenorm": 0, "lact_ttt_nope": 0, "lact_no_v_silu": 0,
    "lact_use_bswa": 0, "param_dtype": "bfloat16",
}

# Fields that never change what a loaded model computes: options of the mixers kvm_jax does not
# implement (a model using those mixers is refused on ``token_mixer`` already), switches between
# the authors' eager and Triton kernels, the dtype their trainer builds in (the tensors' own
# dtypes are what is loaded), and fields their eager path never reads (docs/kvm-spec.md §2;
# ``ovq_window_size`` is stored by their OVQ layer and never used). The ``ovq_*`` fields are read
# when a model has OVQ layers and inert otherwise.
INERT_PREFIXES = ("kda_", "gated_deltanet_", "lact_")
INERT_FIELDS = {"kvm_aotriton_forward_attention", "kvm_aotriton_precompiled_forward",
                "param_dtype", "use_overflow_v_key_weighting", "use_state_deltarule",
                "use_state_decay", "model_class_path", "ovq_window_size"}

# Keys Hugging Face's PretrainedConfig writes into every config.json; none describes the network.
HF_KEYS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    "tie_word_embeddings", "tie_worhidden_sizedings", "max_position_embeddings", "use_cache",
    "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size", "add_cross_attention",
    "tie_encoder_decoder", "problem_type", "id2label", "label2id", "task_specific_params",
    "finetuning_task", "tokenizer_class", "prefix", "name_or_path", "_name_or_path",
    "_commit_hash", "_attn_implementation_autoset", "pruned_heads", "bad_words_ids",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "num_labels", "typical_p", "use_bfloat16", "tf_legacy_loss",
    "generation_config", "transformers.js_config", "quantization_config",
}

def authors_kinds() -> dict[str, AuthorsMixer]:
  """``{kind: how the authors' code names it}`` for every registered kind their code also has:
  the ``AUTHORS`` row its own class declares (a subclass registered under another name does not
  inherit it: their code has no such mixer)."""
  return own_members("AUTHORS")


def _kind_of_mixer_name() -> dict[str, str]:
  """Their ``token_mixer`` names -> kvm_jax kinds."""
  return {name: kind for kind, m in authors_kinds().items() for name in m.token_mixers}


def _mixer_name_of_kind() -> dict[str, str]:
  """kvm_jax kinds -> the ``token_mixer`` name an export writes."""
  return {kind: m.token_mixers[0] for kind, m in authors_kinds().items()}


def _kind_of_class_path() -> dict[str, str]:
  """Their ``*_class_path`` values -> kvm_jax kinds."""
  return {path: kind for kind, m in authors_kinds().items() for path in m.class_paths}


def with_numerics(cfg: ModelConfig, dtype: str, numerics: Optional[str]) -> ModelConfig:
  """``cfg`` with parameters and activations in ``dtype`` and, unless ``numerics`` is None, the
  authors' two bfloat16 casts switched on ("authors": RoPE tables and KVM state-value readout,
  docs/kvm-spec.md §5, §11.6) or off ("float32")."""
  if dtype not in DTYPES:
    raise ConfigError(f"dtype={dtype!r}; choose from {DTYPES}.")
  cfg = dataclasses.replace(cfg, param_dtype=dtype, compute_dtype=dtype)
  if numerics is None:
    return cfg
  if numerics not in NUMERICS:
    raise ConfigError(f"numerics={numerics!r}; choose from {NUMERICS}.")
  cast = "bfloat16" if numerics == "authors" else None
  options = cfg.options
  for kind in dict.fromkeys(cfg.layer_mixers):
    if isinstance(cfg.options_of(kind), KVMConfig):
      options = options.set(kind, dataclasses.replace(cfg.options_of(kind),
                                                      readout_value_dtype=cast))
  return dataclasses.replace(cfg, rope_table_dtype=cast or "float32", options=options)


def _resolve_mixer(cfg: dict, role: str) -> str:
  """kvm_jax kind of the ``main`` or ``alt`` mixer of an authors' config."""
  name_field, path_field = (("token_mixer", "token_mixer_class_path") if role == "main"
                            else ("alt_token_mixer", "alt_token_mixer_class_path"))
  path = cfg[path_field]
  if path is not None:
    paths = _kind_of_class_path()
    if not isinstance(path, str) or path not in paths:
      raise ConfigError(f"{path_field}={path!r}: kvm_jax implements only "
                        f"{sorted(paths)}.")
    return paths[path]
  name = cfg[name_field]
  names = _kind_of_mixer_name()
  if not isinstance(name, str) or name not in names:
    raise ConfigError(f"{name_field}={name!r}: kvm_jax implements the mixers "
                      f"{sorted(names)} (KVM, full attention, SWA, block SWA, OVQ, "
                      f"RWKV-7), not {name!r}.")
  return names[name]


def authors_fields(config: dict) -> tuple[dict, list[str]]:
  """The authors' fields of a ``config.json`` with their defaults filled in, and the keys that are
  neither their fields nor Hugging Face's (reported as warnings by the loader)."""
  if not isinstance(config, dict):
    raise ConfigError(f"config.json must hold a JSON object, got {type(config).__name__}.")
  full = dict(AUTHORS_DEFAULTS)
  full.update({k: v for k, v in config.items() if k in AUTHORS_DEFAULTS})
  unknown = sorted(k for k in config if k not in AUTHORS_DEFAULTS and k not in HF_KEYS)
  return full, unknown


def layer_kinds(cfg: dict) -> tuple[str, ...]:
  """kvm_jax mixer kind of each layer of an authors' config (fields already filled in)."""
  layers = _int(cfg, "num_hidden_layers", 1)
  main = _resolve_mixer(cfg, "main")
  every = _int(cfg, "alt_layer_every")
  if every <= 1:  # their Block alternates only for alt_layer_every > 1
    return (main,) * layers
  alt = _resolve_mixer(cfg, "alt")
  if alt == main:
    raise ConfigError(f"alt_token_mixer={cfg['alt_token_mixer']!r} is the same kind as "
                      f"token_mixer={cfg['token_mixer']!r} ({main}); in their code each role then "
                      "anchors its value residual on a different layer, which kvm_jax does not "
                      "express.")
  if layers < 2:
    raise ConfigError(f"alt_layer_every={every} needs num_hidden_layers >= 2 (their model reads "
                      f"layer 1 as the first main layer), got {layers}.")
  return tuple(alt if i % every == 0 else main for i in range(layers))


def model_config_from_authors(config: dict, *, numerics: str = "authors",
                              dtype: str = "float32") -> ModelConfig:
  """The :class:`~kvm_jax.config.model.ModelConfig` of an authors' ``config.json`` (a dict).

  Args:
    config: the parsed ``config.json``; absent fields take the authors' defaults.
    numerics: "authors" reproduces their hard-coded bfloat16 casts (RoPE tables, the KVM
      state-value readout; docs/kvm-spec.md §5, §11.6); "float32" computes both in float32.
    dtype: parameter and activation dtype, "float32" or "bfloat16".

  Raises:
    ConfigError: a field selects something kvm_jax does not implement (the message names it).
  """
  cfg, _ = authors_fields(config)
  _check_authors_switches(cfg)
  kinds = layer_kinds(cfg)
  used = sorted(set(kinds))
  alternates = _int(cfg, "alt_layer_every") > 1
  hidden, heads = _int(cfg, "hidden_size", 1), _int(cfg, "num_attention_heads", 1)
  d_qk, d_v, kv_heads = _authors_head_widths(cfg, used, hidden, heads)
  ropes, rope_dims, theta = _authors_rope(cfg, kinds, used, alternates)
  shift, value_residual = _authors_front_end(cfg, used)
  options = _authors_options(cfg, used, ropes, d_qk)
  try:
    model = ModelConfig(
        vocab_size=_int(cfg, "vocab_size", 1), num_layers=len(kinds), hidden_size=hidden,
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=None if d_qk * heads == hidden else d_qk,
        value_head_dim=None if d_v == d_qk else d_v,  # kvm_jax's value width defaults to D
        mixers=kinds[0] if len(used) == 1 else kinds, rope_dims=rope_dims, rope_theta=theta,
        options=options,
        family="gptalpha2", family_options=GPTAlpha2Options(
            ffn_expansion=_float(cfg, "ffn_expansion"), tokenshift_attention=shift,
            tokenshift_mlp=_flag(cfg, "use_tokenshift_ffn"), value_residual=value_residual,
            share_value_anchor=alternates and _flag(cfg, "alt_share_v0")),
        # their Block: residual_scale or 1.0
        residual_scale=_float(cfg, "residual_scale", allow_none=True) or None,
        mup_base_dim=_int(cfg, "mup_base_dim", 1))
  except ValueError as e:
    raise ConfigError(f"config.json gives no valid kvm_jax model: {e}") from None
  return with_numerics(model, dtype, numerics)


def _check_authors_switches(cfg: dict) -> None:
  """Refuses, by name, the switches of their model that kvm_jax does not implement."""
  if cfg["model_class_path"] not in (None, MODEL_CLASS_PATH):
    raise ConfigError(f"model_class_path={cfg['model_class_path']!r}: kvm_jax reads "
                      f"{MODEL_CLASS_PATH} checkpoints only.")
  for name, implemented in (("use_block_lambdas", 0), ("use_skip_connections", 0),
                            ("use_l2wrap", 0)):
    if _flag(cfg, name) != bool(implemented):
      raise ConfigError(f"{name}={cfg[name]!r}: kvm_jax does not implement "
                        f"{name.removeprefix('use_').replace('_', ' ')}; only {implemented} "
                        "loads.")
  if _float(cfg, "logit_softcap", allow_none=True):
    raise ConfigError(f"logit_softcap={cfg['logit_softcap']!r}: kvm_jax's LM head has no logit "
                      "soft-capping; only 0 loads.")


def _titles(kinds) -> str:
  """The kinds' names in messages ("SWA", "RWKV-7"), joined by "/"."""
  rows = authors_kinds()
  return "/".join(rows[kind].title or kind for kind in kinds)


def _authors_head_widths(cfg: dict, used: list, hidden: int, heads: int
                         ) -> tuple[int, int, Optional[int]]:
  """(q/k head width, value head width, KV heads or None) exactly as their ValueResidualMixin
  resolves them; a kind whose layer sizes its heads itself (``own_head_width``: RWKV-7's reads
  d_head only) fixes both widths, and the KV heads when the model has no other layers."""
  d_head = _opt_int(cfg, "d_head")
  d_qk = _opt_int(cfg, "d_qk_head") or d_head or hidden // heads
  d_v = _opt_int(cfg, "d_v_head") or d_head or hidden // heads
  own = [kind for kind in used if authors_kinds()[kind].own_head_width]
  if own:
    head = d_head or hidden // heads
    if len(used) > 1 and (d_qk, d_v) != (head, head):
      raise ConfigError(f"d_qk_head={cfg['d_qk_head']!r}, d_v_head={cfg['d_v_head']!r}: their "
                        f"{_titles(own)} layers use heads of d_head or hidden/heads = {head} "
                        "whatever these say, and kvm_jax has one head width for every layer; a "
                        f"hybrid with {_titles(own)} loads only when the other layers' heads are "
                        "that wide.")
    d_qk = d_v = head
  kv_heads = None if cfg["num_key_value_heads"] is None else _int(cfg, "num_key_value_heads", 1)
  if len(own) == len(used):
    kv_heads = None  # no layer reads num_key_value_heads
  return d_qk, d_v, kv_heads


def _authors_rope(cfg: dict, kinds: tuple, used: list, alternates: bool
                  ) -> tuple[dict, int, float]:
  """({kind: (rotary width, theta)}, the model's rotary width, its theta). The main role's
  layers use (rope_partial_dim, rope_theta), the alt role's (alt_rope_partial_dim,
  alt_rope_theta); kvm_jax has one width for the layers of a kind with its own (``own_rope``:
  swa) and one for the others, and one theta."""
  rows = authors_kinds()
  no_rope = tuple(kind for kind in used if not rows[kind].rotates)

  def role_rope(kind):
    if kind in no_rope:
      return 0, _float(cfg, "rope_theta")
    if alternates and kind == kinds[0]:
      return _int(cfg, "alt_rope_partial_dim", 0), _float(cfg, "alt_rope_theta")
    return _int(cfg, "rope_partial_dim", 0), _float(cfg, "rope_theta")
  ropes = {kind: role_rope(kind) for kind in used}
  thetas = {theta for dims, theta in ropes.values() if dims > 0}
  if len(thetas) > 1:
    raise ConfigError(f"rope_theta={cfg['rope_theta']!r} and alt_rope_theta="
                      f"{cfg['alt_rope_theta']!r} differ; kvm_jax uses one RoPE base for every "
                      "layer.")
  theta = thetas.pop() if thetas else _float(cfg, "rope_theta")
  # the rotating layers without a width of their own share the model's one width
  shared = {ropes[k][0] for k in used if rows[k].rotates and not rows[k].own_rope}
  if len(shared) > 1:
    own = _titles(kind for kind, row in rows.items() if row.own_rope)
    raise ConfigError(f"rope_partial_dim={cfg['rope_partial_dim']!r} and alt_rope_partial_dim="
                      f"{cfg['alt_rope_partial_dim']!r} differ between two non-{own} mixers; "
                      f"kvm_jax gives all non-{own} layers one RoPE width.")
  if shared:
    rope_dims = shared.pop()
  else:  # no layer reads the model's RoPE width; 0 when none of them rotates at all
    rope_dims = 0 if no_rope else _int(cfg, "rope_partial_dim", 0)
  return ropes, rope_dims, theta


def _authors_front_end(cfg: dict, used: list) -> tuple[bool, bool]:
  """(token shift of attention, value residual): one setting for every layer, read from each
  mixer kind's own mode fields."""
  prefix = {kind: m.mode_prefix for kind, m in authors_kinds().items()}

  def shifts(kind):
    if prefix[kind] is None:
      return _flag(cfg, "use_tokenshift_att")
    mode = cfg[f"{prefix[kind]}_token_shift_mode"]
    return _flag(cfg, "use_tokenshift_att") and mode == "rwkv"
  shift = {kind: shifts(kind) for kind in used}
  if len(set(shift.values())) > 1:
    raise ConfigError("the token shift of attention is on for some mixers and off for others ("
                      + ", ".join(f"{prefix[k]}_token_shift_mode="
                                  f"{cfg[prefix[k] + '_token_shift_mode']!r}"
                                  if prefix[k] is not None else
                                  f"{k} follows use_tokenshift_att={cfg['use_tokenshift_att']!r}"
                                  for k in used)
                      + "); kvm_jax applies one setting to every layer.")
  value_residual = _flag(cfg, "use_value_residual")
  always = [kind for kind in used if authors_kinds()[kind].always_value_residual]
  if len(always) == len(used):
    value_residual = True  # their layers (RWKV-7's time mix) mix v_first in; they ignore the field
  elif always and not value_residual:
    raise ConfigError(f"use_value_residual=0 in a hybrid with {_titles(always)}: their "
                      f"{_titles(always)} layers mix the first layer's value in regardless, and "
                      "kvm_jax applies one value-residual setting to every layer; only "
                      "use_value_residual=1 loads.")
  if value_residual:
    for kind in used:
      if prefix[kind] is None:
        continue
      field = f"{prefix[kind]}_value_residual_mode"
      if cfg[field] != "rwkv":
        raise ConfigError(f"{field}={cfg[field]!r}: kvm_jax implements the 'rwkv' value residual "
                          "only.")
  return shift[used[0]], value_residual


def _authors_options(cfg: dict, used: list, ropes: dict, d_qk: int) -> dict:
  """``{kind: options}`` of every kind whose ``AUTHORS`` row reads options (in kind-name order):
  its ``read_options`` for a kind the model uses, or whose fields their config always carries;
  the options' defaults for the others."""
  classes = registered_mixers()
  options = {}
  for kind, row in sorted(authors_kinds().items()):
    if row.read_options is None:
      continue
    if kind in used or row.carried:
      rope = ropes[kind][0] if kind in used else None
      options[kind] = row.read_options(AuthorsReading(cfg, rope, d_qk))
    else:
      options[kind] = classes[kind].Options()
  return options


def authors_config_from_model(model: ModelConfig) -> dict:
  """The authors' ``config.json`` fields for ``model`` (every MixerConfig field, plus the Hugging
  Face keys their ``from_pretrained`` reads), or :class:`ExportError` naming what their code
  cannot express."""
  kinds = model.layer_mixers
  if model.family != "gptalpha2":
    raise ExportError(f"family={model.family!r}: the authors' format holds GPTAlpha-2 models; "
                      "export this model in its own family's transformers format instead.")
  if model.kv_sharing != "none":
    raise ExportError(f"kv_sharing={model.kv_sharing!r}: their model has no cross-layer KV "
                      "sharing.")
  used = sorted(set(kinds))
  main, alt, every = _authors_roles(kinds)
  names = _mixer_name_of_kind()
  for kind in used:
    if kind not in names:
      raise ExportError(f"mixer {kind!r}: their code has no such mixer (it has "
                        f"{sorted(names)}).")
  out = dict(AUTHORS_DEFAULTS)
  out["token_mixer"] = names[main]
  rope_main = model.rope_dims_of(kinds.index(main))
  out.update(rope_partial_dim=rope_main, rope_theta=float(model.rope_theta),
             alt_rope_theta=float(model.rope_theta))
  if alt is not None:
    out.update(alt_token_mixer=names[alt], alt_layer_every=every,
               alt_rope_partial_dim=model.rope_dims_of(0),
               alt_share_v0=int(model.share_value_anchor))
  out.update(_authors_option_fields(model, used, rope_main))
  _check_authors_heads(model, used)
  D, Dv = model.qk_head_dim, model.v_head_dim
  default_head = model.hidden_size // model.num_heads
  out.update(
      vocab_size=model.vocab_size, num_hidden_layers=model.num_layers,
      num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
      hidden_size=model.hidden_size, mup_base_dim=model.mup_base_dim,
      d_qk_head=None if D == default_head else D, d_v_head=None if Dv == default_head else Dv,
      ffn_expansion=float(model.family_options.ffn_expansion), residual_scale=float(model.scale),
      use_tokenshift_att=int(model.tokenshift_attention),
      use_tokenshift_ffn=int(model.tokenshift_mlp), use_value_residual=int(model.value_residual),
      param_dtype=model.param_dtype)
  out["model_type"] = MODEL_TYPE
  out["architectures"] = [ARCHITECTURE]
  out["tie_word_embeddings"] = False
  return out


def _authors_roles(kinds: tuple) -> tuple[str, Optional[str], int]:
  """(main mixer, alt mixer or None, alt_layer_every) of a layer pattern: their model runs one
  mixer, or two with the alt one on layers ``i % alt_layer_every == 0``."""
  used = sorted(set(kinds))
  if len(used) == 1:
    return used[0], None, -1
  every = next((e for e in range(2, len(kinds) + 1)
                if len({kinds[i] for i in range(len(kinds)) if i % e == 0}) == 1
                and len({kinds[i] for i in range(len(kinds)) if i % e}) == 1
                and kinds[0] != kinds[1]), None)
  if every is None:
    raise ExportError(f"mixers={kinds}: their model runs one mixer, or two alternating with "
                      "the alt mixer on layers i % alt_layer_every == 0; this layout is "
                      "neither.")
  return kinds[1], kinds[0], every


def _authors_option_fields(model: ModelConfig, used: list, rope_main: int) -> dict:
  """The fields the kinds' ``write_options`` write (in kind-name order) for the kinds ``model``
  uses, and for those whose fields their config always carries (:class:`AuthorsWriting` refuses
  two used kinds that write one field differently)."""
  rows = authors_kinds()
  writing = AuthorsWriting(model, rope_main, rows)
  for kind, row in sorted(rows.items()):
    if row.write_options is not None and (kind in used or row.carried):
      row.write_options(writing, kind)
  return writing.fields


def _check_authors_heads(model: ModelConfig, used: list) -> None:
  """Refuses head layouts their layers cannot run: grouped K/V heads where their layer takes
  none (``grouped_kv``), and value heads not adding up to the width where their layer reshapes
  its output (``reshapes_output``)."""
  rows = authors_kinds()
  Dv = model.v_head_dim
  ungrouped = sorted(kind for kind in used if not rows[kind].grouped_kv)
  if model.kv_heads != model.num_heads and ungrouped:
    grouped = _titles(kind for kind, row in rows.items() if row.grouped_kv)
    raise ExportError(f"num_kv_heads={model.num_kv_heads} with {ungrouped} layers: their "
                      f"{_titles(ungrouped)} layers call scaled_dot_product_attention without "
                      f"enable_gqa, so only {grouped} layers may use grouped K/V heads.")
  for kind in used:
    if rows[kind].reshapes_output and model.num_heads * Dv != model.hidden_size:
      raise ExportError(f"{_titles([kind])} layers with num_heads x value head dim = "
                        f"{model.num_heads * Dv} != hidden_size={model.hidden_size}: their "
                        f"{_titles([kind])} layer reshapes its output to the input's shape.")
  if model.residual_scale == 0:
    raise ExportError("residual_scale=0: their Block reads `residual_scale or 1.0`, i.e. 1.")
