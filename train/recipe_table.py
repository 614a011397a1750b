"""The recipes' train steps compiled for the chips users rent: per-chip memory, fit, and what fits.

Every recipe on every topology, rewriting the table in docs/hardware.md; one cell, printed only;
and the nightly check that regenerates the table and compares it with the committed one::

  python -m kvm_jax.train.recipe_table
  python -m kvm_jax.train.recipe_table --recipes kvm256_120m --topologies v5e:4x4 --no-write
  python -m kvm_jax.train.recipe_table --check

Every cell is ``kvm-train --memory-report --topology=T`` of a recipe
(:func:`kvm_jax.train.memory.compile_step`) at 8 sequences x 8192 tokens per chip, data-parallel
over the topology's chips (``mesh_data=-1``), with the recipe's own remat, loss slices and
dtypes. A step that does not fit is compiled again with the settings that trade compute or
communication for memory (:func:`kvm_jax.train.memory.fitting_settings`) and the first that fits
is named. The rows: the paper's 120M presets (KVM-256, √N, the saturating SWA hybrid, full
attention, OVQ + SWA, RWKV-7), its 350M KVM-256, and the three pretrained shapes converted to
KVM layers (``train/configs/pretrained.py:MODEL,kvm``), fine-tuned at 8192 tokens.

The numbers are XLA's (libtpu's and the CUDA plugins' compilers, run on this host), so they
change with those compilers' versions; the JSON beside the table records which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Optional

import jax

from kvm_jax.config.target import compiler_reason
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train import memory

GIB = 2 ** 30
SEQUENCES_PER_CHIP, SEQUENCE_LENGTH = 8, 8192
#: Recipe name -> the config ``kvm-train --config`` takes.
RECIPES = {
    "kvm256_120m": "paper.py:kvm256_120m",
    "kvm_sqrt16_120m": "paper.py:kvm_sqrt16_120m",
    "kvm_swa_sat1024_120m": "paper.py:kvm_swa_sat1024_120m",
    "gpta2_120m": "paper.py:gpta2_120m",
    "ovq_swa_120m": "paper.py:ovq_swa_120m",
    "rwkv7_120m": "paper.py:rwkv7_120m",
    "kvm256_350m": "paper.py:kvm256_350m",
    "qwen3_0_6b_kvm": "pretrained.py:qwen3_0_6b,kvm",
    "llama3_2_1b_kvm": "pretrained.py:llama3_2_1b,kvm",
    "gemma3_1b_kvm": "pretrained.py:gemma3_1b,kvm",
}
TOPOLOGIES = ("v5e:4x4", "v6e:2x2", "v5p:2x2x1", "h100:1x8")
DOC = Path(__file__).resolve().parents[1] / "docs" / "hardware.md"
DATA = Path(__file__).resolve().parents[1] / "docs" / "data" / "recipe_table.json"
START, END = "<!-- recipe-table:start -->", "<!-- recipe-table:end -->"
#: Two runs of one compiler version give the same bytes; across versions a cell may move. --check
#: accepts 2 % and requires the same fit.
CHECK_TOLERANCE = 0.02


def recipe_config(recipe: str, chips: int) -> TrainConfig:
  """``recipe``'s config at 8 x 8192 tokens per chip, data-parallel over ``chips``."""
  from kvm_jax.train.main import load_config
  cfg = load_config(f"train/configs/{RECIPES[recipe]}")
  return dataclasses.replace(cfg, batch_size=SEQUENCES_PER_CHIP * chips,
                             seq_len=SEQUENCE_LENGTH, grad_accum_steps=1, mesh_data=-1,
                             mesh_fsdp=1, mesh_tensor=1)


def cell(recipe: str, topology: str, budget: int = 4, log=print) -> dict:
  """One table cell: the step's peak per chip and fit, and when it does not fit the first
  setting that does (compiled, at most ``budget`` tries)."""
  target = memory.parse_target(topology)
  cfg = recipe_config(recipe, target.device_count)
  try:
    report = memory.compile_step(cfg, topology)
  except Exception as e:  # a compiler's error is the cell's answer, not the table's end
    log(f"  {recipe} on {topology}: does not compile: {compiler_reason(e)}")
    return {"recipe": recipe, "topology": topology, "chip_gib": target.memory_per_chip / GIB,
            "fits": False, "peak_gib": None, "refusal": None, "fix": None, "fix_peak_gib": None,
            "flops_ratio": None, "error": compiler_reason(e)}
  row = {"recipe": recipe, "topology": topology, "chip_gib": report.memory / GIB,
         "fits": bool(report.fits), "peak_gib": report.peak / GIB if report.compiled else None,
         "refusal": report.error or None, "fix": None, "fix_peak_gib": None,
         "flops_ratio": report.flops_ratio}
  log(f"  {recipe} on {topology}: {report.verdict()}")
  if not report.fits:
    found = memory.fitting_settings(cfg, topology, limit=1, budget=budget,
                                    progress=lambda t: log(f"    trying {t}"))
    if found:
      text, fixed = found[0]
      row["fix"], row["fix_peak_gib"] = text.replace("--config.", ""), fixed.peak / GIB
      log(f"    fits with {text}: {fixed.peak / GIB:.2f} GiB")
  return row


def cell_text(row: dict) -> str:
  """A cell of the markdown table: ``9.35 GiB`` when it fits, else what does."""
  if row.get("error"):
    return f"**does not compile**: {row['error']}"
  if row["fits"]:
    return f"{row['peak_gib']:.2f} GiB"
  need = (f"{row['peak_gib']:.1f} GiB" if row["peak_gib"] is not None else
          _refused_need(row["refusal"]))
  fix = (f"fits with `{row['fix']}` ({row['fix_peak_gib']:.2f} GiB)" if row["fix"]
         else "nothing tried fits")
  return f"**does not fit** ({need}); {fix}"


def _refused_need(refusal: Optional[str]) -> str:
  m = re.search(r"required for HLO temporaries \(([\d.]+)G\)", refusal or "")
  return f"temporaries {m.group(1)} GiB" if m else "refused"


def markdown(rows: list[dict], recipes=None, topologies=None) -> str:
  """The table of ``rows``: a line per recipe, a column per topology (by default those the rows
  hold); a cell no row gives is "–" (not compiled)."""
  topologies = list(topologies or dict.fromkeys(r["topology"] for r in rows))
  recipes = list(recipes or dict.fromkeys(r["recipe"] for r in rows))
  at = {(r["recipe"], r["topology"]): r for r in rows}
  chips = {t: memory.parse_target(t).memory_per_chip / GIB for t in topologies}
  head = "| recipe | " + " | ".join(f"{t} ({chips[t]:.2f} GiB per chip)" for t in topologies)
  lines = [head + " |", "|---" * (len(topologies) + 1) + "|"]
  for recipe in recipes:
    cells = [cell_text(at[(recipe, t)]) if (recipe, t) in at else "–" for t in topologies]
    lines.append(f"| {recipe} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def write_doc(table: str, doc: Path = DOC) -> None:
  """Replaces the text between the table's markers in ``doc``."""
  text = doc.read_text()
  if START not in text or END not in text:
    raise ValueError(f"{doc} has no {START} ... {END} section for the table.")
  head, rest = text.split(START, 1)
  _, tail = rest.split(END, 1)
  doc.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def compare(new: list[dict], old: list[dict]) -> list[str]:
  """The cells where ``new`` differs from ``old``: another fit, or a peak more than
  :data:`CHECK_TOLERANCE` apart."""
  before = {(r["recipe"], r["topology"]): r for r in old}
  problems = []
  for r in new:
    o = before.get((r["recipe"], r["topology"]))
    if o is None:
      problems.append(f"{r['recipe']} on {r['topology']}: not in the committed table")
      continue
    if o["fits"] != r["fits"]:
      problems.append(f"{r['recipe']} on {r['topology']}: fits {r['fits']}, table says "
                      f"{o['fits']}")
    for key in ("peak_gib", "fix_peak_gib"):
      if (o[key] is None) != (r[key] is None) or (
          o[key] is not None and abs(r[key] - o[key]) > CHECK_TOLERANCE * o[key]):
        problems.append(f"{r['recipe']} on {r['topology']}: {key} {r[key]} vs {o[key]}")
  return problems


def versions() -> dict:
  import importlib.metadata as md
  out = {"jax": jax.__version__}
  for pkg in ("libtpu", "jax-cuda13-plugin"):
    try:
      out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
      out[pkg] = None
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m kvm_jax.train.recipe_table", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--recipes", default=",".join(RECIPES),
                 help=f"comma-separated rows, of {', '.join(RECIPES)} (default: all)")
  p.add_argument("--topologies", default=",".join(TOPOLOGIES),
                 help="comma-separated columns, TPU topologies or GPUs (default: %(default)s)")
  p.add_argument("--budget", type=int, default=4,
                 help="compiles tried per cell that does not fit (default: %(default)s)")
  p.add_argument("--no-write", action="store_true",
                 help="print the table; leave docs/hardware.md and its JSON alone")
  p.add_argument("--cells-out", metavar="FILE",
                 help="also write the computed cells to FILE (JSON), e.g. one column per process "
                      "to merge with --from")
  p.add_argument("--from", dest="from_cells", metavar="FILE,...",
                 help="compile nothing: render (and write) the table from cells that earlier "
                      "runs wrote with --cells-out")
  p.add_argument("--check", action="store_true",
                 help="regenerate the cells and compare them with docs/data/recipe_table.json "
                      "(the same fit, peaks within 2 %%); exit 1 on a difference")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  recipes = [r for r in args.recipes.split(",") if r]
  unknown = [r for r in recipes if r not in RECIPES]
  if unknown:
    raise SystemExit(f"--recipes: unknown {unknown}; choose from {list(RECIPES)}.")
  topologies = [t for t in args.topologies.split(",") if t]
  for t in topologies:
    try:
      memory.parse_target(t)
    except ValueError as e:
      raise SystemExit(f"--topologies: {e}") from None
  if args.from_cells:
    rows = [row for path in args.from_cells.split(",") if path
            for row in json.loads(Path(path).read_text())]
    order = {(r, t): i for i, (r, t) in enumerate((r, t) for r in RECIPES for t in TOPOLOGIES)}
    rows.sort(key=lambda row: order.get((row["recipe"], row["topology"]), len(order)))
    rows = list({(row["recipe"], row["topology"]): row for row in rows}.values())  # last wins
  else:
    rows = []
    for i, (recipe, topology) in enumerate((r, t) for r in recipes for t in topologies):
      print(f"[{i + 1}/{len(recipes) * len(topologies)}] {recipe} on {topology}", flush=True)
      rows.append(cell(recipe, topology, args.budget,
                       log=lambda text: print(text, flush=True)))
      if args.cells_out:  # after every cell: a long run that stops keeps what it computed
        Path(args.cells_out).write_text(json.dumps(rows, indent=1) + "\n")
  table = markdown(rows, list(RECIPES), TOPOLOGIES) if args.from_cells else markdown(rows)
  print(table)
  if args.check:
    problems = compare(rows, json.loads(DATA.read_text())["cells"])
    print("\n".join(problems) if problems else "the table matches docs/data/recipe_table.json")
    return 1 if problems else 0
  if not args.no_write:
    DATA.parent.mkdir(parents=True, exist_ok=True)
    DATA.write_text(json.dumps({"versions": versions(), "cells": rows}, indent=1) + "\n")
    write_doc(table)
    print(f"wrote {DOC} and {DATA}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
