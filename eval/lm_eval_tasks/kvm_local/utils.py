"""Loaders for the offline example tasks: JSONL files next to this file, no download."""

import json
from pathlib import Path

import datasets

_HERE = Path(__file__).parent


def _load(name: str) -> datasets.DatasetDict:
  rows = [json.loads(line) for line in (_HERE / f"{name}.jsonl").read_text().splitlines() if line]
  return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def choice(**_):
  return _load("choice")


def generate(**_):
  return _load("generate")


def documents(**_):
  return _load("documents")
