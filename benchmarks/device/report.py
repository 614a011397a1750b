"""``summary.md``: the tables of a run, built from its ``results.jsonl`` alone (so a run killed at
any point still gets a report, and ``--summarize`` rebuilds it), and the follow-up command for
the stages that ran out of time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from benchmarks.device.geometry import BUDGETS, STAGES
from benchmarks.device.records import RESULTS, SUMMARY, read_records

FOLLOW_UP_TOTAL_S = 540   # one follow-up command: within the device tool's 10 minutes a call


def _fmt(x: Any) -> str:
  if x is None:
    return "-"
  if isinstance(x, bool):
    return "yes" if x else "NO"
  if isinstance(x, float):
    if x == 0:
      return "0"
    if abs(x) >= 1e4 or abs(x) < 1e-3:
      return f"{x:.2e}"
    return f"{x:.4g}"
  return str(x).replace("|", "\\|").replace("\n", " ")


def _gib(x) -> Optional[float]:
  return None if x is None else x / 2**30


def _status(r: dict) -> str:
  s = r.get("status", "?")
  if s == "skipped":
    return f"skipped: {r.get('reason', '?')}"
  if s in ("error", "failed"):
    why = r.get("error") or "; ".join(r.get("fails") or []) or r.get("reason") or ""
    return f"{s}: {why[:160]}" if why else s
  return s


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in rows]
  return lines


def _ratio(a, b) -> Optional[float]:
  try:
    return float(a) / float(b) if a is not None and b else None
  except (TypeError, ValueError):
    return None


def _env_line(env: dict) -> str:
  dev, ver = env.get("devices", {}), env.get("versions", {})
  mode = {True: "interpreted", False: "compiled"}.get(dev.get("pallas_interpret"), "?")
  return (f"jax {ver.get('jax', '?')}, jaxlib {ver.get('jaxlib', '?')}; backend "
          f"{dev.get('backend', '?')}, {dev.get('device_count', '?')} x "
          f"{dev.get('device_kind', '?')}; Pallas kernels {mode}")


def _baselines(recs: list[dict], key: str, per_seq: bool) -> dict:
  """Per T: the full-attention figure (cuDNN, else XLA attention) the KVM rows are divided by."""
  base = {}
  for r in recs:
    if r.get("impl") in ("cudnn", "full-xla") and isinstance(r.get(key), (int, float)):
      if r.get("impl") == "cudnn" or r.get("T") not in base:
        value = r[key] / (r.get("batch") or r.get("B") or 1) if per_seq else r[key]
        base[r.get("T")] = (r.get("impl"), value)
  return base


def follow_up(records: list[dict]) -> Optional[str]:
  """The command that finishes, on a still-warm machine, the stages this run cut short (entries
  skipped for time, or killed at the budget): those stages only, each with three times its
  budget, all within :data:`FOLLOW_UP_TOTAL_S`."""
  run = next((r for r in records if r.get("kind") == "run"), {})
  budgets = {**BUDGETS, **(run.get("budgets_s") or {})}
  short = []
  for stage in STAGES:
    cut = [r for r in records if r.get("stage") == stage and (
        (r.get("kind") == "entry" and r.get("status") == "skipped" and r.get("reason") == "time")
        or (r.get("kind") == "stage" and r.get("status") in ("timeout", "skipped")))]
    if cut:
      short.append(stage)
  if not short or run.get("mode") == "smoke":
    return None
  share = FOLLOW_UP_TOTAL_S / sum(3 * budgets[s] for s in short)
  timeouts = ",".join(f"{s}={int(3 * budgets[s] * min(1.0, share))}" for s in short)
  return (f"bash scripts/device_check.sh --stages {','.join(short)} --timeouts {timeouts} "
          f"--total-budget {FOLLOW_UP_TOTAL_S}")


def _group_entries(records: list[dict]) -> tuple[dict[str, list[dict]], list[dict]]:
  """(entries by stage, stage failures): a stage's ``(stage)`` entry is its crash, reported
  apart from the stage's tables."""
  entries: dict[str, list[dict]] = {}
  failures = []
  for r in records:
    if r.get("kind") == "entry":
      (failures if r.get("entry") == "(stage)" else entries.setdefault(r.get("stage", "?"), [])
       ).append(r)
  return entries, failures


def _stages_table(run: dict, stage_recs: dict[str, dict], entries: dict[str, list[dict]]
                  ) -> list[str]:
  """The table of stages: status, seconds and entry counts of each, in the run's order (else in
  the order the records name them)."""
  rows = []
  for stage in run.get("stages") or list(dict.fromkeys(list(stage_recs) + list(entries))):
    st = stage_recs.get(stage, {})
    c = st.get("entries") or {}
    rows.append([stage, st.get("status", "not recorded"), st.get("seconds"), c.get("ok", 0),
                 c.get("failed", 0), c.get("error", 0), c.get("skipped", 0), st.get("note")])
  return _table(["stage", "status", "seconds", "ok", "failed", "error", "skipped", "note"], rows)


def _section(title: str, header: Sequence[str], make_row: Callable[[dict], list],
             recs: list[dict], extra: Optional[Callable[[list], list]] = None) -> list[str]:
  """The lines of one stage's section: its table of ``recs`` (and ``extra``'s lines), "(no
  entries)" without records, or a note where a record cannot be rendered."""
  lines = ["", f"## {title}", ""]
  if not recs:
    return lines + ["(no entries)"]
  try:
    lines.extend(_table(header, [make_row(r) for r in recs]))
    if extra:
      lines.extend(extra(recs))
  except Exception as e:  # noqa: BLE001 - a malformed record must not cost the report
    lines.append(f"(could not render: {type(e).__name__}: {e})")
  return lines


def _setup_sections(entries: dict[str, list[dict]]) -> list[str]:
  """The sections of the checks that come before timing: env, kernels, numerics, kvm-check."""
  lines = _section(
      "env", ["entry", "status", "values"],
      lambda r: [r.get("entry"), _status(r), json.dumps(
          {k: v for k, v in r.items()
           if k not in ("stage", "time", "kind", "entry", "status", "seconds")})[:400]],
      entries.get("env", []))
  lines += _section(
      "kernels (pre-flight: each Pallas kernel vs its XLA op)",
      ["kernel", "dtype", "G", "status", "rel rms", "tol", "int diffs", "compile s"],
      lambda r: [r.get("kernel"), r.get("dtype"), r.get("G"), _status(r), r.get("rel_rms"),
                 r.get("tolerance"),
                 None if r.get("differences") is None else
                 f"{r['differences']}/{r.get('compared')}", r.get("compile_s")],
      entries.get("kernels", []))
  lines += _section(
      "numerics: pallas vs xla",
      ["Hkv", "dtype", "precision", "status", "out max rel", "out rel rms", "tol",
       "state rel", "routing same", "routing diffs"],
      lambda r: [r.get("Hkv"), r.get("dtype"), r.get("precision"), _status(r),
                 r.get("output_max_rel"), r.get("output_rel_rms"), r.get("tolerance"),
                 r.get("state_rel"), r.get("routing_same"),
                 None if r.get("routing_differences") is None else
                 f"{sum(r['routing_differences'])}/{r.get('routing_decisions')}"],
      entries.get("numerics", []))
  lines += _section(
      "kvm-check", ["case", "status", "passed", "seconds"],
      lambda r: [r.get("entry"), _status(r), r.get("passed"), r.get("seconds")],
      entries.get("check", []))
  return lines


def _timing_sections(entries: dict[str, list[dict]]) -> list[str]:
  """The prefill, decode and backward sections, each row set against full attention."""
  base = _baselines(entries.get("prefill", []), "ms", per_seq=True)
  lines = _section(
      "prefill (forward; ms, median after warm-up)",
      ["T", "impl", "B", "status", "ms", "ms/seq", "baseline", "baseline ÷ this", "compile s"],
      lambda r: [r.get("T"), r.get("impl"), r.get("batch"), _status(r), r.get("ms"),
                 r.get("ms_per_seq"), base.get(r.get("T"), (None, None))[0],
                 _ratio(base.get(r.get("T"), (None, None))[1], r.get("ms_per_seq")),
                 r.get("compile_s")], entries.get("prefill", []))
  fulls = [r.get("ms_per_step") for r in entries.get("decode", [])
           if str(r.get("impl", "")).startswith("full-")
           and isinstance(r.get("ms_per_step"), (int, float))]
  best_full = min(fulls, default=None)
  lines += _section(
      "decode (ms per step, steps inside one jitted fori_loop)",
      ["impl", "B", "context", "steps", "status", "ms/step", "best full ÷ this", "cache GiB",
       "compile s"],
      lambda r: [r.get("impl"), r.get("B"), r.get("context"), r.get("steps"), _status(r),
                 r.get("ms_per_step"), _ratio(best_full, r.get("ms_per_step")),
                 _gib(r.get("cache_bytes")), r.get("compile_s")], entries.get("decode", []),
      extra=lambda recs: ["", next((r["note"] for r in recs if r.get("note")
                                    and str(r.get("impl", "")).startswith("kvm-")), "")])
  base = _baselines(entries.get("backward", []), "ms", per_seq=False)
  lines += _section(
      "backward (gradient; ms and compiled memory)",
      ["T", "impl", "B", "status", "ms", "baseline ÷ this", "temp GiB", "needed GiB",
       "compile s"],
      lambda r: [r.get("T"), r.get("impl"), r.get("B"), _status(r), r.get("ms"),
                 _ratio(base.get(r.get("T"), (None, None))[1], r.get("ms")),
                 _gib(r.get("temp_size_bytes")), _gib(r.get("needed_bytes")),
                 r.get("compile_s")], entries.get("backward", []))
  return lines


def _other_sections(entries: dict[str, list[dict]]) -> list[str]:
  """The documents, compile and trace sections."""
  lines = _section(
      "documents (segment ids: exactness in float32; time with ids ÷ without)",
      ["entry", "T", "B", "dtype", "status", "rel rms", "tol", "rows same", "plain ms",
       "one doc/row ÷ plain", "mix ÷ plain", "documents in mix", "s (compiles included)"],
      lambda r: [r.get("entry"), r.get("T"), r.get("B"), r.get("dtype"), _status(r),
                 r.get("rel_rms"), r.get("tolerance"), r.get("rows_same"),
                 r.get("plain_ms"), r.get("one_ratio"), r.get("mix_ratio"),
                 r.get("documents_in_mix"), r.get("seconds_with_compile")],
      entries.get("documents", []))
  lines += _section(
      "compile (compile only, abstract shapes; seconds)",
      ["impl", "op", "Hkv", "R", "T", "status", "lower s", "compile s", "temp GiB"],
      lambda r: [r.get("impl"), r.get("op"), r.get("Hkv"), r.get("R"), r.get("T"),
                 _status(r), r.get("lower_s"), r.get("compile_s"),
                 _gib(r.get("temp_size_bytes"))], entries.get("compile", []))
  lines += _section(
      "trace", ["entry", "status", "file", "traced", "MiB"],
      lambda r: [r.get("entry"), _status(r), r.get("file"),
                 ",".join(r.get("traced") or []) or None,
                 None if r.get("bytes") is None else r["bytes"] / 2**20],
      entries.get("trace", []))
  return lines


def _closing_lines(failures: list[dict], records: list[dict]) -> list[str]:
  """The stage failures and, where stages were cut short by time, the command that finishes
  them."""
  lines = []
  if failures:
    lines += ["", "## Stage failures", ""]
    lines += [f"- {r.get('stage')}: {r.get('error')}" for r in failures]
  command = follow_up(records)
  if command:
    lines += ["", "## Next", "", "Stages cut short by time; to finish them while the machine is "
              "still warm (into an empty $OUT):", "", f"    {command}"]
  return lines


def summary_text(records: list[dict]) -> str:
  """The markdown report of a run, from its records alone."""
  run = next((r for r in records if r.get("kind") == "run"), {})
  stage_recs = {r["stage"]: r for r in records if r.get("kind") == "stage"}
  entries, failures = _group_entries(records)
  env = {r.get("entry"): r for r in entries.get("env", [])}
  lines = [f"# KVM device check ({run.get('mode', '?')})", "", _env_line(env), "",
           "Ratios are baseline time ÷ this time: above 1, this arm is faster than full "
           "attention (cuDNN; XLA attention where there is no GPU).", "", "## Stages", ""]
  lines += _stages_table(run, stage_recs, entries)
  lines += _setup_sections(entries)
  lines += _timing_sections(entries)
  lines += _other_sections(entries)
  lines += _closing_lines(failures, records)
  return "\n".join(lines) + "\n"


def write_summary(out: Path) -> str:
  text = summary_text(read_records(out / RESULTS))
  (out / SUMMARY).write_text(text, encoding="utf-8")
  return text
