"""Configs to and from JSON, so a run directory says which model its checkpoints hold.

Every config here is a (possibly nested, possibly frozen) dataclass of plain values. The JSON form
tags each dataclass with its class name (``"__class__": "KVMConfig"``); decoding only builds
classes from an explicit registry, so a config file can never instantiate arbitrary code, and runs
the class's own validation. JSON has no tuples: every list is read back as a tuple (no config field
is a list; tuples keep the frozen configs hashable, which jit's static arguments need). The mixers'
options classes (:mod:`kvm_jax.config.mixers`, any registered kind) and the backbone families'
(:mod:`kvm_jax.config.families`) are known without being named.
A file carries its format's version (:data:`FORMAT_KEY`); one without it was written before
versions existed and is upgraded once, by :func:`upgrade_unversioned`, when read.
"""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

from etils import epath
from typing import Any, Iterable, Mapping

from kvm_jax.config import budget as budget_lib
from kvm_jax.config import families as family_options
from kvm_jax.config import mixers as mixer_options
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.config.model import ModelConfig

CLASS_KEY = "__class__"
#: The top-level key holding a config file's format version. Version 2: the mixers' settings in
#: the model's ``options`` table and the backbone's in ``family_options``. Files without the key
#: (version 1) kept them as fields of the model (``kvm``, ``swa_window``, ``tokenshift_mlp``, ...).
FORMAT_KEY = "format_version"
FORMAT_VERSION = 2
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


def from_jsonable(obj: Any, classes: Iterable[type] = (),
                  upgrades: Mapping[str, Any] = {}) -> Any:  # noqa: B006 (read only)
  """Inverse of :func:`to_jsonable`; ``classes`` adds dataclasses beyond the core configs;
  ``upgrades`` maps a class name to a function that rewrites its fields (already built) from an
  earlier format into the current one (:func:`upgrade_unversioned`)."""
  registry = {c.__name__: c for c in (*CORE_CLASSES, *mixer_options.options_classes(),
                                      *family_options.family_options_classes(), *classes)}

  def build(x):
    if isinstance(x, dict) and CLASS_KEY in x:
      name = x[CLASS_KEY]
      if name not in registry:
        raise ValueError(f"config names unknown class {name!r}; known: {sorted(registry)}.")
      cls = registry[name]
      fields = {k: build(v) for k, v in x.items() if k != CLASS_KEY}
      if name in upgrades:
        fields = upgrades[name](fields)
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


def with_format(data: dict) -> dict:
  """A config's JSON object (:func:`to_jsonable`) stamped with the current format version."""
  return {FORMAT_KEY: FORMAT_VERSION, **data}


def read_config(data: dict, classes: Iterable[type] = ()) -> Any:
  """The config of a JSON object of any format version: the current one as it is, a file
  without a version upgraded (:func:`upgrade_unversioned`), a newer one refused."""
  data = dict(data)
  version = data.pop(FORMAT_KEY, 1)
  if not isinstance(version, int) or version > FORMAT_VERSION:
    raise ValueError(f"config {FORMAT_KEY}={version!r}: this kvm_jax reads versions up to "
                     f"{FORMAT_VERSION}; it was written by a newer kvm_jax (upgrade kvm_jax).")
  return from_jsonable(data, classes, upgrades=upgrade_unversioned() if version == 1 else {})


# The model fields of version 1 files: a field naming a kind holds its whole options; the others
# hold one field of a kind's options.
_UNVERSIONED_KIND_FIELDS = {"kvm": None, "swa_window": ("swa", "window"),
                            "swa_rope_dims": ("swa", "rope_dims"),
                            "bswa_chunk_size": ("bswa", "chunk_size"),
                            "bswa_window_chunks": ("bswa", "window_chunks"),
                            "bswa_sink_rows": ("bswa", "sink_rows")}
# ... and the GPTAlpha-2 backbone's, now fields of its family options.
_UNVERSIONED_FAMILY_FIELDS = ("ffn_expansion", "tokenshift_attention", "tokenshift_mlp",
                              "value_residual", "share_value_anchor")


def upgrade_unversioned() -> dict[str, Any]:
  """The one migration: ``{class name: fields -> fields}`` reading a file written before format
  versions (0.1.0's layout), whose model kept its mixers' settings as fields of its own. Each
  such field replaces one field of its kind's options in ``options`` (or of the kind's defaults),
  a field naming a kind gives that kind's options, and the backbone's fields become
  ``family_options``."""

  def model_fields(fields: dict) -> dict:
    fields = dict(fields)
    family = {n: fields.pop(n) for n in _UNVERSIONED_FAMILY_FIELDS if n in fields}
    if family:
      base = fields.get("family_options") or {}
      base = base if isinstance(base, Mapping) else dataclasses.asdict(base)
      fields["family_options"] = family_options.family_options_class(
          fields.get("family", "gptalpha2"))(**{**base, **family})
    kinds = {n: fields.pop(n) for n in _UNVERSIONED_KIND_FIELDS if n in fields}
    if kinds:
      options, per_kind = dict(fields.get("options") or {}), {}
      for name, value in kinds.items():
        if _UNVERSIONED_KIND_FIELDS[name] is None:
          options.setdefault(name, value)
        else:
          kind, field = _UNVERSIONED_KIND_FIELDS[name]
          per_kind.setdefault(kind, {})[field] = value
      for kind, values in per_kind.items():
        base = options.get(kind) or mixer_options.options_class(kind)()
        options[kind] = dataclasses.replace(base, **values)
      fields["options"] = options
    return fields

  return {"ModelConfig": model_fields}


#: The command-line spelling of config values, shown by every CLI's --help.
VALUE_SPEC_HELP = (
    "Values are read by the field's type: true/false, numbers, text; none for an unset optional "
    "field; budgets as specs (" + budget_lib.BUDGET_SPEC_HELP + "); sequences as comma lists "
    "(mixers: one name for every layer, one per layer, or a pattern repeated to the depth, e.g. "
    "swa,kvm).")


def parse_value(current: Any, text: str, field: str = "value") -> Any:
  """The value of a config field (now ``current``) written as ``text`` on a command line: the
  one spelling every CLI accepts (``kvm-train --config.FIELD``, ``kvm-eval``/``kvm-convert
  --kvm.FIELD``; :data:`VALUE_SPEC_HELP`); a ValueError says why ``text`` is not one."""
  if field == "budget" or isinstance(current, (budget_lib.FixedBudget, budget_lib.PowerLawBudget,
                                               budget_lib.SaturatingBudget)):
    return budget_lib.parse_budget(text)
  if isinstance(current, bool):
    if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
      raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1", "yes")
  if isinstance(current, (int, float)):
    try:
      return type(current)(text)
    except ValueError:
      kind = "an integer" if isinstance(current, int) else "a number"
      raise ValueError(f"expected {kind}, got {text!r}") from None
  if isinstance(current, str):
    return text
  if isinstance(current, tuple) or field == "mixers":
    if text.strip()[:1] in ("(", "["):
      return tuple(_literal(text))
    items = [x.strip() for x in text.split(",") if x.strip()]
    kinds = {type(x) for x in current} if isinstance(current, tuple) else {str}
    if not kinds:  # an empty sequence shows no type: whole numbers are ints (layer indices)
      kinds = {int} if items and all(_is_int(x) for x in items) else {str}
    cast = kinds.pop() if len(kinds) == 1 and kinds <= {int, float, str} else str
    return tuple(cast(x) for x in items)
  if current is None:
    if text.lower() == "none":
      return None
    try:
      return _literal(text)
    except ValueError:
      return text  # an optional text field, e.g. a dtype name
  return _literal(text)


def is_optional(field: dataclasses.Field) -> bool:
  """Whether a dataclass field's annotation admits None (``Optional[...]``, ``X | None``)."""
  annotation = field.type if isinstance(field.type, str) else repr(field.type)
  return "Optional[" in annotation or "None" in annotation


def parse_field(field: dataclasses.Field, current: Any, text: str) -> Any:
  """:func:`parse_value` for a dataclass field, which also reads ``none`` as None wherever the
  field's annotation admits None, whatever it holds now (``max_state_rows=64`` in a config file
  can be unset from the command line); a text field that is not optional keeps ``none`` as text
  (``remat=none``)."""
  if text.strip().lower() == "none" and is_optional(field):
    return None
  return parse_value(current, text, field.name)


def flat_fields(cfg: Any) -> dict[str, Any]:
  """``{dotted field: value}`` of a config's leaves, in field order, each value as its JSON form
  (a list for a tuple) except a budget, which is one leaf: its spec text (``"sqrt:16@256"``)."""
  def flat(value, prefix):
    if isinstance(value, dict):
      if value.get(CLASS_KEY, "").endswith("Budget"):
        return {prefix: budget_text(from_jsonable(value))}
      out = {}
      for key, item in value.items():
        if key != CLASS_KEY:
          out.update(flat(item, f"{prefix}.{key}" if prefix else key))
      return out
    return {prefix: value}
  return flat(to_jsonable(cfg), "")


def budget_text(budget: Any) -> str:
  """A budget's spec (``budget_lib.budget_label``) where it reads back to the same budget; else
  its repr. The spec prints numbers to 6 digits and has no rounding: a field compared or shown
  through it must not make two budgets the same."""
  label = budget_lib.budget_label(budget)
  try:
    if budget_lib.parse_budget(label) == budget:
      return label
  except ValueError:
    pass
  return repr(budget)


def value_text(value: Any) -> str:
  """A config value as :func:`parse_value` reads it back (``--config.FIELD=<this>``)."""
  if value is None:
    return "none"
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (list, tuple)):
    return ",".join(value_text(v) for v in value)
  return str(value)


def _is_int(text: str) -> bool:
  try:
    int(text)
    return True
  except ValueError:
    return False


def _literal(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    raise ValueError(f"cannot read {text!r} as a Python literal") from None


def save(path: str | Path, cfg: Any) -> None:
  # epath: a gs:// (or other remote) run directory is written there, not to a local "gs:" folder.
  epath.Path(path).write_text(json.dumps(with_format(to_jsonable(cfg)), indent=2) + "\n")


def load(path: str | Path, classes: Iterable[type] = ()) -> Any:
  return read_config(json.loads(epath.Path(path).read_text()), classes)
