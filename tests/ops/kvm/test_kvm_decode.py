"""Prefill + token-by-token decode reproduces the full-sequence outputs and final state."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.ops.kvm.cases import (TOLERANCE, random_inputs, random_params, rel_rms, select,
                                   valid_rows)
from tests.helpers import in_ci

TOL = TOLERANCE["float32"]["output"]  # same terms summed in another order (cases.TOLERANCE)
CASES = {c.name: c for c in select("decode")}


@pytest.fixture(scope="module")
def decode_step_jit():
  """One jitted decode step for every test: the position is traced, so it never retraces."""
  return jax.jit(kj.kvm_decode_step, static_argnames=("cfg",))


@pytest.mark.parametrize("name", in_ci(sorted(CASES), {"decode_powerlaw_gqa",
                                                        "decode_saturating_nb3_gated_init"}))
def test_decode_after_prefill_matches_full_sequence(name, decode_step_jit):
  case = CASES[name]
  cfg, B, T, Hkv = case.cfg, case.batch, case.seq_len, case.kv_heads
  D, Dv = case.head_dim, case.value_dim
  q, k, v, g, params = case.inputs(11)
  y_full, s_full = kj.kvm_attention(q, k, v, g, params, cfg)
  cache0 = kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D, value_dim=Dv, max_len=T)
  assert cache0.state.capacity == kj.state_rows_after(cfg, T)
  # Prefixes: 1 token, < C, < L, exactly L, ragged past L, past the first update.
  for prefix in (1, 3, 7, 8, 10, 17):
    y_pre, cache = kj.kvm_prefill(q[:, :prefix], k[:, :prefix], v[:, :prefix], g[:, :prefix],
                                  params, cfg, cache0)
    assert rel_rms(y_pre, y_full[:, :prefix]) < TOL, prefix
    outs = [y_pre]
    for t in range(prefix, T):
      s = slice(t, t + 1)
      y_t, cache = decode_step_jit(q[:, s], k[:, s], v[:, s], g[:, s], params, cfg, cache)
      outs.append(y_t)
    assert rel_rms(jnp.concatenate(outs, axis=1), y_full) < TOL, prefix
    np.testing.assert_array_equal(cache.length, [T] * cache.length.shape[0])  # one per row
    np.testing.assert_array_equal(cache.state.num_rows, int(s_full.num_rows))
    n = int(s_full.num_rows)
    for got, want in zip(valid_rows(cache.state), valid_rows(s_full)):
      assert rel_rms(got, want) < TOL, prefix
    # Rows beyond the count stay zero (nothing written outside the schedule).
    assert not np.any(np.asarray(cache.state.keys[:, :, n:]))


def test_decode_from_empty_cache_and_single_trace():
  case = CASES["decode_powerlaw_gqa"]
  cfg, H, Hkv = case.cfg, case.heads, case.kv_heads
  B, D, Dv, n = 1, 8, 6, 23
  q, k, v, g = random_inputs(5, B, n, H, Hkv, D, Dv)
  params = random_params(5, D, H)
  y_full, _ = kj.kvm_attention(q, k, v, g, params, cfg)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(q_t, k_t, v_t, g_t, cache):
    return kj.kvm_decode_step(q_t, k_t, v_t, g_t, params, cfg, cache)

  cache = kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D, value_dim=Dv, max_len=n)
  outs = []
  for t in range(n):  # every position, including updates and initial-state growth, one trace
    y_t, cache = step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1], cache)
    outs.append(y_t)
  assert rel_rms(jnp.concatenate(outs, axis=1), y_full) < TOL
  chex.clear_trace_counter()


def test_decode_past_max_len_is_an_error_or_nan():
  case = CASES["decode_fixed_C"]
  cfg, H, Hkv = case.cfg, case.heads, case.kv_heads
  B, D, Dv, n = 1, 8, 6, 5
  q, k, v, g = random_inputs(6, B, n + 1, H, Hkv, D, Dv)
  params = random_params(6, D, H)
  cache = kj.kvm_init_cache(cfg, batch=B, kv_heads=Hkv, head_dim=D, value_dim=Dv, max_len=n)
  _, cache = kj.kvm_prefill(q[:, :n], k[:, :n], v[:, :n], g[:, :n], params, cfg, cache)
  last = (q[:, n:], k[:, n:], v[:, n:], g[:, n:])
  with pytest.raises(ValueError, match="max_len"):
    kj.kvm_decode_step(*last, params, cfg, cache)
  # Under an outer jit the position is traced: the output is poisoned, never silently wrong.
  y, _ = jax.jit(lambda c: kj.kvm_decode_step(*last, params, cfg, c))(cache)
  assert np.all(np.isnan(np.asarray(y)))
  with pytest.raises(ValueError, match="max_len"):
    kj.kvm_prefill(q, k, v, g, params, cfg, cache)


def test_cache_bytes_are_measured_from_arrays():
  cfg = kj.KVMConfig(chunk_size=256, window_chunks=2, rope_dims=32, budget=kj.FixedBudget(256))
  cache = kj.kvm_init_cache(cfg, batch=1, kv_heads=4, head_dim=64, value_dim=64, max_len=16384,
                            dtype=jnp.bfloat16)
  sizes = cache.nbytes()
  # state: keys + values (f32, 256 rows) + radius (f32) + num_rows (int32), and its normalized
  # readout (keys + values in the cache's bf16)
  assert sizes["state"] == 4 * 256 * (64 + 64 + 1) * 4 + 4 + 4 * 256 * (64 + 64) * 2
  # window ring: L = 512 tokens of bf16 keys and values + f32 gates
  assert sizes["window"] == 512 * 4 * (64 + 64) * 2 + 512 * 4 * 4


def test_kvm_attention_traces_once_per_shape():
  case = CASES["decode_powerlaw_gqa"]
  cfg, H, Hkv = case.cfg, case.heads, case.kv_heads

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(q, k, v, g, params):
    return kj.kvm_attention(q, k, v, g, params, cfg)

  for seed in range(3):  # new values, same shapes: no retrace
    q, k, v, g = random_inputs(seed, 1, 19, H, Hkv, 8, 6)
    run(q, k, v, g, random_params(seed, 8, H))
  chex.clear_trace_counter()
