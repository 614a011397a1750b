"""Fused Pallas kernels (readout, routing/state update) as fast paths of ``kvm_jax.ops``.

Empty until the kernels issue (#5) lands; ``kvm_jax.kvm_attention(implementation="xla")`` is the
reference every kernel will be tested against.
"""
