"""kvm-eval: NIAH scoring with oracle "models", the report layout, run directories (config.json
round trips, restored parameters), the NIAH training stream, and the CLI end to end."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.config import io as config_io
from kvm_jax.eval import cli
from kvm_jax.eval import niah as niah_eval
from kvm_jax.runs import TRAIN_CLASSES, Checkpointer, TrainConfig, load_trained, save_config
from kvm_jax.tasks import mqar, niah
from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.tokenizers import ByteTokenizer
from kvm_jax.train import train
from tests.helpers import random_model
from tests.helpers.reports import check_eval_report

TOK = ByteTokenizer()
COUNT = lambda text: len(TOK.encode(text))


def _needle_reader(prompt: str, length: int) -> str:
  """An oracle that reads the needle's value out of the prompt, as a perfect model would."""
  return " " + re.search(r" is: (\S+)\.", prompt).group(1) + "."


@pytest.mark.parametrize("task", niah.TASKS)
def test_niah_oracle_scores_100_and_silence_scores_0(task):
  kw = dict(tasks=[task], lengths=[600, 900], depths=niah_eval.pick_depths(5),
            generation_budget=16)
  perfect = niah_eval.run_niah(_needle_reader, COUNT, **kw)
  silent = niah_eval.run_niah(lambda prompt, length: "", COUNT, **kw)
  assert [r["score"] for r in perfect] == [100.0, 100.0]
  assert [r["score"] for r in silent] == [0.0, 0.0]
  assert all(r["examples"] == 5 and len(r["hits"]) == 5 for r in perfect)


def test_pick_depths_spans_the_range():
  np.testing.assert_array_equal(niah_eval.pick_depths(40), niah.DEPTHS)
  assert niah_eval.pick_depths(2).tolist() == [0.0, 100.0]
  with pytest.raises(ValueError, match="--niah-depths"):
    niah_eval.pick_depths(41)


def test_markdown_report_layout():
  results = [
      {"model": "kvm-a", "mixers": ["kvm", "kvm"], "parameters": 1_500_000,
       "niah": [{"task": "niah_single_1", "length": 4096, "score": 37.5}],
       "mqar": {"rows": [{"pairs": 8, "recall": 0.5, "recall_state_only": 0.25}],
                "window_note": "32 tokens (the longest exact window of its kvm layers)"},
       "position_loss": {"nll": [3.0, 2.5, 2.25], "text_nll": 2.625, "tokens": 12000,
                         "documents": 3, "min_chars": 4096, "context": 4096,
                         "packing": "pad"}},
      {"model": "tiny", "mixers": ["full"], "parameters": 20_000,
       "niah": {"skipped": "vocab"}, "mqar": {"rows": []}, "position_loss": {"skipped": "vocab"}},
  ]
  assert cli.markdown_report(results) == (
      "| model | mixers | params | NIAH-S1 4K | MQAR 8 pairs (all / state-only) | text NLL "
      "| NLL first bucket | NLL last bucket |\n"
      "|---|---|---|---|---|---|---|---|\n"
      "| kvm-a | kvm | 1.50M | 37.5 | 0.500 / 0.250 | 2.625 | 3.000 | 2.250 |\n"
      "| tiny | full | 0.02M | skipped | – | – | – | – |\n\n"
      "- tiny: niah skipped — vocab\n- tiny: position_loss skipped — vocab\n"
      "- kvm-a: MQAR state-only = queried key farther back than 32 tokens (the longest exact "
      "window of its kvm layers)\n"
      "- kvm-a: text NLL over 12000 tokens of 3 documents of >= 4096 characters (first 4097 "
      "tokens each), pad packing\n")


@pytest.mark.parametrize("name", sorted(kj.presets.PRESETS))
def test_config_json_round_trip_of_every_preset(name):
  cfg = kj.presets.PRESETS[name]()
  back = config_io.from_jsonable(json.loads(json.dumps(config_io.to_jsonable(cfg))))
  assert back == cfg and hash(back) == hash(cfg)


def test_train_config_round_trip_and_bad_configs(tmp_path):
  cfg = TrainConfig(model=kj.presets.tiny(mixers=("swa", "kvm")), task="niah",
                    niah=niah.NIAHSpec(seq_len=640), text_files=("a.txt",))
  config_io.save(tmp_path / "c.json", cfg)
  assert config_io.load(tmp_path / "c.json", TRAIN_CLASSES) == cfg
  custom = kj.presets.tiny(options={"kvm": kj.KVMConfig(chunk_size=8, rope_dims=8,
                                                            budget=lambda n: 16)})
  with pytest.raises(ValueError, match="callable budget"):
    config_io.to_jsonable(custom)
  with pytest.raises(ValueError, match="unknown class 'Evil'"):
    config_io.from_jsonable({"__class__": "Evil"})
  with pytest.raises(ValueError, match="unknown fields \\['colour'\\]"):
    config_io.from_jsonable({"__class__": "FixedBudget", "rows": 3, "colour": 1})


def test_niah_training_stream():
  spec = niah.NIAHSpec(seq_len=640)
  a, b = niah.niah_example(0, 5, spec), niah.niah_example(0, 5, spec)
  np.testing.assert_array_equal(a["inputs"], b["inputs"])
  for i in range(6):
    ex = niah.niah_example(1, i, spec)
    scored = ex["labels"] != IGNORE
    answer = TOK.decode(ex["labels"][scored])
    assert re.fullmatch(r" \d{7}\.", answer), answer  # " <7 digits>." then EOS
    assert ex["labels"][scored][-1] == TOK.eos_id
    # The scored value is the needle's value, which appears in the inputs exactly once.
    prompt = TOK.decode(ex["inputs"][:np.argmax(scored)])
    assert prompt.count(answer[1:-1]) == 1
    # Labels are the inputs shifted by one.
    idx = np.flatnonzero(scored)
    idx = idx[idx + 1 < len(ex["inputs"])]
    np.testing.assert_array_equal(ex["labels"][idx], ex["inputs"][idx + 1])
  with pytest.raises(ValueError, match="too short"):
    niah.niah_example(0, 0, niah.NIAHSpec(seq_len=300))
  with pytest.raises(ValueError, match="task"):
    niah.NIAHSpec(task="niah_multikey_1")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A 3-step kvm-train run on a byte-vocabulary model (so every suite applies)."""
  workdir = tmp_path_factory.mktemp("runs") / "kvm-tiny"
  kvm = kj.KVMConfig(chunk_size=16, window_chunks=2, sink_rows=1, rope_dims=8,
                     budget=kj.PowerLawBudget(4.0, 0.5, min_rows=16))
  cfg = TrainConfig(model=kj.presets.tiny("kvm", options={"kvm": kvm}, vocab_size=320), task="mqar",
                    mqar=mqar.MQARSpec(seq_len=64, vocab_size=64, num_pairs=4), batch_size=4,
                    steps=3, warmup_steps=1, log_every=1, checkpoint_every=3)
  out = train(cfg, workdir, verbose=False)
  return workdir, cfg, out


def test_load_trained_restores_the_run(run_dir):
  workdir, cfg, out = run_dir
  loaded_cfg, model, step = load_trained(workdir)
  assert loaded_cfg == cfg and step == 3
  from flax import nnx
  _, params = nnx.split(model)
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(out["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="no config.json"):
    load_trained(workdir / "checkpoints")


@pytest.fixture(scope="module")
def baseline_runs(run_dir):
  """Run directories of an OVQ/SWA and an RWKV-7 model beside the trained KVM run (random
  parameters, what kvm-train leaves behind; the same KVM window in their configs, so MQAR splits
  recall at the same distance)."""
  workdir, cfg, _ = run_dir
  names = {"ovq-swa-tiny": ("swa", "ovq"), "rwkv7-tiny": "rwkv7"}
  for i, (name, mixers) in enumerate(names.items()):
    model_cfg = kj.presets.tiny(mixers, options={"kvm": cfg.model.kvm}, vocab_size=320)
    model = random_model(model_cfg, seed=i)
    save_config(dataclasses.replace(cfg, model=model_cfg), workdir.parent / name)
    ckpt = Checkpointer(workdir.parent / name / "checkpoints")
    try:
      ckpt.save(3, {"params": nnx.state(model, nnx.Param)}, {}, force=True)
    finally:
      ckpt.close()
  return names


def test_kvm_eval_end_to_end(run_dir, baseline_runs, tmp_path, capsys):
  """Every suite on three run directories (KVM trained, OVQ/SWA and RWKV-7): results, the report's
  rows, the plot."""
  workdir, _, _ = run_dir
  out = tmp_path / "eval"
  rc = cli.main(["--checkpoint", str(workdir.parent), "--out", str(out), "--niah-lengths", "512",
                 "--niah-depths", "2", "--niah-gen-tokens", "8", "--niah-tasks", "niah_single_1",
                 "--mqar-pairs", "2,4,40", "--mqar-batches", "1", "--mqar-batch-size", "4",
                 "--position-context", "256", "--position-bucket", "128", "--position-docs", "2"])
  assert rc == 0
  results = json.loads((out / "results.json").read_text())["results"]
  by_name = {r["model"]: r for r in results}
  assert sorted(by_name) == ["kvm-tiny", "ovq-swa-tiny", "rwkv7-tiny"]
  for name, mixers in baseline_runs.items():
    other = by_name[name]
    assert sorted(set(other["mixers"])) == sorted({mixers} if isinstance(mixers, str)
                                                  else set(mixers))
    assert other["niah"][0]["examples"] == 2 and 0 <= other["niah"][0]["score"] <= 100
    assert [r["pairs"] for r in other["mqar"]["rows"]] == [2, 4]
    assert all(0 <= r["recall"] <= 1 for r in other["mqar"]["rows"])
    assert len(other["position_loss"]["nll"]) == 2 and np.all(np.isfinite(
        other["position_loss"]["nll"]))
  report_rows = (out / "report.md").read_text().splitlines()
  assert [line.split(" | ")[0] for line in report_rows[2:5]] == [
      "| kvm-tiny", "| ovq-swa-tiny", "| rwkv7-tiny"]
  assert report_rows[3].startswith("| ovq-swa-tiny | ovq/swa |")
  assert report_rows[4].startswith("| rwkv7-tiny | rwkv7 |")
  # MQAR splits at each model's own longest exact window, named in the report.
  cfg_of = lambda name: load_trained(workdir.parent / name)[0].model  # noqa: E731
  assert by_name["kvm-tiny"]["mqar"]["window"] == cfg_of("kvm-tiny").kvm.window_len
  ovq_swa = cfg_of("ovq-swa-tiny")
  assert by_name["ovq-swa-tiny"]["mqar"]["window"] == max(
      ovq_swa.options_of("swa").window, ovq_swa.options_of("ovq").chunk_size)
  assert by_name["rwkv7-tiny"]["mqar"]["window"] == 0  # no exact window: all state-only
  assert all(r["answers_in_window"] == 0 for r in by_name["rwkv7-tiny"]["mqar"]["rows"])
  for name in by_name:
    assert f"- {name}: MQAR state-only = queried key farther back than " \
        f"{by_name[name]['mqar']['window_note']}" in (out / "report.md").read_text()
  res = by_name["kvm-tiny"]
  assert res["model"] == "kvm-tiny" and res["step"] == 3
  assert [r["length"] for r in res["niah"]] == [512] and res["niah"][0]["examples"] == 2
  assert [r["pairs"] for r in res["mqar"]["rows"]] == [2, 4]
  assert res["mqar"]["skipped_pairs"] and res["mqar"]["skipped_pairs"][0].startswith("40:")
  assert len(res["position_loss"]["nll"]) == 2
  assert (out / "position_loss.png").stat().st_size > 0
  # The report, spelled out from the numbers in results.json (test_markdown_report_layout pins
  # the formatting rules on hand-made numbers).
  mq = {r["pairs"]: r for r in res["mqar"]["rows"]}
  nll = res["position_loss"]["nll"]
  assert "\n".join(report_rows[:3]) == (
      "| model | mixers | params | NIAH-S1 512 | MQAR 2 pairs (all / state-only) "
      "| MQAR 4 pairs (all / state-only) | text NLL | NLL first bucket | NLL last bucket |\n"
      "|---|---|---|---|---|---|---|---|---|\n"
      f"| kvm-tiny | kvm | {res['parameters'] / 1e6:.2f}M | {res['niah'][0]['score']:.1f} "
      f"| {mq[2]['recall']:.3f} / {mq[2]['recall_state_only']:.3f} "
      f"| {mq[4]['recall']:.3f} / {mq[4]['recall_state_only']:.3f} "
      f"| {res['position_loss']['text_nll']:.3f} | {nll[0]:.3f} | {nll[-1]:.3f} |")
  assert (out / "report.md").read_text() in capsys.readouterr().out
  check_eval_report((out / "report.md").read_text(), results)  # every cell against results.json


def test_kvm_eval_bad_arguments(tmp_path):
  with pytest.raises(SystemExit, match="not a run directory"):
    cli.main(["--checkpoint", str(tmp_path)])
  with pytest.raises(SystemExit):
    cli.main(["--checkpoint", str(tmp_path), "--suite", "niah,mmlu"])
  with pytest.raises(SystemExit, match="multiple of"):
    cli.main(["--checkpoint", str(tmp_path), "--position-context", "1000"])
