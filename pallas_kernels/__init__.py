"""Fused Pallas kernels for the KVM hot path (installed as ``kvm_jax.kernels``): fast paths of the
per-chunk operations of :mod:`kvm_jax.ops.kvm`, selected with ``implementation="pallas"`` (or
``"auto"``) by the op's registry (``kvm_jax.ops.kvm.api``).

* :mod:`kvm_jax.kernels.readout` — the streaming readout over ``[state ; window]``
  (+ ``custom_vjp``);
* :mod:`kvm_jax.kernels.update` — the tiled routing scores (novelty, merge target) and row
  accumulation, plugged into ``update_state``;
* :mod:`kvm_jax.kernels.decode` — one token against state and ring (flash-decoding);
* :mod:`kvm_jax.kernels.resources` — each kernel's per-program working set against H100/H200 and
  TPU v5e limits;
* :mod:`kvm_jax.kernels.backend` — TPU (Mosaic) / GPU (Triton) / CPU-interpret choices, precision;
* :mod:`kvm_jax.kernels.sharding` — per-shard execution under a mesh, over caller-named axes;
* :mod:`kvm_jax.kernels.tokamax_readout` — the same readout run by tokamax's attention (optional package),
  the speed yardstick of ``kvm-bench --readout-tokamax``, chosen with ``readout="tokamax"`` (or by
  ``"auto"`` where it was measured faster).

Kernels import only lower-level op helpers (``kvm_jax.ops.common``, ``kvm_jax.ops.kvm.state``),
never the dispatcher that calls them. The XLA scan (``implementation="xla"``) stays the default
and the reference; ``kvm-check`` compares the two on any machine.
"""

