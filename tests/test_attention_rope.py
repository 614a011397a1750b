"""Baseline attention mixers and RoPE against dense, obviously-correct references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvm_jax.ops import attention as att
from kvm_jax.ops.rope import linspace01, apply_rope, rope_frequencies, rope_tables
from kvm_jax.ops.kvm.cases import random_inputs, rel_rms


def dense_reference(q, k, v, visible):
  """softmax(q·k/√D) v with an explicit boolean ``visible[p, j]`` mask, GQA by repetition."""
  H, Hkv = q.shape[2], k.shape[2]
  k = np.repeat(np.asarray(k, np.float64), H // Hkv, axis=2)
  v = np.repeat(np.asarray(v, np.float64), H // Hkv, axis=2)
  s = np.einsum("bqhd,bkhd->bhqk", np.asarray(q, np.float64), k) / np.sqrt(q.shape[-1])
  s = np.where(visible[None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  return np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def masks(T, kind, window=0, C=0, nb=0, sinks=0):
  p = np.arange(T)[:, None]
  j = np.arange(T)[None, :]
  causal = j <= p
  if kind == "full":
    return causal
  if kind == "swa":
    return causal & (j > p - window)
  return causal & ((j // C >= p // C - nb + 1) | (j < sinks))


KINDS = [("full", {}), ("swa", dict(window=5)), ("bswa", dict(chunk_size=4, window_chunks=2)),
         ("bswa_sink", dict(chunk_size=4, window_chunks=2, sink_rows=2))]


def _prefill(kind, q, k, v, kw):
  if kind == "full":
    return att.full_attention(q, k, v)
  if kind == "swa":
    return att.sliding_window_attention(q, k, v, kw["window"])
  return att.block_sliding_window_attention(q, k, v, **kw)


@pytest.mark.parametrize("kind, kw", KINDS, ids=[k for k, _ in KINDS])
def test_prefill_matches_dense_mask_and_decode_matches_prefill(kind, kw):
  B, T, H, Hkv, D = 2, 19, 4, 2, 8
  q, k, v, _ = random_inputs(0, B, T, H, Hkv, D, D)
  visible = masks(T, kind.split("_")[0], kw.get("window", 0), kw.get("chunk_size", 0),
                  kw.get("window_chunks", 0), kw.get("sink_rows", 0))
  y = _prefill(kind.split("_")[0], q, k, v, kw)
  assert rel_rms(y, dense_reference(q, k, v, visible)) < 1e-5
  cache0 = att.init_ring_cache(kind.split("_")[0], batch=B, kv_heads=Hkv, head_dim=D,
                               value_dim=D, max_len=T, **kw)
  for prefix in (1, 6, 11):
    cache = att.ring_prefill(k[:, :prefix], v[:, :prefix], cache0)
    outs = [y[:, :prefix]]
    for t in range(prefix, T):
      y_t, cache = att.ring_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], cache)
      outs.append(y_t)
    assert rel_rms(jnp.concatenate(outs, axis=1), y) < 1e-5, prefix


def test_rope_frequency_rule_and_pairs():
  f = rope_frequencies(head_dim=12, rope_dims=8, theta=10000.0)
  # linspace(0, 1, 4) exponents: f from 1 down to exactly 1/theta, pairs share a frequency
  np.testing.assert_allclose(f[:8:2], (1 / 10000.0) ** np.linspace(0, 1, 4), rtol=1e-6)
  np.testing.assert_array_equal(f[0::2][:4], f[1::2][:4])
  assert f[0] == 1.0 and np.isclose(f[6], 1e-4) and not np.any(f[8:])


# float32 bit patterns of torch.linspace(0, 1, n) (torch 2.13, CPU) at the entries where numpy's
# linspace differs from it: n = 32 are the exponents of the paper's 64 rotary channels, n = 64 of
# the hybrids' full-RoPE SWA layers (128 channels).
TORCH_LINSPACE_BITS = {
    32: {18: 0x3F14A52A, 22: 0x3F35AD6C, 26: 0x3F56B5AE, 30: 0x3F77BDF0},
    64: {3: 0x3D430C32, 6: 0x3DC30C32, 7: 0x3DE38E3A, 12: 0x3E430C32, 13: 0x3E534D36,
         14: 0x3E638E3A},
}


def test_rope_exponents_are_torch_linspace_bit_for_bit():
  """The authors' RoPE exponents come from torch.linspace in float32; numpy's linspace rounds
  some of them differently, and a last-bit difference in a frequency flips roundings of the
  bfloat16 tables (logits 2e-5 apart instead of 6e-7 on a hybrid of their checkpoints)."""
  for n, bits in TORCH_LINSPACE_BITS.items():
    ours = linspace01(n).view(np.uint32)
    numpy_own = np.linspace(0, 1, n, dtype=np.float32).view(np.uint32)
    for i, want in bits.items():
      assert ours[i] == want and numpy_own[i] != want, (n, i)
  assert linspace01(1).tolist() == [0.0] and linspace01(2).tolist() == [0.0, 1.0]


def test_rope_rotation_sign_nope_channels_and_relative_positions():
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 3, 2, 12))
  cos, sin = rope_tables(jnp.arange(3)[None], 12, 8)
  y = apply_rope(x, cos, sin)
  np.testing.assert_array_equal(np.asarray(y[..., 8:]), np.asarray(x[..., 8:]))  # NoPE untouched
  a = 2 * rope_frequencies(12, 8)[0]  # position 2, pair 0 (f = 1)
  want0 = np.cos(a) * x[0, 2, 0, 0] + np.sin(a) * x[0, 2, 0, 1]
  want1 = np.cos(a) * x[0, 2, 0, 1] - np.sin(a) * x[0, 2, 0, 0]
  np.testing.assert_allclose([y[0, 2, 0, 0], y[0, 2, 0, 1]], [want0, want1], rtol=1e-5)
  # q·k depends only on the position difference.
  q = jax.random.normal(jax.random.PRNGKey(1), (12,))
  k = jax.random.normal(jax.random.PRNGKey(2), (12,))
  def dot_at(pq, pk):
    cq, sq = rope_tables(jnp.array([[pq]]), 12, 8)
    ck, sk = rope_tables(jnp.array([[pk]]), 12, 8)
    return float(jnp.sum(apply_rope(q[None, None, None], cq, sq) * apply_rope(k[None, None, None], ck, sk)))
  np.testing.assert_allclose(dot_at(7, 3), dot_at(104, 100), rtol=1e-4)
  assert abs(dot_at(7, 3) - dot_at(7, 5)) > 1e-3


def test_rope_bf16_tables_round_like_the_authors():
  cos32, _ = rope_tables(jnp.arange(50)[None], 8, 8)
  cos16, _ = rope_tables(jnp.arange(50)[None], 8, 8, table_dtype=jnp.bfloat16)
  assert cos16.dtype == jnp.bfloat16
  err = np.abs(np.asarray(cos16, np.float32) - np.asarray(cos32)).max()
  assert 0 < err < 2 ** -8
