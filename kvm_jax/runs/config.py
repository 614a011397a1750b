"""Deprecated name of :mod:`kvm_jax.runs.train_config` (the run's ``TrainConfig`` and its specs). Importing a name from here still
works, with a DeprecationWarning."""

import importlib
import warnings


def __getattr__(name: str):
  warnings.warn("kvm_jax.runs.config is deprecated; import kvm_jax.runs.train_config.", DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module("kvm_jax.runs.train_config"), name)
