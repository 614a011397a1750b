"""Deprecated name of :mod:`kvm_jax.hf.authors_config` (the authors' config.json format). Importing a name from here still
works, with a DeprecationWarning."""

import importlib
import warnings


def __getattr__(name: str):
  warnings.warn("kvm_jax.hf.config is deprecated; import kvm_jax.hf.authors_config.", DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module("kvm_jax.hf.authors_config"), name)
