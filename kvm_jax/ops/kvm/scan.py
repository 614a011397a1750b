"""The KVM layer as one ``jax.lax.scan`` over chunks: the fast path on every backend, and the
reference the fused kernels are tested against.

Per query chunk ``c`` the scan body (1) attends the chunk's queries jointly to the valid state rows
and to the exact window (the previous ``window_chunks - 1`` chunks plus the causal current chunk),
then (2) if the static schedule says so, folds the oldest window chunk into the state. The state
lives in a buffer of static capacity (the budget at this sequence length) with a traced row count,
so the whole computation is one compiled loop with ``O(T · (R + L))`` work.

The two per-chunk operations are pluggable (:class:`ChunkOps`): the XLA functions of
``state.py`` / ``kvm_jax.ops.common`` (:data:`XLA_OPS`), or the fused Pallas kernels, which the
implementation registry (``api.py``) plugs in. This module never imports the kernels.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from kvm_jax.budget import kvm_schedule
from kvm_jax.config import KVMConfig
from kvm_jax.ops.common import joint_attention, to_chunks, window_mask, window_stack
from kvm_jax.ops.kvm.state import (KVMParams, KVMState, initial_state, state_readout,
                                   temperatures, update_state)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class ChunkOps:
  """The two operations a KVM scan (or decode step) runs per chunk.

  Attributes:
    name: what runs, e.g. "xla" or "pallas[gpu]" (shown in errors and benchmarks).
    attend_fn: the contract of :func:`kvm_jax.ops.common.joint_attention`.
    update_fn: the contract of :func:`kvm_jax.ops.kvm.state.update_state`.
    kernel: static configuration passed to both as ``kc=`` (a kernel's target, interpret mode and
      mesh axes), or None for plain XLA functions.

  Frozen and compared by value, so it is a static argument of ``jit``: equal ops share compiled
  programs.
  """

  name: str
  attend_fn: Callable
  update_fn: Callable
  kernel: Optional[Any] = None

  def attend(self, *args, **kwargs):
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    return self.attend_fn(*args, **kwargs)

  def update(self, *args, **kwargs):
    if self.kernel is not None:
      kwargs["kc"] = self.kernel
    return self.update_fn(*args, **kwargs)


XLA_OPS = ChunkOps("xla", joint_attention, update_state)


def scan_inputs(q: Array, k: Array, v: Array, cfg: KVMConfig):
  """What every chunked KVM scan feeds its body: ``(schedule, xs, pad_time, mask)``.

  ``xs`` holds, per query chunk, its index, queries ``[B, C, Hkv, G, D]``, the window keys and
  values ``[B, nb·C, Hkv, ·]`` and the schedule flags; ``pad_time`` pads a ``[B, T, ...]`` array to
  whole chunks; ``mask(chunk)`` is the ``[C, nb·C]`` causal, in-sequence window mask.
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
      "q": to_chunks(pad_time(q), nC, C).reshape(nC, B, C, Hkv, H // Hkv, D),
      "win_k": window_stack(pad_time(k), nC, C, nb),                  # [nC, B, nb*C, Hkv, D]
      "win_v": window_stack(pad_time(v), nC, C, nb),                  # [nC, B, nb*C, Hkv, Dv]
      "visible": jnp.asarray(sched.state_visible),
      "update": jnp.asarray(sched.update_after),
      "n_append": jnp.asarray(sched.n_append, jnp.int32),
  }
  return sched, xs, pad_time, functools.partial(window_mask, chunk=C, window_chunks=nb)


@functools.partial(jax.jit, static_argnames=("cfg", "ops", "remat", "row_update",
                                             "return_routing"))
def kvm_attention_scan(q: Array, k: Array, v: Array, merge_gate: Array, params: KVMParams,
                       cfg: KVMConfig, ops: ChunkOps = XLA_OPS, remat: bool = True,
                       row_update: str = "auto", routing=None, return_routing: bool = False):
  """Chunked-scan KVM; see :func:`kvm_jax.kvm_attention` for the contract (inputs are not
  re-validated here: this is the layer below the public API).

  Args:
    ops: the per-chunk operations (:data:`XLA_OPS`, or kernels from
      :func:`kvm_jax.ops.kvm.api.chunk_ops`).
    remat: rematerialize each chunk in the backward pass.
    row_update: how the XLA update accumulates rows: "scatter", "onehot" or "auto" (by backend).
    routing: per-chunk decisions ``(dest, target)``, each ``[num_chunks, B, Hkv, C]`` int32, to
      apply instead of computing them (shared routing).
    return_routing: also return the decisions this call applied, in that form (chunks without an
      update hold ``capacity``: a no-op).
  Returns:
    ``(y [B, T, H, Dv], final state)``, plus the decisions when ``return_routing``.
  """
  B, T, H, D = q.shape
  Hkv, Dv = k.shape[2], v.shape[3]
  G = H // Hkv
  C = cfg.chunk_size
  sched, xs, pad_time, mask = scan_inputs(q, k, v, cfg)
  k_p, v_p, g_p = map(pad_time, (k, v, merge_gate))
  xs["overflow_g"] = window_stack(g_p, sched.num_chunks, C, cfg.window_chunks)[:, :, :C]
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
    y = ops.attend(x["q"], state_keys, state_values, state_valid, x["win_k"], x["win_v"],
                   mask(x["chunk"]), state_temp, window_temp)
    none = jnp.full((B, Hkv, C), sched.final_rows, jnp.int32)  # "no row": a no-op scatter
    decisions = (none, none)
    if any_update:
      state, decisions = jax.lax.cond(
          x["update"],
          lambda s: ops.update(s, x["win_k"][:, :C], x["win_v"][:, :C], x["overflow_g"],
                               x["n_append"], params, cfg, row_update, state_keys,
                               routing=x.get("routing"), return_routing=True),
          lambda s: (s, decisions), state)
    return state, (y.astype(q.dtype), decisions if return_routing else None)

  if remat:
    step = jax.checkpoint(step, prevent_cse=False)
  state, (y, decisions) = jax.lax.scan(step, state0, xs)
  y = jnp.moveaxis(y, 0, 1).reshape(B, sched.num_chunks * C, H, Dv)[:, :T]  # [B, T, H, Dv]
  return (y, state, decisions) if return_routing else (y, state)
