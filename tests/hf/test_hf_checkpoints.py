"""The authors' Hugging Face checkpoints (kvm_jax.hf): loading, kvm-import, kvm-export, fine-tuning.

Oracles, each independent of the code under test:

* ``tests/data/authors/*``: five tiny checkpoints written by the authors' own code
  (``RWKV7BackboneForCausalLM.save_pretrained``, featherless-ai/KVM-paper 6bd7dfd) with their
  logits on ragged sequences that cross several chunk boundaries (tests/data/authors/README.md);
* :func:`authors_state_dict`: the tensor names and shapes their module tree holds for a config,
  written down here from their module definitions; :data:`PAPER_CONFIGS`: their paper configs;
* round trips: export then import must give back the very same parameters and logits;
* the ``safetensors`` package (when installed) and hand-computed bytes for the file format.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.nn import BSWAOptions, SWAOptions
from kvm_jax import hf
from kvm_jax.hf import safetensors as st
from kvm_jax.runs import Checkpointer, TrainConfig, load_config, save_config
from tests.helpers import FLOAT32_TOL, ROOT, in_ci, model_logits, random_model

DATA = ROOT / "tests" / "data" / "authors"
FIXTURES = ("kvm_swa_saturating", "full_bswa", "kvm_power_gqa", "swa_kvm_fixed_shared_anchor_bf16",
            "full_nope_swa", "ovq_swa", "ovq_swa_switches", "rwkv7")

AUTHORS_TOL = 1e-4


# ----------------------------------------------------------------------------------------------
# Their module tree, written down from their code (model/rwkv7_backbone.py: MLP, Block,
# RWKV7BackboneModel, RWKV7BackboneForCausalLM; model/value_residual_mixin.py; model/kvm_mixer.py)
# ----------------------------------------------------------------------------------------------

_TREE_DEFAULTS = dict(
    num_key_value_heads=None, d_qk_head=None, d_v_head=None, d_head=None, ffn_expansion=4.0,
    alt_layer_every=-1, use_tokenshift_att=0, use_tokenshift_ffn=0, use_value_residual=1,
    gptalpha_token_shift_mode="rwkv", kvm_token_shift_mode="rwkv", swa_token_shift_mode="rwkv",
    kvm_use_merge_gate_keys=1, kvm_use_merge_gate_values=1, kvm_use_head_temps=1,
    ovq_token_shift_mode="rwkv")
_MODE_PREFIX = {"kvm": "kvm", "gptalpha": "gptalpha", "gptalpha_bswa": "gptalpha", "swa": "swa",
                "ovq": "ovq"}


def _rwkv7_state_dict(c: dict, a: str) -> dict[str, tuple[int, ...]]:
  """Their ``model/rwkv7_mixer.py`` layer: ``receptance``, ``key``, ``value``, ``output`` [C, C];
  LoRAs ``w1``/``w2``, ``a1``/``a2``, ``v1``/``v2``, ``g1``/``g2`` of widths
  max(32, round(m·C^p/32)·32) with (m, p) = (1.8, ½), (1.8, ½), (1.3, ½), (0.6, 0.8); ``w0``,
  ``a0``, ``v0``, ``k_k``, ``k_a`` and, with token shift, ``x_r`` … ``x_g``, all [1, 1, C];
  ``r_k`` [H, C/H]; GroupNorm ``ln_x`` [C]."""
  C, H = c["hidden_size"], c["num_attention_heads"]
  width = lambda m, p: max(32, int(round(m * C ** p / 32) * 32))
  out = {a + f"{n}.weight": (C, C) for n in ("receptance", "key", "value", "output")}
  for name, (m, p) in {"w": (1.8, 0.5), "a": (1.8, 0.5), "v": (1.3, 0.5), "g": (0.6, 0.8)}.items():
    out.update({a + f"{name}1.weight": (width(m, p), C), a + f"{name}2.weight": (C, width(m, p))})
  names = ["w0", "a0", "v0", "k_k", "k_a"]
  if c["use_tokenshift_att"]:
    names += ["x_r", "x_w", "x_k", "x_v", "x_a", "x_g"]
  out.update({a + n: (1, 1, C) for n in names})
  out.update({a + "r_k": (H, C // H), a + "ln_x.weight": (C,), a + "ln_x.bias": (C,)})
  return out


def authors_state_dict(config: dict) -> dict[str, tuple[int, ...]]:
  """``{name: shape}`` of ``RWKV7BackboneForCausalLM(MixerConfig(**config)).state_dict()``.

  nn.Linear weights are [out, in]; every LayerNorm has weight and bias; RoPE buffers are not
  persistent. Per layer: ``ln_attn``, ``ln_mlp``; the attention mixin's ``c_q/c_k/c_v`` (query
  width H·D, key H_kv·D, value H_kv·Dv), ``ln_q``/``ln_k`` over D, ``c_proj`` back to the width;
  with token shift ("rwkv" mode of the mixer's own field) ``x_q``, ``x_k``, ``x_v``; with the
  value residual ``v_gate1`` [lora, C], ``v_gate2`` [Dv·H_kv, lora], ``v_gate0`` [1, 1, H_kv·Dv]
  and, when token shift did not already create it, ``x_v`` (zeros); KVM adds ``ln_s_k`` over D,
  ``key_weighting`` [H_kv, C] when either merge gate is on, ``front_head_temp``/
  ``state_head_temp`` [H] with head temperatures; OVQ has no ``ln_q``/``ln_k`` and adds ``beta``
  [H]; RWKV-7's layer is :func:`_rwkv7_state_dict`; the MLP ``c_fc`` [int(4C)//32·32, C],
  ``c_proj`` and, with its token shift, ``x_k`` [1, 1, C].
  """
  c = dict(_TREE_DEFAULTS, **config)
  C, H, L, V = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["vocab_size"]
  Hkv = c["num_key_value_heads"] or H
  D = c["d_qk_head"] or c["d_head"] or C // H
  Dv = c["d_v_head"] or c["d_head"] or C // H
  lora = max(32, int(round(1.3 * C ** 0.5 / 32) * 32))
  width = int(c["ffn_expansion"] * C) // 32 * 32
  out = {"transformer.wte.weight": (V, C), "lm_head.weight": (V, C)}
  for ln in ("ln_emb", "ln_head"):
    out.update({f"transformer.{ln}.weight": (C,), f"transformer.{ln}.bias": (C,)})
  for i in range(L):
    p = f"transformer.h.{i}."
    every = c["alt_layer_every"]
    mixer = c["alt_token_mixer"] if every > 1 and i % every == 0 else c["token_mixer"]
    for ln in ("ln_attn", "ln_mlp"):
      out.update({p + f"{ln}.weight": (C,), p + f"{ln}.bias": (C,)})
    a = p + "attn."
    out.update({p + "mlp.c_fc.weight": (width, C), p + "mlp.c_proj.weight": (C, width)})
    if c["use_tokenshift_ffn"]:
      out[p + "mlp.x_k"] = (1, 1, C)
    if mixer == "rwkv7":
      out.update(_rwkv7_state_dict(c, a))
      continue
    out.update({a + "c_q.weight": (H * D, C), a + "c_k.weight": (Hkv * D, C),
                a + "c_v.weight": (Hkv * Dv, C), a + "c_proj.weight": (C, H * Dv)})
    if mixer == "ovq":
      out[a + "beta"] = (H,)
    else:
      out.update({a + "ln_q.weight": (D,), a + "ln_q.bias": (D,), a + "ln_k.weight": (D,),
                  a + "ln_k.bias": (D,)})
    if c["use_tokenshift_att"] and c[f"{_MODE_PREFIX[mixer]}_token_shift_mode"] == "rwkv":
      out.update({a + "x_q": (H * D,), a + "x_k": (Hkv * D,), a + "x_v": (Hkv * Dv,)})
    if c["use_value_residual"]:
      out.update({a + "x_v": (Hkv * Dv,), a + "v_gate1.weight": (lora, C),
                  a + "v_gate2.weight": (Hkv * Dv, lora), a + "v_gate0": (1, 1, Hkv * Dv)})
    if mixer == "kvm":
      out.update({a + "ln_s_k.weight": (D,), a + "ln_s_k.bias": (D,)})
      if c["kvm_use_merge_gate_keys"] or c["kvm_use_merge_gate_values"]:
        out[a + "key_weighting.weight"] = (Hkv, C)
      if c["kvm_use_head_temps"]:
        out.update({a + "front_head_temp": (H,), a + "state_head_temp": (H,)})
  return out


# ----------------------------------------------------------------------------------------------
# Model families (kvm_jax configs, all expressible in their code)
# ----------------------------------------------------------------------------------------------

def _kvm(**kw):
  base = dict(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
              budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))
  return kj.KVMConfig(**{**base, **kw})


def _bswa(**kw):  # the tiny preset's block window with fields replaced
  return dataclasses.replace(kj.presets.TINY_OPTIONS["bswa"], **kw)


def _swa(**kw):
  return dataclasses.replace(kj.presets.TINY_OPTIONS["swa"], **kw)


def _gptalpha2(**kw):  # GPTAlpha-2's switches, the others at their defaults
  return kj.nn.GPTAlpha2Options(**kw)


FAMILIES = {
    "kvm_power": dict(mixers="kvm"),
    "kvm_fixed": dict(mixers="kvm",
                      options={"kvm": _kvm(budget=kj.FixedBudget(16), max_state_rows=16)}),
    "kvm_gqa": dict(mixers="kvm", num_kv_heads=2),
    "swa_kvm_saturating": dict(mixers=("swa", "kvm"),
                               options={"kvm": _kvm(budget=kj.SaturatingBudget(24, min_rows=1))}),
    "full": dict(mixers="full"),
    "bswa": dict(mixers="bswa", options={"bswa": _bswa(window_chunks=3, sink_rows=0)}),
    "swa_full_halfrope": dict(mixers=("swa", "full")),
    "swa_full_nope": dict(mixers=("swa", "full"), rope_dims=0,
                          options={"kvm": _kvm(rope_dims=0)}),
    "kvm_no_token_shift": dict(mixers="kvm", family_options=_gptalpha2(tokenshift_attention=False,
                                                                       tokenshift_mlp=False)),
    "kvm_no_value_residual": dict(mixers="kvm", family_options=_gptalpha2(value_residual=False)),
    "kvm_ablations": dict(mixers="kvm", options={"kvm": _kvm(
        head_temperatures=False, gate_values=False, sink_rows=0, gate_appends=True,
        gate_initial_state=True)}),
    "hybrid_4_layers_shared_anchor": dict(mixers=("swa", "kvm", "swa", "kvm"), num_layers=4,
                                          family_options=_gptalpha2(share_value_anchor=True),
                                          residual_scale=0.5),
    "swa_ovq": dict(mixers=("swa", "ovq"), rope_dims=0, options={"kvm": _kvm(rope_dims=0)}),
    "ovq_switches_no_token_shift": dict(
        mixers="ovq", family_options=_gptalpha2(tokenshift_attention=False), rope_dims=0,
        options={"kvm": _kvm(rope_dims=0),
                 "ovq": kj.OVQConfig(chunk_size=8, max_centroids=12, min_state_size=True,
                                     count_bias=False, normalize_centroids=True,
                                     delta_rule=True)}),
    # the chunk size of RWKV-7's recurrence is a compute setting their format does not record: the
    # default, so that export then import computes bitwise the same
    "rwkv7": dict(mixers="rwkv7", rope_dims=0,
                  options={"kvm": _kvm(rope_dims=0), "rwkv7": kj.nn.RWKV7Options()}),
    "rwkv7_no_token_shift": dict(mixers="rwkv7", rope_dims=0,
                                 family_options=_gptalpha2(tokenshift_attention=False),
                                 options={"kvm": _kvm(rope_dims=0),
                                          "rwkv7": kj.nn.RWKV7Options()}),
}
CI_FAMILIES = ("kvm_gqa", "hybrid_4_layers_shared_anchor", "kvm_no_token_shift", "swa_ovq",
               "ovq_switches_no_token_shift", "rwkv7_no_token_shift")


def _family_config(name: str) -> kj.ModelConfig:
  return kj.presets.tiny(**FAMILIES[name])


def _write_run(workdir, model: kj.LM) -> None:
  """A run directory holding ``model``'s parameters (what kvm-train leaves behind)."""
  save_config(TrainConfig(model=model.cfg, task="text"), workdir)
  ckpt = Checkpointer(workdir / "checkpoints")
  try:
    ckpt.save(3, {"params": nnx.state(model, nnx.Param)}, {}, force=True)
  finally:
    ckpt.close()


def _params(model) -> dict:
  return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(
              nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}


def _tokens(vocab: int, T: int = 45) -> np.ndarray:
  return np.random.default_rng(5).integers(0, vocab, (2, T))


def _effective(cfg: kj.ModelConfig) -> kj.ModelConfig:
  """``cfg`` with the fields that cannot change its function put in one canonical form (what the
  authors' format does not record: KVM settings of a model without KVM layers, the SWA RoPE width
  of a model without SWA layers, block-SWA geometry without block-SWA layers, residual scale
  None = 1, "no cap" on the state)."""
  kinds = set(cfg.layer_mixers)
  kvm = cfg.kvm if "kvm" in kinds else kj.KVMConfig()
  ovq = cfg.options_of("ovq") if "ovq" in kinds else kj.OVQConfig()
  if "kvm" in kinds and kvm.max_state_rows is not None and kvm.max_state_rows >= 80000:
    kvm = dataclasses.replace(kvm, max_state_rows=None)
  if "kvm" in kinds and isinstance(kvm.budget, kj.FixedBudget):
    kvm = dataclasses.replace(kvm, max_state_rows=None)  # a cap >= the fixed rows never binds
  swa = cfg.options_of("swa")
  swa = SWAOptions(window=swa.window,
                   rope_dims=cfg.rope_dims_of(cfg.layer_mixers.index("swa")) if "swa" in kinds
                   else None)
  bswa = cfg.options_of("bswa") if "bswa" in kinds else BSWAOptions(256, 3, 0)
  return dataclasses.replace(cfg, residual_scale=cfg.scale, mixers=cfg.layer_mixers,
                             options={"kvm": kvm, "swa": swa, "bswa": bswa, "ovq": ovq,
                                      "rwkv7": kj.nn.RWKV7Options()})


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """Per family (built on first use): (original model, its run directory, the kvm-export
  directory)."""
  root, cache = tmp_path_factory.mktemp("families"), {}

  def get(name):
    if name not in cache:
      model = random_model(_family_config(name), seed=sum(map(ord, name)))
      run, out = root / name / "run", root / name / "hf"
      _write_run(run, model)
      hf.export_run(run, out, progress=False)
      cache[name] = (model, run, out)
    return cache[name]
  return get


@pytest.mark.parametrize("name", in_ci(FAMILIES, CI_FAMILIES))
def test_export_writes_exactly_the_authors_tensors(exported, name):
  """kvm-export's tensor names and shapes are those of their module tree for the config it
  writes, and that config describes the exported model (mixers per layer, sizes)."""
  model, _, out = exported(name)
  config = json.loads((out / "config.json").read_text())
  written = st.tensor_info(out / "model.safetensors")
  want = authors_state_dict(config)
  assert sorted(set(written) - set(want)) == [] and sorted(set(want) - set(written)) == []
  assert {n: shape for n, (_, shape) in written.items()} == want
  assert {code for code, _ in written.values()} == {"F32"}
  cfg = model.cfg
  names = {"kvm": "kvm", "full": "gptalpha", "swa": "swa", "bswa": "gptalpha_bswa", "ovq": "ovq",
           "rwkv7": "rwkv7"}
  every = config["alt_layer_every"]
  layers = [config["alt_token_mixer"] if every > 1 and i % every == 0 else config["token_mixer"]
            for i in range(config["num_hidden_layers"])]
  assert layers == [names[m] for m in cfg.layer_mixers]
  assert (config["hidden_size"], config["num_attention_heads"], config["vocab_size"]) == (
      cfg.hidden_size, cfg.num_heads, cfg.vocab_size)
  assert (config["num_key_value_heads"] or config["num_attention_heads"]) == cfg.kv_heads
  # the unused zeros their value-residual layers keep without token shift
  if cfg.value_residual and not cfg.tokenshift_attention and cfg.layer_mixers[0] != "rwkv7":
    x_v = st.read_file(out / "model.safetensors", ["transformer.h.0.attn.x_v"])
    assert not np.any(x_v["transformer.h.0.attn.x_v"])


@pytest.mark.parametrize("name", in_ci(FAMILIES, CI_FAMILIES))
def test_export_then_import_is_the_identity(exported, name):
  """Parameters bitwise, logits bitwise, the config up to fields that cannot matter."""
  model, _, out = exported(name)
  back = kj.load_pretrained(out, numerics="float32", progress=False)
  assert _effective(back.cfg) == _effective(model.cfg)
  a, b = _params(model), _params(back)
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  tokens = _tokens(model.cfg.vocab_size)
  np.testing.assert_array_equal(model_logits(back, tokens), model_logits(model, tokens))


# The model sections of their paper configs (configs/prolong/{120M,350M}/*.yaml and base.yaml's
# mup_base_dim), written down here: importing a released model must give kvm_jax's own preset.
_PAPER_COMMON = dict(model_class_path="model.rwkv7_backbone.RWKV7BackboneForCausalLM",
                     vocab_size=50304, ffn_expansion=4, use_skip_connections=0, use_block_lambdas=0,
                     logit_softcap=0, use_l2wrap=0, use_tokenshift_att=1, use_tokenshift_ffn=1,
                     mup_base_dim=768)
_PAPER_KVM = dict(token_mixer="kvm", rope_theta=10000, rope_partial_dim=64, sink_len=1,
                  chunk_len=256, n_bswa_chunks=2, state_growth_factor=1.0,
                  state_growth_exponent=0.5, state_round_down=1, state_saturation_n=None,
                  param_dtype="bfloat16", kvm_apply_merge_gate_to_initial_state=0)
PAPER_CONFIGS = {
    "kvm256": dict(_PAPER_KVM, n_max_d_chunks=1, state_budget_mode="fixed", state_min_len=256),
    "kvm_sqrt16": dict(_PAPER_KVM, n_max_d_chunks=10000, state_budget_mode="power_law",
                       state_growth_factor=16.0, state_min_len=256),
    "kvm_swa_sat1024": dict(_PAPER_KVM, use_value_residual=1, alt_layer_every=2,
                            alt_rope_partial_dim=128, n_max_d_chunks=10000, swa_window_size=256,
                            state_budget_mode="kvm_saturation", state_min_len=1,
                            state_saturation_n=1024),
    "gpta2": dict(token_mixer="gptalpha", rope_partial_dim=64),
    "bswa": dict(token_mixer="gptalpha_bswa", rope_partial_dim=64, chunk_len=256,
                 n_bswa_chunks=3, sink_len=0),
    "swa_halfrope": dict(token_mixer="gptalpha", rope_partial_dim=64, alt_layer_every=2,
                         alt_rope_partial_dim=128, swa_window_size=256),
    "swa_nope": dict(token_mixer="gptalpha", rope_partial_dim=0, alt_layer_every=2,
                     alt_rope_partial_dim=128, swa_window_size=256),
    # ovq_swa_ts_c256_s1024_wd.yaml (the SWA window: their default chunk_len, 256) and rwkv_wd.yaml
    "ovq_swa": dict(token_mixer="ovq", use_value_residual=1, rope_theta=10000,
                    rope_partial_dim=0, alt_layer_every=2, alt_rope_partial_dim=128,
                    ovq_window_size=256, ovq_chunk_size=256, ovq_max_centroids=1024,
                    ovq_normalize_centroids=0, ovq_use_min_state_size=0,
                    ovq_use_counts_for_lr_only=0, ovq_use_delta_rule=0, param_dtype="bfloat16"),
    "rwkv7": dict(token_mixer="rwkv7"),
}
_PAPER_SIZES = {"120m": dict(num_hidden_layers=12, num_attention_heads=6, hidden_size=768,
                             residual_scale=1.0),
                "350m": dict(num_hidden_layers=24, num_attention_heads=8, hidden_size=1024,
                             residual_scale=0.5)}


@pytest.mark.parametrize("size", list(_PAPER_SIZES))
@pytest.mark.parametrize("family", list(PAPER_CONFIGS))
def test_paper_configs_import_as_the_presets(family, size):
  """Their released models' configs map onto kvm_jax's presets (kj.presets.<family>_<size>), and
  kvm-export of a preset writes those fields back."""
  theirs = {**_PAPER_COMMON, **PAPER_CONFIGS[family], **_PAPER_SIZES[size]}
  preset = getattr(kj.presets, f"{family}_{size}")()
  got = hf.model_config_from_authors(theirs, numerics="float32")
  assert _effective(got) == _effective(preset)
  written = hf.authors_config_from_model(preset)
  for field, value in theirs.items():
    if field in ("param_dtype", "swa_window_size"):
      continue  # the build dtype their model never reads; the SWA window of SWA-less models
    assert written[field] == value, field
  got_back = hf.model_config_from_authors(written, numerics="float32")
  assert _effective(got_back) == _effective(preset)


def test_kv_sharing_is_refused_by_export(tmp_path):
  """Their model has no cross-layer KV sharing: kvm-export refuses and says so, before reading
  weights."""
  cfg = kj.presets.tiny(mixers="full", kv_sharing="fusedkv_lite")
  save_config(TrainConfig(model=cfg, task="text"), tmp_path / "run")
  with pytest.raises(hf.ExportError, match="kv_sharing='fusedkv_lite'"):
    hf.export_run(tmp_path / "run", tmp_path / "out", progress=False)
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("overrides, match", [
    (dict(mixers=("swa", "swa", "kvm", "swa"), num_layers=4), "neither"),
    (dict(options={"kvm": _kvm(value_norm="none")}), "kvm.value_norm='none'"),
    (dict(options={"kvm": _kvm(budget=kj.CallableBudget(lambda n: 8))}), "callable"),
    (dict(options={"kvm": _kvm(max_state_rows=20)}), "max_state_rows=20"),
    (dict(mixers=("kvm", "bswa"), options={"bswa": _bswa(window_chunks=3)}), "share chunk_len"),
    (dict(mixers=("swa", "kvm"), num_kv_heads=2), r"num_kv_heads=2 with \['swa'\] layers"),
    (dict(mixers="swa", head_dim=8, options={"swa": _swa(rope_dims=8)}),
     "their SWA layer reshapes"),
    (dict(residual_scale=0.0), "residual_scale=0"),
    (dict(mixers=("kvm", "swa"), options={"swa": _swa(rope_dims=4)}), "zeroes rope_partial_dim=4"),
    (dict(options={"kvm": _kvm(state_rope_dims=4)}), "kvm.state_rope_dims=4"),
    (dict(options={"kvm": _kvm(logit_softcap=30.0)}), "kvm.logit_softcap=30.0"),
])
def test_export_refuses_what_their_code_cannot_express(overrides, match):
  with pytest.raises(hf.ExportError, match=match):
    hf.authors_config_from_model(kj.presets.tiny(**overrides))


def test_kinds_writing_one_field_must_agree():
  """A field two kinds write (their KVM and block-SWA layers share the window geometry) takes one
  value: two kinds the model uses must agree, refused by field name otherwise; a kind the model
  does not use writes only where no used kind did, and a kind may rewrite its own fields."""
  from kvm_jax.nn.authors_format import AuthorsWriting
  cfg = kj.presets.tiny(mixers="kvm,bswa")
  writing = AuthorsWriting(cfg, 8, hf.authors_config.authors_kinds())
  writing.put("bswa", chunk_len=8, sink_len=1)
  writing.put("swa", chunk_len=99, swa_window_size=12)  # no swa layers: bswa's value stays
  writing.put("kvm", chunk_len=8, sink_len=1)
  writing.put("kvm", sink_len=2)
  assert writing.fields == dict(chunk_len=8, sink_len=2, swa_window_size=12)
  writing = AuthorsWriting(cfg, 8, hf.authors_config.authors_kinds())
  writing.put("bswa", chunk_len=8, sink_len=1, n_bswa_chunks=3)
  with pytest.raises(hf.ExportError, match=r"their KVM and block-SWA layers share chunk_len and "
                     r"sink_len, but kvm has \(4, 1\) and bswa \(8, 1\)"):
    writing.put("kvm", chunk_len=4, sink_len=1)


# ----------------------------------------------------------------------------------------------
# Against the authors' own checkpoints and logits
# ----------------------------------------------------------------------------------------------

# CI: SWA, KVM (fixed and saturating budgets), full attention, NoPE, a shared anchor, Dv != D and a
# bf16 file; nightly adds block SWA and GQA (both also checked in CI against the float64
# reference, which tests/nn/test_reference_model.py checks against these files).
@pytest.mark.parametrize("name", in_ci(FIXTURES, ("kvm_swa_saturating", "full_nope_swa",
                                                  "swa_kvm_fixed_shared_anchor_bf16", "ovq_swa",
                                                  "ovq_swa_switches", "rwkv7")))
def test_load_pretrained_matches_the_authors_logits(name):
  """``kj.load_pretrained(DIR)(tokens)`` against the logits their model computed (ragged T = 45,
  chunks of 8: the KVM states grow and merge), with their numerics (the default) and in float32
  (compared with their model run with its bfloat16 casts turned off)."""
  ref = np.load(DATA / name / "reference.npz")
  for numerics, key, tol in (("authors", "logits", AUTHORS_TOL),
                             ("float32", "logits_float32", FLOAT32_TOL)):
    model = kj.load_pretrained(DATA / name, numerics=numerics, progress=False)
    want = ref[key]
    np.testing.assert_allclose(model_logits(model, ref["tokens"]), want, rtol=0,
                               atol=tol * np.abs(want).max(), err_msg=numerics)
    assert model.cfg.rope_table_dtype == ("bfloat16" if numerics == "authors" else "float32")


def test_default_numerics_are_the_authors():
  cfg = kj.load_pretrained(DATA / "kvm_power_gqa", progress=False).cfg
  assert (cfg.rope_table_dtype, cfg.kvm.readout_value_dtype) == ("bfloat16", "bfloat16")
  assert cfg.kv_heads == 2 and cfg.num_heads == 4
  assert isinstance(cfg.kvm.budget, kj.PowerLawBudget)


def test_bfloat16_load_casts_the_parameters():
  """dtype="bfloat16": every parameter in bfloat16 (rounded from the file's float32), activations
  bfloat16, and the logits still those of their model within bfloat16 compute error."""
  ref = np.load(DATA / "kvm_swa_saturating" / "reference.npz")
  model = kj.load_pretrained(DATA / "kvm_swa_saturating", dtype="bfloat16", progress=False)
  assert model.cfg.compute_dtype == "bfloat16"
  f32 = kj.load_pretrained(DATA / "kvm_swa_saturating", progress=False)
  b, a = _params(model), _params(f32)
  for key in a:
    assert b[key].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(b[key], a[key].astype(ml_dtypes.bfloat16))
  got = model_logits(model, ref["tokens"])
  # bfloat16 activations: ~2^-8 relative per operation over two layers
  np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=0.1 * np.abs(ref["logits"]).max())


# Keys of their config.json that say nothing about the network: Hugging Face's bookkeeping and
# their trainer's build dtype (their model code never reads param_dtype).
_NOT_THE_NETWORK = {"auto_map", "transformers_version", "architectures", "dtype", "torch_dtype",
                    "param_dtype", "tie_worhidden_sizedings", "bos_token_id", "eos_token_id",
                    "pad_token_id", "max_position_embeddings"}


def _head_dims(c: dict) -> tuple[int, int]:
  """Their ValueResidualMixin's head dims: d_qk_head or d_head or width/heads (same for values)."""
  default = c["hidden_size"] // c["num_attention_heads"]
  return (c.get("d_qk_head") or c.get("d_head") or default,
          c.get("d_v_head") or c.get("d_head") or default)


@pytest.mark.parametrize("name", in_ci(FIXTURES, ("swa_kvm_fixed_shared_anchor_bf16", "rwkv7",
                                                  "ovq_swa")))
def test_import_then_export_gives_back_their_checkpoint(tmp_path, name):
  """kvm-import then kvm-export of their checkpoint: the imported run holds load_pretrained's
  config and parameters, the export the same tensors bitwise (in the file's own dtype) and every
  config field that describes the network equal to theirs."""
  src = DATA / name
  original = json.loads((src / "config.json").read_text())
  run = hf.import_checkpoint(src, tmp_path / "run", progress=False)
  record = json.loads((run / "import.json").read_text())
  assert record["source"] == str(src.resolve()) and record["numerics"] == "authors"
  cfg, model, step = kj.runs.load_trained(run)
  assert step == 0 and cfg.task == "text"
  direct = kj.load_pretrained(src, progress=False)
  assert cfg.model == direct.cfg
  a, b = _params(model), _params(direct)
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
  hf.export_run(run, tmp_path / "out", dtype=original["dtype"], progress=False)
  theirs = st.read_file(src / "model.safetensors")
  ours = st.read_file(tmp_path / "out" / "model.safetensors")
  assert theirs.keys() == ours.keys()
  for key in theirs:
    assert ours[key].dtype == theirs[key].dtype
    np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
  written = json.loads((tmp_path / "out" / "config.json").read_text())
  assert _head_dims(written) == _head_dims(original)
  uses_swa = "swa" in (original["token_mixer"], original["alt_token_mixer"]
                       if original["alt_layer_every"] > 1 else None)
  rotates = set(cfg.model.layer_mixers) - {"ovq", "rwkv7"}  # OVQ and RWKV-7 layers read no RoPE
  skip = _NOT_THE_NETWORK | {"d_qk_head", "d_v_head", "d_head"} | (
      set() if uses_swa else {"swa_window_size"}) | (
      set() if rotates else {"rope_partial_dim", "rope_theta"})
  differing = {k: (original[k], written.get(k)) for k in original
               if k not in skip and written.get(k) != original[k]}
  assert differing == {}
  assert written["dtype"] == original["dtype"]


# ----------------------------------------------------------------------------------------------
# Bad input: every error names the file, field or tensor
# ----------------------------------------------------------------------------------------------

def _copy(tmp_path, name="full_bswa"):
  dest = tmp_path / name
  shutil.copytree(DATA / name, dest)
  return dest


def _edit_config(path, **fields):
  config = json.loads((path / "config.json").read_text())
  config.update(fields)
  (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("fields, match", [
    (dict(token_mixer="kda"), "token_mixer='kda'"),
    (dict(token_mixer="gated_deltanet"), "token_mixer='gated_deltanet'"),
    (dict(token_mixer_class_path="model.lact_mixer.SequenceMixer"), "token_mixer_class_path"),
    (dict(use_skip_connections=1), "use_skip_connections=1"),
    (dict(use_block_lambdas=1), "use_block_lambdas=1"),
    (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    (dict(gptalpha_value_residual_mode="linear"), "gptalpha_value_residual_mode='linear'"),
    (dict(alt_token_mixer="gptalpha"), "alt_token_mixer='gptalpha'"),
    (dict(alt_rope_theta=500000.0), "alt_rope_theta=500000.0"),
    (dict(model_class_path="model.other.Model"), "model_class_path='model.other.Model'"),
])
def test_unsupported_config_fields_are_named(tmp_path, fields, match):
  path = _copy(tmp_path)
  _edit_config(path, **fields)
  with pytest.raises(hf.ConfigError, match=match.replace("(", r"\(").replace(".", r"\.")):
    kj.load_pretrained(path, progress=False)


@pytest.mark.parametrize("fields, match", [
    (dict(kvm_use_vlens=0), "kvm_use_vlens=0"),
    (dict(state_budget_mode="exponential"), "state_budget_mode='exponential'"),
    (dict(state_budget_mode="kvm_saturation", state_saturation_n=None), "state_saturation_n"),
    (dict(rope_partial_dim=0), "rope_partial_dim=0"),
    (dict(state_round_down=0), "state_round_down=0"),
    (dict(n_max_d_chunks=0), "n_max_d_chunks=0"),
])
def test_unsupported_kvm_fields_are_named(tmp_path, fields, match):
  path = _copy(tmp_path, "kvm_power_gqa")
  _edit_config(path, **fields)
  with pytest.raises(hf.ConfigError, match=match):
    kj.load_pretrained(path, progress=False)


@pytest.mark.parametrize("name, fields, match", [
    ("ovq_swa", dict(ovq_value_residual_mode="linear"), "ovq_value_residual_mode='linear'"),
    ("ovq_swa", dict(ovq_chunk_size=0), "ovq_chunk_size=0 must be >= 1"),
    ("ovq_swa", dict(ovq_max_centroids=0), "ovq_max_centroids=0"),
    ("ovq_swa", dict(ovq_use_delta_rule=2), "ovq_use_delta_rule=2 must be 0 or 1"),
    ("ovq_swa", dict(ovq_token_shift_mode="none"), "ovq_token_shift_mode='none'"),
    ("ovq_swa", dict(num_key_value_heads=1), "num_kv_heads=1"),
    ("rwkv7", dict(d_head=8), "num_heads x head_dim = 2 x 8 must equal hidden_size=32"),
    ("rwkv7", dict(alt_layer_every=2, use_value_residual=0), "use_value_residual=0 in a hybrid"),
    ("rwkv7", dict(alt_layer_every=2, d_qk_head=8), "d_qk_head=8, d_v_head=None"),
    ("rwkv7", dict(alt_layer_every=2, alt_rope_partial_dim=16), "first RWKV-7 layer"),
])
def test_unsupported_baseline_fields_are_named(tmp_path, name, fields, match):
  path = _copy(tmp_path, name)
  _edit_config(path, **fields)
  with pytest.raises(hf.ConfigError, match=match):
    kj.load_pretrained(path, progress=False)


def test_rwkv7_ignores_the_fields_its_layer_never_reads(tmp_path):
  """Their RWKV-7 time mix reads neither num_key_value_heads, d_qk_head/d_v_head nor
  use_value_residual: a pure RWKV-7 checkpoint that sets them loads, and computes their logits."""
  path = _copy(tmp_path, "rwkv7")
  _edit_config(path, num_key_value_heads=1, d_qk_head=8, d_v_head=4, use_value_residual=0)
  model = kj.load_pretrained(path, progress=False)
  assert model.cfg.num_kv_heads is None and model.cfg.qk_head_dim == 16 and model.cfg.value_residual
  ref = np.load(DATA / "rwkv7" / "reference.npz")
  np.testing.assert_allclose(model_logits(model, ref["tokens"]), ref["logits_float32"], rtol=0,
                             atol=FLOAT32_TOL * np.abs(ref["logits_float32"]).max())


@pytest.mark.parametrize("fields, match", [
    (dict(swa_window_size=None), "swa_window_size=None must be an integer"),
    (dict(token_mixer=["kvm"]), r"token_mixer=\['kvm'\]"),
    (dict(rope_theta="abc"), "rope_theta='abc' must be a finite number"),
    (dict(num_key_value_heads="1"), "num_key_value_heads='1' must be an integer"),
    (dict(d_head=16.5), "d_head=16.5 must be an integer"),
    (dict(ffn_expansion=None), "ffn_expansion=None must be a finite number"),
    (dict(use_value_residual=2), "use_value_residual=2 must be 0 or 1"),
])
def test_malformed_config_values_are_named(fields, match):
  config = json.loads((DATA / "kvm_swa_saturating" / "config.json").read_text())
  with pytest.raises(hf.ConfigError, match=match):
    hf.model_config_from_authors({**config, **fields})


def test_config_spellings_their_code_accepts():
  """A fixed budget at or below one chunk (their default state_min_len -1 included) keeps the
  first chunk's rows forever, i.e. FixedBudget(chunk_len); "kvm_triton" names their Triton KVM
  class; integral floats are integers; residual_scale 0 means 1 (their `or 1.0`)."""
  config = json.loads((DATA / "kvm_power_gqa" / "config.json").read_text())
  for min_len in (-1, 0, 1, 8):
    cfg = hf.model_config_from_authors({**config, "state_budget_mode": "fixed",
                                        "state_min_len": min_len})
    assert cfg.kvm.budget == kj.FixedBudget(8)
  cfg = hf.model_config_from_authors({**config, "token_mixer": "kvm_triton",
                                      "num_key_value_heads": 2.0, "residual_scale": 0})
  assert cfg.layer_mixers == ("kvm", "kvm") and cfg.num_kv_heads == 2 and cfg.scale == 1.0


def test_missing_files_are_named(tmp_path):
  with pytest.raises(hf.CheckpointError, match="is not a directory"):
    kj.load_pretrained(tmp_path / "nowhere")
  path = _copy(tmp_path)
  (path / "config.json").unlink()
  with pytest.raises(hf.CheckpointError, match="has no config.json"):
    kj.load_pretrained(path)
  path = _copy(tmp_path, "kvm_power_gqa")
  (path / "model.safetensors").unlink()
  with pytest.raises(hf.CheckpointError, match="holds no model.safetensors"):
    kj.load_pretrained(path)


def test_pickled_checkpoints_are_refused_with_the_conversion(tmp_path):
  path = _copy(tmp_path)
  (path / "model.safetensors").rename(path / "pytorch_model.bin")
  with pytest.raises(hf.CheckpointError, match=r"pickled PyTorch weights \(\['pytorch_model.bin'\]\)"
                     r"[\s\S]*never unpickles[\s\S]*safetensors"):
    kj.load_pretrained(path)


def test_truncated_file_is_named(tmp_path):
  path = _copy(tmp_path)
  data = (path / "model.safetensors").read_bytes()
  (path / "model.safetensors").write_bytes(data[:-100])
  with pytest.raises(hf.CheckpointError, match=r"model.safetensors: tensor '[\w.]+' .*truncated"):
    kj.load_pretrained(path, progress=False)
  (path / "model.safetensors").write_bytes(data[:5])
  with pytest.raises(hf.CheckpointError, match="too short"):
    kj.load_pretrained(path, progress=False)
  (path / "model.safetensors").write_bytes(struct.pack("<Q", 6) + b"{nope}" + data[8:64])
  with pytest.raises(hf.CheckpointError, match="not valid JSON"):
    kj.load_pretrained(path, progress=False)


def _rewrite(path, change):
  tensors = {k: np.array(v) for k, v in st.read_file(path / "model.safetensors").items()}
  change(tensors)
  st.write_file(path / "model.safetensors", tensors, {"format": "pt"})


def test_wrong_missing_and_extra_tensors_are_named(tmp_path):
  path = _copy(tmp_path)
  _rewrite(path, lambda t: t.update({"transformer.h.1.attn.c_q.weight": np.zeros((32, 31),
                                                                                    np.float32)}))
  with pytest.raises(hf.CheckpointError,
                     match=r"'transformer.h.1.attn.c_q.weight' has shape \[32, 31\] but the config "
                           r"implies \[32, 32\]"):
    kj.load_pretrained(path, progress=False)
  path = _copy(tmp_path / "b")
  _rewrite(path, lambda t: t.pop("transformer.h.0.attn.v_gate0"))
  with pytest.raises(hf.CheckpointError, match=r"missing 1 tensor.*transformer.h.0.attn.v_gate0"):
    kj.load_pretrained(path, progress=False)
  path = _copy(tmp_path / "c")
  _rewrite(path, lambda t: t.update({"transformer.h.0.attn.ln_s_k.weight": np.ones(16, np.float32)}))
  with pytest.raises(hf.CheckpointError, match=r"does not explain.*transformer.h.0.attn.ln_s_k"):
    kj.load_pretrained(path, progress=False)


def test_sharded_index_problems_are_named(tmp_path):
  model = random_model(kj.presets.tiny(mixers="full"))
  tensors = hf.to_authors(nnx.state(model, nnx.Param), model.cfg)
  files = st.write_checkpoint(tmp_path, tensors, {"format": "pt"}, max_shard_bytes=100_000,
                              progress=False)
  assert len(files) > 2 and (tmp_path / st.INDEX_FILE).exists()
  back = st.read_checkpoint(tmp_path)
  assert back.keys() == tensors.keys()
  for key in tensors:
    np.testing.assert_array_equal(back[key], tensors[key])
  index = json.loads((tmp_path / st.INDEX_FILE).read_text())
  for weight_map, match in (([], "must map tensor names"), ({"a": 5}, "must map tensor names"),
                            ({"a": "../outside.safetensors"}, "plain file names"),
                            ({"a": "/abs/x.safetensors"}, "plain file names")):
    (tmp_path / st.INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(hf.CheckpointError, match=match):
      st.read_checkpoint(tmp_path)
  moved = dict(index["weight_map"], **{"lm_head.weight": files[0].name})
  (tmp_path / st.INDEX_FILE).write_text(json.dumps({"weight_map": moved}))
  if index["weight_map"]["lm_head.weight"] != files[0].name:
    with pytest.raises(hf.CheckpointError, match="'lm_head.weight', which .* assigns to"):
      st.read_checkpoint(tmp_path)
  (tmp_path / st.INDEX_FILE).write_text(json.dumps(index))
  files[1].unlink()
  with pytest.raises(hf.CheckpointError, match=f"lists \\['{files[1].name}'\\]"):
    st.read_checkpoint(tmp_path)


def test_destinations_that_would_delete_the_source_are_refused(tmp_path):
  """--overwrite replaces DEST, so DEST may be neither the source nor a folder holding it."""
  run = hf.import_checkpoint(DATA / "full_bswa", tmp_path / "runs" / "a", progress=False)
  for dest in (run, tmp_path / "runs", tmp_path):
    with pytest.raises(ValueError, match="write to a new directory"):
      hf.export_run(run, dest, overwrite=True, progress=False)
  with pytest.raises(ValueError, match="write to a new directory"):
    hf.import_checkpoint(DATA / "full_bswa", DATA, overwrite=True, progress=False)
  assert kj.runs.load_trained(run)[2] == 0 and (DATA / "full_bswa" / "config.json").exists()


def test_init_from_an_authors_directory_says_to_import_it():
  from kvm_jax.train.start import with_init_model
  cfg = TrainConfig(init_from=str(DATA / "full_bswa"))
  with pytest.raises(ValueError, match="convert it first: kvm-import"):
    with_init_model(cfg)


def test_cli_errors_exit_2_with_the_message(tmp_path, capsys):
  from kvm_jax.hf.cli import export_main, import_main
  path = _copy(tmp_path)
  _edit_config(path, use_skip_connections=1)
  assert import_main([str(path), str(tmp_path / "run"), "--no-progress"]) == 2
  assert "use_skip_connections=1" in capsys.readouterr().err
  assert export_main([str(DATA / "full_bswa"), str(tmp_path / "out")]) == 2
  assert "not a kvm_jax run directory" in capsys.readouterr().err
  hf.import_checkpoint(DATA / "full_bswa", tmp_path / "run2", progress=False)
  assert import_main([str(DATA / "full_bswa"), str(tmp_path / "run2")]) == 2
  assert "not empty" in capsys.readouterr().err


def test_an_interrupted_import_leaves_nothing_behind(tmp_path, monkeypatch):
  """kvm-import writes a staged directory and renames it at the end: a failure while writing
  leaves neither DEST nor the staging directory, and an existing DEST replaced with --overwrite
  stays whole until the new one is complete."""
  def broken_save(self, *args, **kwargs):
    raise OSError("disk full")
  hf.import_checkpoint(DATA / "full_bswa", tmp_path / "run", progress=False)
  before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*"))
  monkeypatch.setattr(Checkpointer, "save", broken_save)
  with pytest.raises(OSError, match="disk full"):
    hf.import_checkpoint(DATA / "full_bswa", tmp_path / "new", progress=False)
  with pytest.raises(OSError, match="disk full"):
    hf.import_checkpoint(DATA / "kvm_power_gqa", tmp_path / "run", overwrite=True, progress=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
  assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "run").rglob("*")) == before


def test_unknown_config_keys_warn_and_load(tmp_path, capsys):
  """A key that is neither their field nor Hugging Face's is named in a warning, not an error;
  the progress bar reports the bytes loaded (off a terminal: lines, ending at the total)."""
  path = _copy(tmp_path)
  _edit_config(path, kvm_future_option=3)
  with pytest.warns(UserWarning, match=r"\['kvm_future_option'\]"):
    kj.load_pretrained(path)
  err = capsys.readouterr().err
  total = sum(a.nbytes for a in st.read_file(path / "model.safetensors").values())
  assert f"load {total}/{total}" in err


@pytest.mark.parametrize("name", ["kvm-import", "kvm-export", "kvm-convert"])
def test_help_explains_every_flag(name, capsys):
  from kvm_jax.hf import cli
  kind = name.split("-")[1]
  parser, main = getattr(cli, f"{kind}_parser")(), getattr(cli, f"{kind}_main")
  with pytest.raises(SystemExit) as exit_info:
    main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  assert f"usage: {name}" in text
  for action in parser._actions:
    assert action.help, f"{action.option_strings or action.dest} has no help"
    for flag in action.option_strings:
      assert flag in text, flag


# ----------------------------------------------------------------------------------------------
# The safetensors format itself
# ----------------------------------------------------------------------------------------------

def test_safetensors_round_trip_and_bytes(tmp_path):
  tensors = {
      "f32": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
      "bf16": np.array([1.0, -2.5, 3.140625, 1e-3], ml_dtypes.bfloat16),
      "f16": np.array([[0.5, -1.0]], np.float16), "i64": np.array([-3, 2**40], np.int64),
      "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float32),
      "flag": np.array([True, False]),
  }
  st.write_file(tmp_path / "a.safetensors", tensors, {"format": "pt"})
  back = st.read_file(tmp_path / "a.safetensors")
  assert back.keys() == tensors.keys()
  for key, value in tensors.items():
    assert back[key].dtype == value.dtype and back[key].shape == value.shape
    np.testing.assert_array_equal(back[key], value)
  assert st.read_metadata(tmp_path / "a.safetensors") == {"format": "pt"}
  # By hand: an 8-byte length, a JSON header padded to 8 bytes, then the raw little-endian data;
  # bfloat16 is the top half of the float32 bit pattern.
  raw = (tmp_path / "a.safetensors").read_bytes()
  (n,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8:8 + n])
  assert n % 8 == 0 and header["bf16"]["dtype"] == "BF16" and header["bf16"]["shape"] == [4]
  begin, end = header["bf16"]["data_offsets"]
  bits = np.frombuffer(raw[8 + n + begin:8 + n + end], "<u2")
  want = (np.array([1.0, -2.5, 3.140625, 1e-3], np.float32).view(np.uint32) >> 16)
  # 1e-3 is not a bfloat16: round to nearest even of the dropped half
  f = np.array([1e-3], np.float32).view(np.uint32)[0]
  want[3] = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
  np.testing.assert_array_equal(bits, want.astype(np.uint16))


def test_safetensors_interoperates_with_the_reference_package(tmp_path):
  """Files the ``safetensors`` package writes read here, and files written here read there."""
  stnp = pytest.importorskip("safetensors.numpy")
  tensors = {"a": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
             "b": np.array([[1, 2]], np.int64), "c": np.array([0.25, 8.0], np.float16)}
  stnp.save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
  for key, value in st.read_file(tmp_path / "theirs.safetensors").items():
    np.testing.assert_array_equal(value, tensors[key])
  st.write_file(tmp_path / "ours.safetensors", tensors, {"format": "pt"})
  for key, value in stnp.load_file(str(tmp_path / "ours.safetensors")).items():
    np.testing.assert_array_equal(value, tensors[key])


# ----------------------------------------------------------------------------------------------
# Imported runs elsewhere: the trainer (fine-tuning) and evaluation
# ----------------------------------------------------------------------------------------------

def _imported_text_model(tmp_path):
  """A vocabulary-320 model (byte tokenizer) in their format, imported as a run directory."""
  model = random_model(kj.presets.tiny(mixers=("swa", "kvm"), vocab_size=320), seed=3)
  _write_run(tmp_path / "native", model)
  hf.export_run(tmp_path / "native", tmp_path / "theirs", progress=False)
  return model, hf.import_checkpoint(tmp_path / "theirs", tmp_path / "imported", numerics="float32",
                                     progress=False)


def test_fine_tuning_starts_from_the_imported_parameters(tmp_path):
  """kvm-train --config.init_from=DIR: the first step's loss is the imported model's loss on the
  first batch (computed here from its logits), the model config is DIR's, and the imported
  directory itself is refused as a workdir with the command to use."""
  from kvm_jax.train.data import task_dataset
  from kvm_jax.train.loop import train
  _, imported = _imported_text_model(tmp_path)
  cfg = TrainConfig(model=kj.presets.tiny(), task="text", seq_len=32, batch_size=2, steps=2,
                    warmup_steps=1, log_every=1, checkpoint_every=2, init_from=str(imported))
  with pytest.raises(ValueError, match="--config.init_from="):
    train(dataclasses.replace(cfg, init_from=""), imported, verbose=False)
  train(cfg, tmp_path / "tune", verbose=False)
  run = load_config(tmp_path / "tune")
  assert run.model == load_config(imported).model and run.init_from == str(imported)
  first = json.loads((tmp_path / "tune" / "metrics.jsonl").read_text().splitlines()[0])
  assert first["step"] == 1
  data = task_dataset(cfg, "train")  # the trainer's first batch: examples 0 and 1
  batch = {k: np.stack([data[i][k] for i in (0, 1)]) for k in ("inputs", "labels")}
  model = kj.load_pretrained(imported)
  logits = model_logits(model, batch["inputs"]).astype(np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  labels = batch["labels"]
  mask = labels >= 0
  nll = -np.take_along_axis(logp, np.where(mask, labels, 0)[..., None], -1)[..., 0]
  assert first["loss"] == pytest.approx(nll[mask].mean(), rel=1e-5)


@pytest.mark.slow
def test_imported_run_in_kvm_eval_lm_eval_and_generate(tmp_path):
  """The evaluation tools read an imported run directory like any other: kvm-eval's MQAR suite,
  the lm-eval adapter's loglikelihood (against the logits) and generate."""
  model, imported = _imported_text_model(tmp_path)
  out = tmp_path / "eval"
  subprocess.run([sys.executable, "-m", "kvm_jax.eval.cli", "--checkpoint", str(imported),
                  "--suite", "mqar", "--out", str(out)], check=True, cwd=ROOT)
  assert json.loads((out / "results.json").read_text())
  from kvm_jax.eval.lm_eval_adapter import KVMEvalLM
  from lm_eval.api.instance import Instance
  lm = KVMEvalLM(checkpoint=str(imported))
  (ll, _), = lm.loglikelihood([Instance(request_type="loglikelihood", doc={},
                                        arguments=("ab", "c"), idx=0)])
  logits = model_logits(model, np.array([[97, 98]])).astype(np.float64)[0, -1]
  want = logits[99] - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
  assert ll == pytest.approx(want, abs=1e-4)
