"""Deprecated path of :mod:`kvm_jax.kernels.tokamax_readout` (the KVM readout run by tokamax; "anchor" is the value residual's word): its names still import
from here, each with a DeprecationWarning."""

from kvm_jax.renamed import forwarding

__getattr__, __dir__ = forwarding("kvm_jax.kernels.anchor", "kvm_jax.kernels.tokamax_readout")
