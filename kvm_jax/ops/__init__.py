"""Pure-JAX operators (no Flax): the KVM oracle, chunked scan and decode step."""

from kvm_jax.ops.common import KVMParams, KVMState
from kvm_jax.ops.kvm import kvm_attention
from kvm_jax.ops.kvm_decode import KVMCache, kvm_decode_step, kvm_init_cache, kvm_prefill
from kvm_jax.ops.kvm_reference import kvm_attention_reference

__all__ = ["KVMParams", "KVMState", "KVMCache", "kvm_attention", "kvm_attention_reference",
           "kvm_init_cache", "kvm_prefill", "kvm_decode_step"]
