"""MQAR recall of a model, sliced by number of key-value pairs and by where the queried key lives.

The generator is :func:`kvm_jax.tasks.mqar.mqar_example` (Zoology's ``multiquery_ar`` recipe). For each
``num_pairs`` this evaluates ``batches × batch_size`` held-out sequences and reports recall at the
answer positions overall, for keys still inside the exact window (distance < ``window``) and for
keys only reachable through the compressed state (distance >= ``window``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.loss import cross_entropy_sums
from kvm_jax.util.progress import progress
from kvm_jax.tasks import mqar
from kvm_jax.tasks.pipeline import batched_iterator


def mqar_recall(logits_fn: Callable[[jax.Array], jax.Array], *, seq_len: int, vocab_size: int,
                pairs: Sequence[int], window: int, seed: int = 10_000, batches: int = 4,
                batch_size: int = 16) -> list[dict]:
  """One row per pair count: ``{"pairs", "recall", "recall_in_window", "recall_state_only",
  "answers_in_window", "answers_state_only", "answer_nll"}`` (``answer_nll``: the mean negative
  log-likelihood of the right value at the answer positions)."""
  rows = []
  for n in progress(pairs, desc="mqar"):
    spec = mqar.MQARSpec(seq_len=seq_len, vocab_size=vocab_size, num_pairs=n)
    it = batched_iterator(mqar.mqar_dataset(seed, spec), batch_size)
    counts, nll, answers = None, 0.0, 0
    for _ in range(batches):
      batch = next(it)
      logits = logits_fn(jnp.asarray(batch["inputs"]))
      pred = np.asarray(jnp.argmax(logits, axis=-1))
      c = mqar.recall_counts(pred, batch["labels"], batch["distance"], window)
      counts = c if counts is None else {k: counts[k] + c[k] for k in c}
      loss, count = cross_entropy_sums(logits, jnp.asarray(batch["labels"]))
      nll, answers = nll + float(loss), answers + int(count)
    rows.append({"pairs": n, **mqar.recall_ratios(counts),
                 "answers_in_window": int(counts["in_window"][1]),
                 "answers_state_only": int(counts["state_only"][1]),
                 "answer_nll": nll / max(answers, 1)})
  return rows
