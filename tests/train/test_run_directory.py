"""A run directory a user cannot break, and commands that say what they do.

* A command that cannot resume the run in its workdir (another model, task, data, batch, seed or
  teacher) is refused before anything is written: every file stays byte-identical. Settings a run
  may change on resume (steps, schedule, cadence, memory settings) are applied with a notice and
  recorded in config.json's history and metrics.jsonl.
* Ctrl-C saves and stops like SIGTERM; a second one aborts at once (the end-to-end run is in
  test_train's kill/SIGTERM/SIGINT test).
* Every data source's ids are checked against the model's vocabulary before anything is built; a
  run without a checkpoint and a forward pass on no token are refused in one line.
* The one spelling of values (budget specs, mixer patterns, none, comma lists) in kvm-train's
  --config.*, kvm-eval's and kvm-convert's --kvm.*, config files and Python.
* Starts that speak, --show-config as lines, the ETA from steady steps, kvm-eval's sizes and
  output folders, distillation on the teacher's task, and ``kj.tokenizer_of``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.config import io as config_io
from kvm_jax.nn.convert import describe_kvm, parse_kvm_flags
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import config_history, load_config, load_trained
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec
from kvm_jax.train.loop import train
from kvm_jax.train.main import apply_override, main as train_main
from tests.helpers import ROOT, random_model, write_run

MQAR = MQARSpec(seq_len=32, vocab_size=64, num_pairs=4)


def _model(**fields) -> kj.ModelConfig:
  """A one-layer SWA model: the cheapest to compile."""
  return kj.presets.tiny(**{"mixers": "swa", "num_layers": 1, "vocab_size": 64, **fields})


def _cfg(**fields) -> TrainConfig:
  base = dict(model=_model(), task="mqar", mqar=MQAR, batch_size=4, steps=2, warmup_steps=1,
              log_every=1, checkpoint_every=2, eval_every=0)
  return TrainConfig(**{**base, **fields})


def _files(workdir: Path) -> dict[str, str]:
  """sha256 of every file under ``workdir``."""
  return {str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(workdir.rglob("*")) if p.is_file()}


@pytest.fixture
def saved_run(tmp_path) -> tuple[Path, TrainConfig]:
  """A run directory with a config and a checkpoint (step 0; no training, nothing compiled)."""
  cfg = _cfg()
  return write_run(tmp_path / "run", cfg, random_model(cfg.model, 1)), cfg


@pytest.mark.parametrize("change, shown", [
    (dict(model=_model(num_layers=2)), "model.num_layers: 1 → 2"),
    (dict(model=_model(mixers="kvm")), "model.mixers: 'swa' → 'kvm'"),
    (dict(task="text", seq_len=32), "task: 'mqar' → 'text'"),
    (dict(mqar=dataclasses.replace(MQAR, num_pairs=6)), "mqar.num_pairs: 4 → 6"),
    (dict(batch_size=8), "batch_size: 4 → 8"),
    (dict(seed=3), "seed: 0 → 3"),
])
def test_a_command_that_cannot_resume_is_refused_and_writes_nothing(saved_run, change, shown,
                                                                     capsys):
  workdir, cfg = saved_run
  before = _files(workdir)
  new = dataclasses.replace(cfg, **change)
  if new.task == "text":
    new = dataclasses.replace(new, model=_model(vocab_size=320))
  with pytest.raises(ValueError) as refused:
    train(new, workdir, verbose=True)
  message = str(refused.value)
  assert shown in message, message
  assert "Nothing was written" in message and "--workdir=NEW_DIR" in message
  assert f"--config.init_from={workdir}" in message
  assert _files(workdir) == before  # byte for byte
  assert "compiling" not in capsys.readouterr().out


def test_kvm_train_refuses_in_one_message(saved_run, capsys):
  workdir, _ = saved_run
  before = _files(workdir)
  flags = [f"--workdir={workdir}", "--config=train/configs/tiny_mqar.py", "--config.steps=300"]
  with pytest.raises(SystemExit) as refused:
    train_main(flags)
  text = str(refused.value)
  assert text.startswith(f"kvm-train: {workdir} holds a run (checkpoints up to step 0)")
  assert "model.hidden_size: 64 → 64" not in text and "model.num_heads: 4 → 2" in text
  assert "steps" not in text.split("Nothing was written")[0]  # steps may change: not listed
  assert _files(workdir) == before


def test_resume_with_changed_settings_is_announced_and_recorded(tmp_path, capsys):
  """A 2-step run resumed with 3 steps and another learning rate: the run says so, config.json
  keeps the change in its history (and still loads), metrics.jsonl has a line for it between the
  steps, and the start spoke before compiling: the parameter count, "compiling the train
  step...". A run with a config but no checkpoint starts afresh under any config."""
  workdir = tmp_path / "run"
  cfg = _cfg()
  train(cfg, workdir, verbose=True)
  out = capsys.readouterr().out
  lines = out.splitlines()
  count = f"{kj.count_params(cfg.model)['total']:,} parameters"
  assert count in lines[0] and lines[1] == "compiling the train step..."
  assert lines[2].startswith("compiled in ")
  train(dataclasses.replace(cfg, steps=3, learning_rate=1e-3), workdir, verbose=True)
  out = capsys.readouterr().out
  assert "resuming with changed settings: steps: 2 → 3, learning_rate: 0.003 → 0.001" in out
  change = {"step": 2, "config_changed": {"steps": [2, 3], "learning_rate": [0.003, 0.001]}}
  assert config_history(workdir) == [change]
  assert load_config(workdir).steps == 3
  records = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == [1, 2, 2, 3] and records[2] == change
  # The same command again: nothing changed, nothing added.
  train(dataclasses.replace(cfg, steps=3, learning_rate=1e-3), workdir, verbose=False)
  assert config_history(workdir) == [change]
  # A directory whose run never saved holds nothing to resume: any config starts there.
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  (fresh / "config.json").write_text((workdir / "config.json").read_text())
  other = _cfg(model=_model(hidden_size=32, num_heads=2))
  from kvm_jax.runs.resume import check_resume
  assert check_resume(other, fresh) is None


def test_first_ctrl_c_stops_after_the_step_and_the_second_aborts():
  """The hook that watches signals: a first SIGINT asks for a save and a stop after the step (as
  SIGTERM does), a second raises KeyboardInterrupt at once; closing restores the handlers."""
  from kvm_jax.train.hooks import Preemption
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  hook = Preemption()
  try:
    event = types.SimpleNamespace(done=5, preempted=False)
    hook.after_step(event)
    assert not event.preempted
    os.kill(os.getpid(), signal.SIGINT)
    hook.after_step(event)
    assert event.preempted and hook.stop == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  finally:
    hook.close()
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  hook = Preemption()
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    event = types.SimpleNamespace(done=1, preempted=False)
    hook.after_step(event)
    assert event.preempted and hook.stop == "SIGTERM"
  finally:
    hook.close()


# -- vocabulary, empty inputs, missing checkpoints ----------------------------------------------

def _shards(tmp_path) -> str:
  from kvm_jax.tasks.shards import write_shards
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  write_shards(["some text", "more text"], ByteTokenizer(), tmp_path / "shards")
  return str(tmp_path / "shards")


@pytest.mark.parametrize("source", ["text", "shards", "niah", "mqar"])
def test_data_beyond_the_vocabulary_is_refused_before_anything_is_built(tmp_path, source,
                                                                        capsys):
  """The byte tokenizer's 320 ids (text, token shards, NIAH) or an MQAR vocabulary of 300
  against a 256-id model: refused with the numbers and the fix, before a model is built, a
  program compiled or a file written."""
  model = _model(vocab_size=256)
  cfg = {"text": lambda: _cfg(model=model, task="text", seq_len=32),
         "shards": lambda: _cfg(model=model, task="text", seq_len=32, data_dir=_shards(tmp_path)),
         "niah": lambda: _cfg(model=model, task="niah", niah=NIAHSpec(seq_len=256)),
         "mqar": lambda: _cfg(model=model, mqar=dataclasses.replace(MQAR, vocab_size=300))}[source]()
  workdir = tmp_path / "run"
  with pytest.raises(ValueError, match=r"ids up to (319|299) but model.vocab_size=256: set "
                                       r"--config.model.vocab_size=(320|300)"):
    train(cfg, workdir, verbose=True)
  assert not workdir.exists() and "parameters" not in capsys.readouterr().out


def test_runs_without_a_checkpoint_and_empty_inputs_are_refused_in_one_line(tmp_path):
  from kvm_jax.eval.cli import main as eval_main
  from kvm_jax.runs.directory import save_config
  run = tmp_path / "run"
  save_config(_cfg(), run)  # a run that stopped before its first save
  for load in (load_trained, kj.load_pretrained):
    with pytest.raises(ValueError, match="holds no checkpoint: its run stopped before") as e:
      load(run)
    assert "\n" not in str(e.value)
  with pytest.raises(SystemExit, match=r"^kvm-eval: .* holds no checkpoint") as e:
    eval_main(["--checkpoint", str(run), "--suite", "mqar", "--out", str(tmp_path / "e")])
  assert "\n" not in str(e.value)
  model = random_model(_model(), 2)
  for shape in ((2, 0), (0, 5)):
    with pytest.raises(ValueError, match=r"at least one row and one token"):
      model(jnp.zeros(shape, jnp.int32))


# -- one spelling of values ---------------------------------------------------------------------

# (field, text, value): how every CLI reads a value, and what it must give.
SPELLINGS = [
    ("budget", "sqrt:8", kj.PowerLawBudget(8.0, 0.5)),
    ("budget", "fixed:64", kj.FixedBudget(64)),
    ("budget", "pow:4:0.75@16", kj.PowerLawBudget(4.0, 0.75, min_rows=16)),
    ("budget", "sat:1024@1", kj.SaturatingBudget(1024, min_rows=1)),
    ("max_state_rows", "none", None),
    ("max_state_rows", "96", 96),
    ("gate_appends", "true", True),
    ("readout_value_dtype", "bfloat16", "bfloat16"),
    ("chunk_size", "8", 8),
]


@pytest.mark.parametrize("field, text, value", SPELLINGS)
def test_kvm_options_read_alike_in_every_cli(field, text, value):
  """kvm-train's --config.model.options.kvm.FIELD and kvm-eval's / kvm-convert's --kvm.FIELD
  give the same value; a budget spec also works in Python and config files."""
  cfg = apply_override(TrainConfig(model=kj.presets.tiny()), f"model.options.kvm.{field}", text)
  assert getattr(cfg.model.options_of("kvm"), field) == value
  assert parse_kvm_flags([f"--kvm.{field}={text}"]) == {field: value}
  if field == "budget":
    assert kj.KVMConfig(budget=text).budget == value


def test_mixer_patterns_and_lists_on_the_command_line_and_in_python():
  cfg = apply_override(TrainConfig(model=kj.presets.tiny(num_layers=4, mixers="kvm")),
                       "model.mixers", "swa,kvm")
  assert cfg.model.layer_mixers == ("swa", "kvm", "swa", "kvm")
  # the pattern repeats to whatever depth comes next, in either order of the flags
  assert apply_override(cfg, "model.num_layers", "6").model.layer_mixers == ("swa", "kvm") * 3
  per_layer = apply_override(cfg, "model.mixers", "full,kvm,kvm,swa").model
  assert per_layer.layer_mixers == ("full", "kvm", "kvm", "swa")
  # one layout, one config, however it is spelled
  assert kj.ModelConfig(mixers="swa,kvm", num_layers=4, rope_dims=64) == kj.ModelConfig(
      mixers=("swa", "kvm", "swa", "kvm"), num_layers=4, rope_dims=64)
  assert kj.ModelConfig(mixers=["kvm", "kvm"], num_layers=2).mixers == "kvm"
  assert apply_override(TrainConfig(), "text_files", "a.txt,b.txt").text_files == (
      "a.txt", "b.txt")
  with pytest.raises(SystemExit, match=r"^--config.model.mixers=swa,kvm,full: .*3 entries but "
                                       r"num_layers=4.*pattern whose length divides"):
    apply_override(cfg, "model.mixers", "swa,kvm,full")
  with pytest.raises(SystemExit, match=r"^--config.model.options.kvm.budget=sqrt: budget 'sqrt' "
                                       r"is not a budget spec"):
    apply_override(cfg, "model.options.kvm.budget", "sqrt")
  # config.json keeps the pattern and reads it back
  from kvm_jax.runs.directory import TRAIN_CLASSES
  assert config_io.from_jsonable(json.loads(json.dumps(config_io.to_jsonable(cfg))),
                                 TRAIN_CLASSES) == cfg


def test_help_shows_the_spelling(capsys):
  for argv, prog in ((["--help"], train_main),):
    with pytest.raises(SystemExit):
      prog(argv)
  text = capsys.readouterr().out
  for spelling in ("sqrt:16@256", "--config.model.mixers=swa,kvm", "none for an unset"):
    assert spelling in text, spelling
  from kvm_jax.eval.cli import build_parser
  assert "sqrt:16@256" in build_parser().format_help()


# -- what a command says ------------------------------------------------------------------------

def test_show_config_prints_one_field_a_line_that_reads_back(capsys):
  assert train_main(["--config=train/configs/tiny_mqar.py", "--workdir=/nonexistent",
                     "--show-config", "--config.model.mixers=swa,kvm",
                     "--config.model.options.kvm.budget=sqrt:2@16"]) == 0
  lines = capsys.readouterr().out.splitlines()
  fields = dict(line.split(" = ", 1) for line in lines)
  assert len(fields) == len(lines) > 40 and max(map(len, lines)) < 100
  assert fields["model.mixers"] == "swa,kvm" and fields["model.options.kvm.budget"] == "sqrt:2@16"
  # every line is a valid override of the config it came from
  from kvm_jax.train.main import load_config as load_file
  cfg = load_file("train/configs/tiny_mqar.py")
  for field in ("model.mixers", "model.options.kvm.budget", "mqar.seq_len", "text_files",
                "model.num_kv_heads"):
    apply_override(cfg, field, fields[field])


def test_eta_counts_only_steady_steps(monkeypatch):
  """A first step of 100 s (compilation) then steps of 1 s: the ETA is the steady rate times the
  steps left, not the average with the compile in it; none before a steady step."""
  from kvm_jax.util import progress
  now = [0.0]
  monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
  bar = progress.ProgressBar(50, "step")
  now[0] = 100.0
  bar.steady_from(1)
  assert "ETA ?" in bar.message(1)
  now[0] = 110.0
  assert bar.eta(11) == pytest.approx(39.0)
  assert "ETA 39s" in bar.message(11)


def test_kvm_eval_sizes_folders_and_schedule(tmp_path, capsys):
  from kvm_jax.eval import cli
  args = types.SimpleNamespace(niah_lengths=None, niah_depths=None, niah_tasks=["niah_single_1"],
                               niah_gen_tokens=32, out=None, checkpoint=[str(tmp_path)])
  cli.resolve_niah_sizes(args, "cpu")
  assert (args.niah_lengths, args.niah_depths) == ([512, 1024, 2048], 5)
  assert "15 generations" in cli.niah_plan(args) and "--niah-lengths" in cli.niah_plan(args)
  gpu = types.SimpleNamespace(niah_lengths=[1024], niah_depths=None)
  cli.resolve_niah_sizes(gpu, "gpu")
  assert (gpu.niah_lengths, gpu.niah_depths) == ([1024], 40)
  first = cli.output_dir(args)
  first.mkdir(parents=True)
  second = cli.output_dir(args)
  assert first.parent == second.parent == tmp_path / "eval" and first != second
  (first / "results.json").write_text("{}")
  assert cli.output_dir(types.SimpleNamespace(out=str(first))) == first
  assert "holds an earlier evaluation; its results are replaced" in capsys.readouterr().out
  kvm = describe_kvm(kj.KVMConfig(chunk_size=16, rope_dims=8, budget="sqrt:4@8"))
  res = {"model": "m", "mixers": ["kvm"], "parameters": 1, "kvm": kvm,
         "kvm_overrides": {"chunk_size": 16}}
  assert ("- m: KVM schedule: budget sqrt:4@8, window 2 chunks of 16 tokens, 1 sink row(s), "
          "max_state_rows None (set for this evaluation: chunk_size=16)"
          in cli.markdown_report([res]))


def test_distillation_takes_the_teachers_task(tmp_path, capsys):
  """train/configs/distill.py on an MQAR teacher trains on the teacher's MQAR task, spec and all,
  unless --config.task says otherwise; without a teacher the task is refused by name."""
  teacher_cfg = _cfg(mqar=MQARSpec(seq_len=48, vocab_size=64, num_pairs=5))
  teacher = write_run(tmp_path / "teacher", teacher_cfg, random_model(teacher_cfg.model, 1))
  flags = ["--config=train/configs/distill.py", f"--workdir={tmp_path / 'student'}",
           f"--config.teacher={teacher}", "--show-config"]
  assert train_main(flags) == 0
  fields = dict(l.split(" = ", 1) for l in capsys.readouterr().out.splitlines())
  assert (fields["task"], fields["mqar.seq_len"], fields["mqar.num_pairs"]) == ("mqar", "48", "5")
  assert train_main(flags + ["--config.task=text"]) == 0
  assert dict(l.split(" = ", 1) for l in capsys.readouterr().out.splitlines())["task"] == "text"
  with pytest.raises(SystemExit, match="task='teacher' trains on the teacher run's task, but no "
                                       "teacher is set"):
    train_main(flags[:2] + ["--show-config"])


def test_tokenizer_of_a_run(tmp_path, saved_run):
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  workdir, _ = saved_run
  assert isinstance(kj.tokenizer_of(workdir), ByteTokenizer)  # the run names none: bytes
  missing = _cfg(task="text", tokenizer_file=str(tmp_path / "gone.json"),
                 model=_model(vocab_size=320))
  write_run(tmp_path / "text", missing, random_model(missing.model, 1))
  with pytest.raises(ValueError, match="gone.json, which does not exist"):
    kj.tokenizer_of(tmp_path / "text")
  authors = ROOT / "tests" / "data" / "authors" / "full_bswa"
  with pytest.raises(ValueError, match="holds no tokenizer.json"):
    kj.tokenizer_of(authors)
