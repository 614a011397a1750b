"""OVQ over a whole sequence: one ``lax.scan`` over chunks with a static schedule.

The dictionary's size before each chunk and the rows each chunk opens depend only on positions
(:meth:`OVQConfig.dictionary_sizes`), so they enter the scan as data: every chunk runs the same
body, nothing is decided on the device, and the dictionary is preallocated at the size it reaches
at the end of the sequence. The first chunk (an empty dictionary) and a partial last chunk run
outside the scan with their own static shapes. The body is rematerialized (only the dictionary is
kept per chunk for the backward pass), so training memory grows with ``chunks × rows``, not with
``chunks × chunk × rows`` scores.
"""

from __future__ import annotations

import functools
import math
import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.ops.ovq.state import OVQState, empty_state, fold, readout, validate_inputs

Array = jax.Array


def heads_first(x: Array) -> Array:
  """``[B, T, H, d]`` -> ``[B, H, T, d]`` float32."""
  return jnp.swapaxes(x, 1, 2).astype(jnp.float32)


def query_scale(beta: Array, head_dim: int) -> Array:
  """``beta·√D`` as ``[1, H, 1, 1]`` float32: the factor queries (and, for the delta rule's
  prediction, keys) are multiplied by; the softmax scale is 1."""
  return beta.astype(jnp.float32).reshape(1, -1, 1, 1) * math.sqrt(head_dim)


def _chunk_step(cfg: OVQConfig, row_update: str, fold_chunk: bool, scale, state, chunk):
  q, k, v, size, num_new = chunk
  y = readout(q, k, v, state, size, cfg.count_bias)
  if fold_chunk:
    state = fold(state, k, v, k * scale, size, num_new, cfg, row_update)
  return state, y


def run_chunks(q: Array, k: Array, v: Array, beta: Array, cfg: OVQConfig, rows: int,
               fold_partial: bool, row_update: str = "auto"):
  """Head-major float32 outputs ``[B, H, T, Dv]`` and the dictionary (``rows`` rows) after every
  full chunk, and after the partial last chunk too when ``fold_partial``."""
  B, H, T, D = q.shape
  Dv = v.shape[-1]
  C = cfg.chunk_size
  sizes = cfg.dictionary_sizes(T)
  scale = query_scale(beta, D)
  q = q * scale
  state = empty_state(B, H, rows, D, Dv)
  full, tail = T // C, T % C
  step = functools.partial(_chunk_step, cfg, row_update)
  outs = []
  if full:
    state, y0 = step(True, scale, state, (q[:, :, :C], k[:, :, :C], v[:, :, :C], 0, sizes[1]))
    outs.append(y0)
  if full > 1:
    def stack(x):  # [B, H, T, d] -> [chunks - 1, B, H, C, d] of chunks 1 .. full - 1
      x = x[:, :, C:full * C].reshape(B, H, full - 1, C, x.shape[-1])
      return jnp.moveaxis(x, 2, 0)
    sizes_np = np.asarray(sizes, np.int32)
    xs = (stack(q), stack(k), stack(v), sizes_np[1:full], sizes_np[2:full + 1] - sizes_np[1:full])
    body = jax.checkpoint(functools.partial(step, True, scale),
                          policy=jax.checkpoint_policies.nothing_saveable)
    state, ys = jax.lax.scan(body, state, xs)
    outs.append(jnp.moveaxis(ys, 0, 2).reshape(B, H, (full - 1) * C, Dv))
  if tail:
    s = full * C
    chunk = (q[:, :, s:], k[:, :, s:], v[:, :, s:], sizes[full], sizes[full + 1] - sizes[full])
    state, y_tail = step(fold_partial, scale, state, chunk)
    outs.append(y_tail)
  return jnp.concatenate(outs, axis=2), state


@functools.partial(jax.jit, static_argnames=("cfg", "row_update"))
def ovq_attention(q: Array, k: Array, v: Array, beta: Array, cfg: OVQConfig,
                  row_update: str = "auto") -> tuple[Array, OVQState]:
  """OVQ attention of a whole sequence.

  Args:
    q, k: ``[B, T, H, D]`` L2-normalized queries and keys.
    v: ``[B, T, H, Dv]`` values.
    beta: ``[H]`` per-head temperatures; scores are ``beta·√D · q·k``, softmax scale 1.
    cfg: the layer's :class:`OVQConfig`.
    row_update: how centroid sums are accumulated: "scatter" (XLA's scatter-add, cheapest),
      "onehot" (a one-hot matmul: deterministic on GPU/TPU, whose scatter-adds use atomics) or
      "auto" (scatter on CPU, one-hot elsewhere; ``kvm_jax.ops.kvm.state.row_update_for``).

  Returns:
    ``y [B, T, H, Dv]`` in ``v``'s dtype and the final :class:`OVQState` with
    ``cfg.capacity(T)`` rows: the dictionary after every chunk, a partial last one included (the
    authors' ``ovq_attention`` returns the same).
  """
  validate_inputs(q, k, v, beta)
  y, state = run_chunks(heads_first(q), heads_first(k), heads_first(v), beta, cfg,
                        cfg.capacity(q.shape[1]), fold_partial=True, row_update=row_update)
  return jnp.swapaxes(y, 1, 2).astype(v.dtype), state
