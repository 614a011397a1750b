"""The oracle: KVM written as plainly as docs/kvm-spec.md (§6.5–§6.7) puts it, chunk by chunk, in
Python.

It is the yardstick for every fast path, so it shares none of their arithmetic (only the state's
pytree type and the input validation): it works in the authors' ``[batch, heads, time, dim]``
layout, grows the state by concatenation (dynamic sizes), evaluates the budget on the fly, ranks
novelty with a stable argsort and gathers tokens by index. Slow by design; use small shapes. It is
traceable by ``jax.grad`` (control flow depends on positions only), so gradients can be compared
too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvm_jax.config.kvm import KVMConfig
# The pytree type and input validation only: none of the arithmetic of the fast paths.
from kvm_jax.ops.kvm.state import KVMState, validate_inputs

_HI = jax.lax.Precision.HIGHEST


def _ln(x, w, b, eps):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) / jnp.sqrt(var + eps) * w + b


def _norm(x):
  """‖x‖₂ over the last axis, keepdims; zero gradient at 0 instead of NaN."""
  sq = (x * x).sum(-1, keepdims=True)
  return jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)


def _repeat_kv(x, groups):
  """[B, Hkv, T, D] -> [B, Hkv*groups, T, D], query head h uses kv head h // groups."""
  return jnp.repeat(x, groups, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _cast_then_repeat(x, groups, low):
  """The authors' ``repeat_interleave(x.bfloat16())`` followed by a cat with float32 values.

  Backward as torch autograd does it: the cat rounds every query head's cotangent to ``low``; the
  repeat's backward sums each group with float accumulation and rounds once more; the cast's
  backward returns to ``x``'s dtype.
  """
  return _repeat_kv(x.astype(low), groups).astype(x.dtype)


def _cast_then_repeat_fwd(x, groups, low):
  return _cast_then_repeat(x, groups, low), None


def _cast_then_repeat_bwd(groups, low, _, ct):
  B, H, M, Dv = ct.shape
  per_head = ct.astype(low).astype(jnp.float32).reshape(B, H // groups, groups, M, Dv)
  return (per_head.sum(axis=2).astype(low).astype(ct.dtype),)  # output dtype == x dtype


_cast_then_repeat.defvjp(_cast_then_repeat_fwd, _cast_then_repeat_bwd)


def _sdpa(q, k, v, mask, softcap=None):
  """softmax(softcap(q kᵀ / √D) + mask) v with a boolean mask [Tq, Tk] (``softcap``: None, or
  scores become ``cap · tanh(s / cap)``)."""
  s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=_HI) / math.sqrt(q.shape[-1])
  if softcap is not None:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(mask, s, -jnp.inf)
  return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision=_HI)


def _lower_right_causal(q_len, kv_len):
  return jnp.arange(kv_len)[None, :] <= jnp.arange(q_len)[:, None] + (kv_len - q_len)


def _desired(cfg: KVMConfig, ctx_len, available, current):
  target = min(cfg.budget.target_rows(ctx_len), available)
  if cfg.max_state_rows is not None:
    target = min(target, cfg.max_state_rows)
  return max(target, current)


def _bswa_begin(n, C, L):
  return max(0, -(-n // C) * C - L)


def kvm_attention_reference(q, k, v, merge_gate, params, cfg: KVMConfig, *, dtype=jnp.float32):
  """Same contract as :func:`kvm_jax.kvm_attention`; computes in ``dtype`` (float32 or float64).

  Returns ``y [B, T, H, Dv]`` and a ``KVMState`` whose arrays hold exactly ``num_rows`` rows. The
  Python loops unroll under ``jit`` (used here because compiling one program is much faster than
  dispatching hundreds of small eager ops for the first time); it also works un-jitted.
  """
  validate_inputs(q, k, v, merge_gate, params, cfg)
  return _reference(q, k, v, merge_gate, params, cfg=cfg, dtype=dtype)


class _OraclePieces:
  """The pieces of one layer's oracle, in the authors' layout ``[B, heads, T, dim]``: LN_s, the
  state keys' preparation, one query chunk's readout over [state ; window] and the fold of one
  chunk into the state, for ``H`` query heads in groups of ``G`` per KV head."""

  def __init__(self, params, cfg: KVMConfig, dtype, H: int, G: int):
    self.cfg, self.dtype, self.G = cfg, dtype, G
    self.w, self.b = params.ln_scale.astype(dtype), params.ln_bias.astype(dtype)
    if cfg.head_temperatures:
      self.tau_f = params.window_temperature.astype(dtype).reshape(1, H, 1, 1)
      self.tau_s = params.state_temperature.astype(dtype).reshape(1, H, 1, 1)
    else:
      self.tau_f = self.tau_s = jnp.ones((1, H, 1, 1), dtype)

  def ln_s(self, x):
    return _ln(x, self.w, self.b, self.cfg.ln_eps)

  def prep(self, kk):
    """Stored state keys: the zeroed rotary channels, then LN_s."""
    r = self.cfg.state_zeroed_dims
    return self.ln_s(jnp.concatenate([jnp.zeros_like(kk[..., :r]), kk[..., r:]], axis=-1))

  def attend(self, qc, kw, vw, s_k, s_v, s_r):
    cfg, G = self.cfg, self.G
    s_k_read = _repeat_kv(self.ln_s(s_k), G)
    if cfg.value_norm == "radius":
      s_v_read = s_v / jnp.maximum(_norm(s_v), 1e-12) * s_r
    else:
      s_v_read = s_v
    if cfg.readout_value_dtype is not None:
      s_v_read = _cast_then_repeat(s_v_read, G, cfg.readout_value_dtype)
    else:
      s_v_read = _repeat_kv(s_v_read, G)
    k_star = jnp.concatenate([s_k_read * self.tau_s, _repeat_kv(kw, G) * self.tau_f], axis=2)
    v_star = jnp.concatenate([s_v_read, _repeat_kv(vw, G)], axis=2)
    return _sdpa(qc, k_star, v_star, _lower_right_causal(qc.shape[2], k_star.shape[2]),
                 cfg.logit_softcap)

  def update(self, s_k, s_v, s_r, ok, ov, og, ctx_len, available):
    """The state after folding the chunk ``ok, ov`` (gate ``og``): the least novel keys' rows
    appended up to the budget, the rest merged into their nearest non-sink rows."""
    cfg = self.cfg
    k_bar = self.prep(ok)
    k_g = k_bar * og if cfg.gate_keys else k_bar
    v_g = ov * og if cfg.gate_values else ov
    k_app, v_app = (k_g, v_g) if cfg.gate_appends else (k_bar, ov)
    m = s_k.shape[2]
    n_app = min(max(_desired(cfg, ctx_len, available, m) - m, 0), ok.shape[2])
    if n_app > 0:
      ref = jax.lax.stop_gradient(self.ln_s(s_k))
      novelty = jnp.einsum("bhcd,bhmd->bhcm", jax.lax.stop_gradient(k_bar), ref,
                           precision=_HI).max(-1)
      order = jnp.argsort(novelty, axis=-1, stable=True)      # least similar first, ties by index
      app_idx = jnp.sort(order[..., :n_app], axis=-1)
      mrg_idx = jnp.sort(order[..., n_app:], axis=-1)
      take = lambda x, idx: jnp.take_along_axis(x, idx[..., None], axis=2)
      s_k = jnp.concatenate([s_k, take(k_app, app_idx)], axis=2)
      s_v = jnp.concatenate([s_v, take(v_app, app_idx)], axis=2)
      s_r = jnp.concatenate([s_r, _norm(take(v_app, app_idx))], axis=2)
      k_m, v_m = take(k_g, mrg_idx), take(v_g, mrg_idx)
    else:
      k_m, v_m = k_g, v_g
    if k_m.shape[2] == 0:
      return s_k, s_v, s_r
    return self.merge(s_k, s_v, s_r, k_m, v_m)

  def merge(self, s_k, s_v, s_r, k_m, v_m):
    """Each merged key's row added into the state row its key scores highest on (sinks
    excluded, first index on ties)."""
    m = s_k.shape[2]
    sinks = min(self.cfg.sink_rows, m)
    if m <= sinks:
      raise AssertionError("state has no non-sink row to merge into")
    logits = jnp.einsum("bhcd,bhmd->bhcm", jax.lax.stop_gradient(k_m),
                        jax.lax.stop_gradient(self.ln_s(s_k)), precision=_HI)
    logits = logits.at[..., :sinks].set(-jnp.inf)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), m, dtype=self.dtype)
    s_k = s_k + jnp.einsum("bhcm,bhcd->bhmd", onehot, k_m, precision=_HI)
    s_v = s_v + jnp.einsum("bhcm,bhcd->bhmd", onehot, v_m, precision=_HI)
    return s_k, s_v, s_r


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _reference(q, k, v, merge_gate, params, cfg: KVMConfig, dtype):
  B, T, H, D = q.shape
  G = H // k.shape[2]
  C, L = cfg.chunk_size, cfg.window_len
  # Authors' layout: [B, heads, T, dim].
  q = jnp.transpose(q, (0, 2, 1, 3)).astype(dtype)
  k = jnp.transpose(k, (0, 2, 1, 3)).astype(dtype)
  v = jnp.transpose(v, (0, 2, 1, 3)).astype(dtype)
  g = jnp.transpose(merge_gate, (0, 2, 1))[..., None].astype(dtype)        # [B, Hkv, T, 1]
  pieces = _OraclePieces(params, cfg, dtype, H, G)
  tau_f, prep = pieces.tau_f, pieces.prep

  # Front: plain causal attention over the first min(T, L) tokens, window temperature only.
  front = min(T, L)
  outs = [_sdpa(q[:, :, :front], _repeat_kv(k[:, :, :front], G) * tau_f,
                _repeat_kv(v[:, :, :front], G), _lower_right_causal(front, front),
                cfg.logit_softcap)]
  # Initial state: the first chunk, ungated unless gate_initial_state; radius from ungated v.
  c0 = min(T, C)
  s_k, s_v = prep(k[:, :, :c0]), v[:, :, :c0]
  s_r = _norm(v[:, :, :c0])
  if cfg.gate_initial_state:
    s_k, s_v = s_k * g[:, :, :c0], s_v * g[:, :, :c0]
  coverage = c0
  for qb in range(L, T, C):
    qe = min(T, qb + C)
    wb = _bswa_begin(qe, C, L)
    assert wb == coverage, (wb, coverage)
    outs.append(pieces.attend(q[:, :, qb:qe], k[:, :, wb:qe], v[:, :, wb:qe], s_k, s_v, s_r))
    if qe >= T:
      break
    nwb = _bswa_begin(min(T, qe + C), C, L)
    if nwb > wb:
      s_k, s_v, s_r = pieces.update(s_k, s_v, s_r, k[:, :, wb:nwb], v[:, :, wb:nwb],
                                    g[:, :, wb:nwb], ctx_len=qe, available=nwb)
      coverage = nwb
  y = jnp.transpose(jnp.concatenate(outs, axis=2), (0, 2, 1, 3))
  state = KVMState(keys=s_k, values=s_v, radius=s_r[..., 0], num_rows=jnp.asarray(s_k.shape[2], jnp.int32))
  return y, state
