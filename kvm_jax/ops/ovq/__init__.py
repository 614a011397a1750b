"""OVQ (online vector quantization), the paper's OVQ/SWA baseline, as pure functions: the oracle
(``reference``), the chunked scan (``scan``), the decode cache and step (``decode``), and the
per-chunk operations they share (``state``)."""

from kvm_jax.util import lazy_exports as _lazy_exports

# Imported on first use (kvm_jax.util.lazy_exports): ``OVQConfig`` alone (a command's defaults) needs
# no JAX.
_EXPORTS = {
    "kvm_jax.ops.ovq.config": ("OVQConfig",),
    "kvm_jax.ops.ovq.decode": ("OVQCache", "ovq_decode_step", "ovq_init_cache", "ovq_prefill"),
    "kvm_jax.ops.ovq.reference": ("ovq_attention_reference",),
    "kvm_jax.ops.ovq.scan": ("ovq_attention",),
    "kvm_jax.ops.ovq.state": ("OVQState",)}
__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = _lazy_exports.exports(__name__, _EXPORTS)
