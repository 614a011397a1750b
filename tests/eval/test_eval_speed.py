"""The speed harness runs on tiny sizes and writes a well-formed table (no timing assertions)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

import kvm_jax as kj
from kvm_jax.eval.bench import speed


def test_kvm_bench_smoke(tmp_path, capsys):
  """Every phase of every arm, the paper's two other baselines included (``--baselines``):
  RWKV-7's decode cache (its state) and the bytes its step must move do not depend on T; OVQ's
  dictionary follows its plateau schedule (341 rows after 512 tokens, 438 after 768)."""
  out = tmp_path / "bench.json"
  assert speed.main(["--lengths", "512,768", "--decode-steps", "2", "--repeats", "1",
                     "--budgets", "fixed256,sqrt16", "--baselines", "ovq,rwkv7", "--heads", "2",
                     "--head-dim", "16", "--json", str(out),
                     "--plot", str(tmp_path / "bench.png")]) == 0
  text = capsys.readouterr().out
  assert "T=   512" in text and "T=   768" in text and "crossover" in text
  assert "rwkv7" in text and "ovq" in text
  rows = json.loads(out.read_text())["rows"]
  assert [r["T"] for r in rows] == [512, 768]
  for r in rows:
    for arm in ("full", "fixed256", "sqrt16", "ovq", "rwkv7"):
      for phase in ("prefill", "backward", "decode"):
        assert r[f"{arm}_{phase}_ms"] > 0, (arm, phase)
    for arm in ("ovq", "rwkv7"):
      assert r[f"{arm}_decode_bytes_accessed"] > 0
    assert r["rwkv7_cache_bytes"] == 2 * 16 * 16 * 4        # H x Dk x Dv float32, B = 1
    assert r["ovq_state_rows"] == speed.OVQ.dictionary_size(r["T"])
    # the dictionary sized for T + 2 tokens (keys, values, counts) and one chunk of keys and
    # values, float32, plus the position
    capacity = speed.OVQ.capacity(r["T"] + 2)
    assert r["ovq_cache_bytes"] == 2 * (capacity * 33 + 256 * 32) * 4 + 4
    # memory is measured from arrays: the full KV cache grows with T, KVM's is bounded
    assert r["full_cache_bytes"] == 2 * 1 * r["T"] * 2 * 16 * 4
    # bytes per decode step: XLA's count for the compiled step and the minimum, both positive
    for arm in ("full", "fixed256", "sqrt16"):
      assert r[f"{arm}_decode_bytes_accessed"] > 0 and r[f"{arm}_decode_min_bytes"] > 0
    # full attention's minimum: the t cached keys and values (t = T, T+1) plus the token's
    # q, k, v in, its k, v written and y out (2 heads of 16, float32)
    assert r["full_decode_min_bytes"] == (2 * r["T"] + 1) / 2 * 2 * 32 * 4 + (32 + 128 + 32) * 4
  assert [r["ovq_state_rows"] for r in rows] == [341, 438]
  assert rows[0]["rwkv7_decode_min_bytes"] == rows[1]["rwkv7_decode_min_bytes"]
  assert rows[1]["ovq_decode_min_bytes"] > rows[0]["ovq_decode_min_bytes"]
  assert rows[1]["fixed256_cache_bytes"] == rows[0]["fixed256_cache_bytes"]
  assert "decode bytes per step" in text
  assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
  with pytest.raises(SystemExit, match="--baselines: unknown 'mamba'"):
    speed.main(["--baselines", "mamba"])


def test_baseline_decode_min_bytes_by_hand():
  """B = 1, H = 2, D = Dv = 16, float32. RWKV-7: the 16 x 16 state read and written per head, the
  token's r, w, k, a, b, v in and o out. OVQ at t = 300 (chunk [256, 512)): the 204 rows of the
  dictionary after one chunk (keys, values, count) and the chunk's 44 earlier tokens (keys and
  values) read, the token's q, k, v in, y out, k and v written into the chunk buffer."""
  assert speed.rwkv7_decode_min_bytes(1, 2, 16, 16, 4) == 2 * (2 * 256 * 4 + 7 * 16 * 4)
  token = 2 * 64 * 4 + 2 * 32 * 4
  assert speed.ovq_decode_min_bytes(speed.OVQ, 300, 1, 1, 2, 16, 16, 4) == (
      2 * (204 * 33 + 44 * 32) * 4 + token)


def test_whole_model_decode_rate(tmp_path, capsys):
  out = tmp_path / "models.json"
  assert speed.main(["--phases", "", "--models", "tiny-kvm,tiny-full,tiny-rwkv7",
                     "--model-context", "40", "--decode-steps", "3", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "model tiny-kvm" in text and "tok/s" in text
  models = {m["model"]: m for m in json.loads(out.read_text())["models"]}
  for m in models.values():
    assert m["tokens_per_s"] > 0 and len(m["cache_bytes_per_layer"]) == 2
  # tiny-full preallocates K and V for context + steps + 2 positions per layer (4 heads of 16,
  # float32); the KVM cache is state + window and does not store every position.
  assert models["tiny-full"]["cache_bytes_per_layer"][0] >= 2 * 45 * 4 * 16 * 4
  # RWKV-7: a 16 x 16 float32 state per head, the last layer input (width 64) and the position
  assert models["tiny-rwkv7"]["cache_bytes_per_layer"][0] == 4 * 16 * 16 * 4 + 64 * 4 + 4


def test_kvm_bench_needs_something_to_time():
  with pytest.raises(SystemExit, match="nothing to time"):
    speed.main(["--phases", ""])


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_bench_config_routes_on_real_key_content(head_dim):
  """The benchmark's state keys keep non-rotary channels, so routing is not degenerate (with
  every channel rotary, prep(k) is all zeros and every token merges into the first non-sink
  row); at the paper's head_dim it is the paper's 64 rotary channels."""
  import numpy as np
  from kvm_jax.ops.kvm.state import merge_targets, prepare_state_keys

  cfg = speed.kvm_config("fixed256", head_dim)
  assert 0 < cfg.rope_dims < head_dim and cfg.rope_dims % 2 == 0
  if head_dim == 128:
    assert cfg.rope_dims == 64
  params = kj.KVMParams.init(head_dim, 2)
  rng = np.random.default_rng(0)
  keys = jnp.asarray(rng.standard_normal((1, 2, 64, head_dim)), jnp.float32)
  rows = jnp.asarray(rng.standard_normal((1, 2, 32, head_dim)), jnp.float32)
  prepared = prepare_state_keys(keys, params, cfg)
  read = prepare_state_keys(rows, params, cfg)
  targets = merge_targets(prepared, read, cfg.sink_rows, 32)
  assert len(np.unique(np.asarray(targets))) > 4  # tokens spread over many rows


def test_kvm_decode_min_bytes_by_hand():
  cfg = speed.kvm_config("fixed256", 16)  # C=256, L=512
  sizes = dict(B=1, H=2, Hkv=2, D=16, Dv=16, itemsize=4)
  token = (2 * 16 + 2 * 2 * 32 + 2 * 16) * 4 + 2 * 2 * 4  # q, k/v in and into the ring, y; gates
  # t = 512 >= L: 256 rows of the normalized readout cache (keys and values in the activation
  # dtype) and window [256, 512)
  assert speed.kvm_decode_min_bytes(cfg, 512, 1, 256, **sizes) == (
      2 * (256 * 32 * 4 + 256 * 32 * 4) + token)
  # t = 300 < L: no state; window [0, 300)
  assert speed.kvm_decode_min_bytes(cfg, 300, 1, 256, **sizes) == 2 * 300 * 32 * 4 + token


def test_readout_tokamax(tmp_path, capsys):
  from kvm_jax.kernels import tokamax_readout
  from kvm_jax.kernels.backend import KernelConfig
  out = tmp_path / "readout.json"
  assert speed.main(["--phases", "", "--readout-tokamax", "--lengths", "768", "--repeats", "1",
                     "--budgets", "fixed256", "--heads", "2", "--head-dim", "16",
                     "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "readout T=   768 fixed256  R=256/256" in text
  (r,) = json.loads(out.read_text())["rows"]
  assert r["fixed256_readout_rows"] == 256 and r["fixed256_readout_xla_ms"] > 0
  if KernelConfig.for_target().interpret:
    assert r["fixed256_readout_pallas_ms"] is None and "pallas not timed" in text
  if tokamax_readout.tokamax_available():
    assert r["fixed256_readout_tokamax_ms"] > 0
    assert r["fixed256_readout_xla_vs_anchor"] == pytest.approx(
        r["fixed256_readout_tokamax_ms"] / r["fixed256_readout_xla_ms"])
  else:
    assert r["fixed256_readout_tokamax_ms"] is None and "kvm_jax[tokamax]" in text


def test_documents_bench_helpers_by_hand():
  """kvm-bench --documents: the packed rows it times hold exactly the planned documents, and the
  log-normal corpus covers what it is asked for."""
  import numpy as np
  from kvm_jax.eval.bench import documents_speed
  from kvm_jax.eval.bench import timing

  seg = documents_speed.packed_segments(np.array([3, 2, 4, 6, 1]), batch=2, width=6)
  # documents packing: [3 + 2] then the 4 cannot fit the last slot -> next row [4] ...
  np.testing.assert_array_equal(seg, [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  lengths = documents_speed.lognormal_lengths(5000, median=600, seed=0)
  assert lengths.sum() >= 5000 and lengths.min() >= 1 and 200 < np.median(lengths) < 1800
  with pytest.raises(ValueError, match="rows from"):
    documents_speed.packed_segments(np.array([3]), batch=2, width=6)
  calls = []
  times = timing.interleaved_times({"a": lambda: calls.append("a"),
                                    "b": lambda: calls.append("b")}, repeats=2)
  assert calls == ["a", "b", "a", "b", "a", "b"]   # one warm-up each, then rounds in turn
  assert set(times) == {"a", "b"} and all(len(t) == 2 for t in times.values())
  assert documents_speed.summary({"a": [3.0, 1.0, 2.0]}) == {"a_ms": 2.0, "a_min_ms": 1.0}


@pytest.mark.slow
def test_documents_bench_runs(tmp_path, capsys):
  out = tmp_path / "docs.json"
  assert speed.main(["--documents", "--doc-lengths", "768", "--doc-step-len", "512",
                     "--repeats", "1", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "KVM op T=   768 forward" in text and "train step" in text and "real tokens/s" in text
  measured = json.loads(out.read_text())["documents"]
  assert measured["op"][0]["T"] == 768 and measured["step"]["documents_step_ms"] > 0
