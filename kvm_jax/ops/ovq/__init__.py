"""OVQ (online vector quantization), the paper's OVQ/SWA baseline, as pure functions: the oracle
(``reference``), the chunked scan (``scan``), the decode cache and step (``decode``), and the
per-chunk operations they share (``state``)."""

from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.ops.ovq.decode import OVQCache, ovq_decode_step, ovq_init_cache, ovq_prefill
from kvm_jax.ops.ovq.reference import ovq_attention_reference
from kvm_jax.ops.ovq.scan import ovq_attention
from kvm_jax.ops.ovq.state import OVQState

__all__ = ["OVQCache", "OVQConfig", "OVQState", "ovq_attention", "ovq_attention_reference",
           "ovq_decode_step", "ovq_init_cache", "ovq_prefill"]
