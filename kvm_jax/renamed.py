"""The old path of a renamed module: a module that forwards every public name to the new one,
with a DeprecationWarning naming it, so that users' imports keep working (``from old import X``,
``import old; old.X``, ``from old import *``)."""

from __future__ import annotations

import importlib
import warnings


def forwarding(old: str, new: str) -> tuple:
  """``(__getattr__, __dir__)`` for the module ``old``, forwarding to the module ``new``."""

  def public():
    return [n for n in dir(importlib.import_module(new)) if not n.startswith("_")]

  def __getattr__(name: str):
    if name == "__all__":  # what ``from old import *`` takes: the new module's public names
      return public()
    if name.startswith("__"):  # Python's own probes (``__path__``, ...): not forwarded
      raise AttributeError(name)
    warnings.warn(f"{old} is deprecated; import {new}.", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(new), name)

  def __dir__():
    return public()

  return __getattr__, __dir__


def old_submodules(package: str, *names: str):
  """A package's ``__getattr__`` that still resolves its renamed submodules ``names`` (their old
  paths, each a :func:`forwarding` module) as attributes, as ``import package; package.name``
  did before."""

  def __getattr__(name: str):
    if name in names:
      return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  return __getattr__
