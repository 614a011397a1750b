"""Deprecated path of :mod:`kvm_jax.kvm_config` (the KVM op's ``KVMConfig``): its names still import
from here, each with a DeprecationWarning."""

from kvm_jax.renamed import forwarding

__getattr__, __dir__ = forwarding("kvm_jax.config", "kvm_jax.kvm_config")
