"""Pure-JAX operators (no Flax): the KVM op (``kvm/``), the baseline attentions, the OVQ and RWKV-7
recurrences (``ovq/``, ``rwkv7/``), RoPE, cross-layer KV fusion and their shared building blocks
(``common.py``)."""

from kvm_jax.util import lazy_exports as _lazy_exports

__all__ = ["KVMParams", "KVMState", "KVMCache", "kvm_attention", "kvm_attention_reference",
           "kvm_init_cache", "kvm_prefill", "kvm_decode_step"]

# Imported on first use (kvm_jax.util.lazy_exports): a module that needs only ``ops.common`` (the
# Pallas kernels do) loads neither the KVM op nor, through it, the kernels it dispatches to.
__getattr__, __dir__ = _lazy_exports.exports(__name__, {"kvm_jax.ops.kvm": __all__})
