"""Position-wise loss (the paper's Fig. 4): mean next-token NLL per consecutive bucket of positions.

Works on any local text: documents are tokenized, only those with at least ``context + 1`` tokens
are kept (no packing, so position p really is the p-th token of a document), and each is cut to
``context + 1`` tokens. One curve per model; :func:`plot` draws them.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from kvm_jax.progress import progress


def long_documents(docs: Iterable[str], tokenizer, context: int, limit: int) -> np.ndarray:
  """``[n, context + 1]`` token windows from documents at least that long (first ``limit``)."""
  rows = []
  for doc in docs:
    ids = tokenizer.encode(doc)
    if len(ids) >= context + 1:
      rows.append(ids[:context + 1])
      if len(rows) == limit:
        break
  if not rows:
    raise ValueError(f"no document has {context + 1} tokens; lower --context or add longer text.")
  return np.asarray(rows, np.int32)


def position_nll(logits_fn: Callable[[jax.Array], jax.Array], windows: np.ndarray,
                 bucket: int, batch_size: int = 1) -> np.ndarray:
  """Mean NLL per bucket of ``bucket`` positions, averaged over documents: ``[context // bucket]``."""
  context = windows.shape[1] - 1
  if context % bucket:
    raise ValueError(f"context {context} is not a multiple of the bucket size {bucket}.")
  total = np.zeros(context, np.float64)
  for start in progress(range(0, len(windows), batch_size), desc="position loss"):
    chunk = jnp.asarray(windows[start:start + batch_size])
    logits = logits_fn(chunk[:, :-1])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), chunk[:, 1:])
    total += np.asarray(jnp.sum(nll, axis=0), np.float64)
  per_position = total / len(windows)
  return per_position.reshape(-1, bucket).mean(axis=1)


def plot(curves: dict[str, Sequence[float]], bucket: int, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, curve in curves.items():
    x = (np.arange(len(curve)) + 0.5) * bucket
    ax.plot(x, curve, "o-", ms=3, label=name)
  ax.set_xlabel("position in document (tokens)")
  ax.set_ylabel(f"mean NLL per {bucket}-token bucket")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
