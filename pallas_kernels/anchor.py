"""Deprecated name of :mod:`kvm_jax.kernels.tokamax_readout` (the KVM readout run by tokamax):
"anchor" is the value residual's word in this package. Importing a name from here still works,
with a DeprecationWarning."""

import importlib
import warnings


def __getattr__(name: str):
  warnings.warn("kvm_jax.kernels.anchor is deprecated; import kvm_jax.kernels.tokamax_readout.",
                DeprecationWarning, stacklevel=2)
  return getattr(importlib.import_module("kvm_jax.kernels.tokamax_readout"), name)
