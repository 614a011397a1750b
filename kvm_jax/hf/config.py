"""Deprecated path of :mod:`kvm_jax.hf.authors_config` (the authors' config.json format): its names still import
from here, each with a DeprecationWarning."""

from kvm_jax.renamed import forwarding

__getattr__, __dir__ = forwarding("kvm_jax.hf.config", "kvm_jax.hf.authors_config")
