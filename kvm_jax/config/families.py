"""The options of each backbone family, as :class:`kvm_jax.ModelConfig` holds them.

A backbone family (``"gptalpha2"``, ``"llama"`` or one registered by
:func:`kvm_jax.nn.register_family`) owns one frozen dataclass of options: what its blocks, norms,
MLP, embedding and head are (``ModelConfig.family_options``). ``ModelConfig`` never branches on a
family's name; what it needs it asks the options object through optional members:

* ``mlp_width(model) -> int``: the MLP's hidden width;
* ``check(model) -> None``: raise ``ValueError`` when the options do not fit the model;
* the switches of the GPTAlpha-2 front end (``tokenshift_attention``, ``tokenshift_mlp``,
  ``value_residual``, ``share_value_anchor``): a family without the field has the switch off.

This module only holds the table of families and their options classes; the family modules
register themselves (the Flax side lives in :mod:`kvm_jax.nn.families.family`).
"""

from __future__ import annotations

import dataclasses

# family -> options class, filled by kvm_jax.nn.families.family.register_family.
_OPTIONS_CLASSES: dict[str, type] = {}


def register_family_options(family: str, options_class: type) -> None:
  """Make ``family`` a name ``ModelConfig.family`` accepts, with options of ``options_class`` (a
  frozen dataclass whose defaults build a valid instance). Re-registering with the same class is
  a no-op; with another class an error."""
  if not isinstance(family, str) or not family.isidentifier():
    raise ValueError(f"family name {family!r} must be a Python identifier.")
  if not (dataclasses.is_dataclass(options_class) and isinstance(options_class, type)
          and options_class.__dataclass_params__.frozen):
    raise TypeError(f"options of family {family!r} must be a frozen dataclass class, got "
                    f"{options_class!r}.")
  known = _OPTIONS_CLASSES.get(family)
  if known is not None and known is not options_class:
    raise ValueError(f"family {family!r} is already registered with options {known.__name__}; "
                     f"choose another name for {options_class.__name__}.")
  _OPTIONS_CLASSES[family] = options_class


def family_names() -> tuple[str, ...]:
  """Every registered family, in registration order (the built-ins first)."""
  return tuple(_OPTIONS_CLASSES)


def family_options_class(family: str) -> type:
  """The options class of ``family``; a ValueError naming the known families otherwise."""
  if family not in _OPTIONS_CLASSES:
    raise ValueError(f"unknown backbone family {family!r}; choose from {family_names()}, or "
                     "register one with kvm_jax.nn.register_family(name, cls).")
  return _OPTIONS_CLASSES[family]


def family_options_classes() -> tuple[type, ...]:
  """Every registered family options class (what a JSON config may name)."""
  return tuple(dict.fromkeys(_OPTIONS_CLASSES.values()))
