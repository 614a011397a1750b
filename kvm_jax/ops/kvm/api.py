"""The public KVM op: every backend choice is made here, by one resolver, and nowhere else.

:func:`resolve_kvm_backend` turns a request (``implementation=``, ``readout=``, optionally a
kernel configuration) and a platform into a :class:`KVMBackend`: a frozen record of everything
the op will run. It is the only place the KVM op reads the platform
(:func:`kvm_jax.ops.common.current_platform`); the scan, the state update and decode take its
decisions as arguments. Call it to see what will run::

    resolve_kvm_backend(cfg, platform="gpu")
    # KVMBackend(platform='gpu', implementation='xla', readout='own', source_layout='heads',
    #            row_update='onehot', kernel_config=None)

Implementations (:data:`kvm_jax.config.kvm.KVM_IMPLEMENTATIONS`):

* ``"xla"`` — the chunked ``lax.scan`` with XLA per-chunk operations (``scan.py``); the default
  and the reference every other path is tested against;
* ``"pallas"`` — the same scan with the fused Pallas kernels of :mod:`kvm_jax.kernels` in its
  body (readout and routing/update), compiled for the platform (Mosaic on TPU, Triton on GPU) and
  interpreted on CPU;
* ``"auto"`` — Pallas on the platforms listed in :data:`AUTO_PALLAS_BACKENDS`, where a benchmark
  measured it faster, XLA elsewhere.

The oracle, :func:`kvm_jax.kvm_attention_reference` (``reference.py``), is not an implementation
choice: it is the independent yardstick. Under a device mesh the kernels can run per shard; say
which mesh axes split the batch and the KV heads with :func:`kernel_sharding`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from kvm_jax.config.kvm import KVM_IMPLEMENTATIONS, KVMConfig
from kvm_jax.kernels.tokamax_readout import INSTALL_HINT, joint_attention_tokamax, tokamax_available
from kvm_jax.kernels.backend import KernelConfig
from kvm_jax.kernels.decode import decode_attention_pallas
from kvm_jax.kernels.readout import joint_attention_heads_pallas, joint_attention_pallas
# kernel_sharding is re-exported: callers name it as kvm_jax.ops.kvm(.api).kernel_sharding.
from kvm_jax.kernels.sharding import ShardAxes, current_shard_axes, kernel_sharding  # noqa: F401
from kvm_jax.kernels.update import update_state_pallas
from kvm_jax.ops.common import current_platform, is_concrete
from kvm_jax.ops.documents import check_segment_ids
from kvm_jax.ops.kvm import decode
from kvm_jax.ops.kvm.decode import KVMCache, check_against_cache
from kvm_jax.ops.kvm.documents import kvm_attention_documents
from kvm_jax.ops.kvm.scan import XLA_OPS, ChunkOps, kvm_attention_scan, source_layout_for
from kvm_jax.ops.kvm.state import (KVMOutput, KVMParams, KVMStepOutput, RoutedKVMOutput,
                                   RoutedKVMStepOutput, row_update_for, validate_inputs)

Array = jax.Array

#: Backends on which "auto" picks the Pallas kernels: only where a benchmark (kvm-bench
#: --implementation pallas) measured them faster than the XLA scan. On an H200 (jax 0.11.2, bf16,
#: B=8, H=32, D=128, 4K-32K tokens) the Pallas path measured 2-4x slower than the XLA scan, forward
#: and backward, so the GPU is not listed; no TPU has been measured.
AUTO_PALLAS_BACKENDS: frozenset = frozenset()

#: The readout (one softmax over [state ; window] per chunk) can run on the implementation's own
#: code ("own": the XLA einsums or the Pallas kernel) or on tokamax's flash attention ("tokamax",
#: kvm_jax.kernels.tokamax_readout; pip install 'kvm_jax[tokamax]'). "auto" takes tokamax only on the
#: backends listed here, where `kvm-bench --readout-tokamax` measured it faster than the
#: implementation's own readout in the same run, and only when tokamax imports. No accelerator
#: has measured it yet (on CPU the own XLA readout is faster at sqrt16 and the XLA path is the
#: reference), so the list is empty.
KVM_READOUTS = ("auto", "own", "tokamax")
TOKAMAX_READOUT_BACKENDS: dict = {"xla": frozenset(), "pallas": frozenset()}

#: The platforms a decision can be made for ("cuda" is accepted as another name for "gpu", the
#: way the kernels' targets are named).
KVM_PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class KVMBackend:
  """Everything the KVM op runs for one request on one platform, decided by
  :func:`resolve_kvm_backend` (print it to see what will run).

  Attributes:
    platform: "cpu", "gpu" or "tpu" (:data:`KVM_PLATFORMS`), the platform it was decided for.
    implementation: "xla" (the XLA scan) or "pallas" (the fused kernels in the scan's body).
    readout: "own" (the implementation's readout) or "tokamax" (tokamax's attention,
      :func:`kvm_jax.kernels.tokamax_readout.joint_attention_tokamax`, in the scan and prefill; decode
      runs it too with XLA, while the Pallas decode step keeps its own one-token kernel).
    source_layout: "time" or "heads": how the scan reads its inputs
      (:data:`kvm_jax.ops.kvm.scan.SOURCE_LAYOUTS`; the rule:
      :func:`kvm_jax.ops.kvm.scan.source_layout_for`).
    row_update: "scatter" or "onehot": how the XLA state update accumulates rows
      (:data:`kvm_jax.ops.kvm.state.ROW_UPDATES`); the Pallas update accumulates in its own
      kernel and does not read it.
    kernel_config: the :class:`~kvm_jax.kernels.backend.KernelConfig` the kernels are built with
      (target, interpret mode, mesh axes) for "pallas"; None for "xla".
    heads_split: whether the inputs may arrive split over their heads by a mesh axis (the
      enclosing :func:`kernel_sharding` names one): on TPU the scan then keeps heads whole in
      its layout pins, which otherwise merge time with heads to keep XLA from copying the inputs
      into other layouts (:func:`kvm_jax.ops.kvm.scan.in_row_major`).

  Frozen and compared by value: equal decisions build equal :class:`ChunkOps` and share compiled
  programs.
  """

  platform: str
  implementation: str
  readout: str
  source_layout: str
  row_update: str
  kernel_config: Optional[KernelConfig] = None
  heads_split: bool = False

  def chunk_ops(self) -> ChunkOps:
    """The per-chunk operations this decision runs in the scan and in decode."""
    return chunk_ops(self.implementation, readout=self.readout, kernel_config=self.kernel_config,
                     heads_split=self.heads_split)


def _platform(platform: Optional[str]) -> str:
  p = current_platform() if platform is None else platform
  p = "gpu" if p == "cuda" else p
  if p not in KVM_PLATFORMS:
    raise ValueError(f"platform={p!r} is not one the KVM op can decide for; choose one of "
                     f"{KVM_PLATFORMS} (or 'cuda').")
  return p


def resolve_kvm_backend(cfg: KVMConfig, *, implementation: str = "auto", readout: str = "auto",
                        kernel_config: Optional[KernelConfig] = None,
                        platform: Optional[str] = None,
                        heads_split: Optional[bool] = None) -> KVMBackend:
  """What a KVM request means on ``platform`` for ``cfg``: the one place its backend is decided.

  Args:
    cfg: the :class:`KVMConfig` (``readout_value_dtype`` rules Pallas out).
    implementation: "xla", "pallas" or "auto" (:data:`kvm_jax.config.kvm.KVM_IMPLEMENTATIONS`).
    readout: "own", "tokamax" or "auto" (:data:`KVM_READOUTS`).
    kernel_config: the kernels' configuration for "pallas" (another target, interpret mode,
      mesh axes); default: built for ``platform``, interpreted on CPU, split over the enclosing
      :func:`kernel_sharding`. Not accepted with "xla", which runs no kernel.
    platform: "cpu", "gpu" or "tpu" (:data:`KVM_PLATFORMS`); default: this machine's
      (:func:`kvm_jax.ops.common.current_platform`). Giving it decides for another machine, e.g.
      to inspect what a TPU run would do.
    heads_split: whether the inputs may arrive split over their heads (:class:`KVMBackend`);
      default: whether the enclosing :func:`kernel_sharding` names a head axis that the mesh
      (if one is set) splits.
  Raises:
    ValueError: for a value none of the choices has (the message names it and the choices), and
      for Pallas with ``cfg.readout_value_dtype``.
    ImportError: ``readout="tokamax"`` without the optional tokamax package.
  """
  if implementation not in KVM_IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not available; choose one of "
                     f"{KVM_IMPLEMENTATIONS}.")
  if readout not in KVM_READOUTS:
    raise ValueError(f"readout={readout!r} is not available; choose one of {KVM_READOUTS}.")
  if kernel_config is not None and not isinstance(kernel_config, KernelConfig):
    raise ValueError(f"kernel_config={kernel_config!r} is not a kvm_jax.kernels.backend."
                     "KernelConfig; build one with KernelConfig.for_target(...) or pass None.")
  platform = _platform(platform)
  requested = implementation
  softcap = cfg.logit_softcap
  if implementation == "auto":
    implementation = ("pallas" if platform in AUTO_PALLAS_BACKENDS and softcap is None
                      else "xla")
  if implementation == "pallas" and softcap is not None:
    raise ValueError(f"implementation='pallas': the kernels do not soft-cap scores "
                     f"(logit_softcap={softcap}); use implementation='xla' or 'auto'.")
  if implementation == "pallas" and cfg.readout_value_dtype is not None:
    raise ValueError("implementation='pallas' reads float32 state values; it does not reproduce "
                     "readout_value_dtype (use implementation='xla' for that).")
  if implementation == "xla" and kernel_config is not None:
    raise ValueError(f"kernel_config={kernel_config!r} was given with implementation="
                     f"{requested!r}, which runs XLA and no kernel on {platform!r}; use "
                     "implementation='pallas' or drop kernel_config.")
  if readout == "auto":
    faster = platform in TOKAMAX_READOUT_BACKENDS[implementation] and softcap is None
    readout = "tokamax" if faster and tokamax_available() else "own"
  elif readout == "tokamax" and softcap is not None:
    raise ValueError(f"readout='tokamax' does not soft-cap scores (logit_softcap={softcap}); "
                     "use readout='own' or 'auto'.")
  elif readout == "tokamax" and not tokamax_available():
    raise ImportError(f"readout='tokamax' needs the optional tokamax package: {INSTALL_HINT}.")
  if implementation == "pallas" and kernel_config is None:
    kernel_config = KernelConfig.for_target(platform, shard_axes=current_shard_axes())
  kernels = implementation == "pallas"
  return KVMBackend(platform=platform, implementation=implementation, readout=readout,
                    source_layout=source_layout_for(platform, kernels),
                    row_update=row_update_for(platform), kernel_config=kernel_config,
                    heads_split=(current_shard_axes().may_split_heads() if heads_split is None
                                 else bool(heads_split)))


def backend_for(cfg: KVMConfig, backend: Optional[KVMBackend], default_readout: str = "auto"
                ) -> KVMBackend:
  """The backend a public op runs: ``backend`` when given (it must be what
  :func:`resolve_kvm_backend` decides for ``cfg`` on its platform), else the XLA scan with
  ``default_readout`` (``implementation="auto"`` must be asked for, since it may pick kernels)."""
  if backend is None:
    return resolve_kvm_backend(cfg, implementation="xla", readout=default_readout)
  if not isinstance(backend, KVMBackend):
    raise ValueError(f"backend={backend!r} is not a KVMBackend; build one with "
                     "resolve_kvm_backend(cfg, ...).")
  decided = resolve_kvm_backend(cfg, implementation=backend.implementation,
                                readout=backend.readout, kernel_config=backend.kernel_config,
                                platform=backend.platform, heads_split=backend.heads_split)
  if decided != backend:
    raise ValueError(f"backend={backend} is not what resolve_kvm_backend decides for this "
                     f"config on {backend.platform!r} ({decided}); build it with "
                     "resolve_kvm_backend(cfg, ...).")
  return backend


def chunk_ops(implementation: str, *, target: Optional[str] = None,
              interpret: Optional[bool] = None, shard_axes: Optional[ShardAxes] = None,
              readout: str = "own", kernel_config: Optional[KernelConfig] = None,
              heads_split: bool = False) -> ChunkOps:
  """The per-chunk operations of ``implementation`` ("xla" or "pallas").

  For "pallas": the kernels built with ``kernel_config``, or else for ``target`` ("tpu", "cuda",
  "cpu"; default: this machine's platform), interpreted where there is no compiler unless
  ``interpret`` says otherwise, split over ``shard_axes`` (default: the enclosing
  :func:`kernel_sharding`, else none).
  ``readout``: "own" (the implementation's readout) or "tokamax" (tokamax's attention,
  :func:`kvm_jax.kernels.tokamax_readout.joint_attention_tokamax`; the Pallas decode step keeps its own).
  ``heads_split``: whether the inputs may arrive split over their heads
  (:attr:`KVMBackend.heads_split`).
  The public op builds them from its :class:`KVMBackend` (:meth:`KVMBackend.chunk_ops`).
  """
  if readout not in ("own", "tokamax"):
    raise ValueError(f"chunk_ops: readout={readout!r}; choose 'own' or 'tokamax' ('auto' is "
                     "resolved by resolve_kvm_backend).")
  if implementation == "xla":
    ops = XLA_OPS
  elif implementation == "pallas":
    kc = kernel_config or KernelConfig.for_target(
        target, interpret, shard_axes=current_shard_axes() if shard_axes is None else shard_axes)
    name = f"pallas[{kc.platform}{', interpret' if kc.interpret else ''}]"
    ops = ChunkOps(name, joint_attention_pallas, update_state_pallas, kernel=kc,
                   decode_attend_fn=decode_attention_pallas,
                   attend_heads_fn=joint_attention_heads_pallas)
  else:
    raise ValueError(f"chunk_ops: implementation={implementation!r}; choose 'xla' or 'pallas' "
                     "('auto' is resolved by resolve_kvm_backend).")
  if readout == "tokamax":  # a module-level function: equal ChunkOps share compiled programs
    ops = dataclasses.replace(ops, name=f"{ops.name}+tokamax-readout",
                              attend_fn=joint_attention_tokamax, attend_heads_fn=None)
  return dataclasses.replace(ops, heads_split=True) if heads_split else ops


def kvm_attention(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                  cfg: KVMConfig, *, backend: Optional[KVMBackend] = None, remat: bool = True,
                  routing=None, return_routing: bool = False, segment_ids=None):
  """KVM attention over a whole sequence (prefill / training forward), jit-compiled.

  Args:
    q: ``[B, T, H, D]`` queries after QK-LayerNorm and RoPE.
    k: ``[B, T, Hkv, D]`` keys after QK-LayerNorm and RoPE (H must be a multiple of Hkv).
    v: ``[B, T, Hkv, Dv]`` values.
    merge_gate: ``[B, T, Hkv]`` g = 1 + ELU(x W_g) > 0 (ones to disable).
    params: :class:`KVMParams` (LN_s and temperatures).
    cfg: :class:`KVMConfig` (static).
    backend: the :class:`KVMBackend` that :func:`resolve_kvm_backend` decided (implementation,
      readout, kernels; call it to see what runs, decide once and pass it to every op of a
      request); default: the XLA scan, ``resolve_kvm_backend(cfg, implementation="xla")``.
    remat: the memory-lean backward pass: states kept every ~sqrt(T/C) chunks plus each chunk's
      routing decisions, blocks replayed in reverse with those decisions (memory
      O(sqrt(T/C) · R) for one more forward pass); False: plain autodiff through the scan.
      With ``segment_ids`` on XLA (the aligned layout) the lean pass is always taken.
    routing / return_routing: apply given per-chunk routing decisions / also return the applied
      ones (shared routing across layers; see :func:`kvm_jax.ops.kvm.scan.kvm_attention_scan`).
    segment_ids: ``[B, T]`` int, 0 = padding, each maximal run of one nonzero id one document:
      every document's outputs are those of the document run alone (its own chunk grid, budget,
      state and window; docs/kvm-spec.md §12), on either implementation
      (:mod:`kvm_jax.ops.kvm.documents`); shared routing and the tokamax readout are not
      available with it.
  Returns:
    a :class:`KVMOutput`: ``y [B, T, H, Dv]`` in q's dtype, and ``state``, the final
    :class:`~kvm_jax.ops.kvm.state.KVMState` (float32, capacity = the number of rows the
    schedule reaches at T); with ``return_routing``, a :class:`RoutedKVMOutput` (the same and
    ``routing``). With ``segment_ids``: the state of each row's last document, ``num_rows`` per
    row ``[B]``.
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  if segment_ids is not None:
    _check_documents(segment_ids, q, routing, return_routing,
                     "own" if backend is None else backend.readout)
  # Documents give every row its own state mask, which tokamax's readout cannot take.
  be = backend_for(cfg, backend, default_readout="own" if segment_ids is not None else "auto")
  if segment_ids is not None:
    return KVMOutput(*kvm_attention_documents(q, k, v, merge_gate, params, segment_ids, cfg=cfg,
                                              ops=be.chunk_ops(), row_update=be.row_update,
                                              remat=remat))
  return kvm_attention_scan(q, k, v, merge_gate, params, cfg=cfg, ops=be.chunk_ops(),
                            remat=remat, row_update=be.row_update, routing=routing,
                            return_routing=return_routing, source_layout=be.source_layout)


def _check_documents(segment_ids, q, routing, return_routing, readout: str) -> None:
  """Refuses, by name, what :func:`kvm_attention` cannot do with ``segment_ids``."""
  check_segment_ids(segment_ids, q.shape[:2], "kvm_attention")
  if routing is not None or return_routing:
    raise ValueError("kvm_attention: shared routing (routing=, return_routing=) is not available "
                     "with segment_ids; run shared-routing models on unpacked rows.")
  if readout == "tokamax":
    raise ValueError("kvm_attention: readout='tokamax' takes one state mask for the whole batch, "
                     "and packed documents give every batch row its own state rows; use "
                     "readout='own' or 'auto' (or a backend decided with one) with segment_ids.")


def kvm_prefill(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                cfg: KVMConfig, cache: KVMCache, *, routing=None, return_routing: bool = False,
                backend: Optional[KVMBackend] = None):
  """Runs a prompt of any length >= 1: a :class:`KVMStepOutput` of its outputs and the filled
  cache (:class:`RoutedKVMStepOutput` with ``return_routing``).

  The prompt starts a new sequence: ``cache`` provides sizes, ``max_len`` and dtype, and its
  previous contents are discarded. Shapes and ``backend`` as in :func:`kvm_attention`.
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  check_against_cache(k, v, cache, "kvm_prefill")
  if q.shape[1] > cache.max_len:
    raise ValueError(f"kvm_prefill: prompt of {q.shape[1]} tokens exceeds the cache's max_len="
                     f"{cache.max_len}; create the cache with a larger max_len.")
  be = backend_for(cfg, backend)
  return decode.prefill(q, k, v, merge_gate, params, cfg=cfg, cache=cache, ops=be.chunk_ops(),
                        routing=routing, return_routing=return_routing,
                        row_update=be.row_update, source_layout=be.source_layout)


def kvm_decode_step(q_t: Array, k_t: Array, v_t: Array, g_t: Array, params: KVMParams,
                    cfg: KVMConfig, cache: KVMCache, *, routing=None, return_routing: bool = False,
                    backend: Optional[KVMBackend] = None, active: Optional[Array] = None):
  """Processes one token: ``q_t [B,1,H,D]``, ``k_t [B,1,Hkv,D]``, ``v_t [B,1,Hkv,Dv]``,
  ``g_t [B,1,Hkv]``; returns a :class:`KVMStepOutput` of ``y_t [B,1,H,Dv]`` and the advanced
  cache (:class:`RoutedKVMStepOutput` with ``return_routing``).

  ``backend``: as in :func:`kvm_attention`; pass the one
  a request prefilled with, so that it decodes what it prefilled. The readout applies to the
  one-token attention with XLA (``"tokamax"`` runs tokamax's attention on a one-query chunk); the Pallas
  step always runs its own decode kernel, which has no tokamax form.

  ``routing`` / ``return_routing``: as in :func:`kvm_attention`, for this step's fold
  (``(dest, target)`` ``[B, Hkv, C]``; all ``capacity`` when no fold happens).

  ``active [B]`` (bool; None: every row): the rows fed this token; the others keep their cache
  as it was (their outputs mean nothing).

  Each row decodes at its own position (``cache.length [B]``). Raises ValueError past
  ``max_len`` when the lengths are concrete; under an outer ``jit`` they are traced, and a row's
  outputs past ``max_len`` are NaN rather than silently wrong.
  """
  validate_inputs(q_t, k_t, v_t, g_t, params, cfg, single_token=True)
  check_against_cache(k_t, v_t, cache, "kvm_decode_step")
  if is_concrete(cache.length):
    longest = int(jnp.max(cache.length))
    if longest >= cache.max_len:
      raise ValueError(
          f"kvm_decode_step: a row of the cache already holds {longest} tokens = max_len="
          f"{cache.max_len}; create the cache with a larger max_len to decode further.")
  be = backend_for(cfg, backend)
  return decode.decode_step(q_t, k_t, v_t, g_t, params, cfg=cfg, cache=cache, ops=be.chunk_ops(),
                            routing=routing, return_routing=return_routing,
                            row_update=be.row_update, active=active)


def kvm_resume(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
               cfg: KVMConfig, cache: KVMCache, counts: Optional[Array] = None):
  """Continues every row of ``cache`` by ``W`` tokens in parallel (``q [B, W, H, D]`` ...):
  ``(y [B, W, H, Dv], cache)``, equal to ``W`` :func:`kvm_decode_step` calls to float32 rounding.

  ``W`` and every row's length must be multiples of ``chunk_size``; a row at length 0 starts its
  sequence here (equal to :func:`kvm_prefill` of the piece): the chunked prefill of long
  prompts, piece after piece, rows starting and continuing in one call. ``counts [B]`` (1 ≤
  ``counts[b]`` ≤ ``W``; None: ``W``): row ``b`` takes only its first ``counts[b]`` tokens, so a
  prompt's last, partial chunk goes in the same program (equal to that many decode steps; the
  row's length is then no multiple of ``chunk_size`` and it continues by decode steps). The
  lengths are checked when concrete. Runs on XLA (the fold's row accumulation as the backend
  resolver decides for this platform)."""
  validate_inputs(q, k, v, merge_gate, params, cfg)
  check_against_cache(k, v, cache, "kvm_resume")
  C = cfg.chunk_size
  if q.shape[1] % C:
    raise ValueError(f"kvm_resume: a piece of {q.shape[1]} tokens is not a multiple of "
                     f"chunk_size={C}; feed the rest with kvm_decode_step.")
  if is_concrete(cache.length):
    lengths = jnp.broadcast_to(cache.length, (q.shape[0],))
    if bool(jnp.any(lengths % C != 0)):
      raise ValueError(f"kvm_resume: row lengths {lengths.tolist()} must be multiples of "
                       f"chunk_size={C}; feed the rest of a row's piece with kvm_decode_step.")
  be = resolve_kvm_backend(cfg, implementation="xla")
  return decode.resume(q, k, v, merge_gate, params, cfg=cfg, cache=cache,
                       row_update=be.row_update, counts=counts)
