"""The KVM op, one folder in the manner of tokamax's per-op packages and fla's naive/chunk files.

======================  ==========================================================================
``api.py``              the public functions; every backend choice made by one resolver (registry)
``reference.py``        the oracle: plain, slow, obviously correct (``kvm_attention_reference``)
``scan.py``             the chunked ``lax.scan`` with pluggable per-chunk operations
``decode.py``           the decode cache, prefill and the one-token step
``shared_routing.py``   reconstruction layers that fuse their sources' states (cross-layer sharing)
``state.py``            the state pytrees and the pure functions that build, update and read it
``cases.py``            the shared case matrix, input builders and error metrics of every check
======================  ==========================================================================

The fused kernels live in :mod:`kvm_jax.kernels`; only ``api.py`` plugs them in.
"""

from kvm_jax.util import lazy_exports as _lazy_exports

# Imported on first use (kvm_jax.util.lazy_exports): a kernel that needs only ``state.py`` loads
# neither ``api.py`` nor, through it, the kernels it dispatches to.
_EXPORTS = {
    "kvm_jax.ops.kvm.api": ("AUTO_PALLAS_BACKENDS", "KVM_PLATFORMS", "KVM_READOUTS", "KVMBackend",
                            "chunk_ops", "kernel_sharding", "kvm_attention", "kvm_decode_step",
                            "kvm_prefill", "kvm_resume",
                            "resolve_kvm_backend"),
    "kvm_jax.ops.kvm.decode": ("KVMCache", "kvm_init_cache"),
    "kvm_jax.ops.kvm.reference": ("kvm_attention_reference",),
    "kvm_jax.ops.kvm.scan": ("XLA_OPS", "ChunkOps", "kvm_attention_scan"),
    "kvm_jax.ops.kvm.state": ("KVMOutput", "KVMParams", "KVMState", "KVMStepOutput",
                              "RoutedKVMOutput", "RoutedKVMStepOutput")}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = _lazy_exports.exports(__name__, _EXPORTS)
