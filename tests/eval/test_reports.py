"""Every table a run writes shows the numbers of its JSON results, column by column: the
evaluation report and its budget-sweep table (``kvm-eval``: results.json), the demo's summary
(``kvm-demo``: summary.json) and the conversion study's table.

Each table is read back from its markdown and every cell compared, within its printed precision,
with the entry of the results that its column header names; the column -> entry maps are written
out here, not taken from the code that prints them. The results are made up with a different
value in every field, so a column that shows another column's number fails. The end-to-end tests
of each command (test_eval_cli, test_convert, test_train) run the same comparison on real runs
through :func:`check_eval_report`, :func:`check_sweep_report` and :func:`check_demo_report`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvm_jax.eval import cli
from kvm_jax.train import conversion_study
from kvm_jax.train import demo as default_job

from tests.helpers.reports import (assert_cell, check_demo_report, check_eval_report,
                                   check_sweep_report, markdown_tables)


# -- kvm-eval: the evaluation report ------------------------------------------------------------


def _eval_result(model, mixers, parameters, seed, budget=None, state_rows=None, niah=True):
  """A made-up kvm-eval result with a different number in every field."""
  rng = np.random.default_rng(seed)
  res = {"model": model, "run": f"/runs/{model}", "step": 10, "mixers": mixers,
         "parameters": parameters}
  if budget:
    res.update(budget=budget, state_rows=state_rows)
  if niah:
    res["niah"] = [{"task": task, "length": length, "score": float(rng.uniform(0, 100))}
                   for task in ("niah_single_2", "niah_single_1") for length in (4096, 512)]
  else:
    res["niah"] = {"skipped": "vocabulary"}
  res["mqar"] = {"rows": [{"pairs": p, **{k: float(rng.uniform()) for k in (
      "recall", "recall_in_window", "recall_state_only")}, "answer_nll": float(rng.uniform(1, 5))}
      for p in (8, 2)]}
  res["position_loss"] = {"nll": [float(x) for x in rng.uniform(1, 6, 4)],
                          "text_nll": float(rng.uniform(1, 6)), "tokens": 1000 + seed,
                          "documents": 3, "min_chars": 4096, "context": 4096, "packing": "pad"}
  return res


def test_evaluation_report_equals_its_results():
  results = [_eval_result("kvm-a", ["kvm", "swa", "kvm"], 1_234_567, 0),
             _eval_result("ovq-b", ["swa", "ovq"], 987_000, 1),
             _eval_result("tiny-c", ["full"], 20_000, 2, niah=False)]
  del results[2]["mqar"]["rows"][0]  # a pair count one model lacks
  results[2]["position_loss"] = {"skipped": "vocabulary"}
  report = cli.markdown_report(results)
  header = list(markdown_tables(report)[0][0])
  assert header[3:7] == ["NIAH-S1 512", "NIAH-S1 4K", "NIAH-S2 512", "NIAH-S2 4K"]
  assert header[7:9] == ["MQAR 2 pairs (all / state-only)", "MQAR 8 pairs (all / state-only)"]
  check_eval_report(report, results)


def test_budget_sweep_table_equals_its_results():
  results = [_eval_result("kvm", ["kvm"], 10, 3, budget="fixed:8", state_rows=8),
             _eval_result("kvm", ["kvm"], 10, 4, budget="sqrt:4@8", state_rows=29),
             _eval_result("full", ["full"], 10, 5)]
  results[2]["position_loss"] = {"skipped": "vocabulary"}
  report = "## Test-time budgets\n\n" + cli.sweep_report(cli.sweep_rows(results))
  check_sweep_report(report, results)


# -- kvm-demo: the summary ----------------------------------------------------------------------


def test_demo_report_equals_its_summary():
  rng = np.random.default_rng(6)
  summary = {name: {"memory": memory, "state_rows": 0, "seconds": float(rng.uniform(10, 100)),
                    "final_train_loss": float(rng.uniform(0, 3)),
                    "eval_loss": float(rng.uniform(0, 3)),
                    **{k: float(rng.uniform()) for k in ("recall", "recall_in_window",
                                                         "recall_state_only")}}
             for name, memory in (("full", "all tokens"), ("kvm-fixed", "8 state rows"))}
  summary["full"]["final_train_loss"] = float("nan")  # no training line logged
  check_demo_report(default_job.summary_report(summary), summary)


# -- the conversion study -----------------------------------------------------------------------

@pytest.mark.slow  # trains and distils five tiny runs; docs/pretrained.md §3 has its numbers
def test_state_rope_study_runs_its_rows(tmp_path):
  """The study of docs/pretrained.md §3 at 2 steps per run: a teacher, then two conversions
  (every rotary channel zeroed, half kept) each with its two distillations, in that order; the
  half-kept conversion's state keeps half of the rotary channels."""
  study = conversion_study.state_rope_study(tmp_path, steps=2, distill_steps=2)
  names = [r["model"] for r in study["rows"]]
  assert len(names) == 7 and names[0].endswith("(teacher)")
  assert "zero all 32 rotary channels), no training" in names[1]
  assert "keep the 8 slowest rotary pairs), no training" in names[4]
  kvm = json.loads((tmp_path / "converted-state-zeroes-16" / "config.json").read_text())
  assert kvm["model"]["options"]["kvm"]["state_rope_dims"] == 16
  assert all(0.0 <= r["recall"] <= 1.0 for r in study["rows"])


def test_conversion_study_table_equals_its_rows():
  rng = np.random.default_rng(7)
  rows = [{"model": f"model {i}", "pretrain": int(rng.integers(1, 1000)),
           "distill": int(rng.integers(0, 1000)),
           **{k: float(rng.uniform()) for k in ("recall", "in_window", "state_only",
                                                "eval_loss")}} for i in range(3)]
  columns = {"model": "model", "steps from scratch": "pretrain", "distillation steps": "distill",
             "recall": "recall", "in window": "in_window", "state only": "state_only",
             "eval loss": "eval_loss"}
  table = markdown_tables(conversion_study.markdown_table(rows))[0]
  assert len(table) == len(rows)
  for cells, row in zip(table, rows):
    assert set(cells) == set(columns)
    for column, key in columns.items():
      assert_cell(cells[column], row[key], (row["model"], column))


def test_the_comparison_itself_fails_on_a_swapped_column():
  """The checks above can fail: a report whose "in window" column shows the state-only numbers
  is refused."""
  results = [_eval_result("kvm", ["kvm"], 10, 8, budget="fixed:8", state_rows=8)]
  rows = cli.sweep_rows(results)
  swapped = [dict(r, recall_in_window=r["recall_state_only"]) for r in rows]
  with pytest.raises(AssertionError):
    check_sweep_report("## Test-time budgets\n\n" + cli.sweep_report(swapped), results)
