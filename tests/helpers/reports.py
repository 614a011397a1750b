"""Reading a run's markdown tables back and comparing every cell with its JSON results
(kvm-eval's report, its budget sweep, kvm-demo's summary): shared by the report tests and
the end-to-end tests of each command."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np


def markdown_tables(text: str) -> list[list[dict[str, str]]]:
  """The markdown tables in ``text``, each a list of ``{column header: cell}`` rows."""
  tables, lines = [], text.splitlines()
  i = 0
  while i < len(lines):
    if lines[i].startswith("|") and i + 1 < len(lines) and re.fullmatch(r"\|(-+\|)+",
                                                                       lines[i + 1]):
      header = [c.strip() for c in lines[i].strip("|").split("|")]
      rows, i = [], i + 2
      while i < len(lines) and lines[i].startswith("|"):
        cells = [c.strip() for c in lines[i].strip("|").split("|")]
        assert len(cells) == len(header), lines[i]
        rows.append(dict(zip(header, cells)))
        i += 1
      tables.append(rows)
    else:
      i += 1
  return tables


def assert_cell(cell: str, want, what: str) -> None:
  """``cell`` shows ``want``: text equal, a number within half a unit of its last printed digit,
  or "–" for a missing one (None or NaN)."""
  if want is None or (isinstance(want, float) and np.isnan(want)):
    assert cell == "–", (what, cell, want)
    return
  if isinstance(want, str):
    assert cell == want, (what, cell, want)
    return
  match = re.fullmatch(r"-?\d+(?:\.(\d+))?", cell)
  assert match, (what, cell, want)
  half_unit = 0.5 * 10.0 ** -len(match.group(1) or "")
  assert abs(float(cell) - want) <= half_unit * (1 + 1e-9), (what, cell, want)


def _mean(values) -> float:
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else float("nan")


NIAH_TASK = {"S1": "niah_single_1", "S2": "niah_single_2", "S3": "niah_single_3"}


def _niah_column(header: str):
  """("niah_single_2", 4096) for "NIAH-S2 4K"."""
  task, length = header[len("NIAH-"):].split(" ")
  return NIAH_TASK[task], int(length[:-1]) * 1024 if length.endswith("K") else int(length)


def check_eval_report(report: str, results: list[dict]) -> None:
  """The first table of ``report`` (kvm-eval's report.md) shows ``results``, one row per model."""
  rows = markdown_tables(report)[0]
  assert [r["model"] for r in rows] == [res["model"] for res in results]
  for row, res in zip(rows, results):
    for column, cell in row.items():
      what = (res["model"], column)
      if column == "model":
        continue
      if column == "mixers":
        assert_cell(cell, "/".join(sorted(set(res["mixers"]))), what)
      elif column == "params":
        assert cell.endswith("M"), what
        assert_cell(cell[:-1], res["parameters"] / 1e6, what)
      elif column.startswith("NIAH-"):
        niah = res.get("niah")
        if not isinstance(niah, list):
          assert cell == ("skipped" if niah else "–"), what
          continue
        task, length = _niah_column(column)
        scores = [r["score"] for r in niah if (r["task"], r["length"]) == (task, length)]
        assert_cell(cell, scores[0] if scores else None, what)
      elif column.startswith("MQAR "):
        pairs = int(column.split(" ")[1])
        mq = [r for r in (res.get("mqar") or {}).get("rows", []) if r["pairs"] == pairs]
        if not mq:
          assert cell == "–", what
          continue
        every, state_only = cell.split(" / ")
        assert_cell(every, mq[0]["recall"], what)
        assert_cell(state_only, mq[0]["recall_state_only"], what)
      elif column == "text NLL":
        assert_cell(cell, (res.get("position_loss") or {}).get("text_nll"), what)
      elif column in ("NLL first bucket", "NLL last bucket"):
        nll = (res.get("position_loss") or {}).get("nll")
        assert_cell(cell, None if nll is None else nll[0 if "first" in column else -1], what)
      else:
        raise AssertionError(f"column {column!r} is not checked here")


def check_sweep_report(report: str, results: list[dict]) -> None:
  """The "Test-time budgets" table of ``report`` shows, per evaluated (model, budget), the MQAR
  numbers averaged over the pair counts and the mean text NLL of ``results``."""
  table = markdown_tables(report.split("## Test-time budgets", 1)[1])[0]
  assert len(table) == len(results)
  for row, res in zip(table, results):
    mq = (res.get("mqar") or {}).get("rows", [])
    text_nll = (res.get("position_loss") or {}).get("text_nll")
    want = {"run": Path(res["run"]).name,
            "budget": res.get("budget") or "– (no kvm layers)",
            "state rows": res.get("state_rows"),
            "MQAR recall": _mean(r["recall"] for r in mq),
            "in window": _mean(r["recall_in_window"] for r in mq),
            "state only": _mean(r["recall_state_only"] for r in mq),
            "MQAR answer NLL": _mean(r.get("answer_nll") for r in mq),
            "text NLL": text_nll}
    assert set(row) == set(want)
    for column, cell in row.items():
      assert_cell(cell, want[column], (res["model"], res.get("budget"), column))


DEMO_COLUMNS = {"memory beyond the window": "memory", "recall": "recall",
                "in window": "recall_in_window", "state only": "recall_state_only",
                "eval loss": "eval_loss", "last train loss": "final_train_loss",
                "time (s)": "seconds"}


def check_demo_report(report: str, summary: dict) -> None:
  """``report.md`` of kvm-demo shows ``summary.json``: one row per model, every column its
  entry."""
  rows = markdown_tables(report)[0]
  assert [r["model"] for r in rows] == list(summary)
  for row in rows:
    assert set(row) == {"model", *DEMO_COLUMNS}
    for column, key in DEMO_COLUMNS.items():
      assert_cell(row[column], summary[row["model"]][key], (row["model"], column))
