"""kvm_jax.nn.introspect: the attention map reproduces the layer's output, the update anatomy is the
update the scan applies."""

from __future__ import annotations

import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.nn import introspect
from kvm_jax.ops.kvm.cases import random_inputs, random_params, rel_rms

CFG = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                   budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))

# Valid state rows that chunk c's queries see, worked out by hand for CFG and T = 56 (not read from
# kvm_schedule): chunks 0 and 1 lie inside the first window (L = 16 tokens) and see no state;
# chunk 2 sees the initial state, the first C = 8 tokens; after each chunk c >= 2 an update grows
# the state to floor(4 * sqrt(end of chunk c)) rows, at most C = 8 more: after chunk 2
# min(floor(4 * sqrt(24)) = 19, 8 + 8) = 16, after 3 floor(4 * sqrt(32)) = 22, after 4
# floor(4 * sqrt(40)) = 25, so chunk 5 sees 25.
STATE_ROWS_SEEN_BY = {0: 0, 1: 0, 2: 8, 5: 25}


@pytest.fixture(scope="module")
def layer():
  q, k, v, g = random_inputs(0, 2, 56, 4, 2, 16, 16)
  return q, k, v, g, random_params(0, 16, 4)


@pytest.mark.parametrize("chunk", [0, 1, 2, 5])
def test_attention_map_reproduces_the_output(layer, chunk):
  q, k, v, g, params = layer
  y, _ = kj.kvm_attention(q, k, v, g, params, CFG)
  amap = introspect.chunk_attention(q, k, v, g, params, CFG, chunk)
  np.testing.assert_allclose(np.asarray(amap["probs"]).sum(-1), 1.0, rtol=1e-5)
  assert rel_rms(amap["output"], y[:, chunk * 8:(chunk + 1) * 8]) < 1e-5
  R = amap["capacity"]
  probs = np.asarray(amap["probs"])
  assert np.all(probs[..., amap["state_rows"]:R] == 0)          # invalid state rows
  assert np.all(probs[..., R:][..., amap["window_positions"] < 0] == 0)  # before the start
  assert amap["state_rows"] == STATE_ROWS_SEEN_BY[chunk]


def test_update_anatomy_is_the_applied_update(layer):
  q, k, v, g, params = layer
  sched = kj.kvm_schedule(CFG, 56)
  chunk = next(c for c, u in enumerate(sched.update_after) if u and sched.n_append[c] > 0)
  info = introspect.update_anatomy(k, v, g, params, CFG, chunk)
  n = sched.n_append[chunk]
  assert info["rows_after"] - info["rows_before"] == n
  assert np.all(info["appended"].sum(-1) == n)
  # The appended tokens are the n least novel-similar ones, and they take rows in token order.
  for b in range(2):
    for h in range(2):
      chosen = np.flatnonzero(info["appended"][b, h])
      assert set(chosen) == set(np.argsort(info["novelty"][b, h], kind="stable")[:n])
      assert list(info["dest"][b, h][chosen]) == list(range(info["rows_before"],
                                                          info["rows_before"] + n))
  assert np.all(info["target"][~info["appended"]] >= CFG.sink_rows)  # never into the sink
  assert np.all(info["target"][info["appended"]] == -1)
  # Radii change only where tokens were appended.
  grew = info["radius_after"] != info["radius_before"]
  assert np.all(np.flatnonzero(grew.any(axis=(0, 1))) >= info["rows_before"])
  with pytest.raises(ValueError, match="no state update runs after chunk 0"):
    introspect.update_anatomy(k, v, g, params, CFG, 0)
