"""A package's public names, imported on first use (PEP 562).

``import kvm_jax`` (and any light module under it, such as a command's argument parser) must not
import JAX, Flax and the model: that takes seconds, and ``kvm-train --help`` needs none of it. A
package lists where each of its public names lives; :func:`exports` gives it the module
``__getattr__`` that imports the defining module when a name is first read, and ``__dir__``.
``from package import Name``, ``package.Name`` and ``from package import *`` work as with eager
imports and give the same objects.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Callable, Mapping, Optional, Sequence


class _Package(types.ModuleType):
  """A package whose public name is also one of its submodules (``kvm_jax.generation.generate``, the module,
  and ``kvm_jax.generation.generate``, the function it defines): Python binds the submodule on the package
  when something first imports it, which would hide the function; the name keeps the function."""

  def __setattr__(self, name, value):
    if (isinstance(value, types.ModuleType) and name in self.__dict__.get("_shadowed", ())
        and value.__name__ == f"{self.__name__}.{name}"):
      value = getattr(value, name)
    super().__setattr__(name, value)


def exports(package: str, table: Mapping[str, Sequence[str]], modules: Sequence[str] = (),
            fallback: Optional[Callable] = None) -> tuple[Callable, Callable]:
  """``(__getattr__, __dir__)`` for ``package`` (call it at the end of the package's
  ``__init__``, where ``sys.modules[package]`` is the package).

  ``table``: defining module -> the names of it the package exports; ``modules``: submodules
  exported as modules (``kvm_jax.presets``); ``fallback(name)``: asked for any other name, else
  AttributeError."""
  where = {name: module for module, names in table.items() for name in names}
  this = sys.modules[package]
  this.__class__ = _Package
  this._shadowed = frozenset(n for n, m in where.items() if m == f"{package}.{n}")

  def __getattr__(name: str):
    if name in modules:
      return importlib.import_module(f"{package}.{name}")
    if name not in where:
      if fallback is not None:
        return fallback(name)
      raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(where[name]), name)
    setattr(this, name, value)  # later reads find it without this function
    return value

  def __dir__():
    return sorted(set(vars(this)) | set(where) | set(modules))

  return __getattr__, __dir__
