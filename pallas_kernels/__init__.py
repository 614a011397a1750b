"""Fused Pallas kernels for the KVM hot path: fast paths of ``kvm_jax.ops`` selected with
``implementation="pallas"`` (or ``"auto"``).

* :mod:`pallas_kernels.readout` — the fused readout over ``[state ; window]`` (+ ``custom_vjp``);
* :mod:`pallas_kernels.update` — the fused routing and state update (+ ``custom_vjp``);
* :mod:`pallas_kernels.backend` — TPU (Mosaic) / GPU (Triton) / CPU-interpret choices;
* :mod:`pallas_kernels.sharding` — per-shard execution under a mesh;
* :mod:`pallas_kernels.check` — ``kvm-check``, the user-facing equivalence command.

The XLA ``lax.scan`` (``implementation="xla"``) stays the default and the reference.
"""
