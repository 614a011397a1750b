"""The options of each mixer kind, as :class:`kvm_jax.ModelConfig` holds them.

A mixer kind (``"full"``, ``"swa"``, ``"bswa"``, ``"kvm"``, ``"ovq"``, ``"rwkv7"`` or one
registered by :func:`kvm_jax.nn.register_mixer`) owns one small frozen dataclass of options. ``ModelConfig``
keeps one options object per kind in a :class:`KindOptions` table and never branches on a kind
name: what it needs of a kind it asks the options object, through two optional methods:

* ``rotary_dims(model) -> int``: the rotary channels of this kind's layers (default: the model's
  ``rope_dims``);
* ``check(model) -> None``: raise ``ValueError`` when the options do not fit the model (e.g. KVM's
  ``rope_dims`` must equal the model's).

This module only holds the table of kinds and their options classes; the mixer modules register
themselves (the Flax side lives in :mod:`kvm_jax.nn.registry`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping

# kind -> options class. Filled by kvm_jax.nn.registry (the built-in kinds on import, others
# through register_mixer): the one list of kinds.
_OPTIONS_CLASSES: dict[str, type] = {}


def register_options(kind: str, options_class: type) -> None:
  """Make ``kind`` a mixer name that ``ModelConfig`` accepts, with options of ``options_class``
  (a frozen dataclass whose defaults build a valid instance). Re-registering a kind with the same
  class is a no-op; with another class an error."""
  if not isinstance(kind, str) or not kind.isidentifier():
    raise ValueError(f"mixer kind {kind!r} must be a Python identifier (it names config fields "
                     "on the command line: --config.model.options.KIND.FIELD).")
  if not (dataclasses.is_dataclass(options_class) and isinstance(options_class, type)
          and options_class.__dataclass_params__.frozen):
    raise TypeError(f"options of mixer {kind!r} must be a frozen dataclass class, got "
                    f"{options_class!r}.")
  known = _OPTIONS_CLASSES.get(kind)
  if known is not None and known is not options_class:
    raise ValueError(f"mixer kind {kind!r} is already registered with options "
                     f"{known.__name__}; choose another name for {options_class.__name__}.")
  _OPTIONS_CLASSES[kind] = options_class


def unregister_options(kind: str) -> None:
  """Forgets ``kind`` (a registration that failed a later check is taken back)."""
  _OPTIONS_CLASSES.pop(kind, None)


def mixer_kinds() -> tuple[str, ...]:
  """Every registered mixer kind, in registration order (the built-ins first)."""
  return tuple(_OPTIONS_CLASSES)


def options_class(kind: str) -> type:
  """The options class of ``kind``; a ValueError naming the known kinds otherwise."""
  if kind not in _OPTIONS_CLASSES:
    raise ValueError(f"unknown mixer {kind!r}; choose from {mixer_kinds()}, or register a new "
                     "kind with kvm_jax.nn.register_mixer(kind, cls).")
  return _OPTIONS_CLASSES[kind]


def options_classes() -> tuple[type, ...]:
  """Every registered options class (what a JSON config may name)."""
  return tuple(dict.fromkeys(_OPTIONS_CLASSES.values()))


def rotary_dims(options: Any, model: Any) -> int:
  """Rotary channels of the layers whose kind has ``options``."""
  method = getattr(options, "rotary_dims", None)
  return model.rope_dims if method is None else int(method(model))


def check_options(options: Any, model: Any) -> None:
  """The options' own check against the whole model, when the class has one."""
  method = getattr(options, "check", None)
  if method is not None:
    method(model)


class KindOptions(Mapping):
  """An immutable, hashable ``{kind: options}`` table (a static part of a jitted model's config).

  ``KindOptions({"kvm": KVMConfig(...), "swa": SWAOptions(window=256)})``; ``table[kind]``;
  ``table.set(kind, options)`` returns a new table. A kind without an entry uses its options
  class's defaults (:meth:`resolve`)."""

  __slots__ = ("_items",)

  def __init__(self, items: Mapping[str, Any] | Any = ()):
    pairs = items.items() if isinstance(items, Mapping) else items
    table = {}
    for kind, options in pairs:
      cls = options_class(kind)
      if isinstance(options, Mapping):  # from JSON: a plain dict of fields
        options = cls(**options)
      if not isinstance(options, cls):
        raise TypeError(f"options of mixer {kind!r} must be a {cls.__name__}, got "
                        f"{type(options).__name__} {options!r}.")
      table[kind] = options
    object.__setattr__(self, "_items", tuple(sorted(table.items())))

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(f"KindOptions is immutable; use .set({name!r}, ...)")

  def __getitem__(self, kind: str) -> Any:
    for name, options in self._items:
      if name == kind:
        return options
    raise KeyError(kind)

  def __iter__(self) -> Iterator[str]:
    return (name for name, _ in self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __hash__(self) -> int:
    return hash(self._items)

  def __eq__(self, other) -> bool:
    return isinstance(other, KindOptions) and self._items == other._items

  def __repr__(self) -> str:
    return f"KindOptions({dict(self._items)!r})"

  def set(self, kind: str, options: Any) -> "KindOptions":
    """A new table with ``kind``'s options replaced."""
    return KindOptions({**dict(self._items), kind: options})

  def resolve(self, kind: str) -> Any:
    """The options of ``kind``: its entry, or its class's defaults."""
    return self[kind] if kind in self else options_class(kind)()
