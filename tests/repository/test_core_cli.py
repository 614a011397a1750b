"""The operator-level commands: ``kvm-check`` (its PASS/FAIL verdict and exit status, on hand-made
errors and end to end with a broken implementation), ``kvm-core-demo`` (its printed numbers against
values worked out by hand) and ``kvm-bench-core`` (one consistent row per size)."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import jax.numpy as jnp
import pytest

from kvm_jax import core_demo as demo
from kvm_jax.eval import check
from kvm_jax.eval.bench import core_speed
from kvm_jax.ops.kvm import reference
from kvm_jax.ops.ovq import scan as ovq_scan

NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------------------
# kvm-check
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("output, state, routing, ok, why", [
    (1e-7, 1e-7, "same", True, ""),
    (1e-7, None, "-", True, ""),                                  # no state compared (gradients)
    (2e-5, 2e-5, "-", True, ""),                                  # the tolerance itself passes
    (NAN, 1e-7, "-", False, "output error is NaN"),
    (1e-7, NAN, "-", False, "state error is NaN"),
    (1e-7, INF, "-", False, "state error is inf (the state row counts differ)"),
    (INF, 1e-7, "-", False, "output error is inf"),
    (-INF, 1e-7, "-", False, "output error is inf"),
    (3e-5, 1e-7, "-", False, "output error 3.00e-05 exceeds the tolerance 2e-05"),
    (1e-7, 3e-5, "-", False, "state error 3.00e-05 exceeds the tolerance 2e-05"),
    (1e-7, 1e-7, "DIFFERENT", False, "routing decisions DIFFERENT"),
])
def test_verdict_on_hand_made_errors(output, state, routing, ok, why):
  got_ok, got_why = check.verdict(output, state, 2e-5, routing)
  assert got_ok is ok and (got_why == why if ok else why in got_why), (got_ok, got_why)
  row = check.make_row("case", "pair", output, state, 2e-5, routing)
  assert row["ok"] is ok and row["why"] == got_why
  assert check.format_table([row]).splitlines()[-1].endswith("PASS" if ok else "FAIL")


def test_verdict_names_every_failure():
  ok, why = check.verdict(NAN, 3e-5, 2e-5, "DIFFERENT")
  assert not ok and why == ("output error is NaN (NaN in a result); state error 3.00e-05 exceeds "
                            "the tolerance 2e-05; routing decisions DIFFERENT")


@pytest.mark.parametrize("errors", [[NAN, 1e-7, 1e-8], [1e-7, NAN, 1e-8], [1e-7, 1e-8, NAN]])
def test_worst_keeps_a_nan_wherever_it_is(errors):
  # Python's max() returns 1e-7 for the last two orders: a NaN state would have passed.
  assert math.isnan(check.worst(errors))
  assert check.worst([1e-7, 3e-5, 1e-8]) == 3e-5 and check.worst([1e-7, INF]) == INF


def _nan_values(real):
  """An oracle whose final state holds NaN values. The values are the second of the (keys, values,
  radii) errors, the one Python's max() dropped: kvm-check used to print PASS for this."""
  def oracle(*args, **kwargs):
    y, state = real(*args, **kwargs)
    return y, dataclasses.replace(state, values=state.values * jnp.nan)
  return oracle


def test_kvm_check_exit_status_end_to_end(monkeypatch, capsys):
  # Both runs use case 1 so that the second reuses the first's compiled programs.
  assert check.main(["--cases", "1", "--no-grads", "--ops", "kvm"]) == 0
  out = capsys.readouterr().out
  assert "3/3 checks passed" in out and "FAIL" not in out
  assert re.search(r"xla vs pallas .* same .*PASS", out)

  # kvm-check imports its ops when it runs: the oracle is replaced where it is defined
  monkeypatch.setattr(reference, "kvm_attention_reference",
                      _nan_values(reference.kvm_attention_reference))
  assert check.main(["--cases", "1", "--no-grads", "--ops", "kvm"]) == 1
  out = capsys.readouterr().out
  assert re.search(r"oracle vs xla +\S+ +nan .*FAIL", out), out
  assert "2/3 checks passed" in out
  assert "FAIL fixed, sink 1 / oracle vs xla: state error is NaN (NaN in a result)" in out
  # The other comparisons do not involve the oracle and still pass.
  assert re.search(r"xla vs pallas .*PASS", out) and re.search(r"prefill\+decode .*PASS", out)


def test_kvm_check_runs_the_baselines(monkeypatch, capsys):
  """``--ops ovq,rwkv7``: every comparison row of both small cases passes (gradients included);
  a scan whose dictionary drifts by one centroid count fails its row, and only that row, with
  exit status 1."""
  assert check.main(["--ops", "ovq,rwkv7"]) == 0
  out = capsys.readouterr().out
  for row in ("oracle vs scan", "scan vs prefill+decode", "grads scan vs oracle",
              "oracle vs chunked", "chunked vs prefill+steps", "grads chunked vs oracle"):
    assert re.search(rf"{re.escape(row)} .*PASS", out), row
  assert "6/6 checks passed" in out

  def drifted(*args, **kwargs):
    y, state = real(*args, **kwargs)
    return y, dataclasses.replace(state, counts=state.counts.at[0, 0, 0].add(1.0))
  real = ovq_scan.ovq_attention
  monkeypatch.setattr(ovq_scan, "ovq_attention", drifted)
  assert check.main(["--ops", "ovq", "--no-grads"]) == 1
  out = capsys.readouterr().out
  assert "state error is inf (the state row counts differ)" in out
  assert re.search(r"ovq paper_flags +oracle vs scan .*FAIL", out)
  with pytest.raises(SystemExit, match="--ops: expected some of"):
    check.main(["--ops", "kvm,lstm"])


# ----------------------------------------------------------------------------------------------
# --help of the two commands below
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("module", [demo, core_speed], ids=["kvm-core-demo", "kvm-bench-core"])
def test_help_explains_every_flag(module, capsys):
  with pytest.raises(SystemExit) as exit_info:
    module.main(["--help"])
  assert exit_info.value.code == 0
  text = capsys.readouterr().out
  flags = [a for a in module.build_parser()._actions if a.option_strings]
  assert len(flags) > 2
  for action in flags:
    assert action.help, f"{action.option_strings} has no help"
    for flag in action.option_strings:
      assert re.search(rf"(^|\s){re.escape(flag)}\b", text), flag


# ----------------------------------------------------------------------------------------------
# kvm-core-demo
# ----------------------------------------------------------------------------------------------


def _numbers(text: str) -> list[int]:
  return [int(x.replace(",", "")) for x in re.findall(r"\d[\d,]*", text)]


def test_core_demo_prints_the_numbers_worked_out_by_hand(capsys):
  # T = 40, C = 8, L = 16, budget 4 * sqrt(N) (min 8), B = 2, Hkv = 2, D = Dv = 32, float32.
  assert demo.main(["--length", "40", "--chunk-size", "8"]) == 0
  out = capsys.readouterr().out

  # 1) The paper's budgets (C = 256, L = 512). The state starts as the first chunk, 256 rows; the
  # first update runs after the chunk ending at C + L = 768, and the last one before N tokens
  # after the chunk ending at m = N - C. It sets the budget's target at m, floor(16 * sqrt(m))
  # or floor(1024 * m / (1024 + m)): the growth per update stays under the C-row cap here.
  table = {row[0]: row[1:] for row in (_numbers(line) for line in out.splitlines()
                                       if re.fullmatch(r"\s*\d+(\s+\d+){4}\s*", line))}
  assert sorted(table) == [512 * 2 ** i for i in range(9)]
  for n, row in table.items():
    m = n - 256
    grown = m >= 768
    assert row == [n, 256, math.isqrt(256 * m) if grown else 256,
                   1024 * m // (1024 + m) if grown else 256], n
  assert table[1024] == [1024, 256, 443, 438]  # the first of them, spelled out

  # 2) Chunks 0..4. The first chunk (8 rows) is the state until chunk 2 ends at token 24:
  # min(floor(4 * sqrt(24)) = 19, 8 + 8) = 16 rows, then after chunk 3 (token 32)
  # floor(4 * sqrt(32)) = 22; the last chunk ends the sequence, so no update follows it.
  assert "rows while each query chunk attends: 8 8 8 16 22\n" in out
  assert "final state 22 rows" in out
  errors = [float(x) for x in re.findall(r"= (\d\.\d+e[-+]\d+)", out)]
  assert len(errors) == 2 and max(errors) < 1e-4
  assert "prefill(13)+decode" in out and "all three implementations agree" in out

  # 3) Bytes, float32 (4 B), batch 2: state keys + values + radii over 22 rows plus an int32 row
  # count per batch row, and the normalized readout (keys + values, 22 rows); the window ring
  # holds L = 16 keys, values and gates; the cache adds an int32 length per batch row.
  state = 4 * 2 * 2 * 22 * (32 + 32 + 1) + 2 * 4 + 4 * 2 * 2 * 22 * (32 + 32)
  window = 4 * 2 * 16 * 2 * (32 + 32 + 1)
  full = 4 * 2 * 40 * 2 * 32 * 2
  line = next(x for x in out.splitlines() if x.startswith("3) Decode cache"))
  assert _numbers(line.split(":", 1)[1]) == [state, window, state + window + 2 * 4, full]


# ----------------------------------------------------------------------------------------------
# kvm-bench-core
# ----------------------------------------------------------------------------------------------


def test_bench_core_prints_one_consistent_row_per_size(tmp_path, capsys):
  path = tmp_path / "bench.json"
  assert core_speed.main(["--lengths", "32,64", "--decode-context", "32", "--decode-steps", "8",
                          "--chunk-size", "8", "--state-rows", "8", "--heads", "1",
                          "--head-dim", "16", "--repeats", "1", "--json", str(path)]) == 0
  out = capsys.readouterr().out
  results = json.loads(path.read_text())
  rows = re.findall(r"^ +(\d+) +(\S+) +(\S+) +(\S+)x$", out, re.M)
  assert [int(r[0]) for r in rows] == [32, 64] == [r["T"] for r in results["prefill"]]
  for (_, kvm, full, ratio), saved in zip(rows, results["prefill"]):
    assert saved["kvm_ms"] > 0 and saved["full_ms"] > 0
    assert float(kvm) == round(saved["kvm_ms"], 2) and float(full) == round(saved["full_ms"], 2)
    assert float(ratio) == round(saved["full_ms"] / saved["kvm_ms"], 2)

  d = results["decode"]
  assert 0 < d["kvm_median_ms"] <= d["kvm_max_ms"] and d["full_mean_ms"] > 0
  assert f"(mean) {d['full_mean_ms'] / d['kvm_mean_ms']:.2f}x" in out
  # Cache bytes by hand (float32, B = H = 1, D = 16, C = 8, L = 16): full KV holds T = 32 keys and
  # values; KVM holds 8 state rows (keys, values, radii, int32 count) and their normalized
  # readout (keys, values), the window ring (keys, values, gates) and an int32 length.
  kvm_bytes = 4 * 8 * (16 + 16 + 1) + 4 + 4 * 8 * (16 + 16) + 4 * 16 * (16 + 16 + 1) + 4
  assert (d["kvm_cache_bytes"], d["full_cache_bytes_at_T"]) == (kvm_bytes, 4 * 32 * 16 * 2)
  assert f"KVM {kvm_bytes:,} (state + window" in out and f"full KV {4 * 32 * 16 * 2:,}" in out
