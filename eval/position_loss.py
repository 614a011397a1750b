"""Text loss and position-wise loss (the paper's Fig. 4) of held-out documents, under a packing.

The paper validates on documents of at least 4096 characters, each scored from its first token
over its first 4096 tokens. :func:`eval_documents` picks such documents from any local text, and
:func:`scored_rows` lays them out under one of three packings (``kvm_jax.tasks.packing``):

* ``"pad"`` (the default, the paper's validation): one document per row from its first token,
  padded after its end. Padding sits after every scored token, so causal layers never see it and
  no segment ids are needed.
* ``"documents"``: several documents per row with ``segment_ids``; every layer computes each
  document as if it were alone, so the scores equal ``"pad"``'s (a check of the packed path) with
  fewer, fuller rows.
* ``"cram"``: the documents concatenated (each followed by EOS) and cut into rows, as the authors'
  trainer packs; a document's state and window then carry into the next one. Positions are row
  positions, and the tokens scored differ from the other two (a row boundary cuts documents, and
  the token after each EOS is not scored).

:func:`document_loss` sums the next-token NLL per position; :func:`bucket_means` turns the sums
into the curve of mean NLL per bucket of positions (token-weighted: a bucket holds every scored
token at those positions, so late buckets average the documents long enough to reach them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, Optional, Sequence

import numpy as np

from kvm_jax.util.progress import progress

# JAX, optax and the packing (grain, which imports JAX) are imported by the functions that use
# them: kvm-eval's argument parser reads PAPER_MIN_CHARS.
if TYPE_CHECKING:
  import jax

#: The paper's validation documents: at least this many characters.
PAPER_MIN_CHARS = 4096


def eval_documents(docs: Iterable[str], tokenizer, context: int, limit: int,
                   min_chars: int = PAPER_MIN_CHARS) -> list[np.ndarray]:
  """Token ids of the first ``limit`` documents with at least ``min_chars`` characters, each cut to
  its first ``context + 1`` tokens (``context`` scored positions), int32."""
  chosen = []
  for doc in docs:
    if len(doc) < min_chars:
      continue
    ids = np.asarray(tokenizer.encode(doc)[:context + 1], np.int32)
    if len(ids) >= 2:
      chosen.append(ids)
      if len(chosen) == limit:
        break
  if not chosen:
    raise ValueError(f"no document has {min_chars} characters and 2 tokens; lower "
                     "--text-min-chars or pass longer --text-files.")
  return chosen


@dataclasses.dataclass(frozen=True)
class ScoredRows:
  """Documents laid out in rows, all ``[n, context]`` int32.

  Attributes:
    inputs: the model's input tokens.
    labels: the next token scored at each position, :data:`IGNORE` where nothing is scored.
    segment_ids: the rows' documents (``"documents"`` packing), else None.
    positions: where each scored token counts on the curve: its position in its document
      (``"pad"``, ``"documents"``) or in its row (``"cram"``).
    packing: the packing the rows were made with.
  """

  inputs: np.ndarray
  labels: np.ndarray
  segment_ids: Optional[np.ndarray]
  positions: np.ndarray
  packing: str

  @property
  def context(self) -> int:
    return self.inputs.shape[1]

  def scored_tokens(self) -> int:
    from kvm_jax.tasks.labels import IGNORE
    return int(np.sum(self.labels != IGNORE))


def scored_rows(token_docs: Sequence[np.ndarray], context: int, packing: str,
                eos_id: int) -> ScoredRows:
  """``token_docs`` (each at most ``context + 1`` tokens) in rows of ``context`` positions under
  ``packing`` (module docstring); ``eos_id`` ends each document under ``"cram"``."""
  from kvm_jax.ops.documents import documents
  from kvm_jax.tasks.labels import IGNORE
  from kvm_jax.tasks.packing import PackedRows, check_packing, packed_example, plan_rows
  check_packing(packing)
  width = context + 1
  too_long = [i for i, d in enumerate(token_docs) if len(d) > width]
  if too_long:
    raise ValueError(f"document {too_long[0]} has {len(token_docs[too_long[0]])} tokens, more "
                     f"than context + 1 = {width}; cut documents with eval_documents.")
  if packing == "cram":
    stream = np.concatenate([np.append(d, eos_id) for d in token_docs]).astype(np.int32)
    n = -(-len(stream) // width)
    tokens = np.zeros(n * width, np.int32)
    tokens[:len(stream)] = stream
    tokens = tokens.reshape(n, width)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].copy()
    real = (np.arange(n * width) < len(stream)).reshape(n, width)[:, 1:]
    labels[(inputs == eos_id) | ~real] = IGNORE    # nothing across a document, nothing on padding
    positions = np.broadcast_to(np.arange(context, dtype=np.int32), inputs.shape)
    return ScoredRows(inputs, labels.astype(np.int32), None, positions.copy(), packing)
  plan = plan_rows(np.asarray([len(d) for d in token_docs]), width, packing)
  rows = PackedRows(plan, lambda i: token_docs[i])
  examples = [packed_example(*rows.row(k)) for k in range(len(rows))]
  stack = lambda key: np.stack([e[key] for e in examples]).astype(np.int32)  # noqa: E731
  inputs, labels, segments = stack("inputs"), stack("labels"), stack("segment_ids")
  positions = np.asarray(documents(segments).position, np.int32)  # within each document
  return ScoredRows(inputs, labels, segments if packing == "documents" else None, positions,
                    packing)


def document_loss(logits_fn: Callable[..., jax.Array], rows: ScoredRows,
                  batch_size: int = 1) -> tuple[np.ndarray, np.ndarray]:
  """Next-token NLL summed per curve position, and the number of scored tokens there: two
  ``[context]`` float64 arrays. ``logits_fn(tokens, segment_ids=None) -> [B, T, V]``."""
  import jax.numpy as jnp
  import optax
  from kvm_jax.tasks.labels import IGNORE
  sums = np.zeros(rows.context, np.float64)
  counts = np.zeros(rows.context, np.float64)
  for first in progress(range(0, len(rows.inputs), batch_size), desc=f"text loss ({rows.packing})"):
    part = slice(first, first + batch_size)
    segments = None if rows.segment_ids is None else jnp.asarray(rows.segment_ids[part])
    logits = (logits_fn(jnp.asarray(rows.inputs[part])) if segments is None
              else logits_fn(jnp.asarray(rows.inputs[part]), segments))
    labels = rows.labels[part]
    scored = labels != IGNORE
    nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
        jnp.asarray(logits, jnp.float32), jnp.asarray(np.where(scored, labels, 0))), np.float64)
    np.add.at(sums, rows.positions[part][scored], nll[scored])
    np.add.at(counts, rows.positions[part][scored], 1.0)
  return sums, counts


def bucket_means(sums: np.ndarray, counts: np.ndarray, bucket: int) -> np.ndarray:
  """Mean NLL of the scored tokens in each bucket of ``bucket`` positions, ``[context //
  bucket]`` (NaN where a bucket holds none)."""
  if len(sums) % bucket:
    raise ValueError(f"context {len(sums)} is not a multiple of the bucket size {bucket}.")
  total, count = sums.reshape(-1, bucket).sum(1), counts.reshape(-1, bucket).sum(1)
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def text_loss(logits_fn: Callable[..., jax.Array], token_docs: Sequence[np.ndarray], context: int,
              bucket: int, packing: str = "pad", eos_id: int = 0,
              batch_size: int = 1) -> dict:
  """The text loss of ``token_docs`` under ``packing``: ``{"packing", "documents", "rows",
  "tokens", "text_nll", "nll"}`` (``nll``: :func:`bucket_means` per ``bucket`` positions)."""
  rows = scored_rows(token_docs, context, packing, eos_id)
  sums, counts = document_loss(logits_fn, rows, batch_size)
  return {"packing": packing, "documents": len(token_docs), "rows": int(len(rows.inputs)),
          "tokens": int(counts.sum()), "text_nll": float(sums.sum() / max(counts.sum(), 1)),
          "nll": [float(x) for x in bucket_means(sums, counts, bucket)]}


def plot(curves: dict[str, Sequence[float]], bucket: int, path: str,
         packing: str = "pad") -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, curve in curves.items():
    x = (np.arange(len(curve)) + 0.5) * bucket
    ax.plot(x, curve, "o-", ms=3, label=name)
  ax.set_xlabel("position in row (tokens)" if packing == "cram" else
                "position in document (tokens)")
  ax.set_ylabel(f"mean NLL per {bucket}-token bucket")
  ax.set_title(f"held-out text, {packing} packing")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
