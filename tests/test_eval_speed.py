"""The speed harness runs on tiny sizes and writes a well-formed table (no timing assertions)."""

from __future__ import annotations

import json

from kvm_jax.eval import speed


def test_kvm_bench_smoke(tmp_path, capsys):
  out = tmp_path / "bench.json"
  assert speed.main(["--lengths", "512,768", "--decode-steps", "2", "--repeats", "1",
                     "--budgets", "fixed256,sqrt16", "--heads", "2", "--head-dim", "16",
                     "--json", str(out), "--plot", str(tmp_path / "bench.png")]) == 0
  text = capsys.readouterr().out
  assert "T=   512" in text and "T=   768" in text and "crossover" in text
  rows = json.loads(out.read_text())["rows"]
  assert [r["T"] for r in rows] == [512, 768]
  for r in rows:
    for arm in ("full", "fixed256", "sqrt16"):
      for phase in ("prefill", "backward", "decode"):
        assert r[f"{arm}_{phase}_ms"] > 0
    # memory is measured from arrays: the full KV cache grows with T, KVM's is bounded
    assert r["full_cache_bytes"] == 2 * 1 * r["T"] * 2 * 16 * 4
  assert rows[1]["fixed256_cache_bytes"] == rows[0]["fixed256_cache_bytes"]
  assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_whole_model_decode_rate(tmp_path, capsys):
  out = tmp_path / "models.json"
  assert speed.main(["--phases", "", "--models", "tiny-kvm,tiny-full", "--model-context", "40",
                     "--decode-steps", "3", "--json", str(out)]) == 0
  text = capsys.readouterr().out
  assert "model tiny-kvm" in text and "tok/s" in text
  models = {m["model"]: m for m in json.loads(out.read_text())["models"]}
  for m in models.values():
    assert m["tokens_per_s"] > 0 and len(m["cache_bytes_per_layer"]) == 2
  # tiny-full preallocates K and V for context + steps + 2 positions per layer (4 heads of 16,
  # float32); the KVM cache is state + window and does not store every position.
  assert models["tiny-full"]["cache_bytes_per_layer"][0] >= 2 * 45 * 4 * 16 * 4


def test_kvm_bench_needs_something_to_time():
  import pytest
  with pytest.raises(SystemExit, match="nothing to time"):
    speed.main(["--phases", ""])
