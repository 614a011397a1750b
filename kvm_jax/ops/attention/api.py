"""Causal softmax attention (full or sliding window) with its backend decided in one place.

The ``full`` and ``swa`` mixers call :func:`causal_attention`; which kernel computes it is a
config choice (``ModelConfig.attention_implementation``), the way maxtext's one attention op picks
its kernel:

===============  ================================================================================
``"xla"``        ``jax.nn.dot_product_attention``'s XLA path: dense ``[T, T]`` scores (memory
                 O(T²); the yardstick the others are tested against)
``"chunked"``    :func:`kvm_jax.ops.attention.chunked.chunked_attention`: online softmax over key
                 blocks with a recomputing backward, plain XLA, every backend, O(T·block) memory
``"cudnn"``      cuDNN's fused flash attention through ``jax.nn.dot_product_attention`` (NVIDIA
                 GPUs, bf16/fp16 inputs)
``"splash"``     JAX's Pallas splash attention for TPU (interpreted on other backends, for tests)
``"tokamax"``    ``tokamax.dot_product_attention`` with its own kernel choice (Mosaic GPU/TPU,
                 Triton, chunked XLA); needs the optional ``tokamax`` package
``"auto"``       cudnn on GPU for bf16/fp16, splash on TPU when T is a multiple of 128, chunked
                 everywhere else (CPU included); dense only up to one block (T <= 512), where
                 the scores are small and the chunked path would compute the same ones
===============  ================================================================================

Every implementation takes ``[B, T, H, D]`` queries, ``[B, T, Hkv, D]`` keys and ``[B, T, Hkv, Dv]``
values (GQA when Hkv < H); query p sees keys ``[0, p]``, or ``(p - window, p]`` with a window.
Pallas kernels (splash) run per shard under the enclosing
:func:`kvm_jax.ops.kvm.kernel_sharding`, like the KVM kernels.

As for the KVM op (``kvm_jax.ops.kvm.api.resolve_kvm_backend``), one resolver,
:func:`resolve_attention_backend`, makes every choice for a call (the concrete implementation,
interpret mode, the mesh axes) into a frozen :class:`AttentionBackend`, and is the only reader of
the platform here; :func:`causal_attention` only runs what it decided.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp

from kvm_jax.kernels.sharding import ShardAxes, current_shard_axes, per_shard
from kvm_jax.config.model import ATTENTION_IMPLEMENTATIONS
from kvm_jax.ops.attention import dense
from kvm_jax.ops.attention.chunked import DEFAULT_BLOCK, chunked_attention
from kvm_jax.ops.common import current_platform, import_tokamax
from kvm_jax.ops.documents import WindowRule, check_segment_ids, document_attention, documents

Array = jax.Array

_HALF_PRECISION = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
  """What :func:`causal_attention` runs for one call, decided by :func:`resolve_attention_backend`.

  Attributes:
    platform: the platform it was decided for ("cpu", "gpu", "tpu", ...).
    implementation: the concrete kernel: "xla", "chunked", "cudnn", "splash" or "tokamax" (never
      "auto").
    interpret: run the Pallas kernel (splash) in interpret mode (off on TPU only, by default).
    shard_axes: the mesh axes a Pallas kernel splits over (the enclosing
      :func:`kvm_jax.ops.kvm.kernel_sharding` when it was decided).
  """

  platform: str
  implementation: str
  interpret: bool
  shard_axes: ShardAxes = ShardAxes()


def resolve_attention_backend(implementation: str, q: Array, *, platform: Optional[str] = None,
                              interpret: Optional[bool] = None,
                              shard_axes: Optional[ShardAxes] = None,
                              softcap: Optional[float] = None) -> AttentionBackend:
  """The one place softmax attention's backend is decided, for queries ``q`` (``[B, T, H, D]``;
  only shape and dtype are read) on ``platform`` (default: this machine's,
  :func:`kvm_jax.ops.common.current_platform`).

  "auto" takes cudnn on GPU for bf16/fp16 heads of a size cuDNN supports, splash on TPU when T is
  a multiple of 128, otherwise dense XLA up to one block and the chunked path beyond; with
  soft-capped scores (``softcap``, Gemma 2), which cuDNN's fused attention cannot compute, never
  cudnn. Raises ValueError naming the bad value for an unknown implementation and for requests
  the chosen kernel cannot serve (cudnn with float32 or a soft-cap, splash with T not a multiple
  of 128)."""
  if implementation not in ATTENTION_IMPLEMENTATIONS:
    raise ValueError(f"attention implementation {implementation!r} is unknown; choose from "
                     f"{ATTENTION_IMPLEMENTATIONS}.")
  platform = current_platform() if platform is None else platform
  T, D = q.shape[1], q.shape[3]
  impl = implementation
  if impl == "auto":
    if (platform in ("gpu", "cuda") and q.dtype in _HALF_PRECISION and D <= 256 and D % 8 == 0
        and softcap is None):
      impl = "cudnn"
    elif platform == "tpu" and T % 128 == 0:
      impl = "splash"
    else:
      # Up to one block the chunked path computes exactly the dense scores, only slower (loops
      # that XLA cannot fuse across): short sequences take the dense path.
      impl = "xla" if T <= DEFAULT_BLOCK else "chunked"
  if impl == "cudnn" and softcap is not None:
    raise ValueError(f"attention implementation 'cudnn' cannot soft-cap scores (softcap="
                     f"{softcap}); use 'chunked', 'tokamax' or 'auto'.")
  if impl == "cudnn" and q.dtype not in _HALF_PRECISION:
    raise ValueError(f"attention implementation 'cudnn' needs bfloat16 or float16 inputs, got "
                     f"{q.dtype}; use 'chunked' (or 'auto') for float32.")
  if impl == "splash" and T % 128:
    raise ValueError(f"attention implementation 'splash' needs a sequence length that is a "
                     f"multiple of 128, got {T}; use 'chunked' (or 'auto').")
  return AttentionBackend(
      platform=platform, implementation=impl,
      interpret=(platform != "tpu") if interpret is None else bool(interpret),
      shard_axes=current_shard_axes() if shard_axes is None else shard_axes)


def resolve_attention(implementation: str, q: Array, platform: Optional[str] = None) -> str:
  """The concrete implementation ``implementation`` means for queries ``q`` on ``platform``
  (default: this machine's): :func:`resolve_attention_backend`'s choice."""
  return resolve_attention_backend(implementation, q, platform=platform).implementation


def runs_pallas(implementation: str, platform: Optional[str] = None) -> bool:
  """Whether ``implementation`` may run a Pallas kernel (which must then run per shard under a
  mesh: see :func:`kvm_jax.ops.kvm.kernel_sharding`). "auto" can only on TPU (splash). Asked
  before any queries exist (the trainer, when it sets up the mesh), so it takes no ``q``."""
  if implementation == "auto":
    return (current_platform() if platform is None else platform) == "tpu"
  return implementation in ("splash", "tokamax")


def causal_attention(q: Array, k: Array, v: Array, *, window: Optional[int] = None,
                     scale: Optional[float] = None, implementation: str = "auto",
                     interpret: Optional[bool] = None,
                     segment_ids: Optional[Array] = None,
                     softcap: Optional[float] = None) -> Array:
  """Causal attention of ``q`` over ``k``/``v`` (``window``: the last ``window`` tokens only).

  Args:
    q, k, v: ``[B, T, H, D]``, ``[B, T, Hkv, D]``, ``[B, T, Hkv, Dv]``.
    window: sliding-window length (query's own token included), or None for full attention.
    scale: softmax scale, default ``1/sqrt(D)``.
    implementation: one of :data:`kvm_jax.config.model.ATTENTION_IMPLEMENTATIONS`.
    interpret: run a Pallas kernel (splash) in interpret mode; default: off on TPU only.
    segment_ids: optional ``[B, T]`` int packed documents (0 = padding, each run of one nonzero
      id a document; :mod:`kvm_jax.ops.documents`): every query sees only keys of its own
      document, so each document gets what it would get alone (each padding token sees itself).
      Splash takes them natively (its ``SegmentIds``). ``jax.nn.dot_product_attention`` (xla,
      cudnn) and tokamax's public API take only dense ``[T, T]`` masks, which would cost O(T²)
      memory, so those implementations, and chunked, run the document window path instead
      (:func:`kvm_jax.ops.documents.document_attention`: blocks of queries against the keys in
      reach, plain XLA, O(T · (block + window)) memory).
    softcap: None, or every scaled score becomes ``cap · tanh(score / cap)`` before the mask
      (Gemma 2's ``attn_logit_softcapping``); every implementation but cudnn computes it.
  Returns:
    ``[B, T, H, Dv]`` in ``q.dtype``.
  """
  be = resolve_attention_backend(implementation, q, interpret=interpret, softcap=softcap)
  impl = be.implementation
  if segment_ids is not None:
    check_segment_ids(segment_ids, q.shape[:2], "causal_attention")
    if impl == "splash":
      return _splash(q, k, v, window, scale, be, segment_ids=segment_ids, softcap=softcap)
    rule = WindowRule("causal") if window is None else WindowRule("sliding", window=window)
    return document_attention(q, k, v, segment_ids, rule, scale=scale, softcap=softcap)
  if impl in ("xla", "cudnn"):  # jax.nn.dot_product_attention's own two implementations
    if window is None:
      return dense.full_attention(q, k, v, scale=scale, implementation=impl, softcap=softcap)
    return dense.sliding_window_attention(q, k, v, window, scale=scale, implementation=impl,
                                          softcap=softcap)
  if impl == "chunked":
    return chunked_attention(q, k, v, window=window, scale=scale, softcap=softcap)
  if impl == "tokamax":
    return _tokamax(q, k, v, window, scale, softcap)
  return _splash(q, k, v, window, scale, be, softcap=softcap)


def _tokamax(q, k, v, window, scale, softcap):
  tokamax = import_tokamax("attention implementation 'tokamax' (or use 'auto')")
  local = None if window is None else (window - 1, 0)
  return tokamax.dot_product_attention(q, k, v, is_causal=True, local_window_size=local,
                                       scale=scale, logits_soft_cap=softcap)


def _splash(q, k, v, window, scale, be: AttentionBackend, segment_ids=None, softcap=None):
  """Splash attention: the MQA kernel per (batch row, KV head) over its group of query heads.
  ``segment_ids``: packed documents, as splash's own ``SegmentIds`` (one id per document and
  per padding token, so that a padding token sees only itself)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[-1]
  G = H // Hkv
  one = (splash.CausalMask((T, T)) if window is None
         else splash.LocalMask((T, T), window_size=(window - 1, 0), offset=0))
  size = math.gcd(T, 512)
  blocks = splash.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size,
                             block_q_dkv=size, block_kv_dkv=size, block_kv_dkv_compute=size,
                             block_q_dq=size, block_kv_dq=size)
  scale = 1.0 / math.sqrt(D) if scale is None else scale
  qh = jnp.moveaxis((q * scale).astype(q.dtype).reshape(B, T, Hkv, G, D), 1, 3)  # [B,Hkv,G,T,D]
  kh, vh = jnp.moveaxis(k, 1, 2), jnp.moveaxis(v, 1, 2)                           # [B,Hkv,T,·]

  def kernel():
    return splash.make_splash_mqa(splash.MultiHeadMask([one] * G), block_sizes=blocks,
                                  attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1,
                                  interpret=be.interpret)

  def run(qh, kh, vh):
    return (jax.vmap(jax.vmap(kernel()))(qh, kh, vh),)                         # [B,Hkv,G,T,Dv]

  def run_documents(qh, kh, vh, ids):
    call = kernel()
    one_head = lambda q, k, v, i: call(q, k, v, segment_ids=splash.SegmentIds(q=i, kv=i))  # noqa: E731
    return (jax.vmap(jax.vmap(one_head))(qh, kh, vh, ids),)

  if segment_ids is None:
    out, = per_shard(run, (qh, kh, vh), ("bh", "bh", "bh"), ("bh",), B, Hkv, be.shard_axes)
  else:
    ids = jnp.broadcast_to(documents(segment_ids).index[:, None], (B, Hkv, T))    # [B,Hkv,T]
    out, = per_shard(run_documents, (qh, kh, vh, ids), ("bh",) * 4, ("bh",), B, Hkv,
                     be.shard_axes)
  return jnp.moveaxis(out, 3, 1).reshape(B, T, H, Dv).astype(q.dtype)
