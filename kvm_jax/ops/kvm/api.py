"""The public KVM op: ``implementation=`` is resolved here, in one place, and nowhere else.

Implementations (:data:`kvm_jax.config.KVM_IMPLEMENTATIONS`):

* ``"xla"`` — the chunked ``lax.scan`` with XLA per-chunk operations (``scan.py``); the default
  and the reference every other path is tested against;
* ``"pallas"`` — the same scan with the fused Pallas kernels of :mod:`kvm_jax.kernels` in its
  body (readout and routing/update), compiled for this machine's backend (Mosaic on TPU, Triton
  on GPU) and interpreted on CPU;
* ``"auto"`` — Pallas on the backends listed in :data:`AUTO_PALLAS_BACKENDS`, where a benchmark
  measured it faster, XLA elsewhere.

The oracle, :func:`kvm_jax.kvm_attention_reference` (``reference.py``), is not an implementation
choice: it is the independent yardstick. Under a device mesh the kernels can run per shard; say
which mesh axes split the batch and the KV heads with :func:`kernel_sharding`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional, Sequence

import jax

from kvm_jax.config import KVM_IMPLEMENTATIONS, KVMConfig
from kvm_jax.kernels.anchor import INSTALL_HINT, joint_attention_tokamax, tokamax_available
from kvm_jax.kernels.backend import KernelConfig
from kvm_jax.kernels.decode import decode_attention_pallas
from kvm_jax.kernels.readout import joint_attention_heads_pallas, joint_attention_pallas
from kvm_jax.kernels.sharding import ShardAxes
from kvm_jax.kernels.update import update_state_pallas
from kvm_jax.ops.common import is_concrete
from kvm_jax.ops.kvm import decode
from kvm_jax.ops.kvm.decode import KVMCache, check_against_cache
from kvm_jax.ops.kvm.scan import XLA_OPS, ChunkOps, kvm_attention_scan
from kvm_jax.ops.kvm.state import KVMParams, validate_inputs

Array = jax.Array

# Backends on which "auto" picks the Pallas kernels: only where a benchmark (kvm-bench
# --implementation pallas) measured them faster than the XLA scan. None has been measured yet.
AUTO_PALLAS_BACKENDS: frozenset = frozenset()

# The readout (one softmax over [state ; window] per chunk) can run on the implementation's own
# code ("own": the XLA einsums or the Pallas kernel) or on tokamax's flash attention ("tokamax",
# kvm_jax.kernels.anchor; pip install 'kvm_jax[tokamax]'). "auto" takes tokamax only on the
# backends listed here, where `kvm-bench --readout-anchor` measured it faster than the
# implementation's own readout in the same run, and only when tokamax imports. No accelerator
# has measured it yet (on CPU the own XLA readout is faster at sqrt16 and the XLA path is the
# reference), so the list is empty.
KVM_READOUTS = ("auto", "own", "tokamax")
TOKAMAX_READOUT_BACKENDS: dict = {"xla": frozenset(), "pallas": frozenset()}

_SHARD_AXES: contextvars.ContextVar[ShardAxes] = contextvars.ContextVar(
    "kvm_kernel_shard_axes", default=ShardAxes())


@contextlib.contextmanager
def kernel_sharding(batch_axes: Sequence[str] = (), head_axis: Optional[str] = None
                    ) -> Iterator[ShardAxes]:
  """Inside this context, Pallas kernels called under a mesh (``jax.set_mesh``) run per shard:
  the batch split over ``batch_axes``, the KV heads over ``head_axis`` (each only where the axis
  exists and divides the dimension). Outside it they see whole arrays, which XLA's partitioner
  gathers for them. The names are the caller's: the trainer passes its own mesh axes.

  It is read when a KVM op is *called* (traced) and fixed into the compiled program."""
  token = _SHARD_AXES.set(ShardAxes(batch=tuple(batch_axes), heads=head_axis))
  try:
    yield _SHARD_AXES.get()
  finally:
    _SHARD_AXES.reset(token)


def current_shard_axes() -> ShardAxes:
  """The axes of the enclosing :func:`kernel_sharding` (none outside it); other kernel callers
  (the softmax-attention registry) split their kernels the same way."""
  return _SHARD_AXES.get()


def chunk_ops(implementation: str, *, target: Optional[str] = None,
              interpret: Optional[bool] = None,
              shard_axes: Optional[ShardAxes] = None, readout: str = "own") -> ChunkOps:
  """The per-chunk operations of ``implementation`` ("xla" or "pallas").

  For "pallas": kernels built for ``target`` ("tpu", "cuda", "cpu"; default: this machine's
  backend), interpreted where there is no compiler unless ``interpret`` says otherwise, split over
  ``shard_axes`` (default: the enclosing :func:`kernel_sharding`, else none).
  ``readout``: "own" (the implementation's readout) or "tokamax" (the anchor,
  :func:`kvm_jax.kernels.anchor.joint_attention_tokamax`; decode keeps its own step).
  """
  if readout not in ("own", "tokamax"):
    raise ValueError(f"chunk_ops: readout={readout!r}; choose 'own' or 'tokamax' ('auto' is "
                     "resolved by resolve_implementation).")
  if implementation == "xla":
    ops = XLA_OPS
  elif implementation == "pallas":
    kc = KernelConfig.for_target(
        target, interpret, shard_axes=_SHARD_AXES.get() if shard_axes is None else shard_axes)
    name = f"pallas[{kc.platform}{', interpret' if kc.interpret else ''}]"
    ops = ChunkOps(name, joint_attention_pallas, update_state_pallas, kernel=kc,
                   decode_attend_fn=decode_attention_pallas,
                   attend_heads_fn=joint_attention_heads_pallas)
  else:
    raise ValueError(f"chunk_ops: implementation={implementation!r}; choose 'xla' or 'pallas' "
                     "('auto' is resolved by resolve_implementation).")
  if readout == "tokamax":  # a module-level function: equal ChunkOps share compiled programs
    ops = dataclasses.replace(ops, name=f"{ops.name}+tokamax-readout",
                              attend_fn=joint_attention_tokamax, attend_heads_fn=None)
  return ops


def resolve_implementation(implementation: str, cfg: KVMConfig, readout: str = "auto"
                           ) -> ChunkOps:
  """What ``implementation`` and ``readout`` (:data:`KVM_READOUTS`) mean on this machine for
  ``cfg``, with a clear error otherwise."""
  if implementation not in KVM_IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not available; choose one of "
                     f"{KVM_IMPLEMENTATIONS}.")
  if readout not in KVM_READOUTS:
    raise ValueError(f"readout={readout!r} is not available; choose one of {KVM_READOUTS}.")
  if implementation == "auto":
    implementation = "pallas" if jax.default_backend() in AUTO_PALLAS_BACKENDS else "xla"
  if implementation == "pallas" and cfg.readout_value_dtype is not None:
    raise ValueError("implementation='pallas' reads float32 state values; it does not reproduce "
                     "readout_value_dtype (use implementation='xla' for that).")
  if readout == "auto":
    faster = jax.default_backend() in TOKAMAX_READOUT_BACKENDS[implementation]
    readout = "tokamax" if faster and tokamax_available() else "own"
  elif readout == "tokamax" and not tokamax_available():
    raise ImportError(f"readout='tokamax' needs the optional tokamax package: {INSTALL_HINT}.")
  return chunk_ops(implementation, readout=readout)


def kvm_attention(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                  cfg: KVMConfig, *, implementation: str = "xla", remat: bool = True,
                  routing=None, return_routing: bool = False, readout: str = "auto"):
  """KVM attention over a whole sequence (prefill / training forward), jit-compiled.

  Args:
    q: ``[B, T, H, D]`` queries after QK-LayerNorm and RoPE.
    k: ``[B, T, Hkv, D]`` keys after QK-LayerNorm and RoPE (H must be a multiple of Hkv).
    v: ``[B, T, Hkv, Dv]`` values.
    merge_gate: ``[B, T, Hkv]`` g = 1 + ELU(x W_g) > 0 (ones to disable).
    params: :class:`KVMParams` (LN_s and temperatures).
    cfg: :class:`KVMConfig` (static).
    implementation: "xla", "pallas" or "auto" (see this module's docstring).
    remat: the memory-lean backward pass: states kept every ~sqrt(T/C) chunks plus each chunk's
      routing decisions, blocks replayed in reverse with those decisions (memory
      O(sqrt(T/C) · R) for one more forward pass); False: plain autodiff through the scan.
    routing / return_routing: apply given per-chunk routing decisions / also return the applied
      ones (shared routing across layers; see :func:`kvm_jax.ops.kvm.scan.kvm_attention_scan`).
    readout: "auto", "own" or "tokamax" (:data:`KVM_READOUTS`): who computes each chunk's
      softmax over [state ; window]; "auto" uses tokamax only where it was measured faster.
  Returns:
    ``y [B, T, H, Dv]`` in q's dtype, and the final :class:`KVMState` (float32, capacity = the
    number of rows the schedule reaches at T).
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  ops = resolve_implementation(implementation, cfg, readout)
  return kvm_attention_scan(q, k, v, merge_gate, params, cfg=cfg, ops=ops, remat=remat,
                            routing=routing, return_routing=return_routing)


def kvm_prefill(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                cfg: KVMConfig, cache: KVMCache, *, routing=None, return_routing: bool = False,
                implementation: str = "xla"):
  """Runs a prompt of any length >= 1 and returns its outputs and the filled cache.

  The prompt starts a new sequence: ``cache`` provides sizes, ``max_len`` and dtype, and its
  previous contents are discarded. Shapes as in :func:`kvm_attention`.
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  check_against_cache(k, v, cache, "kvm_prefill")
  if q.shape[1] > cache.max_len:
    raise ValueError(f"kvm_prefill: prompt of {q.shape[1]} tokens exceeds the cache's max_len="
                     f"{cache.max_len}; create the cache with a larger max_len.")
  ops = resolve_implementation(implementation, cfg)
  return decode.prefill(q, k, v, merge_gate, params, cfg=cfg, cache=cache, ops=ops,
                        routing=routing, return_routing=return_routing)


def kvm_decode_step(q_t: Array, k_t: Array, v_t: Array, g_t: Array, params: KVMParams,
                    cfg: KVMConfig, cache: KVMCache, *, routing=None, return_routing: bool = False,
                    implementation: str = "xla"):
  """Processes one token: ``q_t [B,1,H,D]``, ``k_t [B,1,Hkv,D]``, ``v_t [B,1,Hkv,Dv]``,
  ``g_t [B,1,Hkv]``; returns ``y_t [B,1,H,Dv]`` and the advanced cache.

  ``routing`` / ``return_routing``: as in :func:`kvm_attention`, for this step's fold
  (``(dest, target)`` ``[B, Hkv, C]``; all ``capacity`` when no fold happens).

  Raises ValueError past ``max_len`` when the cache length is concrete; under an outer ``jit`` the
  length is traced, and outputs past ``max_len`` are NaN rather than silently wrong.
  """
  validate_inputs(q_t, k_t, v_t, g_t, params, cfg, single_token=True)
  check_against_cache(k_t, v_t, cache, "kvm_decode_step")
  if is_concrete(cache.length) and int(cache.length) >= cache.max_len:
    raise ValueError(
        f"kvm_decode_step: the cache already holds {int(cache.length)} tokens = max_len="
        f"{cache.max_len}; create the cache with a larger max_len to decode further.")
  ops = resolve_implementation(implementation, cfg)
  return decode.decode_step(q_t, k_t, v_t, g_t, params, cfg=cfg, cache=cache, ops=ops,
                            routing=routing, return_routing=return_routing)
