"""Packing documents into rows: the plans by hand, labels that never cross a document, the same
rows from token shards as from text, the loss of a packed batch against each document alone, and
the configuration's checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvm_jax.ops.loss import IGNORE
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks import packing, shards, text
from kvm_jax.tasks.tokenizers import tokenizer
from kvm_jax.train.data import check_packing_model, task_dataset
from kvm_jax.train.evaluation import EvalSpec, eval_sums
from kvm_jax.train.objectives import LMObjective, loss_sums
from tests.helpers import forward, make_model


def pieces(plan: packing.RowPlan) -> list[list[tuple[int, int, int]]]:
  """Per row, its ``(document, start, length)`` pieces."""
  return [[(int(plan.doc[j]), int(plan.start[j]), int(plan.length[j]))
           for j in range(plan.first[r], plan.first[r + 1])] for r in range(len(plan))]


def test_documents_plan_by_hand():
  # width 5: [3] fits; 4 does not fit after it -> next row; 12 = 5 + 5 + 2 (pieces of its own);
  # the 2-piece shares a row with the next 2 and 1; an empty document is skipped.
  plan = packing.plan_rows(np.array([3, 4, 12, 2, 0, 1, 5]), 5, "documents")
  assert pieces(plan) == [[(0, 0, 3)], [(1, 0, 4)], [(2, 0, 5)], [(2, 5, 5)],
                          [(2, 10, 2), (3, 0, 2), (5, 0, 1)], [(6, 0, 5)]]
  assert plan.real_tokens() == 27


def test_pad_plan_by_hand():
  plan = packing.plan_rows(np.array([3, 9, 0, 5]), 5, "pad")
  assert pieces(plan) == [[(0, 0, 3)], [(1, 0, 5)], [(3, 0, 5)]]


def test_rows_and_labels_never_cross_a_document():
  docs = [np.arange(10, 13), np.arange(20, 24), np.arange(30, 42)]
  rows = packing.PackedRows(packing.plan_rows(np.array([3, 4, 12]), 8, "documents"),
                            docs.__getitem__)
  tokens, seg = rows.row(0)              # [10 11 12 | 20 21 22 23 | pad]
  np.testing.assert_array_equal(tokens, [10, 11, 12, 20, 21, 22, 23, 0])
  np.testing.assert_array_equal(seg, [1, 1, 1, 2, 2, 2, 2, 0])
  ex = packing.packed_example(tokens, seg)
  np.testing.assert_array_equal(ex["inputs"], [10, 11, 12, 20, 21, 22, 23])
  np.testing.assert_array_equal(ex["labels"], [11, 12, IGNORE, 21, 22, 23, IGNORE])
  np.testing.assert_array_equal(ex["segment_ids"], [1, 1, 1, 2, 2, 2, 2])
  tokens, seg = rows.row(2)              # the second piece of the long document: one of its own
  np.testing.assert_array_equal(tokens, [38, 39, 40, 41, 0, 0, 0, 0])
  np.testing.assert_array_equal(packing.packed_example(tokens, seg)["labels"],
                                [39, 40, 41, IGNORE, IGNORE, IGNORE, IGNORE])


def _cfg(tmp_path, **fields) -> TrainConfig:
  files = []
  for i, n in enumerate([40, 300, 7, 90, 1200, 3, 64, 500, 33, 260, 95, 180]):
    path = tmp_path / f"doc{i}.txt"
    path.write_text("".join(chr(97 + (i + j) % 26) for j in range(n)))
    files.append(str(path))
  return TrainConfig(task="text", text_files=tuple(files), seq_len=63, batch_size=2,
                     steps=3, warmup_steps=1, **fields)


@pytest.mark.parametrize("mode", ["pad", "documents"])
def test_token_shards_give_the_same_rows_as_text(tmp_path, mode):
  cfg = _cfg(tmp_path, packing=mode)
  tok = tokenizer("")
  shards.write_shards(text.read_documents(cfg.text_files), tok, tmp_path / "shards",
                      progress=False)
  from_text = task_dataset(cfg, "train")
  from_shards = task_dataset(dataclasses.replace(cfg, text_files=(),
                                                 data_dir=str(tmp_path / "shards")), "train")
  for i in (0, 1, 5, 17, 40):   # random access: example i is a function of i alone
    a, b = from_text[i], from_shards[i]
    assert a.keys() == b.keys() == {"inputs", "labels", "segment_ids"}
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  np.testing.assert_array_equal(task_dataset(cfg, "train")[17]["inputs"], from_text[17]["inputs"])


def test_packed_loss_is_the_documents_loss_alone(tmp_path):
  """The trainer's loss on a batch of ``documents`` rows equals the cross-entropy of each
  document piece run alone, summed and divided by the labelled tokens."""
  cfg = _cfg(tmp_path, packing="documents")
  model = make_model(("swa", "kvm"), vocab_size=260)  # bytes and EOS (256)
  ds = task_dataset(cfg, "train")
  shared = [i for i in range(100) if ds[i]["segment_ids"].max() >= 2][:1]  # a row of 2+ documents
  assert len(shared) == 1
  batch = {k: np.stack([ds[i][k] for i in shared]) for k in ("inputs", "labels", "segment_ids")}
  graphdef, params = nnx.split(model, nnx.Param)
  loss, count, _ = loss_sums(graphdef, params, jnp.asarray(batch["inputs"]),
                             jnp.asarray(batch["labels"]), remat="none", slice_len=0,
                             compute_dtype="float32", segment_ids=jnp.asarray(batch["segment_ids"]))
  want, n = 0.0, 0
  for b in range(1):
    seg = batch["segment_ids"][b]
    for doc in set(seg.tolist()) - {0}:
      at = np.flatnonzero(seg == doc)
      tokens, labels = batch["inputs"][b, at], batch["labels"][b, at]
      logits = forward(model, jnp.asarray(tokens)[None])[0]
      logp = jax.nn.log_softmax(np.asarray(logits, np.float64))
      real = labels != IGNORE
      want -= float(np.sum(np.asarray(logp)[np.flatnonzero(real), labels[real]]))
      n += int(real.sum())
  assert int(count) == n
  assert abs(float(loss) - want) < 1e-5 * abs(want)
  # The trainer's objective and its held-out evaluation read the segment ids the same way.
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  objective_loss, _ = LMObjective.of(cfg)(graphdef, params, batch, None, jnp.float32(n))
  assert abs(float(objective_loss) - want / n) < 1e-5 * abs(want / n)
  sums = eval_sums(graphdef, EvalSpec.of(cfg), params, batch)
  assert abs(float(sums["loss_sum"]) - want) < 1e-5 * abs(want) and int(sums["tokens"]) == n


def test_packing_is_checked(tmp_path):
  with pytest.raises(ValueError, match="packing must be one of"):
    _cfg(tmp_path, packing="bins").validate()
  with pytest.raises(ValueError, match="packing='pad' packs text documents, but task='mqar'"):
    dataclasses.replace(_cfg(tmp_path, packing="pad"), task="mqar").validate()
  from kvm_jax import presets
  cfg = dataclasses.replace(_cfg(tmp_path, packing="documents"),
                            model=presets.tiny(mixers="kvm", num_layers=4, kv_sharing="fusedkv",
                                               kvm_kv_sharing="shared_routing"))
  with pytest.raises(ValueError, match="does not run with kvm_kv_sharing='shared_routing'"):
    check_packing_model(cfg)
  check_packing_model(dataclasses.replace(  # window-only fusion keeps documents apart
      cfg, model=dataclasses.replace(cfg.model, kvm_kv_sharing="window")))
  check_packing_model(dataclasses.replace(cfg, packing="pad"))  # one document per row: any model
