"""Every command of the README's shell blocks runs as written on a fresh clone: each ``kvm-*``
command line is parsed by that command's own argument parser (nothing runs), the config files and
``FILE:ARG`` presets it names exist, its ``--config.FIELD=VALUE`` overrides name real fields, and
every run directory it reads is one that a command of the README or docs/ writes (or a
downloaded checkpoint under ``models/``, or a placeholder the reader fills in: ``$MODEL``, ``W``,
``...``).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from kvm_jax.nn.convert import kvm_flags
from kvm_jax.eval import check, cli as eval_cli
from kvm_jax.eval.bench import core_speed
from kvm_jax.eval.bench import speed
from kvm_jax.hf import cli as hf_cli
from kvm_jax import core_demo as demo
from kvm_jax.generation import serve
from kvm_jax.train import main as train_main, prepare_data
from kvm_jax.train import demo as default_job

from tests.helpers import ROOT  # noqa: E402
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|console|sh|shell)\n(.*?)^```", re.M | re.S)
# Words a reader replaces: a token containing one is not checked as a path.
PLACEHOLDERS = re.compile(r"\$|\.\.\.|^W$|^DIR$|^W/|/W$")
PARSERS = {
    "kvm-train": train_main.build_parser, "kvm-demo": default_job.build_parser,
    "kvm-core-demo": demo.build_parser, "kvm-bench-core": core_speed.build_parser,
    "kvm-bench": speed.build_parser, "kvm-eval": eval_cli.build_parser,
    "kvm-check": check.build_parser, "kvm-data": prepare_data.build_parser,
    "kvm-import": hf_cli.import_parser, "kvm-export": hf_cli.export_parser,
    "kvm-convert": hf_cli.convert_parser, "kvm-serve": serve.build_parser,
}
# Where the documents keep checkpoints the reader downloads first (hf download).
DOWNLOADS = ("models/", "~/models/")
# Commands whose parser leaves --config.FIELD / --kvm.FIELD overrides to main().
OVERRIDES = {"kvm-train", "kvm-eval", "kvm-convert"}


def shell_lines(text: str) -> list[str]:
  """The command lines of ``text``'s shell blocks: continuations joined, prompts (``$ ``) and
  output lines (those of a ``console`` block without a prompt) dropped."""
  lines = []
  for block in SHELL_BLOCK.findall(text):
    joined = re.sub(r"\\\n\s*", " ", block)
    prompted = any(line.startswith("$ ") for line in joined.splitlines())
    for line in joined.splitlines():
      if prompted and not line.startswith("$ "):
        continue
      lines.append(line[2:] if line.startswith("$ ") else line)
  return lines


def kvm_commands(line: str) -> list[tuple[str, list[str]]]:
  """``(command, arguments)`` of each ``kvm-*`` command on a shell line (after ``&&``, ``;``,
  ``do``, environment assignments or a launcher such as ``srun``), comments dropped."""
  try:
    words = shlex.split(line, comments=True)
  except ValueError:
    return []
  found, current = [], None
  for word in words:
    ends = word.endswith(";")  # "... --x=1; done": the word, then the command ends
    word = word.rstrip(";")
    if word in ("&&", "&", "|", "do", "done") or (ends and not word):
      current = None
    elif word.rsplit("/", 1)[-1] in PARSERS:
      current = (word.rsplit("/", 1)[-1], [])
      found.append(current)
    elif current is not None:
      current[1].append(word)
    if ends:
      current = None
  return found


def readme_commands() -> list[tuple[str, str, list[str]]]:
  """``(where, command, arguments)`` of every ``kvm-*`` command in the documents."""
  out = []
  for doc in DOCUMENTS:
    for line in shell_lines(doc.read_text(encoding="utf-8")):
      out += [(f"{doc.name}: {line.strip()}", name, args) for name, args in kvm_commands(line)]
  return out


def is_placeholder(word) -> bool:
  return word is None or bool(PLACEHOLDERS.search(str(word)))


def written_runs(commands) -> set[str]:
  """The run directories the commands write: kvm-train's --workdir, kvm-import's and
  kvm-convert's DEST, and the sub-directories of kvm-demo's --workdir (one run per model)."""
  runs = set()
  for _, name, args in commands:
    if "..." in args:
      continue
    parsed = parse(name, args)[0]
    if name == "kvm-train":
      runs.add(parsed.workdir)
    elif name in ("kvm-import", "kvm-convert"):
      runs.add(parsed.dest)
    elif name == "kvm-demo":
      runs |= {f"{parsed.workdir}/{m}" for m in default_job.DEFAULT_MODELS}
  return {r.rstrip("/") for r in runs if not is_placeholder(r)}


def parse(name: str, args: list[str]):
  """The namespace and the leftover overrides of ``name args``."""
  # A value that is one shell variable (--process-id=$i) stands for a number or a name (1 is
  # both); a word that is one ($FLAGS) stands for flags the text shows elsewhere.
  variable = r"\$\{?\w+\}?"
  args = [re.sub(f"={variable}$", "=1", a) for a in args if not re.fullmatch(variable, a)]
  parser = PARSERS[name]()
  if name in OVERRIDES:
    return parser.parse_known_args(args)
  return parser.parse_args(args), []


def problems_of(name: str, args: list[str], runs: set[str]) -> list[str]:
  """What does not hold of one command (module docstring)."""
  try:
    if "..." in args:  # "kvm-train ... --distributed": only the flags shown are checked
      required = ["--config=x", "--workdir=x"] if name == "kvm-train" else []
      PARSERS[name]().parse_known_args(required + [a for a in args if a != "..."])
      return []
    parsed, rest = parse(name, args)
  except SystemExit:
    return [f"{name} refuses its arguments {args}"]
  bad = []
  if name == "kvm-train":
    if is_placeholder(parsed.config):
      return bad
    cfg = train_main.load_config(parsed.config)  # SystemExit names a missing file or preset
    for item in rest:
      key, _, value = item[len("--config."):].partition("=")
      if not item.startswith("--config.") or not value:
        bad.append(f"kvm-train: {item!r} is no --config.FIELD=VALUE")
        continue
      try:
        train_main.apply_override(cfg, key, value)
      except SystemExit as e:
        bad.append(str(e))
    reads = [v.partition("=")[2] for v in rest
             if v.startswith(("--config.init_from=", "--config.teacher="))]
  elif name in ("kvm-eval", "kvm-convert"):
    try:
      kvm_flags(parsed, rest)
    except ValueError as e:
      bad.append(f"{name}: {e}")
    reads = parsed.checkpoint if name == "kvm-eval" else [parsed.src]
  else:
    reads = {"kvm-serve": [getattr(parsed, "run_dir", None)],
             "kvm-export": [getattr(parsed, "run_dir", None)]}.get(name, [])
  for path in reads:  # kvm-eval also takes a directory of runs (kvm-demo's --workdir)
    path = path.rstrip("/")
    if not (is_placeholder(path) or path in runs or path.startswith(DOWNLOADS)
            or name == "kvm-eval" and any(r.startswith(path + "/") for r in runs)):
      bad.append(f"{name} reads {path}, which no command of the README writes")
  return bad


COMMANDS = readme_commands()


def test_the_readme_shows_commands():
  names = {name for _, name, _ in COMMANDS}
  assert {"kvm-train", "kvm-demo", "kvm-eval", "kvm-serve", "kvm-check"} <= names, names


@pytest.mark.parametrize("where,name,args", COMMANDS, ids=[c[0][:90] for c in COMMANDS])
def test_readme_command_is_accepted(where, name, args):
  runs = written_runs(COMMANDS)
  assert not problems_of(name, args, runs), (where, problems_of(name, args, runs))


def test_the_checker_reports_what_it_guards_against():
  """A flag the command lacks, an unknown config field, a missing config file and a run
  directory no command writes are each reported."""
  runs = {"runs/text", "runs/demo/kvm-sqrt"}
  assert problems_of("kvm-check", ["--size", "paper"], runs) == []
  assert problems_of("kvm-check", ["--no-such-flag"], runs)
  assert problems_of("kvm-train", ["--config=train/configs/tiny_text.py", "--workdir=runs/x",
                                   "--config.no_such_field=1"], runs)
  with pytest.raises(SystemExit, match="does not exist"):
    problems_of("kvm-train", ["--config=train/configs/no_such.py", "--workdir=runs/x"], runs)
  assert problems_of("kvm-serve", ["runs/demo/kvm"], runs)
  assert problems_of("kvm-serve", ["runs/text"], runs) == []
  assert kvm_commands("for i in 0 1; do X=1 kvm-train --workdir=W --config=c.py; done # x") == [
      ("kvm-train", ["--workdir=W", "--config=c.py"])]
