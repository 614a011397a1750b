"""MQAR recall slicing with hand-made 'models' whose answers are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.eval.mqar import mqar_recall

SPEC = dict(seq_len=64, vocab_size=64)


def _oracle(window_limit=None):
  """Answers each query from the context it can see: all of it, or only the last `window` tokens."""
  def logits_fn(inputs):
    x = np.asarray(inputs)
    pred = np.zeros_like(x)
    for b in range(x.shape[0]):
      for t in range(x.shape[1]):
        lo = 0 if window_limit is None else max(0, t - window_limit + 1)
        seen = x[b, lo:t]
        hits = np.flatnonzero(seen[:-1] == x[b, t]) if len(seen) > 1 else []
        if len(hits):
          pred[b, t] = seen[hits[0] + 1]
    return jax.nn.one_hot(jnp.asarray(pred), 64)
  return logits_fn


def test_recall_slices():
  full = mqar_recall(_oracle(), pairs=[4, 8], window=16, batches=2, batch_size=4, **SPEC)
  assert [r["pairs"] for r in full] == [4, 8]
  for r in full:
    assert r["recall"] == 1.0 and r["answers_state_only"] > 0
  windowed = mqar_recall(_oracle(16), pairs=[8], window=16, batches=2, batch_size=4, **SPEC)[0]
  assert windowed["recall_in_window"] == 1.0   # keys still within the window are found...
  assert windowed["recall_state_only"] < 0.2   # ...those beyond it are not (chance-level)
  silent = mqar_recall(lambda x: jnp.zeros((*x.shape, 64)), pairs=[4], window=16, batches=1,
                       batch_size=4, **SPEC)[0]
  assert silent["recall"] == 0.0
