"""Position-wise loss on small local text with a tiny model and a hand-made 'model'."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.eval import position_loss
from kvm_jax.tasks.tokenizers import ByteTokenizer


def test_buckets_match_a_direct_computation(tmp_path):
  tok = ByteTokenizer()
  docs = ["short", "x" * 100, "the quick brown fox jumps over the lazy dog " * 3]
  windows = position_loss.long_documents(docs, tok, context=64, limit=10)
  assert windows.shape == (2, 65)  # "short" is skipped, nothing is packed
  model = kj.LM(kj.presets.tiny(vocab_size=320), rngs=nnx.Rngs(0))
  curve = position_loss.position_nll(model, windows, bucket=16, batch_size=2)
  assert curve.shape == (4,)
  logits = model(jnp.asarray(windows[:, :-1]))
  lp = jax.nn.log_softmax(logits, -1)
  nll = -np.take_along_axis(np.asarray(lp), windows[:, 1:, None], -1)[..., 0]
  np.testing.assert_allclose(curve, nll.mean(0).reshape(4, 16).mean(1), rtol=1e-5)
  # A 'model' that is certain of the right token has zero loss everywhere.
  perfect = lambda x: jax.nn.one_hot(jnp.asarray(windows[:, 1:]), 320) * 100.0
  assert np.allclose(position_loss.position_nll(perfect, windows, 16, batch_size=2), 0, atol=1e-3)
  position_loss.plot({"tiny": curve}, 16, str(tmp_path / "pos.png"))
  assert (tmp_path / "pos.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(ValueError, match="no document has"):
    position_loss.long_documents(["ab"], tok, context=64, limit=1)
