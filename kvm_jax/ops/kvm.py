"""The KVM layer as one ``jax.lax.scan`` over chunks (the XLA path, and the reference for kernels).

Per query chunk ``c`` the scan body (1) attends the chunk's queries jointly to the valid state rows
and to the exact window (the previous ``window_chunks - 1`` chunks plus the causal current chunk),
then (2) if the static schedule says so, folds the oldest window chunk into the state. The state
lives in a buffer of static capacity (the budget at this sequence length) with a traced row count,
so the whole computation is one compiled loop with ``O(T · (R + L))`` work.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.budget import kvm_schedule
from kvm_jax.config import KVMConfig
from kvm_jax.ops.common import (KVMParams, KVMState, initial_state, joint_attention, state_readout,
                                temperatures, update_state, validate_inputs)

Array = jax.Array
IMPLEMENTATIONS = ("xla", "pallas", "auto")
# Backends on which "auto" picks the Pallas kernels: only where a benchmark (kvm-bench
# --implementation pallas) measured them faster than the XLA scan. None has been measured yet.
AUTO_PALLAS_BACKENDS: frozenset = frozenset()


def resolve_implementation(implementation: str, cfg: KVMConfig) -> tuple[str, Optional[str]]:
  """``(implementation, kernel target)`` for this machine: "xla" (target None) or "pallas" with
  the backend it is built for — a static argument of every jitted caller, because the kernels
  differ per target. "auto" is Pallas only where it was measured to win."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r} is not available; choose one of "
                     f"{IMPLEMENTATIONS}.")
  if implementation == "auto":
    implementation = "pallas" if jax.default_backend() in AUTO_PALLAS_BACKENDS else "xla"
  if implementation == "xla":
    return implementation, None
  if cfg.readout_value_dtype is not None:
    raise ValueError("implementation='pallas' reads float32 state values; it does not reproduce "
                     "readout_value_dtype (use implementation='xla' for that).")
  return implementation, jax.default_backend()


def chunk_functions(implementation: str, interpret: Optional[bool] = None,
                    target: Optional[str] = None):
  """``(attend, update)`` with the contracts of ``joint_attention`` and ``update_state``: the XLA
  ops, or the fused Pallas kernels built for ``target`` (interpreted where it has no compiler)."""
  if implementation == "xla":
    return joint_attention, update_state
  from pallas_kernels import backend
  from pallas_kernels.readout import joint_attention_pallas
  from pallas_kernels.update import update_state_pallas
  kc = backend.KernelConfig.for_target(target, interpret)
  return (functools.partial(joint_attention_pallas, kc=kc),
          functools.partial(update_state_pallas, kc=kc))


def _to_chunks(x: Array, num_chunks: int, chunk: int) -> Array:
  """``[B, num_chunks*chunk, ...]`` -> ``[num_chunks, B, chunk, ...]``."""
  b = x.shape[0]
  return jnp.moveaxis(x.reshape(b, num_chunks, chunk, *x.shape[2:]), 1, 0)


def _window_stack(x: Array, num_chunks: int, chunk: int, window_chunks: int) -> Array:
  """Per query chunk c, the chunks ``c-nb+1 .. c`` side by side: ``[nC, B, nb*chunk, ...]``.

  Chunks before the sequence start are zeros (masked in attention). Feeding the window as scan
  inputs (instead of slicing a closed-over array) keeps the backward pass free of full-length
  cotangent accumulators.
  """
  front = [(0, 0), ((window_chunks - 1) * chunk, 0)] + [(0, 0)] * (x.ndim - 2)
  chunks = _to_chunks(jnp.pad(x, front), num_chunks + window_chunks - 1, chunk)
  return jnp.concatenate([chunks[j:j + num_chunks] for j in range(window_chunks)], axis=2)


def scan_inputs(q: Array, k: Array, v: Array, cfg: KVMConfig):
  """What every chunked KVM scan feeds its body: ``(schedule, xs, pad_time, window_mask)``.

  ``xs`` holds, per query chunk, its index, queries ``[B, C, Hkv, G, D]``, the window keys and
  values ``[B, nb·C, Hkv, ·]`` and the schedule flags; ``pad_time`` pads a ``[B, T, ...]`` array to
  whole chunks; ``window_mask(chunk)`` is the ``[C, nb·C]`` causal, in-sequence window mask.
  """
  B, T, H, D = q.shape
  Hkv = k.shape[2]
  C, nb = cfg.chunk_size, cfg.window_chunks
  sched = kvm_schedule(cfg, T)
  nC = sched.num_chunks

  def pad_time(x):
    return jnp.pad(x, [(0, 0), (0, nC * C - T)] + [(0, 0)] * (x.ndim - 2))

  xs = {
      "chunk": jnp.arange(nC, dtype=jnp.int32),
      "q": _to_chunks(pad_time(q), nC, C).reshape(nC, B, C, Hkv, H // Hkv, D),
      "win_k": _window_stack(pad_time(k), nC, C, nb),                  # [nC, B, nb*C, Hkv, D]
      "win_v": _window_stack(pad_time(v), nC, C, nb),                  # [nC, B, nb*C, Hkv, Dv]
      "visible": jnp.asarray(sched.state_visible),
      "update": jnp.asarray(sched.update_after),
      "n_append": jnp.asarray(sched.n_append, jnp.int32),
  }
  slot = np.arange(nb * C)
  # Causal within the window: query i of the chunk sees slot s iff s <= (nb-1)*C + i.
  causal = slot[None, :] <= (nb - 1) * C + np.arange(C)[:, None]       # [C, nb*C] static

  def window_mask(chunk):
    return causal & ((chunk - (nb - 1)) * C + slot >= 0)[None, :]    # chunks before 0 are empty

  return sched, xs, pad_time, window_mask


@functools.partial(jax.jit, static_argnames=("cfg", "remat", "row_update", "return_routing",
                                             "implementation", "interpret", "target"))
def kvm_attention_xla(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                      cfg: KVMConfig, remat: bool = True, row_update: str = "auto",
                      routing=None, return_routing: bool = False, implementation: str = "xla",
                      interpret: Optional[bool] = None, target: Optional[str] = None):
  """Chunked-scan KVM; see :func:`kvm_attention` for the contract (inputs are not re-validated).

  ``routing``: per-chunk decisions ``(dest, target)``, each ``[num_chunks, B, Hkv, C]`` int32, to
  apply instead of computing them (shared routing); ``return_routing=True`` also returns the
  decisions this call applied, in that form (chunks without an update hold ``capacity``: no-op).
  ``implementation="pallas"`` runs the same scan with the fused kernels in the body, built for
  ``target`` ("tpu", "cuda", "cpu"; default: this machine's backend).
  """
  attend, update = chunk_functions(implementation, interpret, target)
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[3]
  G = H // Hkv
  C = cfg.chunk_size
  sched, xs, pad_time, window_mask = scan_inputs(q, k, v, cfg)
  k_p, v_p, g_p = map(pad_time, (k, v, merge_gate))
  xs["overflow_g"] = _window_stack(g_p, sched.num_chunks, C, cfg.window_chunks)[:, :, :C]
  if routing is not None:
    xs["routing"] = routing
  state0 = initial_state(k_p[:, :C], v_p[:, :C], g_p[:, :C], sched.initial_rows, sched.final_rows,
                         params, cfg)
  state_temp, window_temp = temperatures(params, cfg, Hkv)
  rows = jnp.arange(sched.final_rows)
  any_update = any(sched.update_after)

  def step(state: KVMState, x):
    state_keys, state_values = state_readout(state, params, cfg, G)
    state_valid = ((rows < state.num_rows) & x["visible"])[None, :]
    window_valid = window_mask(x["chunk"])
    y = attend(x["q"], state_keys, state_values, state_valid, x["win_k"], x["win_v"],
               window_valid, state_temp, window_temp)
    none = jnp.full((B, Hkv, C), sched.final_rows, jnp.int32)  # "no row": a no-op scatter
    decisions = (none, none)
    if any_update:
      state, decisions = jax.lax.cond(
          x["update"],
          lambda s: update(s, x["win_k"][:, :C], x["win_v"][:, :C], x["overflow_g"],
                           x["n_append"], params, cfg, row_update, state_keys,
                           routing=x.get("routing"), return_routing=True),
          lambda s: (s, decisions), state)
    return state, (y.astype(q.dtype), decisions if return_routing else None)

  if remat:
    step = jax.checkpoint(step, prevent_cse=False)
  state, (y, decisions) = jax.lax.scan(step, state0, xs)
  y = jnp.moveaxis(y, 0, 1).reshape(B, sched.num_chunks * C, H, Dv)[:, :T]  # [B, T, H, Dv]
  return (y, state, decisions) if return_routing else (y, state)


def kvm_attention(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                  cfg: KVMConfig, *, implementation: str = "xla", remat: bool = True,
                  routing=None, return_routing: bool = False):
  """KVM attention over a whole sequence (prefill / training forward), jit-compiled.

  Args:
    q: ``[B, T, H, D]`` queries after QK-LayerNorm and RoPE.
    k: ``[B, T, Hkv, D]`` keys after QK-LayerNorm and RoPE (H must be a multiple of Hkv).
    v: ``[B, T, Hkv, Dv]`` values.
    merge_gate: ``[B, T, Hkv]`` g = 1 + ELU(x W_g) > 0 (ones to disable).
    params: :class:`KVMParams` (LN_s and temperatures).
    cfg: :class:`KVMConfig` (static).
    implementation: "xla" (the chunked ``lax.scan``), "pallas" (the same scan with the fused
      readout and routing/update kernels of ``pallas_kernels``; interpret mode on CPU) or "auto"
      (Pallas only on backends listed in ``AUTO_PALLAS_BACKENDS``, where it was measured faster).
    remat: rematerialize each chunk in the backward pass (memory O(T/C · R) for the stored states
      instead of every chunk's attention probabilities).
    routing / return_routing: apply given per-chunk routing decisions / also return the applied
      ones (shared routing across layers; see :func:`kvm_attention_xla`).
  Returns:
    ``y [B, T, H, Dv]`` in q's dtype, and the final :class:`KVMState` (float32, capacity = the
    number of rows the schedule reaches at T).
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  implementation, target = resolve_implementation(implementation, cfg)
  return kvm_attention_xla(q, k, v, merge_gate, params, cfg=cfg, remat=remat, routing=routing,
                           return_routing=return_routing, implementation=implementation,
                           target=target)
