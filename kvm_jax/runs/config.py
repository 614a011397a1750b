"""Deprecated path of :mod:`kvm_jax.runs.train_config` (the run's ``TrainConfig`` and its specs): its names still import
from here, each with a DeprecationWarning."""

from kvm_jax.renamed import forwarding

__getattr__, __dir__ = forwarding("kvm_jax.runs.config", "kvm_jax.runs.train_config")
