"""How ``--config.FIELD=VALUE`` spells a value of every type (``config_io.parse_value``, the one
reader of every CLI), and that what ``--show-config`` prints reads back to the same config.

* Booleans: exactly true/false, 1/0, yes/no in any case; anything else is refused, naming it.
* Integers and floats: what Python's int and float read (signs, underscores, exponents for a
  float); an integer field refuses "1.5" and "1e3", naming the value.
* Optional fields: none (any case) unsets; else a number is a number and other text is text.
* Sequences: a comma list (blanks around entries and empty entries dropped), one element, an
  empty one, or a Python literal; the element type is the current elements'.
* Budgets: every spec form, and a budget's text reading back to the same budget.
* Round trip: every field of the shipped configs and of every preset model, written by
  ``value_text`` and read by ``apply_override``, gives the same config; so does each line of a
  real ``--show-config``. Nothing is compiled.
"""

from __future__ import annotations

import dataclasses

import pytest

import kvm_jax as kj
import kvm_jax.nn  # registers the backbone families  # noqa: F401
from kvm_jax.config import budget as budget_lib
from kvm_jax.config import io as config_io
from kvm_jax.config.io import parse_value, value_text
from kvm_jax.config.mixers import KindOptions
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train.main import apply_override, load_config, main as train_main

TRUE, FALSE = ("true", "True", "TRUE", "1", "yes", "Yes", "YES"), ("false", "False", "0", "no",
                                                                  "NO")


@pytest.mark.parametrize("current", [True, False])
def test_booleans(current):
  """Every documented spelling gives its value whatever the current one; others are refused."""
  for text in TRUE:
    assert parse_value(current, text) is True, text
  for text in FALSE:
    assert parse_value(current, text) is False, text
  for text in ("t", "f", "on", "off", "2", "-1", "", " true", "truee", "none"):
    with pytest.raises(ValueError, match=rf"^expected true or false, got {text!r}$"):
      parse_value(current, text)


def test_a_boolean_flag_reaches_the_field_and_a_bad_one_names_the_flag():
  cfg = TrainConfig(model=kj.presets.tiny())
  for text, value in (("false", False), ("yes", True), ("0", False)):
    assert apply_override(cfg, "model.options.kvm.gate_keys", text).model.options_of(
        "kvm").gate_keys is value
  with pytest.raises(SystemExit, match=r"^--config.model.family_options.value_residual=on: "
                                       r"expected true or false, got 'on'$"):
    apply_override(cfg, "model.family_options.value_residual", "on")


def test_integers_and_floats():
  for text, value in (("12", 12), ("-1", -1), ("+3", 3), ("0", 0), ("1_000", 1000),
                      (" 7 ", 7)):
    got = parse_value(5, text)
    assert got == value and type(got) is int, text
  for text in ("1.5", "1e3", "", "ten", "0x10", "none", "True"):
    with pytest.raises(ValueError, match=rf"^expected an integer, got {text!r}$"):
      parse_value(5, text)
  for text, value in (("3e-3", 3e-3), ("1", 1.0), (".5", 0.5), ("-0.25", -0.25),
                      ("1_000.5", 1000.5), ("1E2", 100.0)):
    got = parse_value(0.1, text)
    assert got == value and type(got) is float, text
  for text in ("", "1/2", "one", "none"):
    with pytest.raises(ValueError, match=rf"^expected a number, got {text!r}$"):
      parse_value(0.1, text)
  with pytest.raises(SystemExit, match=r"^--config.batch_size=1.5: expected an integer, got "
                                       r"'1.5'$"):
    apply_override(TrainConfig(), "batch_size", "1.5")


def test_text_is_taken_as_written():
  """A text field keeps every character (a file name with commas, "none" as a value)."""
  for text in ("a,b.txt", "none", "", " spaced ", "1.5"):
    assert parse_value("x", text) == text
  assert apply_override(TrainConfig(), "remat", "none").remat == "none"


def test_optional_fields():
  """An unset field reads none as unset, a number as a number, other text as text."""
  for text in ("none", "None", "NONE"):
    assert parse_value(None, text) is None
  for text, value in (("96", 96), ("-2", -2), ("1.5", 1.5), ("bfloat16", "bfloat16"),
                      ("True", True)):
    got = parse_value(None, text)
    assert got == value and type(got) is type(value), text
  model = TrainConfig(model=kj.presets.tiny())
  kvm = lambda cfg: cfg.model.options_of("kvm")
  assert kvm(apply_override(model, "model.options.kvm.max_state_rows", "96")).max_state_rows == 96
  assert kvm(apply_override(model, "model.options.kvm.readout_value_dtype", "bfloat16")
             ).readout_value_dtype == "bfloat16"
  assert apply_override(model, "model.num_kv_heads", "2").model.num_kv_heads == 2


def test_sequences():
  """A comma list in the current elements' type; one element, none, a literal."""
  for text, value in (("a.txt,b.txt", ("a.txt", "b.txt")), ("a.txt", ("a.txt",)), ("", ()),
                      (" a.txt , b.txt ", ("a.txt", "b.txt")), ("a,,b,", ("a", "b")),
                      ("['a', 'b']", ("a", "b")), ("('a',)", ("a",))):
    assert parse_value(("x.txt",), text) == value, text
  assert parse_value((1, 2), "3,4,5") == (3, 4, 5)
  assert parse_value((1, 2), "7") == (7,)
  assert parse_value((0.5,), "1,2.5") == (1.0, 2.5)
  assert parse_value((), "0,2") == (0, 2)  # an empty sequence: whole numbers are ints
  assert parse_value((), "a.txt,b.txt") == ("a.txt", "b.txt")
  cfg = TrainConfig()
  assert apply_override(cfg, "text_files", "a.txt").text_files == ("a.txt",)
  assert apply_override(cfg, "text_files", "").text_files == ()
  gemma = TrainConfig(model=kj.presets.tiny(mixers="full", family="gemma", num_layers=4))
  assert apply_override(gemma, "model.family_options.local_layers",
                        "0,2").model.family_options.local_layers == (0, 2)


def test_mixers_one_per_layer_or_a_pattern():
  """One kind, one per layer, or a pattern repeated to the depth; a list that neither fits nor
  repeats is refused naming the flag."""
  cfg = TrainConfig(model=kj.presets.tiny(num_layers=4))
  layers = lambda text: apply_override(cfg, "model.mixers", text).model.layer_mixers
  assert layers("swa") == ("swa",) * 4
  assert layers("swa,kvm") == ("swa", "kvm") * 2
  assert layers("kvm,swa,swa,full") == ("kvm", "swa", "swa", "full")
  with pytest.raises(SystemExit, match=r"^--config.model.mixers=swa,kvm,full: "):
    layers("swa,kvm,full")


BUDGETS = [
    ("fixed:256", budget_lib.FixedBudget(256)),
    ("sqrt:16@256", budget_lib.PowerLawBudget(16.0, 0.5, min_rows=256)),
    ("sqrt:8", budget_lib.PowerLawBudget(8.0, 0.5)),
    ("pow:4:0.75", budget_lib.PowerLawBudget(4.0, 0.75)),
    ("pow:2.5:0.25@8", budget_lib.PowerLawBudget(2.5, 0.25, min_rows=8)),
    ("sat:1024@1", budget_lib.SaturatingBudget(1024, min_rows=1)),
    ("sat:64", budget_lib.SaturatingBudget(64)),
]


@pytest.mark.parametrize("text, budget", BUDGETS, ids=[t for t, _ in BUDGETS])
def test_budget_specs_read_and_write_back(text, budget):
  current = budget_lib.FixedBudget(1)
  assert parse_value(current, text) == budget
  assert parse_value(None, text, "budget") == budget  # an unset budget field reads a spec too
  assert config_io.budget_text(budget) == text
  cfg = apply_override(TrainConfig(model=kj.presets.tiny()), "model.options.kvm.budget", text)
  assert cfg.model.options_of("kvm").budget == budget
  assert config_io.flat_fields(cfg)["model.options.kvm.budget"] == text


def test_a_budget_its_spec_cannot_hold_is_written_exactly():
  """A factor past the spec's 6 digits, or a rounding: two budgets that differ never print (or
  compare, on resume) alike."""
  fine = budget_lib.PowerLawBudget(16.123456789, 0.5)
  rounded = budget_lib.PowerLawBudget(16.0, 0.5, round_down=8)
  for budget in (fine, rounded):
    assert config_io.budget_text(budget) != config_io.budget_text(
        budget_lib.PowerLawBudget(16.1235 if budget is fine else 16.0, 0.5))
  model = lambda budget: TrainConfig(model=kj.presets.tiny(options={"kvm": dataclasses.replace(
      kj.presets.TINY_OPTIONS["kvm"], budget=budget)}))
  from kvm_jax.runs.resume import config_differences
  assert [d.field for d in config_differences(model(budget_lib.PowerLawBudget(16.1235, 0.5)),
                                              model(fine))] == ["model.options.kvm.budget"]
  for spec in ("sqrt", "sqrt:", "fixed:8@2", "pow:4", "sat:1.5", "log:2"):
    with pytest.raises(ValueError, match=rf"^budget {spec!r}"):
      parse_value(budget_lib.FixedBudget(1), spec)


def _value_at(cfg, dotted: str):
  """The value (a config object, not its JSON form) of field ``dotted``."""
  value = cfg
  for name in dotted.split("."):
    value = value[name] if isinstance(value, KindOptions) else getattr(value, name)
  return value


def _configs() -> dict[str, TrainConfig]:
  """The shipped config files and a TrainConfig of every preset model (one per size)."""
  configs = {name: load_config(f"train/configs/{name}.py")
             for name in ("tiny_mqar", "tiny_text", "paper_120m")}
  configs["distill"] = load_config("train/configs/distill.py:attention")
  configs["pretrained"] = load_config("train/configs/pretrained.py:qwen3_0_6b")
  for name, preset in kj.presets.PRESETS.items():
    if name.endswith("_120m"):
      configs[name] = TrainConfig(model=preset())
  for name, shape in kj.presets.PRETRAINED_SHAPES.items():
    configs[name] = TrainConfig(model=shape())
  configs["gemma-tiny"] = TrainConfig(model=kj.presets.tiny(
      mixers="full", family="gemma", num_layers=4,
      family_options=dict(local_layers=(0, 2), attention_softcap=50.0)))
  return configs


def test_every_field_of_every_shipped_config_reads_back_from_its_text():
  """parse_value(value, value_text(value)) is the value itself, for every field; and setting
  every field from that text leaves the whole config unchanged."""
  for name, cfg in _configs().items():
    same = cfg
    for field, shown in config_io.flat_fields(cfg).items():
      value = _value_at(cfg, field)
      text = value_text(shown)
      back = parse_value(value, text, field.rsplit(".", 1)[-1])
      assert back == value and type(back) is type(value), (name, field, text, back)
      same = apply_override(same, field, text)
    assert same == cfg, name


def test_show_config_reads_back_to_the_same_config(capsys):
  """Each line of kvm-train --show-config, given back as --config.FIELD=VALUE to the bare config
  file, rebuilds the config it showed."""
  flags = ["--config.model.mixers=swa,kvm", "--config.model.options.kvm.budget=pow:2.5:0.25@8",
           "--config.text_files=a.txt", "--config.model.num_kv_heads=2", "--config.seed=-3"]
  assert train_main(["--config=train/configs/tiny_text.py", "--workdir=/nonexistent",
                     "--show-config", *flags]) == 0
  lines = capsys.readouterr().out.splitlines()
  shown = dict(line.split(" = ", 1) for line in lines)
  cfg = load_config("train/configs/tiny_text.py")
  for field, text in shown.items():
    cfg = apply_override(cfg, field, text)
  expected = load_config("train/configs/tiny_text.py")
  for flag in flags:
    expected = apply_override(expected, *flag[len("--config."):].split("=", 1))
  assert cfg == expected
  assert expected.seed == -3 and expected.text_files == ("a.txt",)


def test_none_unsets_an_optional_field_that_holds_a_value():
  """``none`` reads as None for a field whose annotation admits None, whatever value the config
  gives it (a config file's ``max_state_rows=64`` can be unset from the command line), in
  ``kvm-train --config`` and ``--kvm`` alike; a text field that is not optional keeps the word."""
  from kvm_jax.nn.convert import parse_kvm_value
  tiny = kj.presets.tiny(mixers="kvm")
  capped = dataclasses.replace(tiny.options_of("kvm"), max_state_rows=64)
  model = dataclasses.replace(tiny, options=tiny.options.set("kvm", capped))
  cfg = TrainConfig(model=model, remat="block")
  unset = apply_override(cfg, "model.options.kvm.max_state_rows", "none")
  assert unset.model.options_of("kvm").max_state_rows is None
  assert apply_override(cfg, "model.options.kvm.max_state_rows", "NONE").model.options_of(
      "kvm").max_state_rows is None
  assert apply_override(cfg, "remat", "none").remat == "none"  # a text field: the word itself
  assert parse_kvm_value("max_state_rows", "none") is None
  assert parse_kvm_value("max_state_rows", "32") == 32
