"""The RWKV-7 time mix's recurrence (the generalized delta rule) as pure functions: the per-token
oracle (``reference``), the chunk-parallel form and the one-token step (``scan``)."""

from kvm_jax.ops.rwkv7.scan import rwkv7_recurrence, rwkv7_step
from kvm_jax.ops.rwkv7.reference import rwkv7_recurrence_reference

__all__ = ["rwkv7_recurrence", "rwkv7_recurrence_reference", "rwkv7_step"]
