"""The KVM state and the pure functions that build, update and read it (no Flax, no kernels).

* pytrees: :class:`KVMParams` (LN_s and the two key temperatures) and :class:`KVMState` (the
  compressed rows as stored, in a static-capacity buffer with a row count);
* input validation at the public API boundary;
* per-token preparation (prep(k), ‖v‖, merge gates), the readout of the state (LN_s keys,
  radius-normalized values) and the state update of one overflow chunk (novelty ranking, appends,
  first-argmax merges).

The scan (``scan.py``), the decode step (``decode.py``) and the Pallas kernels all build on these;
the oracle (``reference.py``) deliberately does *not*, so that it stays an independent
implementation of ``docs/kvm-spec.md``. Shapes: tokens ``[batch, time, heads, dim]``, state
``[batch, kv_heads, rows, dim]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.common import current_platform, is_concrete, layer_norm, tree_nbytes

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Pytrees
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KVMParams:
  """KVM-specific parameters of one layer (docs/kvm-spec.md §6.1).

  Attributes:
    ln_scale: ``[D]`` LN_s weight, one LayerNorm over the head dim shared by all heads.
    ln_bias: ``[D]`` LN_s bias.
    window_temperature: ``[H]`` τ_f, linear multiplier on exact-window keys, per query head.
    state_temperature: ``[H]`` τ_s, linear multiplier on LN_s(state keys), per query head.
  """

  ln_scale: Array
  ln_bias: Array
  window_temperature: Array
  state_temperature: Array

  @classmethod
  def init(cls, head_dim: int, num_heads: int, dtype: Any = jnp.float32) -> "KVMParams":
    """The authors' initialization: LN_s weight 1, bias 0, both temperatures 1."""
    return cls(ln_scale=jnp.ones((head_dim,), dtype), ln_bias=jnp.zeros((head_dim,), dtype),
               window_temperature=jnp.ones((num_heads,), dtype),
               state_temperature=jnp.ones((num_heads,), dtype))


jax.tree_util.register_dataclass(
    KVMParams, data_fields=["ln_scale", "ln_bias", "window_temperature", "state_temperature"],
    meta_fields=[])


class KVMOutput(NamedTuple):
  """What the KVM op over a whole sequence returns: ``y [B, T, H, Dv]`` and the final
  :class:`KVMState`."""

  y: Any
  state: Any


class RoutedKVMOutput(NamedTuple):
  """:class:`KVMOutput` plus the routing decisions the op applied, ``routing`` (what
  ``return_routing=True`` asks for: ``(dest, target)`` per chunk; shared routing across layers
  and the kernels' checks read them)."""

  y: Any
  state: Any
  routing: Any


class KVMStepOutput(NamedTuple):
  """What a prefill, a decode step or a parallel piece returns: ``y`` and the advanced decode
  cache (:class:`kvm_jax.ops.kvm.decode.KVMCache`)."""

  y: Any
  cache: Any


class RoutedKVMStepOutput(NamedTuple):
  """:class:`KVMStepOutput` plus the routing decisions the step applied (``return_routing``)."""

  y: Any
  cache: Any
  routing: Any


class RoutedUpdate(NamedTuple):
  """:func:`update_state` with ``return_routing=True``: the new state and ``routing``, the
  ``(dest, target)`` ``[B, Hkv, C]`` it applied."""

  state: Any
  routing: Any


@dataclasses.dataclass(frozen=True)
class KVMState:
  """The compressed state *as stored* (docs/kvm-spec.md §1), float32.

  Attributes:
    keys: ``[B, Hkv, R, D]`` raw rows: prep(k) of appended tokens plus sums of gated prep(k) of
      merged tokens (LN_s is applied again at readout).
    values: ``[B, Hkv, R, Dv]`` raw (gated) value sums, not normalized.
    radius: ``[B, Hkv, R]`` ‖v‖ of the token that created each row, fixed by merges.
    num_rows: int32 scalar; rows ``[:num_rows]`` are valid, the rest are zero padding up to the
      static capacity R. The same for every batch element and head (the schedule depends only on
      positions).
  """

  keys: Array
  values: Array
  radius: Array
  num_rows: Array

  @property
  def capacity(self) -> int:
    return self.keys.shape[2]

  def nbytes(self) -> int:
    """Bytes of the arrays as allocated (capacity rows, not only valid ones)."""
    return tree_nbytes(self)


jax.tree_util.register_dataclass(
    KVMState, data_fields=["keys", "values", "radius", "num_rows"], meta_fields=[])


def empty_state(batch: int, kv_heads: int, capacity: int, head_dim: int,
                value_dim: int) -> KVMState:
  """A zero state of ``capacity`` rows, none of them valid."""
  return KVMState(keys=jnp.zeros((batch, kv_heads, capacity, head_dim), jnp.float32),
                  values=jnp.zeros((batch, kv_heads, capacity, value_dim), jnp.float32),
                  radius=jnp.zeros((batch, kv_heads, capacity), jnp.float32),
                  num_rows=jnp.zeros((), jnp.int32))


def pad_rows(state: KVMState, capacity: int) -> KVMState:
  """The same state in a buffer of ``capacity`` rows (zero rows appended)."""
  pad = capacity - state.capacity
  if pad < 0:
    raise ValueError(f"cannot shrink a state of {state.capacity} rows to {capacity}.")
  rows = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
  return KVMState(keys=rows(state.keys), values=rows(state.values), radius=rows(state.radius),
                  num_rows=state.num_rows)


# ----------------------------------------------------------------------------------------------
# Input validation at the API boundary
# ----------------------------------------------------------------------------------------------


def validate_inputs(q, k, v, merge_gate, params: KVMParams, cfg: KVMConfig, *,
                    single_token: bool = False) -> None:
  """Shape/rank checks (trace time) and a gate-positivity check when the gate is concrete."""
  if not isinstance(cfg, KVMConfig):
    raise ValueError(f"cfg must be a kvm_jax.KVMConfig, got {type(cfg).__name__}.")
  names = ("q", "k", "v", "merge_gate")
  ranks = (4, 4, 4, 3)
  for name, x, rank in zip(names, (q, k, v, merge_gate), ranks):
    if not hasattr(x, "shape") or len(x.shape) != rank:
      layout = "[batch, time, kv_heads]" if rank == 3 else "[batch, time, heads, dim]"
      raise ValueError(f"{name} must have rank {rank} {layout}, got shape "
                       f"{getattr(x, 'shape', None)}.")
  B, T, H, D = q.shape
  Bk, Tk, Hkv, Dk = k.shape
  if (Bk, Tk) != (B, T) or v.shape[:3] != (B, T, Hkv) or merge_gate.shape != (B, T, Hkv):
    raise ValueError(
        f"inconsistent shapes: q {q.shape}, k {k.shape}, v {v.shape}, merge_gate "
        f"{merge_gate.shape}; expected q [B,T,H,D], k [B,T,Hkv,D], v [B,T,Hkv,Dv], merge_gate "
        f"[B,T,Hkv].")
  if Dk != D:
    raise ValueError(f"q head dim {D} != k head dim {Dk}; queries and keys must share D.")
  if T < 1:
    raise ValueError("sequence length must be >= 1.")
  if single_token and T != 1:
    raise ValueError(f"kvm_decode_step takes exactly one token per call (time axis 1), got {T}; "
                     "use kvm_prefill for prompts.")
  if H % Hkv:
    raise ValueError(f"query heads H={H} must be a multiple of kv heads Hkv={Hkv} (GQA groups).")
  cfg.validate_head_dim(D)
  expected = {"ln_scale": (D,), "ln_bias": (D,), "window_temperature": (H,),
              "state_temperature": (H,)}
  for name, shape in expected.items():
    got = getattr(params, name).shape
    if tuple(got) != shape:
      raise ValueError(f"KVMParams.{name} must have shape {shape}, got {tuple(got)}.")
  if is_concrete(merge_gate) and merge_gate.size:
    try:  # reduce on device, move one scalar; inside an outer trace this raises and we skip
      smallest = float(jnp.min(merge_gate))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
      return
    if not smallest > 0:
      raise ValueError(
          f"merge_gate must be > 0 everywhere (it is g = 1 + ELU(x W_g)), found minimum "
          f"{smallest}; pass ones to disable gating or set gate_keys/gate_values=False.")


# ----------------------------------------------------------------------------------------------
# Per-token preparation and the readout of the state
# ----------------------------------------------------------------------------------------------


def prepare_state_keys(k: Array, params: KVMParams, cfg: KVMConfig) -> Array:
  """prep(k) = LN_s(zero the first ``state_zeroed_dims`` channels of k: every rotary one unless
  ``state_rope_dims`` keeps the slowest), float32 (docs/kvm-spec.md §6.2)."""
  channel = jnp.arange(k.shape[-1])
  k = jnp.where(channel < cfg.state_zeroed_dims, 0.0, k.astype(jnp.float32))
  return layer_norm(k, params.ln_scale, params.ln_bias, cfg.ln_eps)


def safe_l2_norm(x: Array) -> Array:
  """‖x‖ over the last axis; exactly 0 with a zero (not NaN) gradient at x = 0."""
  sq = jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1)
  positive = sq > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, sq, 1.0)), 0.0)


def temperatures(params: KVMParams, cfg: KVMConfig, kv_heads: int) -> tuple[Array, Array]:
  """(τ_s, τ_f) as float32 ``[Hkv, G]`` (query head h = kv·G + g), ones when disabled."""
  H = params.state_temperature.shape[0]
  shape = (kv_heads, H // kv_heads)
  if not cfg.head_temperatures:
    ones = jnp.ones(shape, jnp.float32)
    return ones, ones
  return (params.state_temperature.astype(jnp.float32).reshape(shape),
          params.window_temperature.astype(jnp.float32).reshape(shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _round_and_repeat(values: Array, groups: int, dtype: str) -> Array:
  """``[B,Hkv,R,Dv]`` -> ``[B,Hkv,G,R,Dv]`` rounded to ``dtype``, with the authors' backward.

  Their readout is ``repeat_interleave(x.bfloat16())`` concatenated with float32 window values:
  autograd rounds each *query head's* cotangent to bf16, sums the group in bf16 (rounding again),
  and only then returns to float32 (docs/kvm-spec.md §6.8). A plain cast before a float32 repeat
  would round once after the sum and differ by ~1 bf16 ulp under GQA.
  """
  rounded = values.astype(dtype).astype(jnp.float32)
  return jnp.broadcast_to(rounded[:, :, None], (*values.shape[:2], groups, *values.shape[2:]))


def _round_and_repeat_fwd(values, groups, dtype):
  return _round_and_repeat(values, groups, dtype), None


def _round_and_repeat_bwd(groups, dtype, _, cotangent):
  per_head = cotangent.astype(dtype).astype(jnp.float32)
  return (jnp.sum(per_head, axis=2).astype(dtype).astype(jnp.float32),)


_round_and_repeat.defvjp(_round_and_repeat_fwd, _round_and_repeat_bwd)


def state_readout(state: KVMState, params: KVMParams, cfg: KVMConfig,
                  groups: int = 1) -> tuple[Array, Array]:
  """Readout keys LN_s(S_K) ``[B,Hkv,R,D]`` and values normalize(S_V)·radius
  (docs/kvm-spec.md §6.6).

  Values are ``[B,Hkv,R,Dv]``, or ``[B,Hkv,G,R,Dv]`` (one copy per query head of the group) when
  ``cfg.readout_value_dtype`` reproduces the authors' cast, so that its gradient is rounded per
  query head as theirs is.
  """
  keys = layer_norm(state.keys, params.ln_scale, params.ln_bias, cfg.ln_eps)
  values = state.values
  if cfg.value_norm == "radius":
    # F.normalize: x / max(‖x‖, 1e-12).
    values = values / jnp.maximum(safe_l2_norm(values), 1e-12)[..., None] * state.radius[..., None]
  if cfg.readout_value_dtype is not None:
    values = _round_and_repeat(values, groups, cfg.readout_value_dtype)
  return keys, values




# ----------------------------------------------------------------------------------------------
# State construction and update
# ----------------------------------------------------------------------------------------------


def token_rows(k: Array, v: Array, g: Array, params: KVMParams, cfg: KVMConfig):
  """State rows made directly from tokens, as the initial chunk's (docs/kvm-spec.md §6.5, §6.11).

  ``k [B, n, Hkv, D]``, ``v [B, n, Hkv, Dv]``, ``g [B, n, Hkv]`` -> keys ``[B, Hkv, n, D]``
  (prep(k)), values ``[B, Hkv, n, Dv]``, radius ``[B, Hkv, n]`` from the *ungated* value; keys and
  values gated only with ``gate_initial_state`` (in prefill and decode alike).
  """
  keys = jnp.transpose(prepare_state_keys(k, params, cfg), (0, 2, 1, 3))
  values = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))
  radius = safe_l2_norm(values)
  if cfg.gate_initial_state:
    gate = jnp.transpose(g.astype(jnp.float32), (0, 2, 1))[..., None]
    keys, values = keys * gate, values * gate
  return keys, values, radius


def initial_state(k_chunk: Array, v_chunk: Array, g_chunk: Array, num_valid: int, capacity: int,
                  params: KVMParams, cfg: KVMConfig) -> KVMState:
  """The first ``num_valid`` tokens copied into rows ``[0, num_valid)`` of a ``capacity`` buffer.

  Args:
    k_chunk / v_chunk / g_chunk: ``[B, n, Hkv, D]`` / ``[B, n, Hkv, Dv]`` / ``[B, n, Hkv]`` with
      n >= num_valid; tokens past ``num_valid`` are ignored.
  """
  keys, values, radius = token_rows(k_chunk[:, :num_valid], v_chunk[:, :num_valid],
                                    g_chunk[:, :num_valid], params, cfg)
  state = KVMState(keys=keys, values=values, radius=radius,
                   num_rows=jnp.asarray(num_valid, jnp.int32))
  return pad_rows(state, capacity)


def first_argmax(x: Array) -> Array:
  """Index of the maximum along the last axis, lowest index on exact ties (docs/kvm-spec.md,
  decision 1).

  Written as max + min-index because XLA:CPU's variadic argmax reduction is ~3x slower.
  """
  best = jnp.max(x, axis=-1, keepdims=True)
  return jnp.min(jnp.where(x == best, jnp.arange(x.shape[-1]), x.shape[-1]), axis=-1)


def _ranks_ascending(scores: Array) -> Array:
  """Rank of each entry along the last axis, ascending, ties broken by the lower index first."""
  idx = jnp.arange(scores.shape[-1])
  a = scores[..., :, None]  # the ranked entry j
  b = scores[..., None, :]  # every other entry i
  before = (b < a) | ((b == a) & (idx[None, :] < idx[:, None]))
  return jnp.sum(before, axis=-1).astype(jnp.int32)


def add_rows_onehot(rows: Array, index: Array, updates: Array) -> Array:
  """rows[..., index[c], :] += updates[..., c, :] as a one-hot matmul (deterministic, MXU-friendly).

  rows ``[B, Hkv, R, X]``, index ``[B, Hkv, C]`` (R = dropped), updates ``[B, Hkv, C, X]``.
  """
  onehot = (index[..., None] == jnp.arange(rows.shape[2])).astype(jnp.float32)
  return rows + jnp.einsum("bhcr,bhcx->bhrx", onehot, updates, precision=jax.lax.Precision.HIGHEST)


def add_rows_scatter(rows: Array, index: Array, updates: Array) -> Array:
  """Same contract as :func:`add_rows_onehot` with a scatter-add: O(C·X) instead of O(C·R·X)."""
  add = lambda r, i, u: r.at[i].add(u, mode="drop")
  return jax.vmap(jax.vmap(add))(rows, index, updates)


#: How the XLA update accumulates token rows into state rows. "scatter": a scatter-add, O(C·X);
#: CPU scatters are sequential (deterministic) and cheap. "onehot": a one-hot matmul, O(C·R·X),
#: deterministic on GPU/TPU (no atomics) and run on the matrix units.
ROW_UPDATES = ("scatter", "onehot")


def row_update_for(platform: str) -> str:
  """The row accumulation :data:`ROW_UPDATES` picks for ``platform`` (the rule the KVM op's
  backend resolver applies; a pure function: the caller says which platform)."""
  return "scatter" if platform == "cpu" else "onehot"


def row_adder(row_update: str):
  """The function ``(rows, index, updates) -> rows`` of ``row_update`` ("auto": the platform's,
  :func:`row_update_for`); a ValueError naming any other value."""
  if row_update == "auto":
    # Only direct callers below the ops' entry points get here (the shared-routing replay,
    # introspection, tests); the KVM op passes the value its backend resolver decided.
    row_update = row_update_for(current_platform())
  if row_update == "scatter":
    return add_rows_scatter
  if row_update == "onehot":
    return add_rows_onehot
  raise ValueError(f"row_update must be 'auto' or one of {ROW_UPDATES}, got {row_update!r}.")


def per_row(count, ndim: int) -> Array:
  """A row count, one for the batch (a scalar) or one per batch row (``[B]``: packed documents),
  shaped to broadcast against a batch-first array of ``ndim`` dimensions (a scalar stays one)."""
  count = jnp.asarray(count)
  return count if count.ndim == 0 else count.reshape(count.shape + (1,) * (ndim - 1))


def novelty_scores(k_bar: Array, read: Array, num_rows: Array) -> Array:
  """Max over rows ``[0, num_rows)`` of ``k_bar · read`` per token (float32, HIGHEST).

  ``k_bar [B, Hkv, C, D]``, ``read [B, Hkv, R, D]`` -> ``[B, Hkv, C]``; ``num_rows`` a scalar or
  per batch row ``[B]``."""
  sim = jnp.einsum("bhcd,bhrd->bhcr", k_bar, read, precision=jax.lax.Precision.HIGHEST)
  return jnp.max(jnp.where(jnp.arange(read.shape[2]) < per_row(num_rows, 4), sim, -jnp.inf),
                 axis=-1)


def merge_targets(k_gated: Array, read: Array, first_row: int, stop_row: Array | int) -> Array:
  """First argmax over rows ``[first_row, stop_row)`` of ``k_gated · read`` per token (int32).

  ``k_gated [B, Hkv, C, D]``, ``read [B, Hkv, R, D]`` -> ``[B, Hkv, C]``. A static ``stop_row``
  equal to ``R`` (a full state the schedule knows of) scores only rows ``[first_row, R)`` and
  needs no mask."""
  full = isinstance(stop_row, int) and stop_row == read.shape[2]
  if full:
    read = jax.lax.slice_in_dim(read, first_row, stop_row, axis=2)
  logits = jnp.einsum("bhcd,bhrd->bhcr", k_gated, read, precision=jax.lax.Precision.HIGHEST)
  if full:
    return (first_argmax(logits) + first_row).astype(jnp.int32)
  row = jnp.arange(read.shape[2])
  return first_argmax(jnp.where((row >= first_row) & (row < per_row(stop_row, 4)), logits,
                                -jnp.inf))


class RoutingOps(NamedTuple):
  """The update's heavy parts, swappable for tiled kernels (``kvm_jax.kernels.update``): the two
  ``[C, R]`` score reductions and the accumulation of token rows into state rows. Contracts:
  :func:`novelty_scores`, :func:`merge_targets`, and ``add_rows(rows, index, updates)`` of
  :func:`add_rows_onehot`."""

  novelty: Callable = novelty_scores
  targets: Callable = merge_targets
  add_rows: Optional[Callable] = None  # None: by ``row_update``


def update_state(state: KVMState, overflow_k: Array, overflow_v: Array, overflow_g: Array,
                 n_append: Array, params: KVMParams, cfg: KVMConfig,
                 row_update: str = "auto", read_keys: Array | None = None,
                 routing: tuple[Array, Array] | None = None, return_routing: bool = False,
                 may_append: bool = True, routing_ops: RoutingOps = RoutingOps(),
                 head_major: bool = False, rows_after: int | None = None):
  """Folds one overflow chunk into the state (docs/kvm-spec.md §6.7).

  The ``n_append`` tokens least similar to the current state become new rows (in token order); every
  other token is added, gated, to its most similar non-sink row of the post-append state.

  Args:
    state: current state, ``num_rows`` valid rows.
    overflow_k / overflow_v / overflow_g: ``[B, C, Hkv, D]`` / ``[B, C, Hkv, Dv]`` /
      ``[B, C, Hkv]``, the chunk leaving the exact window (head-major with ``head_major``).
    n_append: int32 scalar from the static schedule (may be traced); with packed documents
      ``[B]``, one per batch row, as is then ``state.num_rows``.
    row_update: how rows are accumulated (:data:`ROW_UPDATES`): the KVM op passes the choice of
      its backend resolver; "auto" applies :func:`row_update_for` to this machine's platform.
    read_keys: optional LN_s(state.keys) already computed for the readout; saves recomputing it
      for novelty, and for routing when nothing is appended.
    routing: optional decisions ``(dest, target)`` to apply instead of computing them (shared
      routing across layers, ``ModelConfig.kvm_kv_sharing="shared_routing"``): ``dest`` is the new
      row of each appended token (``capacity`` = not appended), ``target`` the row each other
      token merges into (``capacity`` = none), both ``[B, Hkv, C]`` int32.
    return_routing: also return the ``(dest, target)`` that were applied.
    may_append: False when the static schedule says ``n_append`` is 0 here: the novelty ranking
      is skipped at trace time. When True, the append is computed and *selected* by
      ``n_append > 0`` (no ``lax.cond``: on GPU a conditional reads its predicate back to the host,
      and with ``n_append = 0`` the append is an exact no-op, so selecting loses nothing).
    routing_ops: the score reductions and row accumulation (:class:`RoutingOps`; XLA by default).
    head_major: the overflow arrays are ``[B, Hkv, C, ·]`` (the scan's layout) instead.
    rows_after: ``num_rows + n_append`` when the static schedule knows it (the scan passes the
      capacity for a fixed budget's full state), so the merge scores need no row mask; None:
      taken from the traced row count.
  Returns:
    The updated state with ``num_rows + n_append`` rows (and the routing if asked). Routing
    decisions carry no gradient; the merged sums, appended rows and radii are differentiable.
  """
  add_rows = routing_ops.add_rows or row_adder(row_update)
  R = state.capacity
  rows = overflow_rows(overflow_k, overflow_v, overflow_g, params, cfg, head_major)
  m = state.num_rows
  m_new = m + n_append
  if routing is not None:
    dest, target = routing
    keys, values, radius = _add_appended(state.keys, state.values, state.radius, dest, rows,
                                         add_rows)
  else:
    if read_keys is None:
      read_keys = layer_norm(state.keys, params.ln_scale, params.ln_bias, cfg.ln_eps)
    old_read = jax.lax.stop_gradient(read_keys)  # routing is a constant: no gradient through it

    if may_append:
      # Novelty: max similarity of the ungated prepared key to the valid pre-append rows (sinks
      # too); the n_append least similar tokens take rows m, m+1, ... in token order.
      novelty = routing_ops.novelty(jax.lax.stop_gradient(rows.k_bar), old_read, m)  # [B,Hkv,C]
      is_append = _ranks_ascending(novelty) < per_row(n_append, 3)
      dest = jnp.where(is_append, per_row(m, 3) + jnp.cumsum(is_append, axis=-1) - 1,
                       R).astype(jnp.int32)
      keys, values, radius = _add_appended(state.keys, state.values, state.radius, dest, rows,
                                           add_rows)
      # With nothing appended the rows are unchanged and routing reads the readout's LN_s keys
      # (the same values the authors route against), not a second LayerNorm of equal keys.
      new_read = jnp.where(per_row(n_append, 4) > 0, _routing_keys(keys, params, cfg),
                           old_read)
    else:
      keys, values, radius, new_read = state.keys, state.values, state.radius, old_read
      dest = jnp.full(rows.k_bar.shape[:3], R, jnp.int32)
    # Merge: gated key vs the post-append rows, sinks excluded, first index wins ties.
    target = routing_ops.targets(jax.lax.stop_gradient(rows.k_gated), new_read, cfg.sink_rows,
                                 m_new if rows_after is None else rows_after)         # [B,Hkv,C]
    target = jnp.where(dest < R, R, target).astype(jnp.int32)  # appended tokens merge nowhere
  keys = add_rows(keys, target, rows.k_gated)
  values = add_rows(values, target, rows.v_gated)
  new = KVMState(keys=keys, values=values, radius=radius, num_rows=m_new.astype(jnp.int32))
  return RoutedUpdate(new, (dest, target)) if return_routing else new


def _routing_keys(keys: Array, params: KVMParams, cfg: KVMConfig) -> Array:
  """LN_s of state keys ``[B, Hkv, R, D]`` as routing scores them: a constant, with no gradient
  to the keys or to LN_s's parameters. A parameter's tangent reaching the score kernels would
  make reverse mode linearize a Pallas call, whose JVP is one call computing primal and tangent
  together, so its primal is unknown and linearization fails wherever autodiff runs through the
  update (packed documents' state steps, a scan without remat)."""
  return jax.lax.stop_gradient(layer_norm(keys, params.ln_scale, params.ln_bias, cfg.ln_eps))


class OverflowRows(NamedTuple):
  """One overflow chunk as state rows, head-major ``[B, Hkv, C, ·]`` float32 (docs/kvm-spec.md
  §6.7): prepared keys (routing), gated keys/values (merges), and what appended rows store."""

  k_bar: Array
  k_gated: Array
  v_gated: Array
  k_app: Array
  v_app: Array


def overflow_rows(overflow_k: Array, overflow_v: Array, overflow_g: Array, params: KVMParams,
                  cfg: KVMConfig, head_major: bool = False) -> OverflowRows:
  """``[B, C, Hkv, ·]`` overflow keys/values/gates (``[B, Hkv, C, ·]`` when ``head_major``) ->
  :class:`OverflowRows`."""
  if not head_major:
    overflow_k, overflow_v = (jnp.transpose(x, (0, 2, 1, 3)) for x in (overflow_k, overflow_v))
    overflow_g = jnp.transpose(overflow_g, (0, 2, 1))
  k_bar = prepare_state_keys(overflow_k, params, cfg)                               # [B,Hkv,C,D]
  v_raw = overflow_v.astype(jnp.float32)                                            # [B,Hkv,C,Dv]
  gate = overflow_g.astype(jnp.float32)[..., None]                                  # [B,Hkv,C,1]
  k_gated = k_bar * gate if cfg.gate_keys else k_bar
  v_gated = v_raw * gate if cfg.gate_values else v_raw
  k_app, v_app = (k_gated, v_gated) if cfg.gate_appends else (k_bar, v_raw)
  return OverflowRows(k_bar, k_gated, v_gated, k_app, v_app)


def _add_appended(keys, values, radius, dest, rows: OverflowRows, add_rows):
  """Appended tokens become rows ``dest`` (``capacity`` = not appended); radius = ‖value‖."""
  keys = add_rows(keys, dest, rows.k_app)
  values = add_rows(values, dest, rows.v_app)
  radius = add_rows(radius[..., None], dest, safe_l2_norm(rows.v_app)[..., None])[..., 0]
  return keys, values, radius
