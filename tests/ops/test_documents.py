"""Packed documents (``segment_ids``): every document's outputs, final state and gradients equal
those of the document run alone.

The alone runs are independent of the packed path: the KVM op without ``segment_ids`` (the chunked
scan, itself checked against the Python oracle in test_kvm_equivalence.py) and, for the window
attention, float64 numpy softmax written from the rule's definition. Every document runs alone as a
row of its own followed by filler (``kvm_jax.ops.documents.documents_alone``): each kind is causal,
so the outputs at the document's positions are those of the document alone, and one compiled
program serves every length; final states are compared with runs at the document's own length.
Tolerances are float32 rounding: the packed paths reorder sums (a step's window gathered apart from
the row, a document's window split from the front's), a few ulps, so 2e-5 relative RMS for outputs
and states, 1e-4 for gradients (``kvm_jax.ops.kvm.cases.TOLERANCE``); a discrete difference (a row,
a window slot or a routing decision of another document) is O(1).
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from tests.helpers import DATA, FAST_COMPILE, TEST_XLA_FLAGS, forward, in_ci, make_model
from kvm_jax.config.budget import FixedBudget, PowerLawBudget, SaturatingBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.documents import (WindowRule, document_attention, document_spans,
                                   documents, documents_alone, segment_ids_from_lengths)
from kvm_jax.ops.kvm.cases import TOLERANCE, random_inputs, random_params, rel_rms
from kvm_jax.ops.kvm.document_scan import aligned_layout, document_block, layout_chunks
from kvm_jax.ops.kvm.documents import kvm_attention_documents, max_state_steps, state_steps

OUT_TOL, GRAD_TOL = TOLERANCE["float32"]["output"], TOLERANCE["float32"]["grad"]

# C = 4, window = 2 chunks (L = 8): documents of 1, C-1, C, C+1 tokens, one just past the window
# (9), past several folds (13) and past the budgets' growth steps (22, 30); boundaries fall
# mid-chunk everywhere; padding (negative entries) in front, between and after documents. Row 1 is
# one document after padding with as many state steps as a row of T tokens can hold (every slot of
# the static bound used). ``reuse_ids`` numbers documents 1, 2, 1, 2, ... in every row.
T = 64
LAYOUT = ([1, 3, 4, 5, 9, 13, -7, 22],
          [-3, 61],
          [13, 22, -1, 5, 9, 4, 3, 1, -6],
          [9, 22, 30, -3])
TINY = dict(chunk_size=4, window_chunks=2, rope_dims=2)


def test_documents_by_hand():
  seg = np.array([[0, 5, 5, 5, 2, 2, 0, 0, 5, 5],
                  [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]], np.int32)
  d = jax.tree_util.tree_map(np.asarray, documents(jnp.asarray(seg)))
  np.testing.assert_array_equal(d.valid[0], seg[0] != 0)
  # row 0: pad | 5 5 5 | 2 2 | pad | pad | 5 5  -> documents 0..5 (padding tokens are their own)
  np.testing.assert_array_equal(d.index[0], [0, 1, 1, 1, 2, 2, 3, 4, 5, 5])
  np.testing.assert_array_equal(d.start[0], [0, 1, 1, 1, 4, 4, 6, 7, 8, 8])
  np.testing.assert_array_equal(d.position[0], [0, 0, 1, 2, 0, 1, 0, 0, 0, 1])
  np.testing.assert_array_equal(d.length[0], [1, 3, 3, 3, 2, 2, 1, 1, 2, 2])
  np.testing.assert_array_equal(d.position[1], np.arange(10))
  np.testing.assert_array_equal(d.length[1], np.full(10, 10))
  # the layouts the tests write: lengths per row, negative = padding
  np.testing.assert_array_equal(segment_ids_from_lengths(([2, -1, 3], [-2, 1, 1, 2]), 6),
                                [[1, 1, 0, 3, 3, 3], [0, 0, 2, 3, 4, 4]])
  np.testing.assert_array_equal(segment_ids_from_lengths(([1, 1, 2, -1, 1],), 6, reuse_ids=True),
                                [[1, 2, 1, 1, 0, 1]])
  assert list(document_spans(([2, -1, 3],))) == [(0, 0, 2), (0, 3, 3)]
  with pytest.raises(ValueError, match="holds 5 tokens, not seq_len=6"):
    segment_ids_from_lengths(([2, 3],), 6)


def _window_alone(q, k, v, rule: WindowRule, scale: float) -> np.ndarray:
  """float64 softmax attention of one document alone, the rule spelled out per query."""
  n, H, _ = q.shape
  G = H // k.shape[1]
  out = np.zeros((n, H, v.shape[-1]))
  for p in range(n):
    if rule.kind == "causal":
      keys = range(0, p + 1)
    elif rule.kind == "sliding":
      keys = range(max(0, p - rule.window + 1), p + 1)
    else:
      keys = range(max(0, (p // rule.chunk - rule.window_chunks + 1) * rule.chunk), p + 1)
    keys = list(keys)
    for h in range(H):
      s = np.array([q[p, h] @ k[j, h // G] for j in keys]) * scale
      w = np.exp(s - s.max())
      out[p, h] = (w / w.sum()) @ v[keys, h // G]
  return out


@pytest.mark.parametrize("rule", [WindowRule("causal"), WindowRule("sliding", window=5),
                                  WindowRule("chunks", chunk=4, window_chunks=2)],
                         ids=lambda r: r.kind)
def test_document_attention_is_each_document_alone(rule):
  seg = segment_ids_from_lengths(LAYOUT, T, reuse_ids=True)
  q, k, v, _ = random_inputs(3, len(LAYOUT), T, 4, 2, 8, 6)
  y = np.asarray(document_attention(q, k, v, jnp.asarray(seg), rule, block=16), np.float64)
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  for b, t, n in document_spans(LAYOUT):
    want = _window_alone(q64[b, t:t + n], k64[b, t:t + n], v64[b, t:t + n], rule, 8 ** -0.5)
    assert rel_rms(y[b, t:t + n], want) < OUT_TOL, (b, t, n)
  assert np.all(np.isfinite(y))  # padding tokens too


def _dense_documents(q, k, v, seg, window):
  """Dense softmax attention under the ``[B, T, T]`` mask of the documents (same document,
  causal, within ``window``), each padding token its own document: the yardstick."""
  index = np.asarray(documents(jnp.asarray(seg)).index)
  t = np.arange(seg.shape[1])
  mask = (index[:, :, None] == index[:, None, :]) & (t[None, None, :] <= t[None, :, None])
  if window is not None:
    mask &= t[None, None, :] > t[None, :, None] - window
  G = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kk, precision="highest") / np.sqrt(q.shape[-1])
  p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, vv, precision="highest")


@pytest.mark.parametrize("implementation", ["splash", "chunked"])
def test_attention_backends_keep_documents_apart(implementation):
  """``causal_attention(..., segment_ids=)``: splash (its Pallas TPU kernel, interpreted here)
  takes the documents as its own segment ids; the other backends run the document window path.
  Outputs and gradients equal the float64 rule of each document alone; every padding token sees
  only itself (it equals its own value)."""
  from kvm_jax.ops.attention.api import causal_attention
  layout = ([5, 60, -3, 130, 58], [-2, 127, 1, 126])        # T = 256 (splash: multiples of 128)
  seg = segment_ids_from_lengths(layout, 256)
  q, k, v, _ = random_inputs(4, 2, 256, 4, 2, 16, 16)
  w = jax.random.normal(jax.random.PRNGKey(1), q.shape)
  for window in (None, 48):
    rule = WindowRule("causal") if window is None else WindowRule("sliding", window=window)
    run = lambda q, k, v: causal_attention(  # noqa: E731
        q, k, v, window=window, implementation=implementation, segment_ids=jnp.asarray(seg))
    y, grads = jax.value_and_grad(lambda *a: jnp.sum(run(*a) * w), argnums=(0, 1, 2))(q, k, v)
    y = np.asarray(run(q, k, v), np.float64)
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    for b, t, n in document_spans(layout):
      want = _window_alone(q64[b, t:t + n], k64[b, t:t + n], v64[b, t:t + n], rule, 16 ** -0.5)
      assert rel_rms(y[b, t:t + n], want) < OUT_TOL, (window, b, t, n)
    pad = seg == 0
    np.testing.assert_allclose(y[pad], np.repeat(np.asarray(v, np.float64), 2, axis=2)[pad],
                               rtol=1e-5, atol=1e-6)
    want_grads = jax.grad(lambda *a: jnp.sum(_dense_documents(*a, seg, window) * w),
                          argnums=(0, 1, 2))(q, k, v)
    for name, a, e in zip("qkv", grads, want_grads):
      assert rel_rms(a, e) < GRAD_TOL, (window, name)


def _kvm_inputs(B, H=2, Hkv=1, seed=0, seq_len=T):
  q, k, v, g = random_inputs(seed, B, seq_len, H, Hkv, 8, 6)
  return q, k, v, g, random_params(seed, 8, H)


BUDGETS = {"fixed": dict(budget=FixedBudget(4), sink_rows=1),
           "sqrt": dict(budget=PowerLawBudget(3.0, 0.5, min_rows=4), sink_rows=1),
           "sat_no_sink_gqa": dict(budget=SaturatingBudget(12, min_rows=1), sink_rows=0)}


# The fixed budget's code path (no appends) is also the other budgets' once they stop growing.
@pytest.mark.parametrize("name", in_ci(list(BUDGETS), {"sqrt", "sat_no_sink_gqa"}))
def test_kvm_documents_are_each_document_alone(name):
  cfg = KVMConfig(**TINY, **BUDGETS[name])
  H, Hkv = (4, 2) if "gqa" in name else (2, 1)
  q, k, v, g, params = _kvm_inputs(len(LAYOUT), H, Hkv)
  seg = jnp.asarray(segment_ids_from_lengths(LAYOUT, T, reuse_ids=True))
  y, state = kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg)
  assert y.shape == q.shape[:3] + (6,) and y.dtype == q.dtype
  assert np.all(np.isfinite(np.asarray(y)))
  docs, inputs = documents_alone(LAYOUT, q, k, v, g, fills=[0, 0, 0, 1])
  y_alone, _ = kj.kvm_attention(*inputs, params, cfg)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(y[b, t:t + n], y_alone[i, :n]) < OUT_TOL, (b, t, n)
  _assert_last_states_alone(docs, state, q, k, v, g, params, cfg)


def _assert_last_states_alone(docs, state, q, k, v, g, params, cfg):
  """The packed state of each row equals its last document's run alone at its own length."""
  last = {b: (t, n) for b, t, n in docs}
  for b, (t, n) in last.items():
    part = lambda x: x[b:b + 1, t:t + n]  # noqa: E731
    _, s_alone = kj.kvm_attention(part(q), part(k), part(v), part(g), params, cfg)
    rows = int(s_alone.num_rows)
    assert int(state.num_rows[b]) == rows
    for got, want in ((state.keys, s_alone.keys), (state.values, s_alone.values),
                      (state.radius, s_alone.radius)):
      assert rel_rms(got[b, :, :rows], want[0, :, :rows]) < OUT_TOL, b


@pytest.mark.parametrize("path", ["aligned", "steps"])
def test_kvm_document_gradients_are_the_sum_of_each_document_alone(path):
  """Both document paths (the XLA op takes "aligned"; "steps" is the kernels' and a one-chunk
  window's, here on the XLA operations)."""
  cfg = KVMConfig(**TINY, **BUDGETS["sqrt"])
  layout = ([9, 20, 3, -2, 30], [-3, 30, 9, 20, -2])
  q, k, v, g, params = _kvm_inputs(2)
  seg = jnp.asarray(segment_ids_from_lengths(layout, T))
  w = jax.random.normal(jax.random.PRNGKey(5), q.shape[:3] + (6,))
  real = (seg != 0)[..., None, None]

  def packed(*args):
    y, _ = kvm_attention_documents(*args, seg, cfg=cfg, path=path)
    return jnp.sum(jnp.where(real, y * w, 0.0))

  got = jax.jit(jax.grad(packed, argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
  docs, (q1, k1, v1, g1, w1, real1) = documents_alone(layout, q, k, v, g, w, seg != 0,
                                                 fills=[0, 0, 0, 1, 0, False])

  def alone(qs, ks, vs, gs, p):
    y, _ = kj.kvm_attention(qs, ks, vs, gs, p, cfg, remat=False)  # plain autodiff: one more path
    return jnp.sum(jnp.where(real1[..., None, None], y * w1, 0.0))

  grads = jax.jit(jax.grad(alone, argnums=(0, 1, 2, 3, 4)))(q1, k1, v1, g1, params)
  want = [np.zeros(x.shape) for x in (q, k, v, g)]
  for i, (b, t, n) in enumerate(docs):
    for acc, grad in zip(want, grads[:4]):
      acc[b, t:t + n] += np.asarray(grad[i, :n])
  want_params = grads[4]
  for name, a, e in zip("qkvg", got[:4], want):
    assert rel_rms(a, e) < GRAD_TOL, name
  for a, e in zip(jax.tree_util.tree_leaves(got[4]), jax.tree_util.tree_leaves(want_params)):
    assert rel_rms(a, e) < GRAD_TOL


def test_aligned_layout_by_hand():
  """C = 4, window 2 chunks: a document longer than (2 - 1)·4 + 1 = 5 tokens starts at a chunk
  of the layout, after the empty slots it needs; any other follows directly (padding tokens are
  documents of one token). Row 0: A 0-2, B 3-8 (6: aligned), pad 9, C 10-11, D 12-20 (9:
  aligned), E 21-25 (5: not), F 26-32 (7: aligned), pad 33. Slots: A 0-2, B 4-9, pad 10, C 11-12,
  D 16-24, E 25-29, F 32-38, pad 39; each chunk is its first token and how many follow. Row 1:
  A 0-5 (aligned), pad 6-11, B 12-14, pad 15-33, no empty slot: a chunk of padding only (tokens
  8-11, 16-19, ...) is empty, one that also holds a document's token (4-7, 12-15) is not."""
  cfg = KVMConfig(**TINY, budget=FixedBudget(4))
  seg = segment_ids_from_lengths(([3, 6, -1, 2, 9, 5, 7, -1], [6, -6, 3, -19]), 34)
  layout = aligned_layout(documents(jnp.asarray(seg)), cfg)
  assert layout_chunks(34, cfg) == 13                  # 34 tokens + 3 slots for each of 5 docs
  empty = [34] * 3                                     # the front chunk; chunks past the row
  np.testing.assert_array_equal(
      layout.offset[0], [34, 0, 3, 7, 11, 12, 16, 20, 24, 26, 30] + empty)
  np.testing.assert_array_equal(layout.count[0], [0, 3, 4, 4, 1, 4, 4, 4, 2, 4, 4, 0, 0, 0])
  np.testing.assert_array_equal(layout.offset[1], [34, 0, 4, 34, 12] + [34] * 9)
  np.testing.assert_array_equal(layout.count[1], [0, 4, 4, 0, 4] + [0] * 9)


def test_documents_filling_the_layout_are_each_alone():
  """Documents one token past the aligned threshold: each takes two chunks of the layout for 6
  tokens, the worst case the layout's capacity covers (its unused chunks are skipped; so is a
  chunk of padding only: row 1's first). Rows of 62 tokens make 23 layout chunks, not a whole
  number of the scan's blocks of 4, and row 0's last document ends in chunk 20, past the last
  whole block: the scan must cover the layout's last chunks too. Row 1 ends with a
  document of whole chunks (16 tokens: no fold after its last chunk)."""
  cfg = KVMConfig(**TINY, **BUDGETS["sqrt"])
  seq_len = 62
  layout = ([2] + [6] * 10, [-1, 6, 6, 3, 6, 6, 6, 6, 6, 16])
  q, k, v, g, params = _kvm_inputs(2, seq_len=seq_len)
  seg = jnp.asarray(segment_ids_from_lengths(layout, seq_len))
  used = np.asarray(aligned_layout(documents(seg), cfg).count > 0)
  assert used.sum(axis=1).tolist() == [21, 19] and layout_chunks(seq_len, cfg) == 23
  block = document_block(-(-seq_len // cfg.chunk_size))   # the scan's: 4 for 16 chunks
  assert np.flatnonzero(used[0, cfg.window_chunks - 1:])[-1] == 20 >= 23 // block * block
  y, state = kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg)
  docs, inputs = documents_alone(layout, q, k, v, g, fills=[0, 0, 0, 1])
  y_alone, _ = kj.kvm_attention(*inputs, params, cfg)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(y[b, t:t + n], y_alone[i, :n]) < OUT_TOL, (b, t, n)
  _assert_last_states_alone(docs, state, q, k, v, g, params, cfg)


def test_pallas_documents_are_each_document_alone_and_route_as_xla():
  """The Pallas kernels (interpret mode) in the document steps: per batch row state row counts in
  the readout's mask and the routing kernels' row bounds. Outputs and the last documents' states
  equal each document run alone (on the XLA scan), and equal the XLA document path's, whose
  routing decisions (as the states' rows show) the kernels reproduce; gradients with respect to
  the inputs and the KVM parameters equal XLA's (tests/kernels/test_documents_kernels.py: the other
  paths and a model's training step)."""
  cfg = KVMConfig(**TINY, **BUDGETS["sat_no_sink_gqa"])  # appends (novelty kernel) and merges
  layout = ([1, 3, 5, 9, -2, 22, 22], [-3, 30, 9, 4, 18])
  q, k, v, g, params = _kvm_inputs(2, H=4, Hkv=2, seed=1)
  seg = jnp.asarray(segment_ids_from_lengths(layout, T))
  pallas = kj.resolve_kvm_backend(cfg, implementation="pallas", readout="own")
  y, state = kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg, backend=pallas)
  y_xla, state_xla = kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg)
  assert rel_rms(y, y_xla) < OUT_TOL
  np.testing.assert_array_equal(np.asarray(state.num_rows), np.asarray(state_xla.num_rows))
  docs, inputs = documents_alone(layout, q, k, v, g, fills=[0, 0, 0, 1])
  y_alone, _ = kj.kvm_attention(*inputs, params, cfg)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(y[b, t:t + n], y_alone[i, :n]) < OUT_TOL, (b, t, n)
  b, t, n = docs[-1]  # row 1's last document (18 tokens: past its first fold), at its length
  part = lambda x: x[b:b + 1, t:t + n]  # noqa: E731
  _, s_alone = kj.kvm_attention(part(q), part(k), part(v), part(g), params, cfg)
  rows = int(s_alone.num_rows)
  assert int(state.num_rows[1]) == rows
  assert rel_rms(state.keys[1, :, :rows], s_alone.keys[0, :, :rows]) < OUT_TOL

  w = jax.random.normal(jax.random.PRNGKey(5), y.shape)
  loss = lambda impl: lambda *a: jnp.sum(  # noqa: E731
      kj.kvm_attention(*a, cfg, segment_ids=seg, backend=impl).y * w)
  grads = [jax.jit(jax.grad(loss(impl), argnums=(0, 1, 2, 3, 4)))(q, k, v, g, params)
           for impl in (pallas, kj.resolve_kvm_backend(cfg, readout="own"))]
  for name, a, e in zip("qkvg", *grads):
    assert rel_rms(a, e) < GRAD_TOL, name
  for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(grads[0][4]),
                          jax.tree_util.tree_leaves(grads[1][4])):
    assert rel_rms(a, e) < GRAD_TOL, jax.tree_util.keystr(path)


@pytest.mark.parametrize("path", ["aligned", "steps"])
def test_padding_changes_nothing_and_stays_finite(path):
  """Padding inputs never reach a document, and a padding token attends to itself alone: its
  output is its value for each query head of its group (two groups of two here), and its
  output's gradient reaches that value only."""
  cfg = KVMConfig(**TINY, **BUDGETS["sqrt"])
  q, k, v, g, params = _kvm_inputs(len(LAYOUT), H=4, Hkv=2)
  seg = jnp.asarray(segment_ids_from_lengths(LAYOUT, T))
  pad = (seg == 0)
  noise = lambda x, s: jnp.where(pad.reshape(pad.shape + (1,) * (x.ndim - 2)),  # noqa: E731
                                 100.0 * jax.random.normal(jax.random.PRNGKey(s), x.shape), x)
  attend = lambda *a: kvm_attention_documents(*a, params, seg, cfg=cfg, path=path)  # noqa: E731
  y1, s1 = attend(q, k, v, g)
  g2 = jnp.where(pad[..., None], 1.0 + jnp.abs(noise(g, 4)), g)
  q2, k2, v2 = noise(q, 1), noise(k, 2), noise(v, 3)
  y2, s2 = attend(q2, k2, v2, g2)
  real = ~np.asarray(pad)
  np.testing.assert_array_equal(np.asarray(y1)[real], np.asarray(y2)[real])
  assert np.all(np.isfinite(np.asarray(y2)))
  for a, b in zip(jax.tree_util.tree_leaves(s1), jax.tree_util.tree_leaves(s2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  group = q.shape[2] // k.shape[2]
  np.testing.assert_allclose(np.asarray(y2)[~real], np.repeat(np.asarray(v2), group, 2)[~real],
                             rtol=1e-6)
  w = jax.random.normal(jax.random.PRNGKey(5), y2.shape)
  dq, dk, dv = jax.jit(jax.grad(lambda *a: jnp.sum(attend(*a, g2)[0] * w), argnums=(0, 1, 2)))(
      q2, k2, v2)
  w_own = np.asarray(w).reshape(w.shape[:2] + (k.shape[2], group, -1)).sum(3)
  np.testing.assert_allclose(np.asarray(dv)[~real], w_own[~real], rtol=1e-5)
  # Zero in exact arithmetic (the output is the value, whatever the query and key). The aligned
  # path gives exact zeros; the steps path forms it as p·(dy·v - dy·y), and the float32 rounding
  # of that cancellation at |v| ~ 300, |k| ~ 300 measures ~1e-3.
  for grad in (dq, dk):
    np.testing.assert_allclose(np.asarray(grad)[~real], 0.0,
                               atol=0.0 if path == "aligned" else 1e-2)


def test_document_blocks_divide_full_rows():
  """A row filled by one document runs exactly its chunks when a divisor of the row's chunk count
  lies near its square root (the paper's 8192 tokens in chunks of 256: 32 chunks, blocks of 8;
  isqrt's blocks of 6 ran 36 chunks); otherwise the block stays about the square root."""
  assert [document_block(n) for n in (16, 32, 64, 128, 7, 33)] == [4, 8, 8, 16, 3, 6]
  for n in range(1, 600):
    block, root = document_block(n), math.sqrt(n)
    near = [d for d in range(1, n + 1) if n % d == 0 and root / 1.5 <= d <= root * 1.5]
    if near:
      assert n % block == 0, (n, block)
    assert root / 2 <= block <= 2 * root + 1, (n, block)


def test_state_steps_fit_the_static_bound():
  """Every state step (a chunk of a document past its window, on the document's own grid) gets a
  slot: the count never exceeds ``max_state_steps``, which one document filling the row reaches."""
  cfg = KVMConfig(**TINY, budget=FixedBudget(4))
  rng = np.random.default_rng(0)
  layouts = [[T]] + [list(rng.multinomial(T, np.ones(k) / k)) for k in (2, 3, 5, 8)]
  layouts = [[n for n in lens if n] for lens in layouts]
  seg = jnp.asarray(segment_ids_from_lengths(layouts, T))
  bound = max_state_steps(T, cfg)
  steps = np.asarray(state_steps(documents(seg), cfg, bound + 4))
  for b, lengths in enumerate(layouts):
    expected = sum(max(0, -(-n // 4) - 2) for n in lengths)  # chunks past the 2-chunk window
    assert (steps[b] < T).sum() == expected <= bound
  assert (steps[0] < T).sum() == bound


def test_document_arguments_are_checked():
  cfg = KVMConfig(**TINY, budget=FixedBudget(4))
  q, k, v, g, params = _kvm_inputs(2)
  seg = jnp.ones((2, T), jnp.int32)
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 64\)"):
    kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg[:, :10])
  with pytest.raises(ValueError, match="must be integers"):
    kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg.astype(jnp.float32))
  with pytest.raises(ValueError, match="must be >= 0"):
    kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=-seg)
  with pytest.raises(ValueError, match="readout='own'"):
    kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg,
                     backend=kj.resolve_kvm_backend(cfg, readout="tokamax"))
  with pytest.raises(ValueError, match="shared routing"):
    kj.kvm_attention(q, k, v, g, params, cfg, segment_ids=seg, return_routing=True)


# -- the model -----------------------------------------------------------------------------------
# tiny: C = 8, window 2 chunks (L = 16), swa window 12, bswa 8 x 2 with one sink. Documents of 1
# token, inside the window (9), just past it (17) and past several budget growth steps (30), with
# boundaries mid-chunk and padding between and after; the chunk-edge lengths are the op's tests.
MODEL_T = 64
MODEL_LAYOUT = ([1, 9, -3, 30, 17, -4], [-2, 17, 30, 9, -6])
MODEL_MIXERS = {"kvm": "kvm", "hybrid": ("full", "swa", "bswa", "kvm"),
                "rwkv7_ovq": ("rwkv7", "ovq")}  # RWKV-7 first: it makes the value anchor
# Cross-layer KV sharing (layers 2 and 3 read layers 0 and 1's K/V): bswa layers fold the
# sources into one attention (FusedKV); kvm layers fuse the window and keep their own state.
MODEL_SHARING = {"fusedkv_bswa": dict(mixers="bswa", kv_sharing="fusedkv"),
                 "fusedkv_kvm": dict(mixers="kvm", kv_sharing="fusedkv")}


packed_forward = nnx.jit(lambda model, tokens, seg: model(tokens, segment_ids=seg))


# hybrid and fusedkv_kvm: the gradient test below checks their logits and padding in CI (its
# program returns the logits), so here they run nightly.
@pytest.mark.parametrize("name", in_ci(list(MODEL_MIXERS) + list(MODEL_SHARING),
                                        {"kvm", "rwkv7_ovq", "fusedkv_bswa"}))
def test_model_documents_are_each_document_alone(name):
  if name in MODEL_SHARING:
    model = make_model(num_layers=4, **MODEL_SHARING[name])
    assert model.cfg.kv_sources(3) is not None and model.cfg.kv_sources(1) is None
  else:
    mixers = MODEL_MIXERS[name]
    model = make_model(mixers, num_layers=len(mixers) if isinstance(mixers, tuple) else 2)
  assert model.cfg.tokenshift_attention and model.cfg.tokenshift_mlp and model.cfg.value_residual
  seg = jnp.asarray(segment_ids_from_lengths(MODEL_LAYOUT, MODEL_T))
  tokens = jax.random.randint(jax.random.PRNGKey(7), seg.shape, 0, model.cfg.vocab_size)
  logits = packed_forward(model, tokens, seg)
  assert np.all(np.isfinite(np.asarray(logits)))
  docs, (rows,) = documents_alone(MODEL_LAYOUT, tokens)
  alone = forward(model, rows)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(logits[b, t:t + n], alone[i, :n]) < OUT_TOL, (b, t, n)
  # Padding tokens change nothing.
  other = jnp.where(seg == 0, (tokens + 17) % model.cfg.vocab_size, tokens)
  np.testing.assert_array_equal(np.asarray(packed_forward(model, other, seg))[np.asarray(seg) != 0],
                                np.asarray(logits)[np.asarray(seg) != 0])


@pytest.mark.parametrize("name", in_ci(["hybrid", "rwkv7_ovq", "fusedkv_kvm"],
                                        {"hybrid", "fusedkv_kvm"}))
def test_model_gradients_are_the_sum_of_each_document_alone(name):
  """The parameters' gradient of a loss on packed rows equals the sum of each document's
  gradient run alone: the whole backward pass (every mixer's document path, token shifts, value
  residual, RoPE positions, KV sharing) keeps documents apart. The loss reads each position's
  logits against fixed random weights (real positions only); alone, each document is a row of
  its own followed by filler, which the causal model's document positions never see. The same
  programs return the logits: each document's equal its own alone, and padding tokens change
  none of them."""
  mixers = MODEL_MIXERS.get(name)
  model = (make_model(num_layers=4, **MODEL_SHARING[name]) if mixers is None else
           make_model(mixers, num_layers=len(mixers)))
  assert model.cfg.tokenshift_attention and model.cfg.tokenshift_mlp and model.cfg.value_residual
  graphdef, params = nnx.split(model, nnx.Param)
  rest = nnx.state(model, nnx.Not(nnx.Param))
  seg = jnp.asarray(segment_ids_from_lengths(MODEL_LAYOUT, MODEL_T))
  tokens = jax.random.randint(jax.random.PRNGKey(7), seg.shape, 0, model.cfg.vocab_size)
  w = jax.random.normal(jax.random.PRNGKey(8), seg.shape + (model.cfg.vocab_size,))
  _, (rows, w_rows, real_rows) = documents_alone(MODEL_LAYOUT, tokens, w, seg != 0)

  def loss(params, tokens, w, real, segment_ids=None):
    logits = nnx.merge(graphdef, params, rest)(tokens, segment_ids=segment_ids)
    return jnp.sum(jnp.where(real[..., None], logits * w, 0.0)), logits

  grad = jax.jit(jax.grad(loss, has_aux=True))
  packed, logits = grad(params, tokens, w, seg != 0, seg)
  alone, alone_logits = grad(params, rows, w_rows, real_rows)
  got, want = jax.tree_util.tree_leaves_with_path(packed), jax.tree_util.tree_leaves(alone)
  assert len(got) == len(want) > 0
  for (path, a), e in zip(got, want):
    assert rel_rms(a, e) < GRAD_TOL, jax.tree_util.keystr(path)
  assert np.all(np.isfinite(np.asarray(logits)))
  docs = list(document_spans(MODEL_LAYOUT))
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(logits[b, t:t + n], alone_logits[i, :n]) < OUT_TOL, (b, t, n)
  other = jnp.where(seg == 0, (tokens + 17) % model.cfg.vocab_size, tokens)
  real = np.asarray(seg) != 0
  np.testing.assert_array_equal(np.asarray(grad(params, other, w, seg != 0, seg)[1])[real],
                                np.asarray(logits)[real])


def test_bf16_documents_are_as_close_to_alone_as_bf16_is_to_float32():
  """bfloat16 activations: each packed document's logits stay as close to the document alone (in
  bfloat16) as bfloat16 itself is to float32 on that document. The packed path sums its softmax
  in other blocks than the alone run, so bf16 rounding differs, but never by more than bf16's own
  error (within 2x; a state or window leak moves logits by O(1))."""
  model = make_model(("swa", "kvm"), num_layers=2, compute_dtype="bfloat16")
  exact = make_model(("swa", "kvm"), num_layers=2)
  layout = ([-3, 30, 17, -14],)      # past the window and the budget's growth steps; mid-chunk
  seg = jnp.asarray(segment_ids_from_lengths(layout, MODEL_T))
  tokens = jax.random.randint(jax.random.PRNGKey(8), seg.shape, 0, model.cfg.vocab_size)
  logits = packed_forward(model, tokens, seg)
  docs, (rows,) = documents_alone(layout, tokens)
  alone, alone_exact = forward(model, rows), forward(exact, rows)
  for i, (b, t, n) in enumerate(docs):
    bf16_error = rel_rms(alone[i, :n], alone_exact[i, :n])
    assert 0 < bf16_error < 0.1, (t, n, bf16_error)
    packed_error = rel_rms(logits[b, t:t + n], alone[i, :n])
    assert packed_error <= 2 * bf16_error, (t, n, packed_error, bf16_error)


# Logits with segment_ids unset, written by the tree before documents existed (commit 2e2c846) with
# exactly the models and tokens of ``_none_path_logits`` below, on a 2-core AMD EPYC without
# AVX-512 (the development machine's CPU on 2026-12-04; an earlier fixture, written on another
# CPU, differed from it by up to 1.1e-6 with the same jax), compiled as the tests compile
# (``fast_compile`` and ``xla_flags``: tests/conftest.py; XLA's default emitters moved these
# logits by up to 7.7e-7).
NONE_PATH_FIXTURE = DATA / "documents" / "none_path_logits.npz"
NONE_PATH_MODELS = {"kvm": dict(mixers="kvm"),
                    "softmax_kvm": dict(mixers="full,swa,bswa,kvm", num_layers=4),
                    "rwkv7_ovq": dict(mixers="rwkv7,ovq"),
                    "fusedkv": dict(mixers="kvm", num_layers=4, kv_sharing="fusedkv")}


def cpu_vector_isa() -> str:
  """The host CPU's vector instruction sets (SSE/AVX/AVX-512/AMX/FMA flags of /proc/cpuinfo),
  sorted and space-separated; "" where /proc/cpuinfo is unreadable. XLA's CPU backend compiles
  for the host's features, so two machines with different sets may round float32 sums
  differently (seen here: logits moved by up to 1.1e-6) while running the same code."""
  try:
    flags_line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags"))
  except (OSError, StopIteration):
    return ""
  prefixes = ("sse", "ssse", "avx", "amx", "fma", "f16c")
  return " ".join(sorted(f for f in flags_line.split(":", 1)[1].split() if f.startswith(prefixes)))


def _none_path_logits(name: str, tokens) -> np.ndarray:
  model = make_model(**NONE_PATH_MODELS[name], seed=7)
  graphdef, params = nnx.split(model)
  return np.asarray(jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", list(NONE_PATH_MODELS))
def test_without_segment_ids_logits_are_bitwise_those_before_documents(name):
  """Documents add code paths, not changes: with ``segment_ids`` unset every kind computes
  bit for bit what it computed before, on the fixture's build (jax version, platform, CPU
  vector instruction sets and the tests' compile settings). Elsewhere XLA's own rounding
  differs, and the logits must agree to float32 rounding (rtol 1e-5 with atol 1e-6 on logits of
  size ~1: between two CPU types the difference measured 1.1e-6 at most, inside this)."""
  fixture = np.load(NONE_PATH_FIXTURE)
  logits = _none_path_logits(name, fixture["tokens"])
  same_build = (str(fixture["jax_version"]) == jax.__version__
                and str(fixture["platform"]) == jax.devices()[0].platform
                and str(fixture["cpu_vector_isa"]) == cpu_vector_isa()
                and bool(fixture["fast_compile"]) == FAST_COMPILE
                and str(fixture["xla_flags"]) == TEST_XLA_FLAGS)
  if same_build:
    np.testing.assert_array_equal(logits, fixture[name])
  else:
    np.testing.assert_allclose(logits, fixture[name], rtol=1e-5, atol=1e-6)


def test_model_refuses_documents_where_it_cannot_keep_them_apart():
  tokens = jnp.zeros((1, 16), jnp.int32)
  seg = jnp.ones((1, 16), jnp.int32)
  shared_routing = make_model("kvm", num_layers=4, kv_sharing="fusedkv",
                              kvm_kv_sharing="shared_routing")
  with pytest.raises(ValueError, match="shared.routing"):
    shared_routing(tokens, segment_ids=seg)
  model = make_model("kvm")
  with pytest.raises(ValueError, match="without a cache"):
    model.blocks[0].attn(jnp.zeros((1, 16, model.cfg.hidden_size)), None,
                         documents(seg).position, model.init_cache(1, 16)[0], False,
                         documents=documents(seg))
  with pytest.raises(ValueError, match=r"segment_ids must have shape \(1, 16\)"):
    make_model("kvm")(tokens, segment_ids=jnp.ones((1, 8), jnp.int32))


# Four lengths (four compiled backwards per op): 1 token, 9 and 17 (mid-chunk boundaries for chunks
# of 4 and 8) and 32; the last document of row 1 ends the row.
RECURRENT_LAYOUT = ([1, 9, 17, -5, 32], [-5, 17, 9, 1, 32])


def test_rwkv7_documents_are_each_document_alone():
  """The chunked RWKV-7 recurrence with ``segment_ids``: outputs and gradients of every document
  as if alone, boundaries anywhere in its chunks (L = 8), the final state the last document's."""
  from kvm_jax.ops.rwkv7.scan import rwkv7_recurrence
  layout = RECURRENT_LAYOUT
  B, H, K, V = 2, 2, 4, 3
  keys = jax.random.split(jax.random.PRNGKey(0), 6)
  r, k, kk, a = (jax.random.normal(keys[i], (B, T, H, K)) for i in range(4))
  w = -jnp.exp(-jax.nn.softplus(-jax.random.normal(keys[4], (B, T, H, K))) - 0.5)
  v = jax.random.normal(keys[5], (B, T, H, V))
  kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
  inputs = (r, w, k, v, -kk, kk * jax.nn.sigmoid(a))
  seg = jnp.asarray(segment_ids_from_lengths(layout, T))
  weights = jax.random.normal(jax.random.PRNGKey(9), (B, T, H, V))
  real = (seg != 0)[..., None, None]

  def packed(*x):
    o, h = rwkv7_recurrence(*x, chunk_size=8, segment_ids=seg)
    return jnp.sum(jnp.where(real, o * weights, 0.0)), (o, h)

  grads, (o, h) = jax.jit(jax.grad(packed, argnums=tuple(range(6)), has_aux=True))(*inputs)
  docs, (*alone_inputs, w1, real1) = documents_alone(layout, *inputs, weights, seg != 0)

  def alone(*x):
    o, h = rwkv7_recurrence(*x, chunk_size=8)
    return jnp.sum(jnp.where(real1[..., None, None], o * w1, 0.0)), (o, h)

  g_alone, (o_alone, h_alone) = jax.jit(jax.grad(alone, argnums=tuple(range(6)), has_aux=True))(
      *alone_inputs)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(o[b, t:t + n], o_alone[i, :n]) < OUT_TOL, (b, t, n)
    for got, want in zip(grads, g_alone):
      # Against the whole gradient's scale: a one-token document's gradient with respect to its
      # decay and removal is exactly 0 alone, and a few ulps of others' rounding when packed.
      error = np.sqrt(np.mean((np.asarray(got[b, t:t + n]) - np.asarray(want[i, :n])) ** 2))
      assert error < GRAD_TOL * np.sqrt(np.mean(np.asarray(got) ** 2)), (b, t, n)
  # Row 1 ends with its last document, the longest (its alone row has no fill after it).
  assert docs[-1][0] == 1 and docs[-1][2] == o_alone.shape[1]
  assert rel_rms(h[1], h_alone[-1]) < OUT_TOL


# The delta-rule case also scores with count bias; the plain running means run nightly.
@pytest.mark.parametrize("cfg", in_ci([dict(), dict(delta_rule=True, normalize_centroids=True)],
                                      {"delta"}, ids=lambda c: "delta" if c else "plain"),
                         ids=lambda c: "delta" if c else "plain")
def test_ovq_documents_are_each_document_alone(cfg):
  """OVQ with ``segment_ids``: each document's outputs and gradients as if alone (chunk 4,
  dictionary of up to 6 centroids, documents of 1 to 32 tokens, boundaries mid-chunk)."""
  from kvm_jax.ops.ovq import ovq_attention
  from kvm_jax.ops.ovq.config import OVQConfig
  from kvm_jax.ops.ovq.documents import ovq_attention_documents
  cfg = OVQConfig(chunk_size=4, max_centroids=6, **cfg)
  layout = RECURRENT_LAYOUT
  B, H = 2, 2
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k = (unit(jax.random.normal(keys[i], (B, T, H, 8))) for i in range(2))
  v = jax.random.normal(keys[2], (B, T, H, 6))
  beta = jnp.array([0.7, 1.3])
  seg = jnp.asarray(segment_ids_from_lengths(layout, T))
  weights = jax.random.normal(jax.random.PRNGKey(9), v.shape)
  real = (seg != 0)[..., None, None]

  def packed(q, k, v, beta):
    y = ovq_attention_documents(q, k, v, beta, seg, cfg)
    return jnp.sum(jnp.where(real, y * weights, 0.0)), y

  grads, y = jax.jit(jax.grad(packed, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, beta)
  # Fill after each document with ones: nonzero queries and keys, whatever the op does with them.
  docs, (q1, k1, v1, w1, real1) = documents_alone(layout, q, k, v, weights, seg != 0,
                                             fills=[1, 1, 0, 0, False])

  def alone(q, k, v, beta):
    y, _ = ovq_attention(q, k, v, beta, cfg)
    return jnp.sum(jnp.where(real1[..., None, None], y * w1, 0.0)), y

  g_alone, y_alone = jax.jit(jax.grad(alone, argnums=(0, 1, 2, 3), has_aux=True))(q1, k1, v1, beta)
  for i, (b, t, n) in enumerate(docs):
    assert rel_rms(y[b, t:t + n], y_alone[i, :n]) < OUT_TOL, (b, t, n)
    for got, want in zip(grads[:3], g_alone[:3]):
      error = np.sqrt(np.mean((np.asarray(got[b, t:t + n]) - np.asarray(want[i, :n])) ** 2))
      assert error < GRAD_TOL * np.sqrt(np.mean(np.asarray(got) ** 2)), (b, t, n)
  assert rel_rms(grads[3], g_alone[3]) < GRAD_TOL


def test_an_update_kernel_returning_a_plain_tuple_still_runs_the_aligned_documents():
  """A ``ChunkOps.update_fn`` written to the earlier contract (``(state, (dest, target))`` as a
  plain tuple, not ``RoutedUpdate``) runs the aligned documents path, bitwise as the built-in."""
  import dataclasses
  from kvm_jax.ops.kvm.scan import XLA_OPS
  from kvm_jax.ops.kvm.state import update_state

  def plain(*args, **kwargs):
    out = update_state(*args, **kwargs)
    return (out[0], tuple(out[1])) if kwargs.get("return_routing") else out
  cfg = KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=4,
                  budget=FixedBudget(6))
  q, k, v, g, params = _kvm_inputs(1, H=2, Hkv=2, seed=3, seq_len=40)
  seg = jnp.asarray(segment_ids_from_lengths(([9, 20, -3, 8],), 40))
  run = lambda ops: kvm_attention_documents(q, k, v, g, params, seg, cfg=cfg, ops=ops,  # noqa: E731
                                            path="aligned")
  (y, state), (y_old, state_old) = run(XLA_OPS), run(dataclasses.replace(XLA_OPS, update_fn=plain))
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y_old))
  np.testing.assert_array_equal(np.asarray(state.keys), np.asarray(state_old.keys))
