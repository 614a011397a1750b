"""Pure-JAX operators (no Flax): the KVM op (``kvm/``), the baseline attentions, the OVQ and RWKV-7
recurrences (``ovq/``, ``rwkv7/``), RoPE, cross-layer KV fusion and their shared building blocks
(``common.py``)."""

from kvm_jax.ops.kvm import (KVMCache, KVMParams, KVMState, kvm_attention, kvm_attention_reference,
                             kvm_decode_step, kvm_init_cache, kvm_prefill)

__all__ = ["KVMParams", "KVMState", "KVMCache", "kvm_attention", "kvm_attention_reference",
           "kvm_init_cache", "kvm_prefill", "kvm_decode_step"]
