"""Backbone families: the Llama and Gemma families read from transformers' own checkpoints
compute transformers' logits and greedy continuations, convert to KVM exactly inside the window
and export back; every mixer kind sits in their blocks; the config readers refuse what they cannot
express by name."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.generation.generate import SamplingConfig, generate
from kvm_jax.hf import ConfigError, checkpoint_kind
from kvm_jax.hf.families import model_config_from_transformers
from kvm_jax.nn.families.llama import LlamaOptions
from tests.helpers import DATA as FIXTURES_ROOT, in_ci

DATA = FIXTURES_ROOT / "transformers"
FIXTURES = sorted(p.name for p in DATA.iterdir() if p.is_dir())
# Both sides compute in float32; the measured gap is <= 5e-7 of the largest logit (summation
# order), so 1e-4 leaves room for other CPUs while a wrong rule (a RoPE frequency, a bias, a
# norm) moves logits by far more.
LOGITS_RTOL = 1e-4


def _reference(name: str) -> dict:
  return dict(np.load(DATA / name / "reference.npz"))


@pytest.fixture(scope="module")
def loaded():
  """Each fixture's model, loaded once."""
  return {name: kj.load_pretrained(DATA / name, progress=False) for name in FIXTURES}


def test_fixtures_cover_every_family_option():
  """The fixture table holds what the tests below claim to cover."""
  cfgs = {name: model_config_from_transformers(json.loads((DATA / name / "config.json")
                                                          .read_text())) for name in FIXTURES}
  gemma = cfgs.pop("gemma3")
  assert cfgs.pop("gemma3_tf4") == gemma and gemma.family == "gemma"
  assert gemma.family_options.local_layers == (0, 1, 3) and gemma.layer_mixers[2] == "full"
  assert gemma.family_options.query_pre_attn_scalar != gemma.qk_head_dim
  assert gemma.family_options.rope_scaling == "linear" and gemma.family_options.qk_norm
  gemma2 = cfgs.pop("gemma2_softcap")
  assert cfgs.pop("gemma2_softcap_tf4") == gemma2 and gemma2.family == "gemma"
  o2 = gemma2.family_options
  assert not o2.qk_norm and o2.attention_softcap == 4.0 and o2.final_logit_softcap == 30.0
  assert o2.local_layers == (0, 2) and gemma2.num_kv_heads == 2
  options = [c.family_options for c in cfgs.values()]
  assert {o.rope_scaling for o in options} == {"none", "linear", "llama3"}
  assert any(o.tie_embeddings for o in options) and any(not o.tie_embeddings for o in options)
  assert any(o.qkv_bias and not o.output_bias for o in options)   # Qwen2
  assert any(o.qkv_bias and o.output_bias and o.mlp_bias for o in options)
  assert any(o.qk_norm for o in options)
  assert any("swa" in c.layer_mixers for c in cfgs.values())
  assert any(c.num_kv_heads for c in cfgs.values()) and any(c.head_dim for c in cfgs.values())


# CI: every family and option (the 4.x-layout copies hold the same weights, and their configs are
# compared with the 5.x ones below); nightly also the copies' logits.
@pytest.mark.parametrize("name", in_ci(FIXTURES, {n for n in FIXTURES if not n.endswith("_tf4")}))
def test_logits_and_greedy_generation_equal_transformers(name, loaded):
  """Logits of 45 tokens (past the Llama-3 scaling's original length and Mistral's window) and
  14 greedily generated tokens equal transformers' own."""
  ref, model = _reference(name), loaded[name]
  logits = np.asarray(model(jnp.asarray(ref["tokens"])))
  scale = np.max(np.abs(ref["logits"]))
  np.testing.assert_array_less(np.max(np.abs(logits - ref["logits"])), LOGITS_RTOL * scale)
  prompt, want = ref["prompt"], ref["generated"]
  tokens, _ = generate(model, jnp.asarray(prompt), max_new_tokens=want.shape[1] - prompt.shape[1],
                       key=jax.random.key(0), sampling=SamplingConfig(temperature=0.0))
  np.testing.assert_array_equal(np.asarray(tokens), want)


def test_both_config_layouts_read_the_same_model():
  """transformers 4.x's ``rope_theta``/``rope_scaling`` and 5.x's ``rope_parameters`` give one
  config."""
  for name in ("llama3_gqa", "qwen2", "gemma3", "gemma2_softcap"):
    read = lambda d: model_config_from_transformers(json.loads((DATA / d / "config.json")
                                                               .read_text()))
    assert read(name) == read(name + "_tf4")


def test_a_transformers_directory_is_never_read_as_the_authors_format():
  assert {checkpoint_kind(DATA / name) for name in FIXTURES} == {"transformers"}
  assert checkpoint_kind(DATA.parent / "authors" / "kvm_power_gqa") == "authors"


def _edited(tmp_path: Path, name: str, **fields) -> Path:
  dest = tmp_path / name
  shutil.copytree(DATA / name, dest)
  config = json.loads((dest / "config.json").read_text())
  config.update(fields)
  (dest / "config.json").write_text(json.dumps(config))
  return dest


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="gemma3"), "model_type='gemma3' (the multimodal Gemma 3"),
    (dict(model_type="falcon"), "model_type='falcon' is not a family kvm_jax reads"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)),
     "RoPE type 'yarn' is not supported"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    (dict(layer_types=["full_attention"]), "layer_types=['full_attention'] must name"),
    (dict(num_key_value_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(intermediate_size=None), "lacks 'intermediate_size'"),
])
def test_configs_it_cannot_express_are_refused_by_name(tmp_path, fields, message):
  with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                     .replace("[", r"\[").replace("]", r"\]")):
    kj.load_pretrained(_edited(tmp_path, "llama3_gqa", **fields), progress=False)


def test_layer_types_are_the_kinds_own():
  """transformers' layer types and sliding window come from each kind's own class
  (``TRANSFORMERS``); a kind without one has no transformers format."""
  from kvm_jax.nn import registry
  assert registry.kinds_of_layer_types() == {"full_attention": "full",
                                             "sliding_attention": "swa"}
  assert registry.sliding_kinds() == ("swa",)
  assert set(registry.transformers_layers()) == {"full", "swa"}


def test_qwen_sliding_window_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="use_sliding_window=true"):
    kj.load_pretrained(_edited(tmp_path, "qwen2", use_sliding_window=True), progress=False)


def test_a_missing_or_misshapen_tensor_is_named(tmp_path):
  from kvm_jax.hf import read_checkpoint, write_checkpoint
  tensors = read_checkpoint(DATA / "qwen2")
  name = "model.layers.1.self_attn.k_proj.bias"
  broken = tmp_path / "broken"
  shutil.copytree(DATA / "qwen2", broken)
  write_checkpoint(broken, {k: v for k, v in tensors.items() if k != name},
                   metadata={"format": "pt"}, progress=False)
  with pytest.raises(kj.hf.CheckpointError, match=f"missing \\['{name}'\\]"):
    kj.load_pretrained(broken, progress=False)
  write_checkpoint(broken, {**tensors, name: np.zeros((3,), np.float32)},
                   metadata={"format": "pt"}, progress=False)
  with pytest.raises(kj.hf.CheckpointError, match=f"'{name}' has shape \\[3\\]"):
    kj.load_pretrained(broken, progress=False)


def _llama_cfg(mixers, **overrides) -> kj.ModelConfig:
  """A tiny Llama-family model with every option on: RoPE on all 16 channels of a head with
  llama3 scaling, q/k norms, q/k/v biases, a tied head."""
  options = LlamaOptions(intermediate_size=96, qkv_bias=True, qk_norm=True, tie_embeddings=True,
                         rope_scaling="llama3", rope_factor=4.0, rope_original_max_len=16)
  kvm = dataclasses.replace(kj.presets.TINY_OPTIONS["kvm"], rope_dims=16)
  fields = dict(family="llama", family_options=options, rope_dims=16, options={"kvm": kvm})
  return kj.presets.tiny(mixers, **{**fields, **overrides})


@pytest.mark.parametrize("mixers", in_ci(["swa,kvm", "full,bswa", "rwkv7,ovq"],
                                          {"swa,kvm", "rwkv7,ovq"}))
def test_every_mixer_kind_decodes_in_llama_blocks_as_it_runs_whole(mixers):
  """Prefill of 31 tokens (past a chunk boundary of every kind) then 5 decode steps equal the
  whole-sequence forward (float32 rounding, 1e-5 of the largest logit), for each kind in the
  Llama family's blocks."""
  model = kj.LM(_llama_cfg(mixers), rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 36)), jnp.int32)
  whole = np.asarray(model(tokens))
  caches = model.init_cache(2, 64)
  logits, caches = model.prefill(tokens[:, :31], caches)
  steps = [np.asarray(logits)]
  step_fn = nnx.jit(lambda m, t, c: m.decode_step(t, c))
  for t in range(31, 36):
    step, caches = step_fn(model, tokens[:, t:t + 1], caches)
    steps.append(np.asarray(step))
  np.testing.assert_allclose(np.concatenate(steps, 1), whole, rtol=0,
                             atol=1e-5 * np.max(np.abs(whole)))


def test_llama_config_round_trips_through_json(tmp_path):
  from kvm_jax.config import io as config_io
  cfg = _llama_cfg("swa,kvm")
  assert config_io.from_jsonable(config_io.to_jsonable(cfg)) == cfg


CONVERT_KVM = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=8,
                           budget=kj.PowerLawBudget(2.0, 0.5, min_rows=4))


def _convert_kvm(model) -> kj.KVMConfig:
  """CONVERT_KVM rotating the model's channels (all of them in these families), the state keeping
  the slower half of the rotary pairs (what kvm-convert chooses for them)."""
  r = model.cfg.rope_dims
  return dataclasses.replace(CONVERT_KVM, rope_dims=r, state_rope_dims=r // 2)


def test_state_channel_order_pairs_the_rotate_half_layout_fastest_first():
  """The KVM layer shows the op q/k channels as adjacent rotary pairs, fastest first, so that
  state_rope_dims zeroes the fastest pairs and keeps the slow ones (checked against the RoPE
  frequencies of a llama3-scaled model, 12 of 16 channels rotated)."""
  from kvm_jax.nn.families.llama import Llama
  from kvm_jax.ops.rope import rope_inverse_frequencies
  cfg = _llama_cfg("kvm", rope_dims=12, options={"kvm": dataclasses.replace(
      kj.presets.TINY_OPTIONS["kvm"], rope_dims=12)})
  order = Llama.state_channel_order(cfg, 0)
  assert sorted(order) == list(range(16)) and list(order[12:]) == [12, 13, 14, 15]
  inverse = rope_inverse_frequencies(cfg.family_options, 12, cfg.rope_theta)
  frequency = np.concatenate([inverse, inverse])        # of each channel, rotate-half layout
  pairs = frequency[np.asarray(order[:12])].reshape(6, 2)
  assert np.all(pairs[:, 0] == pairs[:, 1])              # partners side by side
  assert np.all(np.diff(pairs[:, 0]) < 0)                # fastest first


# CI: GQA with llama3 scaling, q/k/v biases, Gemma's front end (q/k norms, local/global RoPE),
# Gemma 2's soft-capped scores in the KVM readout; sliding-window layers in
# test_kvm_convert_reads_a_transformers_directory.
@pytest.mark.parametrize("name", in_ci([n for n in FIXTURES if not n.endswith("_tf4")],
                                       {"llama3_gqa", "qwen2", "gemma3", "gemma2_softcap"}))
def test_conversion_is_exact_inside_the_window(name, loaded):
  """Every layer made kvm with the family's front end: logits equal the source's (float32, 1e-5
  of the largest logit) on sequences up to the exact length (the KVM window of 8 tokens; 8 <
  Mistral's 12), and differ past it, where the state takes over."""
  from kvm_jax.nn.convert import exact_length
  source = loaded[name]
  kvm = _convert_kvm(source)
  converted = kj.convert_to_kvm(source, "all", kvm)
  assert set(converted.cfg.layer_mixers) == {"kvm"}
  assert converted.cfg.family == source.cfg.family
  n = exact_length(source.cfg, range(source.cfg.num_layers), kvm)
  assert n == 8
  tokens = jnp.asarray(_reference(name)["tokens"])
  want, got = np.asarray(source(tokens)), np.asarray(converted(tokens))
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got[:, :n], want[:, :n], rtol=0, atol=1e-5 * scale)
  assert np.max(np.abs(got[:, n:] - want[:, n:])) > 1e-2 * scale


def test_kvm_convert_reads_a_transformers_directory(tmp_path):
  """kvm-convert SRC DEST on a transformers directory writes a run whose logits equal the
  source's inside a Mistral window shorter than the KVM window."""
  from kvm_jax.hf.cli import convert_main
  src = DATA / "mistral_window_sharded"
  dest = tmp_path / "run"
  assert convert_main([str(src), str(dest), "--layers", "1", "--kvm.chunk_size=8",
                       "--kvm.window_chunks=2", "--kvm.rope_dims=8", "--no-progress"]) == 0
  record = json.loads((dest / "conversion.json").read_text())
  assert record["exact_up_to_tokens"] == 12 and record["mixers"] == ["swa", "kvm"]
  source, converted = (kj.load_pretrained(p, progress=False) for p in (src, dest))
  tokens = jnp.asarray(_reference("mistral_window_sharded")["tokens"][:, :12])
  want = np.asarray(source(tokens))
  np.testing.assert_allclose(np.asarray(converted(tokens)), want, rtol=0,
                             atol=1e-5 * np.max(np.abs(want)))


@pytest.mark.parametrize("name", ["llama3_gqa", "llama_linear_tied_bias", "qwen2", "qwen3_bf16",
                                  "mistral_window_sharded", "gemma3", "gemma2_softcap"])
def test_export_writes_back_what_transformers_wrote(tmp_path, name):
  """kvm-import then kvm-export: the same model type, a config.json read back to the same model,
  and exactly transformers' tensors (names, values; a tied head stored once). (Outside CI the
  exported directories load in transformers 4.57 and 5.25 with logits equal to the fixture's.)"""
  from kvm_jax.hf import export_run, import_checkpoint, read_checkpoint
  run = import_checkpoint(DATA / name, tmp_path / "run", progress=False)
  export_run(run, tmp_path / "out", progress=False)  # in the source's dtype, unasked
  theirs = json.loads((DATA / name / "config.json").read_text())
  ours = json.loads((tmp_path / "out" / "config.json").read_text())
  assert ours["model_type"] == theirs["model_type"]
  assert ours["architectures"] == theirs["architectures"]
  assert (model_config_from_transformers(ours, dtype="float32")
          == model_config_from_transformers(theirs, dtype="float32"))
  want, got = read_checkpoint(DATA / name), read_checkpoint(tmp_path / "out")
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key].dtype == value.dtype, key
    np.testing.assert_array_equal(np.asarray(got[key], np.float32),
                                  np.asarray(value, np.float32), err_msg=key)


# The special token ids and generation settings that transformers' generate reads: a
# generation_config.json of the kind Qwen's chat models ship, written by hand. Its second end token
# is where row 0 of qwen3_bf16's greedy continuation starts (93), which row 1 never reaches.
QWEN_GENERATION = {"bos_token_id": 1, "eos_token_id": [2, 93], "pad_token_id": 0,
                   "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                   "transformers_version": "5.25.0"}
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
  """``round_trip(case)``: (source, export) of qwen3_bf16 (bfloat16 weights) through kvm-import
  (to float32, the default) and kvm-export with no flags; the source as the fixture is ("plain":
  its config.json's token ids, no generation_config.json) or with QWEN_GENERATION added
  ("generation")."""
  from kvm_jax.hf import export_run, import_checkpoint
  made = {}

  def make(case: str) -> tuple[Path, Path]:
    if case not in made:
      root = tmp_path_factory.mktemp(case)
      shutil.copytree(DATA / "qwen3_bf16", root / "src")
      if case == "generation":
        (root / "src" / "generation_config.json").write_text(json.dumps(QWEN_GENERATION))
      run = import_checkpoint(root / "src", root / "run", progress=False)
      export_run(run, root / "out", progress=False)
      made[case] = (root / "src", root / "out")
    return made[case]
  return make


@pytest.mark.parametrize("case", ["plain", "generation"])
def test_export_keeps_special_tokens_generation_config_and_dtype(round_trip, case):
  """What transformers needs besides the tensors' values survives import then export, field by
  field: config.json's special token ids and dtype, generation_config.json (the source's own, or
  the ids transformers derives from config.json when it has none), and every tensor's stored
  dtype."""
  from kvm_jax.hf.safetensors import tensor_info
  src, out = round_trip(case)
  theirs, ours = (json.loads((d / "config.json").read_text()) for d in (src, out))
  assert {f: ours.get(f) for f in (*TOKEN_FIELDS, "dtype")} == {
      f: theirs[f] for f in (*TOKEN_FIELDS, "dtype")}
  written = json.loads((out / "generation_config.json").read_text())
  assert written == (QWEN_GENERATION if case == "generation"
                     else {f: theirs[f] for f in TOKEN_FIELDS})
  stored = lambda d: {name: code for name, (code, _) in tensor_info(d / "model.safetensors")
                      .items()}
  assert stored(out) == stored(src) and set(stored(src).values()) == {"BF16"}


def _generation_config(path: Path):
  """The GenerationConfig transformers' ``from_pretrained`` gives a model in ``path`` (its
  generation_config.json, else one derived from config.json: transformers 5.25's
  ``GenerationMixin._load_generation_config``), which is what ``generate`` stops by."""
  transformers = pytest.importorskip("transformers")
  try:
    return transformers.GenerationConfig.from_pretrained(path)
  except OSError:
    return transformers.GenerationConfig.from_pretrained(path, config_file_name="config.json",
                                                         _from_model_config=True)


@pytest.mark.parametrize("case", ["plain", "generation"])
def test_transformers_generation_stops_where_the_source_does(round_trip, case):
  """As transformers reads them, the export's generation settings equal the source's, so its
  greedy generation (on the source's very tensors: the test above) ends the fixture's
  continuation at the same token: row 0 at once with QWEN_GENERATION, never without."""
  src, out = round_trip(case)
  theirs, ours = _generation_config(src), _generation_config(out)
  for field in (*TOKEN_FIELDS, "do_sample", "temperature", "top_k", "top_p"):
    assert getattr(ours, field) == getattr(theirs, field), field
  ref = _reference("qwen3_bf16")
  continuation = ref["generated"][:, ref["prompt"].shape[1]:]

  def stops(cfg) -> list:
    ends = set(np.atleast_1d(cfg.eos_token_id).tolist())
    return [next((i for i, t in enumerate(row) if t in ends), None) for row in continuation]
  assert stops(ours) == stops(theirs) == ([0, None] if case == "generation" else [None, None])


def test_a_run_without_a_source_takes_special_tokens_from_its_tokenizer(tmp_path):
  """With no imported source (a run trained here), the export's special tokens are the ones the
  run's tokenizer_config.json names, looked up in its tokenizer.json, else kvm_jax's own end of
  text; the tensors keep the run's parameter dtype (float32), as before."""
  from kvm_jax.hf import export_run, import_checkpoint
  from kvm_jax.hf.safetensors import tensor_info
  vocab = {"<unk>": 0, "<s>": 5, "</s>": 7, "<pad>": 9, "<|endoftext|>": 11}
  tokenizer = {"version": "1.0", "added_tokens": [
      {"id": i, "content": t, "special": True} for t, i in vocab.items() if t != "<unk>"],
      "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
  (tmp_path / "tok").mkdir()
  (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(tokenizer))
  (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"},
       "pad_token": "<pad>"}))
  run = import_checkpoint(DATA / "qwen3_bf16", tmp_path / "run", progress=False,
                          tokenizer_file=str(tmp_path / "tok" / "tokenizer.json"))
  (run / "import.json").unlink()  # what a run trained here lacks
  export_run(run, tmp_path / "out", progress=False)
  named = {"bos_token_id": 5, "eos_token_id": 7, "pad_token_id": 9}
  config = json.loads((tmp_path / "out" / "config.json").read_text())
  assert {f: config.get(f) for f in TOKEN_FIELDS} == named and config["dtype"] == "float32"
  assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == named
  assert (tmp_path / "out" / "tokenizer_config.json").read_text() == (
      tmp_path / "tok" / "tokenizer_config.json").read_text()
  assert {code for code, _ in tensor_info(tmp_path / "out" / "model.safetensors").values()} == {
      "F32"}
  (run / "tokenizer_config.json").unlink()
  export_run(run, tmp_path / "bare", progress=False)
  assert json.loads((tmp_path / "bare" / "generation_config.json").read_text()) == {
      "eos_token_id": 11}


def test_export_refuses_kvm_layers(tmp_path, loaded):
  from kvm_jax.hf import ExportError, export_run
  from kvm_jax.hf.cli import convert_main
  dest = tmp_path / "converted"
  assert convert_main([str(DATA / "qwen2"), str(dest), "--kvm.chunk_size=8",
                       "--kvm.rope_dims=8", "--no-progress"]) == 0
  with pytest.raises(ExportError, match=r"layers \['kvm'\] have no transformers format"):
    export_run(dest, tmp_path / "out", progress=False)


def test_gemma_global_layers_convert_and_keep_their_rope(loaded):
  """``layers="global"`` picks Gemma's full-attention layer; the kvm layer keeps the global RoPE
  (base and scaling): exact inside the window; a remat scan groups layers by local/global too."""
  source = loaded["gemma3"]
  kvm = _convert_kvm(source)
  converted = kj.convert_to_kvm(source, "global", kvm)
  assert converted.cfg.layer_mixers == ("swa", "swa", "kvm", "swa")
  tokens = jnp.asarray(_reference("gemma3")["tokens"])
  want = np.asarray(source(tokens))
  np.testing.assert_allclose(np.asarray(converted(tokens))[:, :8], want[:, :8], rtol=0,
                             atol=1e-5 * np.max(np.abs(want)))
  every = kj.convert_to_kvm(source, "all", kvm)   # one kind, two RoPEs: no one-layer scan group
  features = np.asarray(every.features(tokens, remat="block"))
  np.testing.assert_allclose(features, np.asarray(every.features(tokens)), rtol=0, atol=1e-5)


def test_gemma2_decodes_and_packs_documents_as_it_runs_whole(loaded):
  """Gemma 2 with its global layers converted to kvm (soft-capped scores in the ring decode of
  its local layers, in the KVM readout of prefill, decode and packed documents, and a soft-capped
  head): prefill of 31 tokens then 5 decode steps equal the whole-sequence forward, and two
  packed documents equal each run alone (float32 rounding, 1e-5 of the largest logit)."""
  source = loaded["gemma2_softcap"]
  kvm = _convert_kvm(source)
  model = kj.convert_to_kvm(source, "global", kvm)
  assert model.cfg.layer_mixers == ("swa", "kvm", "swa", "kvm")
  tokens = jnp.asarray(_reference("gemma2_softcap")["tokens"][:, :36])
  whole = np.asarray(model(tokens))
  atol = 1e-5 * np.max(np.abs(whole))
  logits, caches = model.prefill(tokens[:, :31], model.init_cache(2, 64))
  steps = [np.asarray(logits)]
  step_fn = nnx.jit(lambda m, t, c: m.decode_step(t, c))
  for t in range(31, 36):
    step, caches = step_fn(model, tokens[:, t:t + 1], caches)
    steps.append(np.asarray(step))
  np.testing.assert_allclose(np.concatenate(steps, 1), whole, rtol=0, atol=atol)
  ids = jnp.asarray([[1] * 14 + [2] * 22] * 2, jnp.int32)
  packed = np.asarray(model(tokens, segment_ids=ids))
  for a, b in ((0, 14), (14, 36)):
    np.testing.assert_allclose(packed[:, a:b], np.asarray(model(tokens[:, a:b])), rtol=0,
                               atol=atol)


def test_a_soft_capping_family_refuses_kinds_that_cannot_cap(loaded):
  """Gemma 2 caps every layer's scores: an ovq layer (its dictionary readout has no capped form)
  is refused by name instead of computing another model, and a kind built on the attention front
  end counts as capping only when its class says so (the softmax kinds and kvm do)."""
  from kvm_jax.nn import AttentionFrontEnd, SoftmaxAttention
  from kvm_jax.nn.mixers.kvm import KVMAttention
  cfg = dataclasses.replace(loaded["gemma2_softcap"].cfg, mixers=("swa", "ovq", "swa", "full"),
                            num_kv_heads=None)  # ovq keeps one dictionary per query head
  with pytest.raises(ValueError, match="layer 1: 'ovq' layers do not soft-cap"):
    kj.LM(cfg, rngs=nnx.Rngs(0))
  assert not AttentionFrontEnd.SOFTCAP and SoftmaxAttention.SOFTCAP and KVMAttention.SOFTCAP
  # RWKV-7 computes no attention scores: it sits in a capping family as in any other.
  rwkv = dataclasses.replace(cfg, mixers=("rwkv7", "swa", "rwkv7", "full"), head_dim=None,
                             rope_dims=cfg.hidden_size // cfg.num_heads)
  assert isinstance(kj.LM(rwkv, rngs=nnx.Rngs(0)).blocks[0].attn, kj.nn.RWKV7TimeMix)


def test_a_family_added_from_outside(tmp_path):
  """The recipe of docs/design.md: a Llama variant with LayerNorms, registered from outside the
  package, builds, trains a step, decodes as it runs whole, and saves and reloads its config."""
  from kvm_jax.config import io as config_io
  from kvm_jax.nn import Llama, register_family
  from kvm_jax.nn.layers import layer_norm

  @dataclasses.dataclass(frozen=True)
  class LayerNormLlamaOptions(LlamaOptions):
    pass

  class LayerNormLlama(Llama):
    Options = LayerNormLlamaOptions

    @classmethod
    def norm(cls, cfg, n, rngs):
      return layer_norm(cfg, n, rngs)

  register_family("layernorm_llama", LayerNormLlama)
  cfg = _llama_cfg("swa,kvm", family="layernorm_llama",
                   family_options=LayerNormLlamaOptions(intermediate_size=96))
  model = kj.LM(cfg, rngs=nnx.Rngs(0))
  assert "bias" in nnx.state(model.blocks[0].ln_attn)          # its own norms
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 24)), jnp.int32)
  graphdef, params = nnx.split(model)
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
  grads = jax.jit(jax.grad(loss))(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
  whole = np.asarray(model(tokens))
  logits, caches = model.prefill(tokens[:, :21], model.init_cache(2, 32))
  steps = [np.asarray(logits)]
  for t in range(21, 24):
    step, caches = model.decode_step(tokens[:, t:t + 1], caches)
    steps.append(np.asarray(step))
  np.testing.assert_allclose(np.concatenate(steps, 1), whole, rtol=0,
                             atol=1e-5 * np.max(np.abs(whole)))
  assert config_io.from_jsonable(config_io.to_jsonable(cfg)) == cfg


@pytest.mark.parametrize("stage", ["attention", "logits"])
def test_distillation_against_a_family_teacher(stage, loaded):
  """Gemma-3's conversion (global layer) distilled against the imported Gemma-3 teacher: on
  sequences inside the window the student is the teacher (attention-transfer error and KL zero to
  float32 rounding); on 45 tokens both are positive and the gradient reaches the converted layer's
  KVM-only parameters (attention transfer: only those train), LN_s's scale and the state
  temperature included: Gemma rotates every channel, and the state keys keep the slower half of
  the rotary pairs (with every rotary channel zeroed, state keys would be LN_s's bias alone and
  those two would get no gradient)."""
  from kvm_jax.runs.train_config import DistillSpec
  from kvm_jax.train import distill
  teacher = loaded["gemma3"]
  kvm = _convert_kvm(teacher)
  student = kj.convert_to_kvm(teacher, "global", kvm)
  objective = distill.DistillObjective(
      DistillSpec(stage=stage), nnx.graphdef(teacher),
      distill.converted_layers(student.cfg, teacher.cfg), "none", 0, "float32")
  assert objective.converted == (2,)
  graphdef, params = nnx.split(student)
  tokens = _reference("gemma3")["tokens"]
  metric = "attn_mse" if stage == "attention" else "kl"
  results = {}
  step = jax.jit(jax.value_and_grad(
      lambda p, t, batch, total: objective(graphdef, p, batch, t, total), has_aux=True))
  for length in (8, 45):
    batch = {"inputs": jnp.asarray(tokens[:, :length - 1]),
             "labels": jnp.asarray(tokens[:, 1:length])}
    (_, aux), grads = step(params, nnx.state(teacher), batch, jnp.asarray(2.0 * (length - 1)))
    results[length] = (float(aux[metric]), grads)
  # in the window: float32 rounding of equal models (a KL sum cancels to ~1e-9 per token);
  # beyond it the state takes over and both measures are orders of magnitude larger
  assert results[8][0] < 1e-6 and results[45][0] > 1e-4
  grads = dict(nnx.to_flat_state(results[45][1]))
  moved = {p[3:] for p in grads if p[:3] == ("blocks", 2, "attn") and p[3] in distill.KVM_ONLY
           and float(jnp.abs(grads[p][...]).max()) > 0}
  assert {("window_temperature",), ("ln_s", "bias"), ("ln_s", "scale"),
          ("state_temperature",)} <= moved
