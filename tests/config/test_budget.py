"""Budgets and the static schedule against the numbers of docs/kvm-spec.md §3 and the rules of
§6.3."""

from __future__ import annotations

import math

import pytest

import kvm_jax as kj
from kvm_jax.config.budget import bswa_begin, desired_rows

K = 1024
PAPER = dict(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64)
LENGTHS = [512, 768, 1 * K, 2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K]


def _final_rows(budget, n, **kw):
  return kj.state_rows_after(kj.KVMConfig(budget=budget, **{**PAPER, **kw}), n)


def test_fixed256_is_always_256():
  for n in LENGTHS:
    assert _final_rows(kj.FixedBudget(256), n) == 256


def test_sqrt16_matches_spec_table():
  # docs/kvm-spec.md §3: sqrt16 -> 256 (N<=768), 443, 677, 991, 1425, 2031, 2884, 4087, 5786.
  expected = [256, 256, 443, 677, 991, 1425, 2031, 2884, 4087, 5786]
  budget = kj.PowerLawBudget(factor=16.0, exponent=0.5, min_rows=256)
  got = [_final_rows(budget, n, max_state_rows=256 * 10000) for n in LENGTHS]
  assert got == expected


def test_sat1024_matches_spec_table():
  # docs/kvm-spec.md §3: sat1024 -> 256 (<=768), 438, 651, 808, 906, 962, 992, 1008, 1016.
  expected = [256, 256, 438, 651, 808, 906, 962, 992, 1008, 1016]
  budget = kj.SaturatingBudget(limit=1024, min_rows=1)
  assert [_final_rows(budget, n, max_state_rows=256 * 10000) for n in LENGTHS] == expected


def test_sqrt16_lags_16_sqrt_n_because_budget_uses_tokens_seen():
  budget = kj.PowerLawBudget(factor=16.0, exponent=0.5, min_rows=256)
  for n in (4 * K, 32 * K):
    assert _final_rows(budget, n) < math.floor(16 * math.sqrt(n))


def test_desired_rows_rules():
  b = kj.PowerLawBudget(factor=16.0, exponent=0.5, min_rows=256)
  assert desired_rows(b, 768, 512, 256, None) == 443          # floor(16*sqrt(768))
  assert desired_rows(b, 768, 300, 256, None) == 300          # capped by `available`
  assert desired_rows(b, 768, 512, 256, 260) == 260           # capped by max_state_rows
  assert desired_rows(b, 768, 512, 500, None) == 500          # never shrinks
  assert desired_rows(kj.FixedBudget(10), 10**6, 10**6, 3, None) == 10
  rd = kj.PowerLawBudget(factor=16.0, exponent=0.5, min_rows=0, round_down=64)
  assert rd.target_rows(768) == 384                           # 443 rounded down to 64
  assert kj.SaturatingBudget(limit=1024).target_rows(1024) == 512


def test_callable_budget_and_validation():
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                     budget=lambda n: n // 2)
  assert isinstance(cfg.budget, kj.CallableBudget)
  sched = kj.kvm_schedule(cfg, 40)
  # Each update may append at most one chunk, and the state never shrinks.
  assert all(0 <= a <= 4 for a in sched.n_append)
  assert list(sched.rows_before) == sorted(sched.rows_before)
  bad = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                     budget=lambda n: -1)
  with pytest.raises(ValueError, match="non-negative int"):
    kj.kvm_schedule(bad, 40)


def test_schedule_structure():
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                     budget=kj.PowerLawBudget(3.0, 0.5, min_rows=4))
  s = kj.kvm_schedule(cfg, 29)
  assert s.num_chunks == 8 and s.initial_rows == 4
  assert s.state_visible == (False, False) + (True,) * 6       # only queries at t >= L = 8
  # Updates after query chunks nb..nC-2; the last chunk never updates.
  assert s.update_after == (False, False, True, True, True, True, True, False)
  assert s.final_rows == s.rows_before[-1] + s.n_append[-1]
  for T in (1, 3, 4, 8, 12):  # T <= L + C: no update ever fires
    assert not any(kj.kvm_schedule(cfg, T).update_after)
    assert kj.state_rows_after(cfg, T) == min(T, 4)


def test_bswa_begin():
  # docs/kvm-spec.md §6.4: max(0, ceil(n/C)*C - L)
  assert [bswa_begin(n, 4, 2) for n in (1, 8, 9, 12, 13)] == [0, 0, 4, 4, 8]


def test_average_visible_keys_by_hand():
  """Keys per query averaged over a sequence (what the trainer's MFU counts), hand-computed."""
  from kvm_jax.config.budget import FixedBudget, average_visible_keys
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, budget=FixedBudget(4))
  # Within the window (T <= L = 8) KVM is causal attention: (T + 1) / 2 keys on average.
  for T in (1, 5, 8):
    assert average_visible_keys(cfg, T) == (T + 1) / 2
  # T = 20: positions 0..7 see 1..8 keys (36 in all). Chunk 2 (positions 8..11) sees the window
  # from token 4 (5, 6, 7, 8 keys) plus the 4 initial state rows; chunks 3 and 4 the same with
  # the window starting at 8 and 12: 3 x (26 + 16) = 126. (36 + 126) / 20 = 8.1.
  assert average_visible_keys(cfg, 20) == pytest.approx(8.1)
  # Far beyond the window the average tends to the mean window fill plus the fixed state:
  # the window holds 5..8 keys within each chunk (6.5 on average), plus 4 rows.
  assert average_visible_keys(cfg, 40_000) == pytest.approx(6.5 + 4, rel=1e-3)


# -- budget specs: the short texts of command lines and config files -----------------------------

# Every form, with and without the floor, and the object it names (written out, not parsed).
SPECS = {
    "fixed:256": kj.FixedBudget(256),
    "fixed:1": kj.FixedBudget(1),
    "sqrt:16": kj.PowerLawBudget(16.0, 0.5),
    "sqrt:16@256": kj.PowerLawBudget(16.0, 0.5, min_rows=256),
    "sqrt:2.5@3": kj.PowerLawBudget(2.5, 0.5, min_rows=3),
    "pow:4:0.75": kj.PowerLawBudget(4.0, 0.75),
    "pow:4:0.75@8": kj.PowerLawBudget(4.0, 0.75, min_rows=8),
    "pow:0.5:0.25@1": kj.PowerLawBudget(0.5, 0.25, min_rows=1),
    "sat:1024": kj.SaturatingBudget(1024),
    "sat:1024@1": kj.SaturatingBudget(1024, min_rows=1),
    "sat:48@8": kj.SaturatingBudget(48, min_rows=8),
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_budget_spec_parses_to_its_budget_and_prints_back(spec):
  from kvm_jax.config.budget import budget_label, parse_budget
  budget = parse_budget(spec)
  assert budget == SPECS[spec] and type(budget) is type(SPECS[spec])
  assert budget_label(budget) == spec
  assert parse_budget(budget_label(SPECS[spec])) == SPECS[spec]


def test_budget_spec_other_spellings_print_in_the_canonical_form():
  from kvm_jax.config.budget import budget_label, parse_budget
  # An exponent of 1/2 is the square root; surrounding spaces and a float floor of rows are not
  # part of the language but spaces are forgiven.
  assert parse_budget("pow:16:0.5@256") == kj.PowerLawBudget(16.0, 0.5, min_rows=256)
  assert budget_label(parse_budget("pow:16:0.5@256")) == "sqrt:16@256"
  assert parse_budget("  sat:64@2 ") == kj.SaturatingBudget(64, min_rows=2)
  assert budget_label(kj.PowerLawBudget(16.0, 0.5, min_rows=0)) == "sqrt:16"  # no "@0"


@pytest.mark.parametrize("spec", [
    "", "sqrt", "sqrt:", "fixed:", "fixed:abc", "fixed:1.5", "fixed:0", "fixed:8@4", "pow:4",
    "pow:4:0.5:1", "pow:4:2", "sat:0", "sat:1.5", "sat:1024@x", "sat:1024@-1", "sqrt:-1",
    "sqrt:nan", "sqrt:16@2.5", "linear:4", "fixed 256", "sqrt:16@256@1"])
def test_malformed_budget_spec_is_refused_naming_the_text(spec):
  from kvm_jax.config.budget import parse_budget
  with pytest.raises(ValueError) as error:
    parse_budget(spec)
  message = str(error.value)
  assert repr(spec) in message, message  # names the text as given
  assert "fixed:ROWS" in message, message  # and says what the language is
