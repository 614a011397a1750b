"""Text loss and position-wise loss of held-out documents under each packing: rows laid out by
hand, the loss against a direct computation, and ``documents`` against ``pad`` (each document
alone) on a model whose KVM layers carry state past their window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.eval import position_loss
from kvm_jax.runs.directory import logits_fn
from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.tokenizers import ByteTokenizer

from tests.helpers import random_model

X = IGNORE


def test_rows_by_hand():
  docs = [np.array([11, 12, 13]), np.array([21, 22, 23, 24, 25]), np.array([31, 32])]
  pad = position_loss.scored_rows(docs, context=4, packing="pad", eos_id=9)
  np.testing.assert_array_equal(pad.inputs, [[11, 12, 13, 0], [21, 22, 23, 24], [31, 32, 0, 0]])
  np.testing.assert_array_equal(pad.labels, [[12, 13, X, X], [22, 23, 24, 25], [32, X, X, X]])
  assert pad.segment_ids is None
  np.testing.assert_array_equal(pad.positions[pad.labels != X], [0, 1, 0, 1, 2, 3, 0])
  # Rows of 5 tokens: the 2- and 3-token documents share one, the 5-token one fills the next.
  packed = position_loss.scored_rows([np.array([11, 12]), np.array([21, 22, 23]),
                                      np.array([31, 32, 33, 34, 35])], context=4,
                                     packing="documents", eos_id=9)
  np.testing.assert_array_equal(packed.inputs, [[11, 12, 21, 22], [31, 32, 33, 34]])
  np.testing.assert_array_equal(packed.labels, [[12, X, 22, 23], [32, 33, 34, 35]])
  np.testing.assert_array_equal(packed.segment_ids, [[1, 1, 2, 2], [1, 1, 1, 1]])
  np.testing.assert_array_equal(packed.positions, [[0, 1, 0, 1], [0, 1, 2, 3]])
  cram = position_loss.scored_rows(docs, context=4, packing="cram", eos_id=9)
  # Stream 11 12 13 9 21 22 23 24 25 9 31 32 9, rows of 5 tokens, the last padded.
  np.testing.assert_array_equal(cram.inputs, [[11, 12, 13, 9], [22, 23, 24, 25], [31, 32, 9, 0]])
  np.testing.assert_array_equal(cram.labels, [[12, 13, 9, X], [23, 24, 25, 9], [32, 9, X, X]])
  np.testing.assert_array_equal(cram.positions[0], [0, 1, 2, 3])   # row positions
  with pytest.raises(ValueError, match="more than context"):
    position_loss.scored_rows([np.arange(7)], context=4, packing="pad", eos_id=9)
  with pytest.raises(ValueError, match="packing must be one of"):
    position_loss.scored_rows(docs, context=4, packing="stream", eos_id=9)


def test_documents_are_chosen_by_characters_and_cut_to_the_context():
  tok = ByteTokenizer()
  chosen = position_loss.eval_documents(["short", "y" * 30, "z" * 200, "w" * 99], tok, context=64,
                                        limit=2, min_chars=30)
  assert [len(d) for d in chosen] == [len(tok.encode("y" * 30)), 65]
  with pytest.raises(ValueError, match="no document has 500 characters"):
    position_loss.eval_documents(["ab"], tok, context=64, limit=1, min_chars=500)


def _direct_curve(model, rows, bucket):
  """Per bucket, the mean NLL of the scored tokens, straight from one forward pass."""
  logits = model(jnp.asarray(rows.inputs))
  lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1), np.float64)
  scored = rows.labels != X
  nll = -np.take_along_axis(lp, np.where(scored, rows.labels, 0)[..., None], -1)[..., 0]
  sums, counts = np.zeros(rows.context), np.zeros(rows.context)
  np.add.at(sums, rows.positions[scored], nll[scored])
  np.add.at(counts, rows.positions[scored], 1)
  return (sums.reshape(-1, bucket).sum(1) / counts.reshape(-1, bucket).sum(1),
          nll[scored].mean())


def test_loss_matches_a_direct_computation_and_documents_equal_pad(tmp_path):
  """``pad`` against a hand-written reduction of one forward pass; ``documents`` (several
  documents per row, segment ids) equals ``pad`` to float32 rounding on a KVM model whose
  documents run past its 16-token window, so their states grow and must not carry over."""
  tok = ByteTokenizer()
  # 65, 43, 18, 65 and 65 tokens: the second and third share a row under "documents", the
  # third starting mid-chunk (C = 8).
  texts = ["the quick brown fox jumps over the lazy dog " * 2, "pack my box with five dozen "
           "liquor jugs", "how vexingly quick", "sphinx of black quartz judge my vow " * 3,
           "a" * 70]
  docs = position_loss.eval_documents(texts, tok, context=64, limit=10, min_chars=10)
  # Every parameter drawn at unit scale, so that predictions depend strongly on the context (a
  # fresh initialization predicts nearly uniformly whatever it reads).
  model = random_model(kj.presets.tiny("swa,kvm", vocab_size=320), seed=3)
  pad = position_loss.text_loss(logits_fn(model), docs, context=64, bucket=16, packing="pad",
                                eos_id=tok.eos_id, batch_size=2)
  curve, mean = _direct_curve(model, position_loss.scored_rows(docs, 64, "pad", tok.eos_id), 16)
  np.testing.assert_allclose(pad["nll"], curve, rtol=1e-5)
  np.testing.assert_allclose(pad["text_nll"], mean, rtol=1e-5)
  assert pad["tokens"] == sum(len(d) - 1 for d in docs) and pad["rows"] == len(docs)
  packed = position_loss.text_loss(logits_fn(model), docs, context=64, bucket=16,
                                   packing="documents", eos_id=tok.eos_id)
  assert packed["rows"] < pad["rows"] and packed["tokens"] == pad["tokens"]
  # float32 logits of one document alone vs packed: equal to ~1e-6 relative (test_documents).
  np.testing.assert_allclose(packed["nll"], pad["nll"], rtol=2e-5)
  np.testing.assert_allclose(packed["text_nll"], pad["text_nll"], rtol=2e-5)
  cram = position_loss.text_loss(logits_fn(model), docs, context=64, bucket=16, packing="cram",
                                 eos_id=tok.eos_id)
  assert cram["tokens"] != pad["tokens"] and np.isfinite(cram["text_nll"])
  # A 'model' that is certain of the right token has zero loss everywhere.
  rows = position_loss.scored_rows(docs, 64, "pad", tok.eos_id)
  perfect = lambda x: jax.nn.one_hot(jnp.asarray(rows.labels) % 320, 320) * 100.0  # noqa: E731
  sums, counts = position_loss.document_loss(perfect, rows, batch_size=len(docs))
  assert np.allclose(sums, 0, atol=1e-3) and counts.sum() == pad["tokens"]
  position_loss.plot({"tiny": pad["nll"]}, 16, str(tmp_path / "pos.png"))
  assert (tmp_path / "pos.png").read_bytes()[:4] == b"\x89PNG"
  # An empty late bucket is NaN, not a made-up number.
  assert np.isnan(position_loss.bucket_means(np.ones(4), np.array([1.0, 1, 0, 0]), 2)[1])
