"""Hand-computed cases: every expectation is written from the spec's formulas in numpy.

Setup: D = 4, no RoPE channels, LN_s at init (weight 1, bias 0). The vectors e1, e2, e3 below are
orthogonal, zero-mean and unit-variance, so prep(e) = e / sqrt(1 + eps) and similarities are
easy to read: e_i · LN(e_j) = 4/sqrt(1+eps) for i = j and 0 otherwise. C = 2 and one window chunk
(L = 2), so with T = 6 exactly one update fires: after query chunk [2, 4), folding tokens 2 and 3
(ctx_len = 4, available = 4) into the 2-row initial state [token 0, token 1].
Each case runs through all three implementations: oracle, chunked scan, and prefill + decode.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import kvm_jax as kj

EPS = 1e-5
E1 = np.array([1.0, -1.0, 1.0, -1.0])
E2 = np.array([1.0, 1.0, -1.0, -1.0])
E3 = np.array([1.0, -1.0, -1.0, 1.0])
T, D, DV = 6, 4, 3


def ln(x, w=np.ones(D), b=np.zeros(D)):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / np.sqrt(var + EPS) * w + b


def _cfg(**kw):
  base = dict(chunk_size=2, window_chunks=1, sink_rows=0, rope_dims=0,
              budget=kj.FixedBudget(rows=2), head_temperatures=False)
  base.update(kw)
  return kj.KVMConfig(**base)


def _values():
  return np.random.default_rng(0).normal(size=(T, DV))


def _run_all(cfg, keys, values, gates, queries=None):
  """Returns [(y, state)] for oracle, scan, and prefill(3)+decode; batch 1, one head."""
  if queries is None:
    queries = np.random.default_rng(1).normal(size=(T, D))
  q = jnp.asarray(queries, jnp.float32)[None, :, None, :]
  k = jnp.asarray(keys, jnp.float32)[None, :, None, :]
  v = jnp.asarray(values, jnp.float32)[None, :, None, :]
  g = jnp.asarray(gates, jnp.float32)[None, :, None]
  params = kj.KVMParams.init(D, 1)
  results = [kj.kvm_attention_reference(q, k, v, g, params, cfg),
             kj.kvm_attention(q, k, v, g, params, cfg)]
  cache = kj.kvm_init_cache(cfg, batch=1, kv_heads=1, head_dim=D, value_dim=DV, max_len=T)
  y, cache = kj.kvm_prefill(q[:, :3], k[:, :3], v[:, :3], g[:, :3], params, cfg, cache)
  ys = [y]
  for t in range(3, T):
    y, cache = kj.kvm_decode_step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g[:, t:t + 1],
                                  params, cfg, cache)
    ys.append(y)
  results.append((jnp.concatenate(ys, axis=1), cache.state))
  return results


def _state(state):
  n = int(np.asarray(state.num_rows).reshape(-1)[0])  # batch row 0's (a cache counts per row)
  return (np.asarray(state.keys[0, 0, :n]), np.asarray(state.values[0, 0, :n]),
          np.asarray(state.radius[0, 0, :n]))


def test_two_token_merge_and_readout():
  keys = np.stack([E1, E2, E2, E1, E3, E2])   # token 2 ~ row 1, token 3 ~ row 0
  values = _values()
  gates = np.array([1.0, 1.0, 1.5, 0.5, 1.0, 1.0])
  queries = np.random.default_rng(1).normal(size=(T, D))
  want_keys = np.stack([ln(E1) + 0.5 * ln(E1), ln(E2) + 1.5 * ln(E2)])
  want_values = np.stack([values[0] + 0.5 * values[3], values[1] + 1.5 * values[2]])
  want_radius = np.linalg.norm(values[:2], axis=-1)       # radius fixed at row creation
  # Readout for query 4 (window = token 4 only) and query 5 (tokens 4, 5), docs/kvm-spec.md §6.6.
  read_k = ln(want_keys)
  read_v = want_values / np.linalg.norm(want_values, axis=-1, keepdims=True) * want_radius[:, None]
  def attend(t, window):
    kk = np.concatenate([read_k, keys[window]])
    vv = np.concatenate([read_v, values[window]])
    s = kk @ queries[t] / np.sqrt(D)
    p = np.exp(s - s.max())
    return p / p.sum() @ vv
  want_y4, want_y5 = attend(4, [4]), attend(5, [4, 5])
  # Query 2 (before the update): initial state [prep(k0), prep(k1)] and window token 2.
  init_k = ln(np.stack([ln(E1), ln(E2)]))
  s = np.concatenate([init_k, keys[[2]]]) @ queries[2] / np.sqrt(D)
  p = np.exp(s - s.max())
  want_y2 = p / p.sum() @ np.concatenate([values[:2], values[[2]]])
  for y, state in _run_all(_cfg(), keys, values, gates, queries):
    got_k, got_v, got_r = _state(state)
    np.testing.assert_allclose(got_k, want_keys, atol=1e-5)
    np.testing.assert_allclose(got_v, want_values, atol=1e-5)
    np.testing.assert_allclose(got_r, want_radius, atol=1e-5)
    y = np.asarray(y[0, :, 0])
    np.testing.assert_allclose(y[2], want_y2, atol=1e-5)
    np.testing.assert_allclose(y[4], want_y4, atol=1e-5)
    np.testing.assert_allclose(y[5], want_y5, atol=1e-5)


def test_append_picks_least_similar_token_and_merge_sees_it():
  keys = np.stack([E1, E2, E1, E3, E1, E2])   # token 3 (e3) is orthogonal to both rows
  values = _values()
  gates = np.array([1.0, 1.0, 2.0, 3.0, 1.0, 1.0])
  cfg = _cfg(budget=kj.FixedBudget(rows=3))  # one append: desired = min(3, available 4) = 3
  for _, state in _run_all(cfg, keys, values, gates):
    got_k, got_v, got_r = _state(state)
    assert got_k.shape[0] == 3
    np.testing.assert_allclose(got_k[2], ln(E3), atol=1e-5)          # appended ungated
    np.testing.assert_allclose(got_v[2], values[3], atol=1e-5)
    np.testing.assert_allclose(got_r[2], np.linalg.norm(values[3]), atol=1e-5)
    np.testing.assert_allclose(got_k[0], ln(E1) + 2.0 * ln(E1), atol=1e-5)  # token 2 merged
    np.testing.assert_allclose(got_v[0], values[0] + 2.0 * values[2], atol=1e-5)
    np.testing.assert_allclose(got_k[1], ln(E2), atol=1e-5)


def test_sink_never_receives_merges():
  keys = np.stack([E1, E2, E1, E1, E3, E2])   # both overflow tokens are copies of the sink key
  values = _values()
  gates = np.array([1.0, 1.0, 1.5, 0.5, 1.0, 1.0])
  for _, state in _run_all(_cfg(sink_rows=1), keys, values, gates):
    got_k, got_v, _ = _state(state)
    np.testing.assert_allclose(got_k[0], ln(E1), atol=1e-6)          # sink untouched
    np.testing.assert_allclose(got_v[0], values[0], atol=1e-6)
    np.testing.assert_allclose(got_k[1], ln(E2) + 2.0 * ln(E1), atol=1e-5)
    np.testing.assert_allclose(got_v[1], values[1] + 1.5 * values[2] + 0.5 * values[3], atol=1e-5)


def test_merge_ties_go_to_lowest_row():
  keys = np.stack([E2, E2, E2, E1, E3, E2])   # rows 0 and 1 identical; token 2 ties, token 3 ties
  values = _values()
  gates = np.ones(T)
  for _, state in _run_all(_cfg(), keys, values, gates):
    _, got_v, _ = _state(state)
    np.testing.assert_allclose(got_v[0], values[0] + values[2] + values[3], atol=1e-5)
    np.testing.assert_allclose(got_v[1], values[1], atol=1e-6)


def test_novelty_ties_append_lowest_token_index():
  keys = np.stack([E1, E2, E3, E3, E1, E2])   # tokens 2 and 3 equally novel; one append
  values = _values()
  gates = np.array([1.0, 1.0, 1.0, 0.25, 1.0, 1.0])
  for _, state in _run_all(_cfg(budget=kj.FixedBudget(rows=3)), keys, values, gates):
    got_k, got_v, got_r = _state(state)
    np.testing.assert_allclose(got_r[2], np.linalg.norm(values[2]), atol=1e-5)  # token 2 appended
    # token 3 then merges into the row appended in the same update (post-append routing)
    np.testing.assert_allclose(got_k[2], ln(E3) + 0.25 * ln(E3), atol=1e-5)
    np.testing.assert_allclose(got_v[2], values[2] + 0.25 * values[3], atol=1e-5)


def test_rope_channels_are_zeroed_then_layer_normed():
  """prep(k): RoPE channels zeroed *before* LN_s, so they come out as the LN bias
  (docs/kvm-spec.md §11.2)."""
  from kvm_jax.ops.kvm.state import prepare_state_keys
  cfg = _cfg(rope_dims=2)
  params = kj.KVMParams(ln_scale=jnp.array([2.0, 3.0, 0.5, 1.5]),
                        ln_bias=jnp.array([0.1, -0.2, 0.3, 0.4]),
                        window_temperature=jnp.ones(1), state_temperature=jnp.ones(1))
  k = jnp.array([5.0, 7.0, 1.0, -1.0])
  want = ln(np.array([0.0, 0.0, 1.0, -1.0]), np.asarray(params.ln_scale), np.asarray(params.ln_bias))
  got = np.asarray(prepare_state_keys(k, params, cfg))
  np.testing.assert_allclose(got, want, atol=1e-6)
  assert got[0] != 0 and got[1] != 0
