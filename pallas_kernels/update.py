"""Fused KVM routing + state update of one overflow chunk (docs/kvm-spec.md §6.7), one program per
(batch row, KV head).

In one kernel: novelty of each token (max similarity of its prepared key to the valid pre-append
rows, sinks included), rank of the novelties (ascending, ties to the lower token), append of the
``n_append`` least similar tokens as new rows in token order, ``LN_s`` of the post-append rows,
merge logits of the gated keys against them (sinks and unused rows excluded), first-index argmax,
and the accumulation of gated keys/values into their rows. Rows are accumulated with one-hot
matmuls (``[R, C] @ [C, D]``), which are MXU/tensor-core work and deterministic; there is no
scatter. The routing decisions are returned (``dest``: new row of each appended token, ``target``:
row each other token joins; ``R`` = none).

Backward (``custom_vjp``): given the saved decisions the update is linear, so the gradient of a
token's gated key/value is the cotangent of its row (a gather) and the old rows pass theirs
through. Routing carries no gradient, exactly as in the XLA path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvm_jax.kernels import backend
from kvm_jax.kernels.sharding import per_shard
from kvm_jax.ops.common import layer_norm
from kvm_jax.ops.kvm.state import KVMState, overflow_rows, safe_l2_norm, update_state

_NEG = -jnp.inf


def _nt(a, b, precision):
  """``a [M, K] @ b[N, K]^T`` in float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _update_kernel(keys_ref, values_ref, radius_ref, read_ref, kbar_ref, kapp_ref, kgate_ref,
                   vapp_ref, vgate_ref, vnorm_ref, lnw_ref, lnb_ref, counts_ref,
                   keys_out, values_out, radius_out, dest_out, target_out, *, sink_rows, eps,
                   kc: backend.KernelConfig):
  keys, values, radius = keys_ref[...], values_ref[...], radius_ref[...]   # [R,D] [R,Dv] [R,1]
  R, C = keys.shape[0], kbar_ref.shape[0]
  precision = kc.matmul_precision(jnp.float32)
  m, n_append = counts_ref[:, pl.ds(0, 1)], counts_ref[:, pl.ds(1, 1)]     # [1, 1] int32 each
  row_col = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0)
  row_row = jax.lax.broadcasted_iota(jnp.int32, (1, R), 1)
  tok_col = jax.lax.broadcasted_iota(jnp.int32, (C, 1), 0)
  tok_row = jax.lax.broadcasted_iota(jnp.int32, (1, C), 1)
  diagonal = tok_col == tok_row                                            # [C, C]

  # Novelty against the valid pre-append rows (sinks included), one value per token.
  sim = _nt(kbar_ref[...], read_ref[...], precision)                       # [C, R]
  nov_col = jnp.max(jnp.where(row_row < m, sim, _NEG), axis=1, keepdims=True)        # [C, 1]
  nov_row = jnp.max(jnp.where(diagonal, nov_col, _NEG), axis=0, keepdims=True)       # [1, C]
  # Ascending rank with ties to the lower token: j before i iff nov_j < nov_i or (== and j < i).
  before = (nov_col < nov_row) | ((nov_col == nov_row) & (tok_col < tok_row))       # [C(j), C(i)]
  rank_row = jnp.sum(before.astype(jnp.int32), axis=0, keepdims=True)               # [1, C]
  append_row = rank_row < n_append
  append_col = jnp.max(jnp.where(diagonal, append_row.astype(jnp.int32), 0), axis=1,
                       keepdims=True)                                                # [C, 1]
  # Appended tokens take rows m, m+1, ... in token order.
  count_row = jnp.sum(jnp.where(tok_col <= tok_row, append_col, 0), axis=0, keepdims=True)
  dest = jnp.where(append_row, m + count_row - 1, R)                                 # [1, C]
  onehot = (row_col == dest).astype(jnp.float32)                                     # [R, C]
  keys = keys + jnp.dot(onehot, kapp_ref[...], precision=precision,
                        preferred_element_type=jnp.float32)
  values = values + jnp.dot(onehot, vapp_ref[...], precision=precision,
                            preferred_element_type=jnp.float32)
  radius = radius + jnp.sum(onehot * vnorm_ref[...], axis=1, keepdims=True)

  # Merge: gated keys vs LN_s of the post-append rows (the old readout when nothing appended).
  mean = jnp.mean(keys, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(keys - mean), axis=-1, keepdims=True)
  fresh = (keys - mean) * jax.lax.rsqrt(var + eps) * lnw_ref[...] + lnb_ref[...]
  read = jnp.where(n_append > 0, fresh, read_ref[...])
  logits = _nt(read, kgate_ref[...], precision)                                    # [R, C]
  ok = (row_col >= sink_rows) & (row_col < m + n_append)
  logits = jnp.where(ok, logits, _NEG)
  best = jnp.max(logits, axis=0, keepdims=True)
  target = jnp.min(jnp.where(logits == best, row_col, R), axis=0, keepdims=True)    # first argmax
  target = jnp.where(append_row, R, target)
  onehot = (row_col == target).astype(jnp.float32)
  keys_out[...] = keys + jnp.dot(onehot, kgate_ref[...], precision=precision,
                                 preferred_element_type=jnp.float32)
  values_out[...] = values + jnp.dot(onehot, vgate_ref[...], precision=precision,
                                     preferred_element_type=jnp.float32)
  radius_out[...] = radius
  dest_out[...] = dest
  target_out[...] = target


def _forward(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale, ln_bias,
             counts, sink_rows, eps, kc):
  B, Hkv, R, D = keys.shape
  C, Dv = kbar.shape[2], values.shape[3]
  per_head = lambda *tail: pl.BlockSpec((None, None, *tail), lambda b, h: (b, h, 0, 0))
  whole = lambda *shape: pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))
  kernel = functools.partial(_update_kernel, sink_rows=sink_rows, eps=eps, kc=kc)
  f32, i32 = jnp.float32, jnp.int32
  return pl.pallas_call(
      kernel,
      grid=(B, Hkv),
      in_specs=[per_head(R, D), per_head(R, Dv), per_head(R, 1), per_head(R, D), per_head(C, D),
                per_head(C, D), per_head(C, D), per_head(C, Dv), per_head(C, Dv), per_head(1, C),
                whole(1, D), whole(1, D), whole(1, 2)],
      out_specs=[per_head(R, D), per_head(R, Dv), per_head(R, 1), per_head(1, C),
                 per_head(1, C)],
      out_shape=[jax.ShapeDtypeStruct((B, Hkv, R, D), f32),
                 jax.ShapeDtypeStruct((B, Hkv, R, Dv), f32),
                 jax.ShapeDtypeStruct((B, Hkv, R, 1), f32),
                 jax.ShapeDtypeStruct((B, Hkv, 1, C), i32),
                 jax.ShapeDtypeStruct((B, Hkv, 1, C), i32)],
      interpret=kc.interpret,
      compiler_params=kc.compiler_params(2),
      name="kvm_fused_update",
  )(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale, ln_bias, counts)


@functools.partial(jax.custom_vjp, nondiff_argnums=(13, 14, 15))
def fused_update(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale,
                 ln_bias, counts, sink_rows, eps, kc):
  """One overflow chunk folded into the state; all arrays head-major ``[B, Hkv, ·, ·]`` float32.

  ``keys [R, D]``, ``values [R, Dv]``, ``radius [R, 1]``: the state; ``read [R, D]``: LN_s of the
  keys (routing only); ``kbar`` prepared keys (routing only), ``kapp``/``kgate`` appended / gated
  keys ``[C, D]``; ``vapp``/``vgate`` ``[C, Dv]``; ``vnorm [1, C]``: ‖appended value‖;
  ``ln_scale``/``ln_bias`` ``[1, D]``; ``counts [1, 2]`` int32: (rows, rows to append).
  Returns the new keys, values, radius and the decisions ``dest``, ``target`` ``[B, Hkv, 1, C]``.
  """
  return _forward(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale,
                  ln_bias, counts, sink_rows, eps, kc)


def _fwd(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale, ln_bias,
         counts, sink_rows, eps, kc):
  out = _forward(keys, values, radius, read, kbar, kapp, kgate, vapp, vgate, vnorm, ln_scale,
                 ln_bias, counts, sink_rows, eps, kc)
  return out, (out[3], out[4], read, kbar, ln_scale, ln_bias, counts)


def _gather_rows(cotangent, index):
  """Row ``index[c]`` of ``cotangent [B, Hkv, R, X]`` for each token (zeros where index == R)."""
  R = cotangent.shape[2]
  idx = index[:, :, 0, :]                                                  # [B, Hkv, C]
  rows = jnp.take_along_axis(cotangent, jnp.minimum(idx, R - 1)[..., None], axis=2)
  return jnp.where((idx < R)[..., None], rows, 0.0)


def _bwd(sink_rows, eps, kc, saved, cotangents):
  del sink_rows, eps, kc
  dest, target, read, kbar, ln_scale, ln_bias, counts = saved
  d_keys, d_values, d_radius = cotangents[:3]
  del read, kbar, ln_scale, ln_bias, counts  # routing inputs: no gradient (None below)
  return (d_keys, d_values, d_radius, None, None,
          _gather_rows(d_keys, dest), _gather_rows(d_keys, target),
          _gather_rows(d_values, dest), _gather_rows(d_values, target),
          jnp.swapaxes(_gather_rows(d_radius, dest), 2, 3), None, None, None)


fused_update.defvjp(_fwd, _bwd)


def update_state_pallas(state: KVMState, overflow_k, overflow_v, overflow_g, n_append, params,
                        cfg, row_update="auto", read_keys=None, routing=None,
                        return_routing=False, *, kc: backend.KernelConfig):
  """Drop-in for :func:`kvm_jax.ops.kvm.state.update_state` running :func:`fused_update`.

  Given decisions (shared routing) are applied by the XLA path: there is nothing to fuse.
  """
  if routing is not None:
    return update_state(state, overflow_k, overflow_v, overflow_g, n_append, params, cfg,
                        row_update, read_keys, routing, return_routing)
  del row_update
  kc.check_sizes(chunk_size=overflow_k.shape[1], head_dim=overflow_k.shape[3],
                 value_dim=overflow_v.shape[3])
  rows = overflow_rows(overflow_k, overflow_v, overflow_g, params, cfg)
  if read_keys is None:
    read_keys = layer_norm(state.keys, params.ln_scale, params.ln_bias, cfg.ln_eps)
  counts = jnp.stack([state.num_rows, jnp.asarray(n_append, jnp.int32)]).astype(jnp.int32)
  R = state.keys.shape[2]
  Rp = kc.padded_size(R)  # Triton: power-of-two rows; padded rows are never valid
  pad = lambda x: backend.pad_axis(x, 2, Rp)
  args = (pad(state.keys), pad(state.values), pad(state.radius[..., None]),
          pad(jax.lax.stop_gradient(read_keys)), jax.lax.stop_gradient(rows.k_bar), rows.k_app,
          rows.k_gated, rows.v_app, rows.v_gated, safe_l2_norm(rows.v_app)[:, :, None, :],
          params.ln_scale.astype(jnp.float32)[None], params.ln_bias.astype(jnp.float32)[None],
          counts.reshape(1, 2))
  B, Hkv = state.keys.shape[:2]
  keys, values, radius, dest, target = per_shard(
      lambda *a: fused_update(*a, cfg.sink_rows, cfg.ln_eps, kc), args,
      ("bh",) * 10 + ("r",) * 3, ("bh",) * 5, B, Hkv, kc.shard_axes)
  keys, values, radius = keys[:, :, :R], values[:, :, :R], radius[:, :, :R]
  dest, target = jnp.minimum(dest, R), jnp.minimum(target, R)  # "none" is R again
  new = KVMState(keys=keys, values=values, radius=radius[..., 0],
                 num_rows=(state.num_rows + n_append).astype(jnp.int32))
  return (new, (dest[:, :, 0], target[:, :, 0])) if return_routing else new
