"""Mixers as plug-ins: a kind registered from outside the package builds, counts, trains and decodes;
config files of the earlier layout (flat ``swa_*``/``bswa_*`` fields, a model-level ``kvm``) load to
the same model; what the library asks of each kind (keys per query, cache bytes) agrees with an
independent count."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.config import io as config_io
from kvm_jax.nn import KVMAttention, Mixed, SWAOptions, register_mixer, registry
from kvm_jax.nn.mixers.rwkv7 import RWKV7TimeMix
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.registry import memory_in_words
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import load_config
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.train import completep, sharding
from kvm_jax.train.loop import train
from tests.helpers import decode_all, forward

from tests.helpers import ROOT  # noqa: E402
LEGACY = ROOT / "tests" / "data" / "legacy"


class ScaledKVMAttention(KVMAttention):
  """An outside kind: KVM whose output is multiplied per head by a learned gain (one parameter
  more per query head, labelled a scalar, initialized to 2 so it changes the function)."""

  PARAM_GROUPS = {"out_gain": "scalars"}

  def __init__(self, cfg, layer, *, rngs):
    super().__init__(cfg, layer, rngs=rngs)
    self.out_gain = nnx.Param(jnp.full((cfg.num_heads,), 2.0, cfg.jnp_param_dtype))

  def mix_own(self, x, q, k, v, mixer_cache, decode, shared, documents=None):
    y, mixer_cache, exports = super().mix_own(x, q, k, v, mixer_cache, decode, shared,
                                              documents=documents)
    return Mixed(y * self.out_gain[...][:, None].astype(y.dtype), mixer_cache, exports)


register_mixer("scaled_kvm", ScaledKVMAttention)


# The outside kind's own options (not those of the model's "kvm" entry: a fixed 16-row state).
SCALED_OPTIONS = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                              budget=kj.FixedBudget(16))


def _outside_config(**kw) -> kj.ModelConfig:
  return kj.presets.tiny(mixers=("swa", "scaled_kvm"), options={"scaled_kvm": SCALED_OPTIONS},
                         **kw)


def test_outside_kind_builds_counts_and_is_its_own_function():
  cfg = _outside_config()
  model = kj.LM(cfg, rngs=nnx.Rngs(0))
  assert isinstance(model.blocks[1].attn, ScaledKVMAttention)
  assert model.blocks[1].attn.options == SCALED_OPTIONS != cfg.options_of("kvm")
  plain = kj.presets.tiny(mixers=("swa", "kvm"), options={"kvm": SCALED_OPTIONS})
  assert kj.count_params(cfg)["total"] - kj.count_params(plain)["total"] == cfg.num_heads
  # the new parameter's group and (vector) sharding come from the class
  state = nnx.state(model, nnx.Param)
  groups = {"/".join(path_names(p)): completep.group_of(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]}
  assert groups["blocks/1/attn/out_gain"] == "scalars"
  assert groups["blocks/1/attn/key_weighting/kernel"] == "matrix_params"
  # Same parameters but the gain (it draws no random key): with gain 1 the model is plain KVM,
  # with gain 2 it is not (both perturbed, so the zero-initialized output projections carry
  # signal).
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 40)))
  reference = _perturbed(kj.LM(plain, rngs=nnx.Rngs(0)))
  model = _perturbed(model)
  gain = model.blocks[1].attn.out_gain
  gain[...] = jnp.ones_like(gain[...])
  np.testing.assert_allclose(forward(model, tokens), forward(reference, tokens), rtol=1e-5,
                             atol=1e-6)
  gain[...] = 2 * jnp.ones_like(gain[...])
  assert np.abs(np.asarray(forward(model, tokens) - forward(reference, tokens))).max() > 1e-3


def test_outside_kind_trains_saves_and_decodes(tmp_path):
  cfg = TrainConfig(model=_outside_config(vocab_size=64), task="mqar",
                    mqar=MQARSpec(seq_len=32, vocab_size=64, num_pairs=4), batch_size=4,
                    steps=2, warmup_steps=1, log_every=1, eval_every=0, checkpoint_every=2)
  out = train(cfg, tmp_path / "run", verbose=False)
  assert np.isfinite(out["loss"])
  loaded = load_config(tmp_path / "run")
  assert loaded.model == cfg.model  # the outside kind's options round-trip through config.json
  model = nnx.merge(out["graphdef"], out["params"])
  # decode == forward: prefill 21 tokens (past the first state update at 16), then 4 steps
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 25)))
  decoded, _ = decode_all(model, tokens, 21)
  np.testing.assert_allclose(decoded, forward(model, tokens), rtol=2e-4, atol=2e-5)
  sequence, _ = kj.generate(model, tokens[:, :5], max_new_tokens=3, key=jax.random.PRNGKey(0),
                            sampling=kj.SamplingConfig(temperature=0.0))
  assert sequence.shape == (2, 8)
  # the engine serves its rows as generate does, prompts of two lengths at once
  ragged = [list(map(int, tokens[0, :5])), list(map(int, tokens[1, :9]))]
  alone = [kj.generate(model, jnp.asarray([p]), max_new_tokens=3, key=jax.random.PRNGKey(i),
                       sampling=kj.SamplingConfig(temperature=0.0))[0][0, len(p):].tolist()
           for i, p in enumerate(ragged)]
  assert kj.generate_many(model, ragged, max_new_tokens=3, slots=2) == alone
  # what the kind keeps beyond its window comes from its class (inherited from kvm's)
  assert memory_in_words(cfg.model, 64).endswith("state rows")
  # kvm-eval reads the run (the kind is registered in this process; --plugin does it for a shell)
  from kvm_jax.eval.cli import main as eval_main
  assert eval_main(["--checkpoint", str(tmp_path / "run"), "--suite", "mqar", "--mqar-pairs", "4",
                    "--mqar-batches", "1", "--mqar-batch-size", "2", "--out",
                    str(tmp_path / "eval")]) == 0
  results = json.loads((tmp_path / "eval" / "results.json").read_text())["results"]
  assert results[0]["mqar"], results


def test_outside_kind_is_checked_and_benchmarked_by_the_command_lines(tmp_path, capsys):
  """kvm-check --kinds and kvm-bench --models tiny-<kind> take an outside kind with no edit
  elsewhere: its checks follow from its class (decode, parallel pieces, packed documents), each
  against the model's own forward, and a planted mismatch fails them."""
  from kvm_jax.eval import check, kind_check
  from kvm_jax.eval.bench import speed
  assert check.main(["--ops", "", "--kinds", "scaled_kvm"]) == 0
  text = capsys.readouterr().out
  for pair in ("forward vs prefill+decode", "forward vs prefill+resume", "packed vs alone"):
    assert re.search(rf"kind scaled_kvm +{re.escape(pair)} .* PASS", text), (pair, text)
  with pytest.raises(SystemExit, match=r"--kinds: unknown \['mamba'\]"):
    check.main(["--kinds", "mamba"])
  out = tmp_path / "models.json"
  assert speed.main(["--phases", "", "--models", "tiny-scaled_kvm", "--model-context", "24",
                     "--decode-steps", "2", "--repeats", "1", "--json", str(out)]) == 0
  (row,) = json.loads(out.read_text())["models"]
  assert row["model"] == "tiny-scaled_kvm" and row["tokens_per_s"] > 0
  with pytest.raises(SystemExit, match="no mixer kind 'mamba'"):
    speed.main(["--phases", "", "--models", "tiny-mamba"])
  # The check can fail: a decode step that forgets its cache (a wrong step) is caught.
  original = kj.LM.decode_step
  try:
    kj.LM.decode_step = lambda self, token, caches: original(
        self, token, self.init_cache(token.shape[0], 64))
    rows = kind_check.check_kind("scaled_kvm")
  finally:
    kj.LM.decode_step = original
  assert not rows[0]["ok"] and rows[0]["output"] > 1e-2, rows[0]


def test_plugin_flag_registers_a_kind_for_the_command_line(tmp_path, subprocess_environ):
  """``kvm-train --plugin FILE`` imports a file that registers a kind before the config is read."""
  import subprocess
  import sys
  plugin = tmp_path / "wide_swa.py"
  plugin.write_text("from kvm_jax.nn import register_mixer\n"
                    "from kvm_jax.nn.mixers.swa import SlidingWindowAttention\n"
                    "class WideSWA(SlidingWindowAttention):\n"
                    "  pass\n"
                    "register_mixer('wide_swa', WideSWA)\n")
  command = [sys.executable, "-m", "kvm_jax.train.main", "--config=train/configs/tiny_mqar.py",
             f"--workdir={tmp_path / 'run'}", "--show-config", "--config.model.mixers=wide_swa"]
  env = subprocess_environ()
  refused = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
  assert refused.returncode != 0 and "unknown mixer 'wide_swa'" in refused.stderr
  shown = subprocess.run(command[:3] + [f"--plugin={plugin}"] + command[3:], capture_output=True,
                         text=True, env=env, cwd=ROOT)
  assert shown.returncode == 0, shown.stderr
  assert "model.mixers = wide_swa" in shown.stdout.splitlines()


# What a mixer class must have, written out (not read from the registry's own list).
MEMBERS = ("Options", "LOGICAL_AXES", "PARAM_GROUPS", "mup_d_in_ratios", "keys_per_query",
           "exact_window", "beyond_window", "cache_bytes", "init_cache", "init_tails",
           "anchor_value", "__call__")


def _registered_state():
  from kvm_jax.config import mixers as mixer_options
  return registry.registered_mixers(), mixer_options.mixer_kinds()


@pytest.mark.parametrize("member", MEMBERS)
def test_registry_refuses_a_class_missing_a_member(member):
  """A class with every member a mixer needs but one (copied from the KVM class, so nothing
  else is wrong) is refused, naming the member; ``__call__`` counts only when the class defines
  it (every class has its metaclass's)."""
  assert set(registry.REQUIRED) == set(MEMBERS)  # the protocol says what the tests expect
  body = {name: getattr(KVMAttention, name) for name in MEMBERS if name != member}
  incomplete = type(f"No_{member.strip('_')}", (), body)
  before = _registered_state()
  with pytest.raises(TypeError, match=rf"No_{member.strip('_')}.*lacks \['{member}'\]"):
    register_mixer("incomplete", incomplete)
  assert _registered_state() == before


def test_registry_refuses_malformed_tables_and_leaves_nothing_behind():
  """Each malformed plug-in is refused with a message naming the problem, and the refused kind
  is unknown afterwards (a half-registered kind would let ModelConfig accept a name no class
  builds)."""
  cases = {
      # another class under a taken name
      "kvm": (ScaledKVMAttention, ValueError, "'kvm' is already registered to KVMAttention"),
      # a built-in parameter given other axes, or another group
      "bad_axes": (type("BadAxes", (KVMAttention,), {"LOGICAL_AXES": {
          **KVMAttention.LOGICAL_AXES, "c_q": ("heads", "embed")}}), ValueError,
                   r"BadAxes.LOGICAL_AXES\['c_q'\] = \('heads', 'embed'\), but a registered mixer "
                   r"gives 'c_q' \('embed', 'heads'\)"),
      "bad_group": (type("BadGroup", (RWKV7TimeMix,), {"PARAM_GROUPS": {"w1": "scalars"}}),
                    ValueError, "BadGroup.PARAM_GROUPS\\['w1'\\] = 'scalars'.*name the parameter "
                                "differently"),
      # a misspelt parameter name, in either table
      "typo_group": (type("TypoGroup", (ScaledKVMAttention,), {"PARAM_GROUPS": {
          "out_gian": "scalars"}}), ValueError,
                     r"TypoGroup names parameters it does not create: PARAM_GROUPS\['out_gian'\]"),
      "typo_axes": (type("TypoAxes", (KVMAttention,), {"LOGICAL_AXES": {
          **KVMAttention.LOGICAL_AXES, "key_weightin": ("embed", "kv_heads")}}), ValueError,
                    r"LOGICAL_AXES\['key_weightin'\]"),
      # values outside the vocabularies
      "unknown_group": (type("UnknownGroup", (ScaledKVMAttention,), {"PARAM_GROUPS": {
          "out_gain": "scalar"}}), ValueError,
                        r"PARAM_GROUPS\['out_gain'\] = 'scalar' is not one of \('matrix_params'"),
      "unknown_axis": (type("UnknownAxis", (KVMAttention,), {"LOGICAL_AXES": {
          **KVMAttention.LOGICAL_AXES, "gain": ("embed", "head")}}), ValueError,
                       r"LOGICAL_AXES\['gain'\] = \('embed', 'head'\) is not a pair of"),
      "one_axis": (type("OneAxis", (KVMAttention,), {"LOGICAL_AXES": {"gain": "embed"}}),
                   ValueError, r"LOGICAL_AXES\['gain'\] = 'embed' is not a pair"),
      "not_a_table": (type("NotATable", (KVMAttention,), {"PARAM_GROUPS": ["out_gain"]}),
                      TypeError, "NotATable.PARAM_GROUPS must be a dict"),
      # options that are not a frozen dataclass; a kind that is not an identifier
      "bad_options": (type("BadOptions", (KVMAttention,), {"Options": dict}), TypeError,
                      "options of mixer 'bad_options' must be a frozen dataclass"),
      "my-kind": (type("Dashed", (KVMAttention,), {}), ValueError,
                  "mixer kind 'my-kind' must be a Python identifier"),
      "not_a_mixer": (object, TypeError, "lacks"),
  }
  for kind, (cls, error, message) in cases.items():
    before = _registered_state()
    with pytest.raises(error, match=message):
      register_mixer(kind, cls)
    assert _registered_state() == before, kind
  register_mixer("scaled_kvm", ScaledKVMAttention)  # the same class again: a no-op
  with pytest.raises(ValueError, match="unknown mixer 'kda'.*register_mixer"):
    kj.presets.tiny(mixers="kda")
  with pytest.raises(TypeError, match="options of mixer 'swa' must be a SWAOptions"):
    kj.presets.tiny(mixers="swa", options={"swa": kj.KVMConfig()})
  with pytest.raises(ValueError, match=r"options\['kvm'\].*rope_dims=4 must equal"):
    kj.presets.tiny(options={"kvm": kj.KVMConfig(chunk_size=8, rope_dims=4)})


def test_table_vocabularies_are_the_trainers():
  """The registry's axis and group names are exactly those the sharding rules and the μP scales
  know, and every built-in kind's table entries name parameters its layers create."""
  assert set(registry.LOGICAL_AXIS_NAMES) == set(sharding.LOGICAL_RULES)
  assert set(registry.PARAM_GROUP_NAMES) == set(completep.GROUPS)
  for kind, cls in registry.registered_mixers().items():
    if kind == "scaled_kvm":
      continue
    cfg = kj.ModelConfig(mixers=kind, num_layers=1)
    layer = nnx.eval_shape(lambda: cls(cfg, 0, rngs=nnx.Rngs(0)))
    owners = {str(n) for p, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param)) for n in p}
    assert set(cls.LOGICAL_AXES) | set(cls.PARAM_GROUPS) <= owners, kind


def _perturbed(model: kj.LM) -> kj.LM:
  """Every parameter plus 0.05·N(0, 1) drawn from its own path name, so the zero-initialized
  projections carry signal and the logits depend on every layer (what the legacy fixture's
  logits were computed with)."""
  graphdef, state = nnx.split(model)

  def bump(path, x):
    name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    key = jax.random.PRNGKey(zlib.crc32(name.encode()))
    return x + 0.05 * jax.random.normal(key, x.shape, x.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(bump, state))


def test_config_of_the_earlier_layout_loads_to_the_same_model(tmp_path):
  """``config_0.1.0.json`` and its logits were written by kvm_jax before the options table (the
  flat swa_window/swa_rope_dims/bswa_* fields and a model-level kvm): it loads, the options land
  where they belong, and the model computes the logits the earlier code computed."""
  run = tmp_path / "legacy"
  run.mkdir()
  shutil.copy(LEGACY / "config_0.1.0.json", run / "config.json")
  cfg = load_config(run).model
  assert cfg.options_of("swa") == SWAOptions(window=10, rope_dims=12)
  assert (cfg.options_of("bswa").chunk_size, cfg.options_of("bswa").window_chunks,
          cfg.options_of("bswa").sink_rows) == (4, 3, 2)
  assert cfg.kvm.budget == kj.SaturatingBudget(64, min_rows=4) and cfg.kvm.max_state_rows == 64
  assert cfg.rope_dims_of(0) == 12 and cfg.rope_dims_of(1) == 8
  fixture = np.load(LEGACY / "logits_0.1.0.npz")
  logits = forward(_perturbed(kj.LM(cfg, rngs=nnx.Rngs(0))), jnp.asarray(fixture["tokens"]))
  np.testing.assert_allclose(np.asarray(logits[..., :16]), fixture["logits"], rtol=1e-5,
                             atol=1e-6)
  # and the new layout writes and reads back the same config
  assert config_io.from_jsonable(json.loads(json.dumps(config_io.to_jsonable(cfg)))) == cfg


def test_config_files_carry_their_format_version(tmp_path):
  """A config file is written with the current format version and read back equal; a file of a
  newer version is refused by name; the upgrade of unversioned files applies to those only (a
  current file with a field of the old layout is refused, not silently moved)."""
  cfg = kj.presets.tiny("swa,kvm")
  path = tmp_path / "config.json"
  config_io.save(path, cfg)
  data = json.loads(path.read_text())
  assert data[config_io.FORMAT_KEY] == config_io.FORMAT_VERSION == 2
  assert config_io.load(path) == cfg
  path.write_text(json.dumps({**data, config_io.FORMAT_KEY: 3}))
  with pytest.raises(ValueError, match="format_version=3: .*newer kvm_jax"):
    config_io.load(path)
  path.write_text(json.dumps({**data, "swa_window": 5}))
  with pytest.raises(ValueError, match=r"unknown fields \['swa_window'\]"):
    config_io.load(path)
  del data[config_io.FORMAT_KEY]
  path.write_text(json.dumps({**data, "swa_window": 5}))
  assert config_io.load(path).options_of("swa").window == 5


@pytest.mark.parametrize("mixers", [("full", "swa"), ("bswa", "kvm")])
def test_keys_per_query_and_cache_bytes_match_independent_counts(mixers):
  cfg = kj.presets.tiny(mixers=mixers)
  T = 40
  # keys per query: count the visible positions of every query by brute force
  keys = registry.keys_per_query(cfg, T)
  for layer, kind in enumerate(cfg.layer_mixers):
    o = cfg.options_of(kind)
    t = np.arange(T)
    if kind == "full":
      want = np.mean(t + 1)
    elif kind == "swa":
      want = np.mean(np.minimum(t + 1, o.window))
    elif kind == "bswa":
      begin = np.maximum(0, (t // o.chunk_size - o.window_chunks + 1) * o.chunk_size)
      want = np.mean(t + 1 - begin)
    else:  # the exact window of the query's chunk plus the state rows visible to that chunk
      schedule = kj.kvm_schedule(o, T)
      c = t // o.chunk_size
      begin = np.maximum(0, (c - o.window_chunks + 1) * o.chunk_size)
      state = np.where(np.asarray(schedule.state_visible)[c],
                       np.asarray(schedule.rows_before)[c], 0)
      want = np.mean(t + 1 - begin + state)
    assert keys[layer] == pytest.approx(want), kind
  # cache bytes from shapes == bytes of the allocated caches
  model = kj.LM(cfg, rngs=nnx.Rngs(0))
  assert registry.cache_bytes(cfg, 2, 48) == tuple(model.cache_bytes(model.init_cache(2, 48)))


def test_sharding_axes_come_from_the_mixer_classes():
  cfg = kj.presets.tiny(mixers=("swa", "kvm"))
  state = nnx.state(kj.LM(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  axes = {"/".join(path_names(p)): sharding.logical_axes(p, x.ndim)
          for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
  assert axes["blocks/1/attn/key_weighting/kernel"] == ("embed", "kv_heads")
  assert axes["blocks/0/attn/c_proj/kernel"] == ("heads", "embed")
  assert axes["blocks/0/mlp/c_proj/kernel"] == ("mlp", "embed")
  assert axes["wte/embedding"] == ("vocab", "embed")


def test_command_line_overrides_reach_a_kinds_options():
  from kvm_jax.train.main import apply_override
  cfg = TrainConfig(model=kj.presets.tiny(mixers=("swa", "kvm")))
  cfg = apply_override(cfg, "model.options.kvm.chunk_size", "16")
  cfg = apply_override(cfg, "model.options.swa.window", "20")
  assert cfg.model.options_of("kvm").chunk_size == 16
  assert cfg.model.options_of("swa") == SWAOptions(window=20, rope_dims=16)
  assert cfg.model.options_of("kvm").window_chunks == 2  # the rest of the options unchanged
  # a kind with no entry yet starts from its defaults; unknown kinds and fields are named
  bswa = apply_override(TrainConfig(model=kj.ModelConfig(mixers="bswa", num_layers=1)),
                        "model.options.bswa.sink_rows", "2").model.options_of("bswa")
  assert (bswa.chunk_size, bswa.sink_rows) == (256, 2)
  with pytest.raises(SystemExit, match="unknown mixer 'nope'"):
    apply_override(cfg, "model.options.nope.window", "3")
  with pytest.raises(SystemExit, match="unknown config field 'windw'"):
    apply_override(cfg, "model.options.swa.windw", "3")


def test_exact_window_is_the_longest_exact_reach_of_any_layer():
  """MQAR's in-window / state-only split (kvm-eval): written out from TINY_OPTIONS (kvm 2 chunks
  of 8, swa 12, bswa 2 chunks of 8, ovq chunks of 8); full attention reaches every key, RWKV-7
  none."""
  want = {("kvm",): 16, ("swa",): 12, ("bswa",): 16, ("ovq",): 8, ("rwkv7",): 0,
          ("full",): None, ("swa", "ovq"): 12, ("rwkv7", "ovq"): 8, ("kvm", "full"): None,
          ("swa", "kvm"): 16}
  for mixers, window in want.items():
    assert registry.exact_window(kj.presets.tiny(mixers=",".join(mixers))) == window, mixers
  cfg = kj.presets.tiny(mixers="swa", options={"swa": SWAOptions(window=40)})
  assert registry.exact_window(cfg) == 40


def test_the_authors_rows_are_the_kinds_own():
  """The authors' names for a kind come from its own class (``AUTHORS``); a kind registered from
  outside as a subclass of one of theirs does not inherit the row (their code has no such mixer),
  so an export of it is refused by name."""
  from kvm_jax.hf.authors_config import authors_config_from_model, authors_kinds
  from kvm_jax.hf import ExportError
  rows = authors_kinds()
  assert set(rows) == {"full", "swa", "bswa", "kvm", "ovq", "rwkv7"}
  assert rows["kvm"].token_mixers[0] == "kvm" and not rows["ovq"].rotates
  cfg = kj.presets.tiny(mixers="scaled_kvm", options={"scaled_kvm": SCALED_OPTIONS})
  with pytest.raises(ExportError, match="mixer 'scaled_kvm': their code has no such mixer"):
    authors_config_from_model(cfg)


def test_a_subclass_converts_to_kvm_only_when_it_says_how():
  """A kind registered as a subclass of full attention does not inherit its conversion (its
  function may differ): it is not among the convertible kinds, and converting its layer is
  refused by name."""
  from kvm_jax.nn.convert import convertible_kinds, converted_config
  from kvm_jax.nn import FullAttention

  class PlainFull(FullAttention):
    pass

  register_mixer("plain_full", PlainFull)
  assert "plain_full" not in convertible_kinds() and "full" in convertible_kinds()
  cfg = kj.presets.tiny(mixers=("plain_full", "full"))
  with pytest.raises(ValueError, match=r"layer 0 is a 'plain_full' layer; only .* layers=\[1\]"):
    converted_config(cfg, [0])
