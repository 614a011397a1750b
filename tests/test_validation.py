"""Bad input fails early with a ValueError that names the bad value and the fix."""

from __future__ import annotations

import pytest

import kvm_jax as kj
from kvm_jax.ops.kvm.cases import random_inputs, random_params

CFG = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                   budget=kj.FixedBudget(4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(window_chunks=0), "window_chunks"),
    (dict(rope_dims=3), "rope_dims must be even"),
    (dict(sink_rows=4), "sink_rows=4 must be < chunk_size=4"),
    (dict(budget=kj.FixedBudget(1)), "not above sink_rows"),
    (dict(budget=kj.SaturatingBudget(limit=1)), "not above sink_rows"),
    (dict(budget="sqrt"), "budget"),
    (dict(max_state_rows=1), "max_state_rows"),
    (dict(value_norm="mean"), "value_norm"),
    (dict(readout_value_dtype="int8"), "readout_value_dtype"),
    (dict(gate_keys=1), "gate_keys must be a bool"),
])
def test_config_validation(kwargs, match):
  base = dict(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2, budget=kj.FixedBudget(4))
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    kj.KVMConfig(**base)


@pytest.mark.parametrize("budget, match", [
    (lambda: kj.FixedBudget(0), "rows must be >= 1"),
    (lambda: kj.PowerLawBudget(factor=-1.0), "factor"),
    (lambda: kj.PowerLawBudget(factor=16.0, exponent=2.0), "exponent"),
    (lambda: kj.SaturatingBudget(limit=0), "limit"),
    (lambda: kj.PowerLawBudget(factor=16.0, round_down=0), "round_down"),
])
def test_budget_validation(budget, match):
  with pytest.raises(ValueError, match=match):
    budget()


def test_config_is_hashable_and_frozen():
  assert hash(CFG) == hash(kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                                        budget=kj.FixedBudget(4)))
  with pytest.raises(Exception):
    CFG.chunk_size = 8


def _inputs():
  q, k, v, g = random_inputs(0, 1, 9, 4, 2, 8, 6)
  return q, k, v, g, random_params(0, 8, 4)


@pytest.mark.parametrize("mutate, match", [
    (lambda q, k, v, g, p: (q[0], k, v, g, p), "q must have rank 4"),
    (lambda q, k, v, g, p: (q, k[:, :5], v, g, p), "inconsistent shapes"),
    (lambda q, k, v, g, p: (q, k, v, g[..., 0], p), "merge_gate must have rank 3"),
    (lambda q, k, v, g, p: (q[..., :3, :], k, v, g, p), "multiple of kv heads"),
    (lambda q, k, v, g, p: (q, k[..., :4], v, g, p), "head dim"),
    (lambda q, k, v, g, p: (q, k, v, g.at[0, 3, 1].set(0.0), p), "merge_gate must be > 0"),
    (lambda q, k, v, g, p: (q, k, v, g, kj.KVMParams.init(8, 2)), "window_temperature"),
    (lambda q, k, v, g, p: (q, k, v, g, kj.KVMParams.init(6, 4)), "ln_scale"),
])
def test_input_validation(mutate, match):
  args = mutate(*_inputs())
  with pytest.raises(ValueError, match=match):
    kj.kvm_attention(*args, CFG)
  with pytest.raises(ValueError, match=match):
    kj.kvm_attention_reference(*args, CFG)


def test_rope_dims_larger_than_head_dim():
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, rope_dims=10, budget=kj.FixedBudget(4))
  q, k, v, g, p = _inputs()
  with pytest.raises(ValueError, match="rope_dims=10 exceeds the q/k head dim 8"):
    kj.kvm_attention(q, k, v, g, p, cfg)
  with pytest.raises(ValueError, match="rope_dims"):
    kj.kvm_init_cache(cfg, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=16)


def test_decode_input_validation():
  q, k, v, g, p = _inputs()
  cache = kj.kvm_init_cache(CFG, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=16)
  with pytest.raises(ValueError, match="exactly one token"):
    kj.kvm_decode_step(q[:, :2], k[:, :2], v[:, :2], g[:, :2], p, CFG, cache)
  other = kj.kvm_init_cache(CFG, batch=2, kv_heads=2, head_dim=8, value_dim=6, max_len=16)
  with pytest.raises(ValueError, match="do not match the cache"):
    kj.kvm_decode_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], p, CFG, other)
  with pytest.raises(ValueError, match="max_len must be a positive int"):
    kj.kvm_init_cache(CFG, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=0)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="implementation='triton' is not available"):
    kj.kvm_attention(*_inputs(), CFG, implementation="triton")
  cache = kj.kvm_init_cache(CFG, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=16)
  with pytest.raises(ValueError, match="implementation='triton' is not available"):
    kj.kvm_prefill(*_inputs(), CFG, cache, implementation="triton")
