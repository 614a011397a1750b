"""Changing a trained model's memory: ``kj.with_kvm`` (test-time schedules), ``kj.convert_to_kvm``
and ``kvm-convert`` (attention layers made KVM layers), ``kvm-eval --kvm.FIELD / --budget-sweep``.

The oracle of a conversion is the source model itself: inside the exact window a KVM layer is
causal softmax attention (docs/kvm-spec.md §6.5), so the converted logits must equal the source's
there (float32; both run the same front end, the only difference is the attention kernel's
summation order, ~1e-6) and must differ beyond it, where the state is read. The oracle of a
test-time schedule is ``kj.kvm_schedule``: the state rows a prefill leaves in the cache.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.config.budget import parse_budget
from kvm_jax.nn.convert import KVM_ONLY_PARAMS, new_parameter_paths, parse_kvm_flags, select_layers
from kvm_jax.hf.cli import convert_main
from kvm_jax.nn.mixers.bswa import BSWAOptions
from kvm_jax.runs.directory import CONVERSION_RECORD, load_trained
from tests.helpers import model_logits, random_model, write_run
from tests.helpers.reports import check_eval_report, check_sweep_report

# Tiny geometry: window L = 2 chunks of 4 = 8 tokens, sequences of 24 (4 chunks beyond it).
KVM = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=8,
                   budget=kj.PowerLawBudget(2.0, 0.5, min_rows=4))
T = 24
# float32, same front end; the window's attention kernel sums in another order than full
# attention's (measured ~5e-7).
IN_WINDOW_TOL = 1e-5


def _source(mixers, **overrides):
  options = {"bswa": BSWAOptions(chunk_size=4, window_chunks=2, sink_rows=0)}
  fields = dict(vocab_size=64, num_layers=len(mixers), hidden_size=32, num_heads=2, rope_dims=8,
                mup_base_dim=32)
  cfg = kj.presets.tiny(mixers=mixers, options=options, **{**fields, **overrides})
  return random_model(cfg, seed=3)


def _flat(model):
  return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(model))}


TOKENS = np.random.default_rng(0).integers(0, 64, (2, T))


@pytest.mark.parametrize("mixers, layers, converted", [
    (("full", "full", "full"), "all", ("kvm", "kvm", "kvm")),
    (("full", "full", "full"), "odd", ("full", "kvm", "full")),
    (("full", "bswa", "full"), "1", ("full", "kvm", "full")),   # BSWA: same window + a state
])
def test_conversion_keeps_parameters_and_logits_inside_the_window(mixers, layers, converted):
  source = _source(mixers)
  model = kj.convert_to_kvm(source, layers, KVM)
  assert model.cfg.layer_mixers == converted
  before, after = _flat(source), _flat(model)
  for path, value in before.items():  # every source parameter, bit for bit
    assert np.array_equal(after[path], value), path
  new = new_parameter_paths(model, source)
  assert {p[3:] for p in new} == set(KVM_ONLY_PARAMS)
  assert {p[1] for p in new} == {i for i, k in enumerate(converted) if k != mixers[i]}
  ref, out = model_logits(source, TOKENS), model_logits(model, TOKENS)
  L = KVM.window_len
  np.testing.assert_allclose(out[:, :L], ref[:, :L], rtol=0, atol=IN_WINDOW_TOL)
  # Beyond the window the state is read: every later position moves.
  assert np.abs(out[:, L:] - ref[:, L:]).max(axis=(0, 2)).min() > 1e-4


def test_new_parameters_start_at_their_literal_values_and_meanings():
  """Each new parameter of a converted layer, by value (written out here, not read from the
  conversion's own table), and what it means: the merge gate 1 + ELU(x W_g) is exactly 1 on any
  input, both key temperatures exactly 1, and LN_s a plain normalization without scale or shift.
  Layers that were not converted get nothing new."""
  source = _source(("full", "full", "full"))
  model = kj.convert_to_kvm(source, "0,2", KVM)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 5, 32)) * 3, jnp.float32)
  keys = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 16)) * 2 + 1, jnp.float32)
  for i in (0, 2):
    attn = model.blocks[i].attn
    assert np.array_equal(attn.ln_s.scale[...], np.ones(16, np.float32))
    assert np.array_equal(attn.ln_s.bias[...], np.zeros(16, np.float32))
    assert np.array_equal(attn.key_weighting.kernel[...], np.zeros((32, 2), np.float32))
    assert np.array_equal(attn.window_temperature[...], np.ones(2, np.float32))
    assert np.array_equal(attn.state_temperature[...], np.ones(2, np.float32))
    assert np.array_equal(attn.merge_gate(x), np.ones((2, 5, 2), np.float32))
    params = attn.kvm_params()
    assert np.array_equal(params.window_temperature, [1.0, 1.0])
    assert np.array_equal(params.state_temperature, [1.0, 1.0])
    plain = (keys - keys.mean(-1, keepdims=True)) / jnp.sqrt(keys.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(attn.ln_s(keys), plain, rtol=1e-5, atol=1e-6)
  assert not hasattr(model.blocks[1].attn, "ln_s")


def test_default_options_of_a_conversion():
  """Without options a conversion takes the model's recorded kvm options (here the tiny preset's:
  C = 8, L = 16, 4·√N rows, at least 8, one sink) with the model's rotary width and, for a bswa
  layer, that layer's chunk geometry (chunks of 4, 2 in the window; the sink rows capped below
  the chunk)."""
  source = _source(("full", "bswa"), rope_dims=4)
  assert kj.convert_to_kvm(source, "0").cfg.kvm == kj.KVMConfig(
      chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=4,
      budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))
  assert kj.convert_to_kvm(_source(("bswa", "bswa"), rope_dims=4), "all").cfg.kvm == kj.KVMConfig(
      chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=4,
      budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))


@pytest.mark.parametrize("layers", ["all", "1"])
def test_converted_model_beyond_the_window_is_the_reference_kvm_model(layers):
  """Beyond the window a converted model is a KVM model in every respect: its logits equal the
  independent float64 model of tests/helpers/reference_model.py (written from docs/kvm-spec.md) run with
  the converted parameters and options, at every position of 45 tokens (window L = 16; the state
  grows, appends and merges, and routing must skip the sink). With its new parameters at their
  starting values the state changes the logits there."""
  from tests.helpers.reference_model import lm_logits
  from tests.helpers.reference_cases import (REL_TOL, check_kvm_coverage, reference_config,
                                             reference_params, routing_tokens)
  source = random_model(kj.presets.tiny(mixers="full"), seed=11)
  model = kj.convert_to_kvm(source, layers)
  tokens = routing_tokens(model.cfg.vocab_size)
  log = []
  want = lm_logits(reference_params(model), reference_config(model.cfg), tokens, log)
  check_kvm_coverage(log, model.cfg.kvm.chunk_size)
  got = model_logits(model, tokens)
  np.testing.assert_allclose(got, want, rtol=0, atol=REL_TOL * np.abs(want).max())
  L = model.cfg.kvm.window_len
  assert np.abs(got[:, L:] - model_logits(source, tokens)[:, L:]).max() > 1e-3


def test_conversion_keeps_value_anchors():
  """Converting layer 1 of an all-full model would anchor it on itself (each kind on its first
  layer); the conversion keeps layer 0's anchor for every layer instead."""
  source = _source(("full", "full"))
  model = kj.convert_to_kvm(source, [1], KVM)
  assert model.cfg.share_value_anchor and not source.cfg.share_value_anchor
  assert [model.cfg.value_anchor(i) for i in range(2)] == [0, 0]


def test_conversion_refuses_by_name():
  hybrid = _source(("full", "ovq"))
  with pytest.raises(ValueError, match=r"layer 1 is a 'ovq' layer.*layers=\[0\]"):
    kj.convert_to_kvm(hybrid, "all", KVM)
  with pytest.raises(ValueError, match="layer 1 is a swa layer rotating 16 channels"):
    kj.convert_to_kvm(_source(("full", "swa")), "1", KVM)
  bswa = _source(("bswa", "full"))
  with pytest.raises(ValueError, match="bswa layer of 2 chunks of 4 tokens.*chunk_size=4"):
    kj.convert_to_kvm(bswa, "0", dataclasses.replace(KVM, chunk_size=8))
  with pytest.raises(ValueError, match=r"outside the model's layers 0\.\.1"):
    kj.convert_to_kvm(bswa, "0,2", KVM)
  with pytest.raises(ValueError, match="give 'all', 'odd', 'even'"):
    select_layers("first", 2)
  with pytest.raises(ValueError, match="rope_dims"):  # the model's rotary width is fixed
    kj.convert_to_kvm(bswa, "1", {"rope_dims": 4})


def test_with_kvm_follows_kvm_schedule_and_shares_parameters():
  model = kj.convert_to_kvm(_source(("full", "full")), "all", KVM)
  tokens = jnp.asarray(TOKENS)
  for budget in ("fixed:5", kj.SaturatingBudget(9, min_rows=4)):
    new = kj.with_kvm(model, budget=budget, max_state_rows=11)
    want = kj.kvm_schedule(new.cfg.kvm, T).final_rows
    _, caches = jax.jit(lambda m, t, c: m.prefill(t, c))(new, tokens, new.init_cache(2, T))
    assert [np.asarray(c.mixer.state.num_rows).tolist() for c in caches] == [[want] * 2] * 2, budget
    assert new.cfg.kvm.max_state_rows == 11
  geometry = kj.with_kvm(model, chunk_size=8, window_chunks=3, sink_rows=2)
  assert (geometry.cfg.kvm.window_len, geometry.cfg.kvm.sink_rows) == (24, 2)
  for path, value in _flat(model).items():  # the same parameters
    assert np.array_equal(_flat(geometry)[path], value)
  # A 24-token window covers the whole sequence: causal attention, i.e. the source model.
  np.testing.assert_allclose(model_logits(geometry, TOKENS),
                             model_logits(_source(("full", "full")), TOKENS), atol=IN_WINDOW_TOL)


def test_with_kvm_refuses_by_name():
  model = kj.convert_to_kvm(_source(("full", "full")), "all", KVM)
  with pytest.raises(ValueError, match="rope_dims cannot change"):
    kj.with_kvm(model, rope_dims=4)
  with pytest.raises(ValueError, match="head_temperatures cannot change"):
    kj.with_kvm(model, head_temperatures=False)
  with pytest.raises(ValueError, match=r"unknown KVMConfig field\(s\) \['budgett'\]"):
    kj.with_kvm(model, budgett="fixed:4")
  with pytest.raises(ValueError, match="removes .* W_g"):
    kj.with_kvm(model, gate_keys=False, gate_values=False)
  with pytest.raises(ValueError, match="sink_rows=4 must be < chunk_size=4"):
    kj.with_kvm(model, sink_rows=4)
  with pytest.raises(ValueError, match="no kvm layers"):
    kj.with_kvm(_source(("full", "full")), budget="fixed:4")
  with pytest.raises(ValueError, match="not a budget spec"):
    parse_kvm_flags(["--kvm.budget=sqrt"])
  assert parse_kvm_flags(["--kvm.max_state_rows=none", "--kvm.gate_appends=true"]) == {
      "max_state_rows": None, "gate_appends": True}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """A run directory of the default job's full-attention model (random parameters, MQAR)."""
  from kvm_jax.runs.train_config import TrainConfig
  from kvm_jax.tasks.mqar import MQARSpec
  from kvm_jax.train.demo import model_configs
  cfg = TrainConfig(model=model_configs()["full"], task="mqar",
                    mqar=MQARSpec(seq_len=64, vocab_size=64, num_pairs=8))
  return write_run(tmp_path_factory.mktemp("full") / "full", cfg, random_model(cfg.model, 7))


def test_kvm_convert_cli_writes_a_run_directory(full_run, tmp_path, capsys):
  dest = tmp_path / "converted"
  assert convert_main([str(full_run), str(dest), "--layers", "odd", "--kvm.budget=fixed:12"]) == 0
  assert "layers [1] are kvm" in capsys.readouterr().out
  record = json.loads((dest / CONVERSION_RECORD).read_text())
  assert record["layers"] == [1] and record["kvm"]["budget"] == "fixed:12"
  cfg, model, step = load_trained(dest)
  _, source, _ = load_trained(full_run)
  assert step == 0 and cfg.task == "mqar" and model.cfg.layer_mixers == ("full", "kvm")
  L = model.cfg.kvm.window_len
  tokens = np.random.default_rng(1).integers(0, 64, (2, 40))
  np.testing.assert_allclose(model_logits(model, tokens)[:, :L],
                             model_logits(source, tokens)[:, :L], atol=IN_WINDOW_TOL)
  # A converted directory is a starting point, not a run to resume.
  from kvm_jax.train.start import check_workdir
  with pytest.raises(ValueError, match="written by kvm-convert"):
    check_workdir(cfg, dest)
  assert convert_main([str(full_run), str(dest)]) == 2  # DEST exists
  assert "exists and is not empty" in capsys.readouterr().err
  assert convert_main([str(full_run), str(tmp_path / "x"), "--kvm.bogus=1"]) == 2
  assert "KVMConfig has no field 'bogus'" in capsys.readouterr().err


def test_kvm_eval_budget_sweep_and_override(full_run, tmp_path):
  from kvm_jax.eval import cli
  converted = tmp_path / "runs" / "kvm"
  assert convert_main([str(full_run), str(converted)]) == 0
  out = tmp_path / "eval"
  args = ["--checkpoint", str(tmp_path / "runs"), "--suite", "mqar", "--mqar-pairs", "8",
          "--mqar-batches", "1", "--mqar-batch-size", "8", "--out", str(out)]
  # A sweep with another window for every budget: --kvm.FIELD applies under each.
  assert cli.main(args + ["--budget-sweep", "fixed:8,sqrt:4@8", "--kvm.chunk_size=16"]) == 0
  results = json.loads((out / "results.json").read_text())["results"]
  rows = {r["budget"]: r["state_rows"] for r in results}
  cfg = dataclasses.replace(load_trained(converted)[0].model.kvm, chunk_size=16)
  for spec in ("fixed:8", "sqrt:4@8"):
    new = dataclasses.replace(cfg, budget=parse_budget(spec))
    assert rows[spec] == kj.state_rows_after(new, 64)
  assert {r["kvm"]["chunk_size"] for r in results} == {16}
  assert {r["mqar"]["window"] for r in results} == {32}
  report = (out / "report.md").read_text()
  assert "## Test-time budgets" in report and "| kvm | sqrt:4@8 |" in report
  check_eval_report(report, results)
  check_sweep_report(report, results)
  assert (out / "budget_sweep.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(SystemExit):
    cli.main(args + ["--kvm.rope_dims=4"])


def test_authors_checkpoint_converts_and_matches_their_logits_inside_the_window(tmp_path):
  """The authors'-format fixture (a BSWA/full hybrid their code wrote, with the logits their code
  computed): its full layer converted with a 16-token window gives, inside the window, the
  logits of their model; beyond it the state changes them."""
  from kvm_jax.runs.conversion import write_converted
  from tests.helpers import DATA, FLOAT32_TOL
  source_dir = DATA / "authors" / "full_bswa"
  ref = np.load(source_dir / "reference.npz")
  dest = write_converted(source_dir, tmp_path / "converted", layers="1", numerics="float32",
                         kvm={"chunk_size": 8}, progress=False)
  _, model, _ = load_trained(dest)
  assert model.cfg.layer_mixers == ("bswa", "kvm") and model.cfg.kvm.window_len == 16
  source = kj.load_pretrained(source_dir, numerics="float32", progress=False)
  out, src = model_logits(model, ref["tokens"]), model_logits(source, ref["tokens"])
  want = ref["logits_float32"]  # their model with its bfloat16 casts off: our float32 numerics
  np.testing.assert_allclose(out[:, :16], src[:, :16], rtol=0, atol=IN_WINDOW_TOL)
  np.testing.assert_allclose(out[:, :16], want[:, :16], rtol=0,
                             atol=FLOAT32_TOL * np.abs(want).max())
  assert np.abs(out[:, 16:] - src[:, 16:]).max(axis=(0, 2)).min() > 1e-4


def test_the_kinds_that_convert_are_those_that_say_how():
  """A kind converts when its class says what conversion asks of the KVM options
  (``kvm_conversion``): the three softmax kinds; not kvm itself nor the recurrent baselines."""
  from kvm_jax.nn.convert import convertible_kinds
  kinds = set(convertible_kinds())
  assert {"full", "swa", "bswa"} <= kinds and not kinds & {"kvm", "ovq", "rwkv7"}
