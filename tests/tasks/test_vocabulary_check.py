"""The vocabulary checks at their exact boundary, and under ``init_from`` a way out that works.

* ``check_vocabulary`` (the trainer's, before anything is built): data whose ids fill the model's
  vocabulary exactly is accepted, one id more is refused, for every source of ids (MQAR's spec,
  NIAH's and text's tokenizer, bytes or a ``tokenizer.json``, token shards), and the message's
  numbers are exact. The data really stays below the size the check reads (an oracle: the ids of
  its first examples).
* Under ``init_from`` the model, its vocabulary included, is the starting run's: the refusal names
  that vocabulary, and every ``--config`` flag it proposes, applied, passes; a
  ``--config.model.vocab_size`` that the starting run's model replaces is said, not dropped.
* The model's own id check and the token shards' at their boundaries.

Nothing here builds a model's parameters or compiles a program.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.runs.directory import save_config
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec
from kvm_jax.tasks.tokenizers import ByteTokenizer
from kvm_jax.train.data import check_vocabulary, task_dataset
from kvm_jax.train.main import apply_override, main as train_main
from kvm_jax.train.start import with_init_model

BYTES = ByteTokenizer.vocab_size  # 320: 256 bytes, EOS 256, padded to a multiple of 64


def _model(vocab_size: int) -> kj.ModelConfig:
  return kj.presets.tiny(mixers="swa", num_layers=1, vocab_size=vocab_size)


def _word_tokenizer(path, size: int) -> str:
  """A ``tokenizer.json`` of exactly ``size`` ids: EOS and the words w1 .. w{size-1}."""
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {"<|endoftext|>": 0, **{f"w{i}": i for i in range(1, size)}}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<|endoftext|>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(path))
  return str(path)


def _sources(tmp_path) -> dict:
  """name -> (config fields that make the data, how many ids the data can produce)."""
  from kvm_jax.tasks.shards import write_shards
  word = _word_tokenizer(tmp_path / "tokenizer.json", 77)
  # 40 documents of every word (one a line of a .jsonl), each a window of its own or more.
  docs = [" ".join(f"w{(i + j) % 76 + 1}" for j in range(76)) for i in range(40)]
  corpus = tmp_path / "corpus.jsonl"
  corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  shards = tmp_path / "shards"
  from kvm_jax.tasks.tokenizers import tokenizer
  write_shards(docs, tokenizer(word), shards, progress=False, tokenizer_file=word)
  return {
      "mqar": (dict(task="mqar", mqar=MQARSpec(seq_len=32, vocab_size=100, num_pairs=4)), 100),
      "niah bytes": (dict(task="niah", niah=NIAHSpec(seq_len=512)), BYTES),
      "niah tokenizer.json": (dict(task="niah", niah=NIAHSpec(seq_len=512, tokenizer_file=word)),
                              77),
      "text bytes": (dict(task="text", seq_len=32), BYTES),
      "text tokenizer.json": (dict(task="text", seq_len=16, tokenizer_file=word,
                                   text_files=(str(corpus),)), 77),
      "token shards": (dict(task="text", seq_len=16, data_dir=str(shards), tokenizer_file=word),
                       77),
  }


SOURCE_NAMES = ["mqar", "niah bytes", "niah tokenizer.json", "text bytes", "text tokenizer.json",
                "token shards"]
# The words that name each source in the refusal.
SOURCE_WORDS = {"mqar": "mqar.vocab_size", "niah bytes": "the NIAH tokenizer (bytes)",
                "niah tokenizer.json": "the NIAH tokenizer (", "text bytes":
                "the text tokenizer (bytes)", "text tokenizer.json": "the text tokenizer (",
                "token shards": "the token shards in data_dir="}


@pytest.mark.parametrize("name", SOURCE_NAMES)
def test_a_vocabulary_that_fits_exactly_is_accepted_and_one_id_more_is_refused(tmp_path, name):
  """Data of ``size`` ids: a model of ``size`` ids trains on it; one of ``size - 1`` is refused,
  the message saying the largest id (``size - 1``), the model's size and the size to set."""
  fields, size = _sources(tmp_path)[name]
  fits = TrainConfig(model=_model(size), **fields)
  fits.validate()
  check_vocabulary(fits)
  # The oracle: what the data really produces stays below the size the check reads.
  data = task_dataset(fits, "train")
  ids = np.concatenate([np.ravel(data[i]["inputs"]) for i in range(8)] +
                       [np.ravel(data[i]["labels"]) for i in range(8)])
  assert 0 <= ids[ids >= 0].min() and ids.max() < size, (name, ids.max(), size)
  if name == "mqar":  # MQAR draws from its whole vocabulary: the boundary is tight
    assert max(data[i]["inputs"].max() for i in range(64)) == size - 1
  small = dataclasses.replace(fits, model=_model(size - 1))
  with pytest.raises(ValueError) as refused:
    check_vocabulary(small)
  message = str(refused.value)
  numbers = re.search(r"produces ids up to (\d+) but model\.vocab_size=(\d+): set "
                      r"--config\.model\.vocab_size=(\d+) \(or more\)", message)
  assert numbers and tuple(map(int, numbers.groups())) == (size - 1, size - 1, size), message
  assert message.startswith(SOURCE_WORDS[name]), message
  # The fix it names works: the model of the size it proposes passes.
  check_vocabulary(apply_override(small, "model.vocab_size", numbers.group(3)))


def _init_run(tmp_path, vocab_size: int) -> str:
  """A run directory to fine-tune from (its config; no parameters are read by these checks)."""
  run = tmp_path / "init"
  save_config(TrainConfig(model=_model(vocab_size), task="mqar",
                          mqar=MQARSpec(seq_len=32, vocab_size=vocab_size, num_pairs=4)),
              run, verbose=False)
  return str(run)


def _proposed_flags(message: str) -> list[tuple[str, str]]:
  """Every ``--config.FIELD=VALUE`` a message proposes, as (FIELD, VALUE)."""
  return re.findall(r"--config\.([\w.]+)=([^\s,)]*)", message)


@pytest.mark.parametrize("name", ["mqar", "text bytes"])
def test_under_init_from_the_refusal_names_the_starting_runs_vocabulary_and_its_fixes_work(
    tmp_path, name):
  """A fine-tuning run (init_from's model: 64 ids) on data of more ids: the refusal says the
  model and its vocabulary come from init_from and proposes flags; each group of flags it
  proposes, applied to the command and resolved as the trainer does, passes the check. Setting
  model.vocab_size, the old advice, does not: the starting run's model replaces it."""
  fields, size = _sources(tmp_path)[name]
  init = _init_run(tmp_path, 64)
  cfg = TrainConfig(model=_model(size), init_from=init, **fields)
  with pytest.raises(ValueError) as refused:
    check_vocabulary(with_init_model(cfg))
  message = str(refused.value)
  assert f"ids up to {size - 1}" in message and f"init_from={init!r}" in message
  assert "model.vocab_size=64" in message, message
  assert "set --config.model.vocab_size" not in message  # the advice that cannot work
  flags = _proposed_flags(message)
  assert flags, message
  # The flags come in ways out: another MQAR vocabulary, or from scratch (both flags together).
  scratch = [f for f in flags if f[0] in ("init_from", "model.vocab_size")]
  assert scratch == [("init_from", ""), ("model.vocab_size", str(size))], message
  other = [f for f in flags if f not in scratch]
  assert other == ([("mqar.vocab_size", "64")] if name == "mqar" else []), message
  for way in (scratch, other):
    if not way:
      continue
    fixed = cfg
    for field, value in way:
      fixed = apply_override(fixed, field, value)
    check_vocabulary(with_init_model(fixed))
  # A bare vocab_size flag is what the starting run's model overrides: still refused.
  with pytest.raises(ValueError, match="model.vocab_size=64"):
    check_vocabulary(with_init_model(apply_override(cfg, "model.vocab_size", str(size))))


def test_kvm_train_under_init_from_says_what_works_and_that_vocab_size_is_replaced(tmp_path,
                                                                                   capsys):
  """The issue's command: kvm-train with init_from (a 256-id model) on byte text (320 ids) and
  --config.model.vocab_size=320. It is refused before anything is written, with the init run's
  vocabulary and a way out other than the flag just given; and the flag is not dropped silently:
  stderr names it and the value that replaces it."""
  init = _init_run(tmp_path, 256)
  workdir = tmp_path / "run"
  with pytest.raises(SystemExit) as refused:
    train_main([f"--workdir={workdir}", "--config=train/configs/tiny_text.py",
                f"--config.init_from={init}", "--config.model.vocab_size=320"])
  message = str(refused.value)
  assert "ids up to 319" in message and "model.vocab_size=256" in message, message
  assert "set --config.model.vocab_size=320" not in message, message
  assert "without init_from" in message
  err = capsys.readouterr().err
  assert "model.vocab_size=320 → 256" in err, err
  assert not workdir.exists()
  # Where the run's model already has the config's vocabulary, nothing is replaced: no note.
  capsys.readouterr()
  same = TrainConfig(model=_model(256), init_from=init)
  assert with_init_model(same).model == _model(256)
  assert capsys.readouterr().err == ""


def test_the_models_id_check_at_its_boundary():
  """``LM.check_tokens``: ids 0 and vocab_size - 1 pass, vocab_size and -1 are refused, naming
  the id and the range [0, vocab_size)."""
  model = nnx.eval_shape(lambda: kj.LM(_model(64), rngs=nnx.Rngs(0)))  # no parameters made
  model.check_tokens(jnp.array([[0, 63]]))
  for bad in (64, -1):
    with pytest.raises(ValueError, match=rf"^token id {bad} is outside the vocabulary \[0, 64\)"):
      model.check_tokens(jnp.array([[5, bad]]))


class _Ids:
  """A tokenizer that reads a document as its ids ("3 7 9"), of ``vocab_size`` ids."""

  eos_id = 0

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]:
    return [int(x) for x in text.split()]


def test_token_shards_refuse_an_id_past_the_tokenizers_vocabulary(tmp_path):
  """``kvm-data`` stores ids below the tokenizer's vocab_size: the last one is written (and read
  back), one more is refused with its number and the size, and nothing is left behind."""
  from kvm_jax.tasks.shards import TokenShards, write_shards
  write_shards(["1 99"], _Ids(100), tmp_path / "ok", progress=False)
  shards = TokenShards(str(tmp_path / "ok"))
  assert shards.vocab_size == 100 and list(shards.doc(0)) == [1, 99, 0]
  with pytest.raises(ValueError, match=r"token id 100 is outside \[0, vocab_size=100\)"):
    write_shards(["1 100"], _Ids(100), tmp_path / "bad", progress=False)
  assert not (tmp_path / "bad" / "manifest.json").exists()
  manifest = json.loads((tmp_path / "ok" / "manifest.json").read_text())
  assert manifest["vocab_size"] == 100
