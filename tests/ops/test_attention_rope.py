"""Baseline attention mixers and RoPE against dense, obviously-correct references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvm_jax.ops.attention import dense as att
from kvm_jax.ops.documents import WindowRule
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


def _rule(kind, kw) -> WindowRule:
  """The decode ring's rule for a case of :data:`KINDS`."""
  kind = kind.split("_")[0]
  if kind == "full":
    return WindowRule("causal")
  if kind == "swa":
    return WindowRule("sliding", window=kw["window"])
  return WindowRule("chunks", chunk=kw["chunk_size"], window_chunks=kw["window_chunks"])


def test_a_ring_is_built_from_its_rule_only():
  """A layer kind's name is not a rule: refused, naming the fix."""
  sizes = dict(batch=1, kv_heads=1, head_dim=4, value_dim=4, max_len=16)
  with pytest.raises(TypeError, match=r"rule='swa' is not a WindowRule"):
    att.init_ring_cache("swa", **sizes)


@pytest.mark.parametrize("kind, kw", KINDS, ids=[k for k, _ in KINDS])
def test_prefill_matches_dense_mask_and_decode_matches_prefill(kind, kw):
  B, T, H, Hkv, D = 2, 19, 4, 2, 8
  q, k, v, _ = random_inputs(0, B, T, H, Hkv, D, D)
  visible = masks(T, kind.split("_")[0], kw.get("window", 0), kw.get("chunk_size", 0),
                  kw.get("window_chunks", 0), kw.get("sink_rows", 0))
  y = _prefill(kind.split("_")[0], q, k, v, kw)
  assert rel_rms(y, dense_reference(q, k, v, visible)) < 1e-5
  cache0 = att.init_ring_cache(_rule(kind, kw), batch=B, kv_heads=Hkv, head_dim=D, value_dim=D,
                               max_len=T, sink_rows=kw.get("sink_rows", 0))
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


# float32 bit patterns of torch.linspace(0, 1, n) (torch 2.13, CPU): n = 32 gives the exponents of
# the paper's 64 rotary channels, n = 64 those of the hybrids' full-RoPE SWA layers (128 channels).
TORCH_LINSPACE_BITS = {
    32: [0x00000000, 0x3D042108, 0x3D842108, 0x3DC6318C, 0x3E042108, 0x3E25294A, 0x3E46318C,
         0x3E6739CE, 0x3E842108, 0x3E94A529, 0x3EA5294A, 0x3EB5AD6B, 0x3EC6318C, 0x3ED6B5AD,
         0x3EE739CE, 0x3EF7BDEF, 0x3F042108, 0x3F0C6319, 0x3F14A52A, 0x3F1CE73A, 0x3F25294A,
         0x3F2D6B5B, 0x3F35AD6C, 0x3F3DEF7C, 0x3F46318C, 0x3F4E739D, 0x3F56B5AE, 0x3F5EF7BE,
         0x3F6739CE, 0x3F6F7BDF, 0x3F77BDF0, 0x3F800000],
    64: [0x00000000, 0x3C820821, 0x3D020821, 0x3D430C32, 0x3D820821, 0x3DA28A29, 0x3DC30C32,
         0x3DE38E3A, 0x3E020821, 0x3E124925, 0x3E228A29, 0x3E32CB2D, 0x3E430C32, 0x3E534D36,
         0x3E638E3A, 0x3E73CF3E, 0x3E820821, 0x3E8A28A3, 0x3E924925, 0x3E9A69A7, 0x3EA28A29,
         0x3EAAAAAB, 0x3EB2CB2D, 0x3EBAEBAF, 0x3EC30C32, 0x3ECB2CB4, 0x3ED34D36, 0x3EDB6DB8,
         0x3EE38E3A, 0x3EEBAEBC, 0x3EF3CF3E, 0x3EFBEFC0, 0x3F020820, 0x3F061861, 0x3F0A28A2,
         0x3F0E38E3, 0x3F124924, 0x3F165965, 0x3F1A69A6, 0x3F1E79E7, 0x3F228A28, 0x3F269A69,
         0x3F2AAAAA, 0x3F2EBAEB, 0x3F32CB2C, 0x3F36DB6D, 0x3F3AEBAE, 0x3F3EFBF0, 0x3F430C31,
         0x3F471C72, 0x3F4B2CB3, 0x3F4F3CF4, 0x3F534D35, 0x3F575D76, 0x3F5B6DB7, 0x3F5F7DF8,
         0x3F638E39, 0x3F679E7A, 0x3F6BAEBB, 0x3F6FBEFC, 0x3F73CF3D, 0x3F77DF7E, 0x3F7BEFBF,
         0x3F800000],
}


def test_rope_exponents_are_torch_linspace_bit_for_bit():
  """The authors' RoPE exponents come from torch.linspace in float32, whose entries numpy's
  linspace rounds differently in places; a last-bit difference in a frequency flips roundings of
  the bfloat16 tables (logits 1e-5 apart instead of 6e-7 on their hybrids' checkpoints)."""
  for n, bits in TORCH_LINSPACE_BITS.items():
    want = np.array(bits, np.uint32)
    np.testing.assert_array_equal(linspace01(n).view(np.uint32), want, err_msg=str(n))
    assert np.any(np.linspace(0, 1, n, dtype=np.float32).view(np.uint32) != want)
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
