"""Configs to and from JSON, so a run directory says which model its checkpoints hold.

Every config here is a (possibly nested, possibly frozen) dataclass of plain values. The JSON form
tags each dataclass with its class name (``"__class__": "KVMConfig"``); decoding only builds
classes from an explicit registry, so a config file can never instantiate arbitrary code, and runs
the class's own validation. JSON has no tuples: every list is read back as a tuple (no config field
is a list; tuples keep the frozen configs hashable, which jit's static arguments need). The mixers'
options classes (:mod:`kvm_jax.mixer_options`, any registered kind) are known without being named.
A class may read files of earlier versions through a classmethod ``upgrade_fields(dict) -> dict``
(``ModelConfig`` folds its old per-kind fields into ``options`` so).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from etils import epath
from typing import Any, Iterable, Mapping

from kvm_jax import budget as budget_lib
from kvm_jax import mixer_options
from kvm_jax.config import KVMConfig
from kvm_jax.model_config import ModelConfig

CLASS_KEY = "__class__"
CORE_CLASSES = (ModelConfig, KVMConfig, budget_lib.FixedBudget, budget_lib.PowerLawBudget,
                budget_lib.SaturatingBudget)


def to_jsonable(obj: Any) -> Any:
  """Nested dataclasses/tuples/scalars -> JSON-compatible dicts/lists/scalars."""
  if isinstance(obj, budget_lib.CallableBudget) or (callable(obj) and not dataclasses.is_dataclass(obj)):
    raise ValueError(f"{obj!r} is a callable budget and cannot be written to JSON; use "
                     "FixedBudget, PowerLawBudget or SaturatingBudget for runs that save a config.")
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    out = {CLASS_KEY: type(obj).__name__}
    for field in dataclasses.fields(obj):
      out[field.name] = to_jsonable(getattr(obj, field.name))
    return out
  if isinstance(obj, (list, tuple)):
    return [to_jsonable(x) for x in obj]
  if isinstance(obj, Mapping):  # dicts and the mixers' KindOptions table
    return {str(k): to_jsonable(v) for k, v in obj.items()}
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  raise ValueError(f"cannot write {type(obj).__name__} {obj!r} to a JSON config.")


def from_jsonable(obj: Any, classes: Iterable[type] = ()) -> Any:
  """Inverse of :func:`to_jsonable`; ``classes`` adds dataclasses beyond the core configs."""
  registry = {c.__name__: c for c in (*CORE_CLASSES, *mixer_options.options_classes(),
                                      *classes)}

  def build(x):
    if isinstance(x, dict) and CLASS_KEY in x:
      name = x[CLASS_KEY]
      if name not in registry:
        raise ValueError(f"config names unknown class {name!r}; known: {sorted(registry)}.")
      cls = registry[name]
      fields = {k: build(v) for k, v in x.items() if k != CLASS_KEY}
      upgrade = getattr(cls, "upgrade_fields", None)
      if upgrade is not None:
        fields = upgrade(fields)
      unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
      if unknown:
        raise ValueError(f"config for {name} has unknown fields {sorted(unknown)} (written by a "
                         "newer version?).")
      return cls(**fields)
    if isinstance(x, dict):
      return {k: build(v) for k, v in x.items()}
    if isinstance(x, list):
      return tuple(build(v) for v in x)
    return x

  return build(obj)


def save(path: str | Path, cfg: Any) -> None:
  # epath: a gs:// (or other remote) run directory is written there, not to a local "gs:" folder.
  epath.Path(path).write_text(json.dumps(to_jsonable(cfg), indent=2) + "\n")


def load(path: str | Path, classes: Iterable[type] = ()) -> Any:
  return from_jsonable(json.loads(epath.Path(path).read_text()), classes)
