"""Token shards and ``kvm-data`` against the in-memory text pipeline they replace.

The oracles are independent of the shard code: ``tokenizer.encode`` for stored documents,
``text.cram_pack`` for the windows and ``text.text_dataset`` over its windows for the training
and eval streams, ``text.read_documents``/``read_hf_documents`` for what the command reads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks import shards, text
from kvm_jax.tasks.tokenizers import ByteTokenizer
from kvm_jax.train import prepare_data

TOK = ByteTokenizer()
PIECES = ("a", "b", " ", "é", "€", "🙂", "\n")  # 1-, 2-, 3- and 4-byte UTF-8


def random_docs(seed: int, n: int, max_len: int = 90) -> list[str]:
  """Documents of 0 .. max_len characters (so up to ~4·max_len bytes), some empty."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, max_len, size=n)
  lengths[rng.random(n) < 0.1] = 0
  return ["".join(rng.choice(PIECES, size=int(k))) for k in lengths]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """200 random documents in shards of at most 1500 tokens."""
  docs = random_docs(0, 200)
  out = tmp_path_factory.mktemp("corpus") / "shards"
  manifest = shards.write_shards(docs, TOK, out, shard_tokens=1500, progress=False)
  return docs, out, manifest


def test_round_trip_documents_and_manifest(corpus):
  docs, out, manifest = corpus
  expected = [TOK.encode(d) + [TOK.eos_id] for d in docs]
  ts = shards.TokenShards(out)
  assert (ts.num_docs, ts.num_tokens) == (len(docs), sum(map(len, expected)))
  assert (ts.eos_id, ts.vocab_size) == (TOK.eos_id, TOK.vocab_size)
  for i, ids in enumerate(expected):
    got = ts.doc(i)
    assert got.dtype == np.uint16 and got.tolist() == ids, i
  with pytest.raises(IndexError):
    ts.doc(len(docs))

  assert manifest == json.loads((out / "manifest.json").read_text())
  assert (manifest["dtype"], manifest["tokenizer"]) == ("uint16", {"kind": "bytes"})
  assert (manifest["num_docs"], manifest["num_tokens"]) == (ts.num_docs, ts.num_tokens)
  entries = manifest["shards"]
  assert len(entries) >= 3
  assert sum(e["num_docs"] for e in entries) == len(docs)
  assert sorted(p.name for p in out.iterdir()) == sorted(
      ["manifest.json"] + [f"shard-{k:05d}.bin" for k in range(len(entries))])
  # Whole documents, in order: a shard closes only when the next document would not fit.
  first = 0
  for e in entries:
    sizes = [len(ids) for ids in expected[first:first + e["num_docs"]]]
    assert e["num_tokens"] == sum(sizes) <= 1500
    if first + e["num_docs"] < len(docs):
      assert e["num_tokens"] + len(expected[first + e["num_docs"]]) > 1500
    first += e["num_docs"]


def test_shard_boundaries(tmp_path):
  """A document longer than shard_tokens gets a shard of its own; a shard may end exactly full."""
  sizes = [20, 3, 3, 9, 1, 10]  # tokens with EOS
  manifest = shards.write_shards(["x" * (n - 1) for n in sizes], TOK, tmp_path, shard_tokens=10,
                                 progress=False)
  assert [(e["num_docs"], e["num_tokens"]) for e in manifest["shards"]] == [
      (1, 20), (2, 6), (2, 10), (1, 10)]


class WideTokenizer:
  """Ids above 65535 (needs uint32); ``bad`` adds an id past the vocabulary."""

  vocab_size, eos_id = 70_000, 69_999

  def __init__(self, bad: bool = False):
    self.bad = bad

  def encode(self, s: str) -> list[int]:
    return [60_000 + ord(c) % 9_000 for c in s] + ([70_000] if self.bad and "x" in s else [])


def test_wide_vocabulary_and_out_of_range_ids(tmp_path):
  docs = ["xyz", "", "héllo wörld"]
  manifest = shards.write_shards(docs, WideTokenizer(), tmp_path / "a", progress=False)
  ts = shards.TokenShards(tmp_path / "a")
  assert manifest["dtype"] == "uint32" and manifest["tokenizer"] == {"kind": "WideTokenizer"}
  for i, d in enumerate(docs):
    assert ts.doc(i).tolist() == WideTokenizer().encode(d) + [69_999]
  with pytest.raises(ValueError, match=r"document 0: token id 70000 .*vocab_size=70000"):
    shards.write_shards(docs, WideTokenizer(bad=True), tmp_path / "b", progress=False)
  assert not list((tmp_path / "b").iterdir())  # no manifest, no half-written shard


@pytest.mark.parametrize("seq_len", [1, 7, 31, 64, 150])
def test_cram_windows_equal_cram_pack(corpus, seq_len):
  """Same windows, same order: long documents cut to one window each, short ones packed with
  the overflow dropped, including buffers that a long document interrupts."""
  docs, out, _ = corpus
  expected = text.cram_pack(docs, TOK, seq_len)
  index = shards.TokenShards(out).cram_windows(seq_len)
  got = np.stack([index.window(k) for k in range(len(index))])
  assert got.dtype == np.int32 and got.shape == expected.shape
  np.testing.assert_array_equal(got, expected)
  if seq_len in (31, 64):  # the cases worth having: a long document inside a buffer window
    buffer = np.flatnonzero(index.long_doc < 0)
    spans = index.short_docs[index.last[buffer]] - index.short_docs[index.first[buffer]]
    assert np.any(spans > index.last[buffer] - index.first[buffer])
    assert np.any(index.long_doc >= 0)


def test_too_small_corpus(tmp_path):
  docs = ["ab", "c", ""]
  shards.write_shards(docs, TOK, tmp_path / "s", progress=False)
  with pytest.raises(ValueError, match="too small"):
    text.cram_pack(docs, TOK, 8)
  with pytest.raises(ValueError, match="too small for even one window of 9 tokens"):
    shards.TokenShards(tmp_path / "s").cram_windows(8)
  assert len(shards.TokenShards(tmp_path / "s").cram_windows(5)) == 1  # 3 + 2 + 1 = 6 tokens


@pytest.mark.parametrize("split", ["train", "eval"])
def test_shard_dataset_equals_text_dataset(corpus, split):
  """Element for element, past the first epoch (where the shuffle changes)."""
  docs, out, _ = corpus
  seq_len, seed = 24, 7
  windows = text.cram_pack(docs, TOK, seq_len)
  n_eval = max(1, len(windows) // 20)
  assert n_eval > 1
  old = text.text_dataset(windows[n_eval:] if split == "train" else windows[:n_eval], TOK.eos_id,
                          seed)
  new = shards.shard_dataset(out, seq_len, seed, split)
  epoch = len(windows) - n_eval if split == "train" else n_eval
  indices = list(range(2 * epoch + 3)) if split == "eval" else [*range(5), *range(epoch - 2,
                                                                                  epoch + 40)]
  for i in indices:
    a, b = old[i], new[i]
    assert a.keys() == b.keys()
    for key in a:
      assert a[key].dtype == b[key].dtype
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"{split}[{i}][{key}]")
  with pytest.raises(ValueError, match="split"):
    shards.shard_dataset(out, seq_len, seed, "test")


def test_streams_shard_by_shard_and_leaves_no_partial_files(tmp_path):
  """A shard file is complete on disk while later documents are still being read; a failure
  leaves neither a manifest nor a temporary file."""
  out = tmp_path / "s"

  def documents():
    for i in range(30):
      if i == 20:
        assert (out / "shard-00000.bin").exists() and not (out / "manifest.json").exists()
        raise RuntimeError("input failed")
      yield "0123456789"

  with pytest.raises(RuntimeError, match="input failed"):
    shards.write_shards(documents(), TOK, out, shard_tokens=40, progress=False)
  # 11 tokens a document, 3 a shard: documents 0-17 in six complete shards, 18-19 discarded.
  assert sorted(p.name for p in out.iterdir()) == [f"shard-{k:05d}.bin" for k in range(6)]
  with pytest.raises(ValueError, match="no manifest.json"):
    shards.TokenShards(out)


def test_corrupted_shards_are_named(corpus, tmp_path):
  _, out, manifest = corpus
  for name, damage, message in [
      ("magic", lambda b: b"XXXX" + b[4:], "not a token shard .magic number"),
      ("truncated", lambda b: b[:-8], "truncated or corrupted"),
      ("offsets", lambda b: b[:-8] + (10 ** 9).to_bytes(8, "little"), "offsets"),
  ]:
    copy = tmp_path / name
    copy.mkdir()
    for f in out.iterdir():
      (copy / f.name).write_bytes(f.read_bytes())
    victim = copy / manifest["shards"][1]["file"]
    victim.write_bytes(damage(victim.read_bytes()))
    with pytest.raises(ValueError, match=message) as e:
      shards.TokenShards(copy)
    assert str(victim) in str(e.value)


def run_cli(args, capsys):
  code = prepare_data.main([str(a) for a in args])
  return code, capsys.readouterr()


def same_shards(a, b) -> None:
  assert json.loads((a / "manifest.json").read_text()) == json.loads(
      (b / "manifest.json").read_text())
  for f in sorted(a.glob("shard-*.bin")):
    assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_cli_files(tmp_path, capsys):
  data = tmp_path / "data"
  data.mkdir()
  docs = random_docs(1, 40)
  lines = [json.dumps({"text": d, "id": i}, ensure_ascii=i % 2 == 0) for i, d in enumerate(docs)]
  (data / "a.jsonl").write_text("\n".join(lines[:25]) + "\n\n" + "\n".join(lines[25:]) + "\n",
                                encoding="utf-8")
  (data / "b.jsonl").write_text(json.dumps({"text": "second file"}) + "\n", encoding="utf-8")
  (data / "c.txt").write_text("a whole file\nis one document ✓\n", encoding="utf-8")
  inputs = [data / "*.jsonl", data / "c.txt"]
  code, out = run_cli([*inputs, "--out", tmp_path / "cli", "--shard-tokens", 500], capsys)
  assert code == 0
  assert "documents: 42" in out.out and "tokenizing" in out.err

  files = [data / "a.jsonl", data / "b.jsonl", data / "c.txt"]
  expected = text.read_documents([str(f) for f in files])
  assert len(expected) == 42
  shards.write_shards(expected, TOK, tmp_path / "api", shard_tokens=500, progress=False)
  same_shards(tmp_path / "cli", tmp_path / "api")

  code, _ = run_cli([*files, "--out", tmp_path / "noeos", "--no-eos"], capsys)
  ts = shards.TokenShards(tmp_path / "noeos")
  assert not ts.manifest["append_eos"]
  assert [ts.doc(i).tolist() for i in range(ts.num_docs)] == [TOK.encode(d) for d in expected]


def test_cli_errors(tmp_path, capsys):
  (tmp_path / "ok.txt").write_text("hello")
  (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n{"body": "y"}\n')
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("mine")
  cases = [
      ([], "no input"),
      ([tmp_path / "missing.jsonl"], "missing.jsonl' does not exist"),
      ([tmp_path / "*.md"], "no file matches"),
      ([tmp_path / "ok.txt", "--hf-dataset", "x"], "not both"),
      ([tmp_path / "bad.jsonl"], r"bad.jsonl:2: no field 'text'"),
      ([tmp_path / "ok.txt", "--tokenizer", tmp_path / "nope.json"], "nope.json' does not exist"),
  ]
  for args, message in cases:
    with pytest.raises(SystemExit, match=message):
      prepare_data.main([str(a) for a in args] + ["--out", str(tmp_path / "o")])
  with pytest.raises(SystemExit, match=r"exists and is not empty \(keep.txt\).*--overwrite"):
    prepare_data.main([str(tmp_path / "ok.txt"), "--out", str(tmp_path / "full")])
  code, _ = run_cli([tmp_path / "ok.txt", "--out", tmp_path / "full", "--overwrite"], capsys)
  assert code == 0 and shards.TokenShards(tmp_path / "full").doc(0).tolist()[:5] == list(b"hello")


def test_cli_cached_hf_dataset(tmp_path, capsys, monkeypatch):
  """A dataset that needs no download (a local folder of .jsonl), cached under tmp_path."""
  datasets = pytest.importorskip("datasets")
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # what kvm-data sets, undone after the test
  folder = tmp_path / "hf"
  folder.mkdir()
  docs = random_docs(2, 30)
  (folder / "train.jsonl").write_text(
      "".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs)),
      encoding="utf-8")
  code, _ = run_cli(["--hf-dataset", folder, "--text-field", "body", "--out", tmp_path / "cli"],
                    capsys)
  assert code == 0
  expected = text.read_hf_documents(str(folder), "train", "body")
  assert expected == docs
  shards.write_shards(expected, TOK, tmp_path / "api", progress=False)
  same_shards(tmp_path / "cli", tmp_path / "api")
  with pytest.raises(SystemExit, match="no column 'text'"):
    prepare_data.main(["--hf-dataset", str(folder), "--out", str(tmp_path / "x")])


def test_train_config_data_dir():
  TrainConfig(task="text", data_dir="shards").validate()
  with pytest.raises(ValueError, match="data_dir='shards' and text_files are both set"):
    TrainConfig(task="text", data_dir="shards", text_files=("a.txt",)).validate()
  with pytest.raises(ValueError, match="hf_dataset"):
    TrainConfig(task="text", data_dir="shards", hf_dataset="x").validate()
  with pytest.raises(ValueError, match="task='mqar'"):
    TrainConfig(task="mqar", data_dir="shards").validate()


def test_trainer_reads_shards_like_the_text_files_they_came_from(corpus, tmp_path):
  """The trainer's text stream from a shard directory equals the one from the same documents
  given as files (both splits), and a vocabulary larger than the model's is refused."""
  import dataclasses

  from kvm_jax.train import loop
  from kvm_jax.train.main import load_config

  docs, out, _ = corpus
  files = []
  for i, doc in enumerate(docs):
    files.append(tmp_path / f"doc{i:03d}.txt")
    files[-1].write_text(doc, encoding="utf-8")
  base = dataclasses.replace(load_config("train/configs/tiny_text.py"), seq_len=40)
  from_files = dataclasses.replace(base, text_files=tuple(str(f) for f in files))
  from_shards = dataclasses.replace(base, data_dir=str(out))
  for split in ("train", "eval"):
    a, b = loop.task_dataset(from_files, split), loop.task_dataset(from_shards, split)
    for i in (0, 1, 7, 50):
      for key in ("inputs", "labels"):
        np.testing.assert_array_equal(a[i][key], b[i][key])
  small = dataclasses.replace(from_shards, model=dataclasses.replace(base.model, vocab_size=64))
  from kvm_jax.train.data import check_vocabulary
  with pytest.raises(ValueError, match="token shards .* ids up to 319 but model.vocab_size=64"):
    check_vocabulary(small)  # what the trainer runs before it builds anything
