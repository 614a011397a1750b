"""OVQ over packed documents (``segment_ids``): every document as if it were run alone.

A document alone has its own chunk grid from its first token: a query in its chunk ``c`` sees the
dictionary built from its chunks ``0 .. c - 1`` (rows by the position-only schedule
:meth:`OVQConfig.dictionary_sizes`) and its own chunk causally, in one softmax. As for KVM
(:mod:`kvm_jax.ops.kvm.documents`) the softmax is split in two parts that join exactly:

* the own-chunk part in the row's layout (:func:`kvm_jax.ops.documents.document_window_partials`
  with the one-chunk window rule on document positions);
* the dictionary part: one ``lax.scan`` over *dictionary steps*, one per chunk ``c >= 1`` of a
  document (its first token at document position ``c·C``), gathered from the row. The step folds
  chunk ``c - 1`` into the dictionary (starting from an empty one at ``c = 1``) and scores the
  chunk's queries against it. A document of ``n`` tokens has ``ceil(n / C) - 1`` steps, so a row
  of ``T`` tokens has at most ``ceil(T / C) - 1``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.common import MASKED
from kvm_jax.ops.documents import (Partials, WindowRule, combine_partials,
                                   document_window_partials, documents, rows_of, scan_in_blocks,
                                   select_rows)
from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.ops.ovq.state import dictionary_scores, empty_state, fold

Array = jax.Array
_HI = jax.lax.Precision.HIGHEST


def max_dictionary_steps(seq_len: int, cfg: OVQConfig) -> int:
  """The most dictionary steps a row of ``seq_len`` tokens holds, whatever its documents."""
  return max(0, -(-seq_len // cfg.chunk_size) - 1)


@functools.partial(jax.jit, static_argnames=("cfg", "row_update"))
def ovq_attention_documents(q: Array, k: Array, v: Array, beta: Array, segment_ids: Array,
                            cfg: OVQConfig, row_update: str = "auto") -> Array:
  """OVQ over the documents of ``segment_ids [B, T]``; ``q``, ``k`` ``[B, T, H, D]`` (L2
  normalized), ``v [B, T, H, Dv]``, ``beta [H]`` as in :func:`kvm_jax.ops.ovq.ovq_attention`.
  Returns ``y [B, T, H, Dv]`` in ``v``'s dtype (no dictionary: it would need each row's last,
  possibly partial, chunk folded at a traced length)."""
  B, T, H, D = q.shape
  Dv = v.shape[-1]
  C = cfg.chunk_size
  docs = documents(segment_ids)
  scale = beta.astype(jnp.float32) * math.sqrt(D)                           # [H]
  qs = q.astype(jnp.float32) * scale[None, None, :, None]
  kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
  # The own chunk: scores q·k times beta·√D, no count bias. One KV head per query head.
  own = document_window_partials(qs[:, :, :, None], kf, vf, docs,
                                 WindowRule("chunks", chunk=C, window_chunks=1),
                                 block=min(C, 128))
  steps_max = max_dictionary_steps(T, cfg)
  if steps_max == 0:
    return combine_partials(own).reshape(B, T, H, Dv).astype(v.dtype)

  sizes = np.asarray(cfg.dictionary_sizes(T), np.int32)                   # rows before chunk c
  R = cfg.capacity(T)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, C)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
  heads = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, n, H, d] -> [B, H, n, d]
  q_p, k_p, v_p = pad(qs), pad(kf), pad(vf)
  start_p = pad(docs.start)
  length_p = pad(docs.length)
  begins = docs.valid & (docs.position >= C) & (docs.position % C == 0)
  rank = jnp.where(begins, jnp.cumsum(begins, axis=1) - 1, steps_max)
  rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
  t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
  steps = jnp.full((B, steps_max), T, jnp.int32).at[rows, rank].set(t, mode="drop")
  sizes_j = jnp.asarray(sizes)
  fresh = empty_state(B, H, R, D, Dv)
  scale4 = scale.reshape(1, H, 1, 1)

  def step(state, first):
    exists = first < T
    at = jnp.minimum(first, T)
    doc_start = jnp.take_along_axis(start_p, at[:, None], 1)[:, 0]
    doc_len = jnp.take_along_axis(length_p, at[:, None], 1)[:, 0]
    c = jnp.where(exists, (at - doc_start) // C, 1)
    state = select_rows(exists & (c == 1), fresh, state)
    before = sizes_j[jnp.clip(c - 1, 0, len(sizes) - 1)]
    after = sizes_j[jnp.clip(c, 0, len(sizes) - 1)]
    prev_k, prev_v = heads(rows_of(k_p, at - C, C)), heads(rows_of(v_p, at - C, C))
    folded = fold(state, prev_k, prev_v, prev_k * scale4, before, after - before, cfg, row_update)
    state = select_rows(exists, folded, state)
    scores, visible = dictionary_scores(heads(rows_of(q_p, at, C)), state, after,
                                        cfg.count_bias)
    scores = jnp.where(visible, scores, MASKED)                                # [B, H, C, R]
    top = jax.lax.stop_gradient(jnp.max(scores, axis=-1))
    p = jnp.exp(scores - top[..., None])
    acc = jnp.einsum("bhnr,bhrv->bhnv", p, state.values, precision=_HI)
    move = lambda x: jnp.moveaxis(x, 1, 2)[:, :, :, None]  # noqa: E731  -> [B, C, H, 1, ...]
    in_doc = exists[:, None] & (at[:, None] + jnp.arange(C)[None] < doc_start[:, None]
                                + doc_len[:, None])
    where = jnp.where(in_doc, at[:, None] + jnp.arange(C)[None], T)
    return state, ((move(top), move(jnp.sum(p, axis=-1)), move(acc)), where)

  _, (parts, where) = scan_in_blocks(step, fresh, jnp.moveaxis(steps, 1, 0))
  top, total, acc = parts
  b = jnp.broadcast_to(jnp.arange(B)[None, :, None], where.shape)
  dictionary = Partials(
      jnp.full((B, T, H, 1), MASKED, jnp.float32).at[b, where].set(top, mode="drop"),
      jnp.zeros((B, T, H, 1), jnp.float32).at[b, where].set(total, mode="drop"),
      jnp.zeros((B, T, H, 1, Dv), jnp.float32).at[b, where].set(acc, mode="drop"))
  return combine_partials(own, dictionary).reshape(B, T, H, Dv).astype(v.dtype)
