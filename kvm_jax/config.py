"""Deprecated name of :mod:`kvm_jax.kvm_config` (the KVM op's ``KVMConfig``). Importing a name from here still
works, with a DeprecationWarning."""

import importlib
import warnings


def __getattr__(name: str):
  warnings.warn("kvm_jax.config is deprecated; import kvm_jax.kvm_config.", DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module("kvm_jax.kvm_config"), name)
