"""The KVM readout computed by a maintained attention library (tokamax): a yardstick to beat.

:func:`joint_attention_tokamax` has exactly the contract of
:func:`kvm_jax.ops.common.joint_attention` — one softmax over ``[state rows ; exact window]`` with
separate key temperatures for the two parts — but hands the work to
``tokamax.dot_product_attention`` over the concatenated keys and values with one boolean mask.
It exists so that the project's own readout (:mod:`kvm_jax.kernels.readout`) can be timed against
a flash-attention kernel somebody else keeps fast (``kvm-bench --readout-tokamax``), and used
instead of it by a backend decided with ``readout="tokamax"`` (or by ``"auto"`` on the backends where
that benchmark measured it faster: ``kvm_jax.ops.kvm.api.TOKAMAX_READOUT_BACKENDS``).

How the two temperatures fit into one plain attention: the score of query head ``h = kv·G + g``
against a key is ``(temp / sqrt(D)) · q·k``, with ``temp`` the state temperature for state rows
and the window temperature for window positions. A plain attention applies one scale to every
score, so the temperature goes into the keys (``k · temp``) and the scale ``1/sqrt(D)`` is passed
to tokamax explicitly. (Folding it into the queries cannot work with one call: a query would need
one factor for the state rows and another for the window; nor can an additive bias express a
multiplicative temperature.)

* ``G == 1`` (as many KV heads as query heads): each key belongs to one query head, so the fold
  is exact and the attention keeps its ``Hkv`` heads.
* ``G > 1`` (grouped queries): the query heads of a group share keys but not temperatures, so the
  keys and values are repeated to one copy per query head (``H = Hkv·G`` heads, plain multi-head
  attention) and each copy carries its head's temperatures. The result is exact, but this readout
  then moves G times the key/value bytes a grouped kernel would: as a yardstick it is only
  representative for ``G == 1`` (the shape ``kvm-bench`` times).

Precision: float32 queries get float32 matmuls (``Precision.HIGHEST``), as the XLA readout. The
keys are multiplied by their temperature in float32 and then cast to the query dtype, so with
bfloat16 inputs the folded keys are rounded once more than in the XLA readout; tokamax's output
(in the query dtype) is returned as float32. A query whose every key is masked gets the mean of
all values in both implementations (both mask with a large finite negative number).

tokamax is optional: ``pip install 'kvm_jax[tokamax]'``. :func:`tokamax_available` says whether it
imports.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.ops.common import import_tokamax, precision_for

Array = jax.Array

INSTALL_HINT = "pip install 'kvm_jax[tokamax]'"


@functools.lru_cache(maxsize=1)
def tokamax_available() -> bool:
  """True when the optional ``tokamax`` package imports."""
  try:
    import tokamax  # noqa: F401  (optional dependency)
  except ImportError:
    return False
  return True


def _tokamax():
  return import_tokamax("joint_attention_tokamax")


def default_implementation(kc=None) -> Optional[str]:
  """The tokamax implementation used when none is named: its XLA path where the project's kernels
  are interpreted (``kc.interpret``, i.e. CPU), else None (tokamax picks the best kernel it has
  for the device — Mosaic GPU/TPU, Triton — falling back to its XLA path)."""
  if kc is not None and getattr(kc, "interpret", False):
    return "xla"
  return None


def _batch_mask(valid: Array, B: int, Tq: int, n: int) -> Array:
  """A visibility mask ``[Tq, n]`` (or broadcastable), or one per batch row ``[B, 1, 1, Tq|1, n]``,
  as tokamax's ``[B | 1, 1, Tq, n]``."""
  valid = jnp.asarray(valid)
  if valid.ndim <= 2:
    return jnp.broadcast_to(valid, (Tq, n))[None, None]
  return jnp.broadcast_to(valid, (B, 1, 1, Tq, n))[:, 0]


def joint_attention_tokamax(q: Array, state_keys: Array, state_values: Array, state_valid: Array,
                            window_keys: Array, window_values: Array, window_valid: Array,
                            state_temp: Array, window_temp: Array, *, kc=None,
                            implementation: Union[None, str, Sequence[str]] = None) -> Array:
  """Drop-in for :func:`kvm_jax.ops.common.joint_attention` run by ``tokamax``.

  Args:
    q: ``[B, Tq, Hkv, G, D]`` queries (query head h = kv·G + g).
    state_keys / state_values: ``[B, Hkv, R, D]`` / ``[B, Hkv, R, Dv]`` readout state (float32);
      values may also be per query head, ``[B, Hkv, G, R, Dv]``.
    state_valid: bool ``[Tq, R]`` (or broadcastable, e.g. ``[1, R]``), or per batch row
      ``[B, 1, 1, Tq | 1, R]`` (rows at positions of their own).
    window_keys / window_values: ``[B, W, Hkv, D]`` / ``[B, W, Hkv, Dv]``.
    window_valid: bool ``[Tq, W]`` (or broadcastable).
    state_temp / window_temp: float32 ``[Hkv, G]`` key temperatures.
    kc: optional :class:`kvm_jax.kernels.backend.KernelConfig` (the ``ChunkOps`` convention);
      only used to choose the default ``implementation`` (:func:`default_implementation`).
    implementation: tokamax's ``implementation=`` ("xla", "xla_chunked", "triton", "mosaic",
      "cudnn", or a sequence tried in order); None: :func:`default_implementation`.
  Returns:
    ``[B, Tq, Hkv, G, Dv]`` float32.
  Raises:
    ImportError: tokamax is not installed (the message names ``pip install 'kvm_jax[tokamax]'``).
  """
  tokamax = _tokamax()
  B, Tq, Hkv, G, D = q.shape
  R, W = state_keys.shape[2], window_keys.shape[1]
  Dv = window_values.shape[-1]
  key_dtype, value_dtype = q.dtype, window_values.dtype
  if implementation is None:
    implementation = default_implementation(kc)

  # Keys and values on tokamax's layout [B, S, heads, ·], state rows first, S = R + W.
  sk = jnp.transpose(state_keys.astype(jnp.float32), (0, 2, 1, 3))          # [B, R, Hkv, D]
  wk = window_keys.astype(jnp.float32)                                       # [B, W, Hkv, D]
  if state_values.ndim == 5:                                                 # [B, Hkv, G, R, Dv]
    sv = jnp.transpose(state_values, (0, 3, 1, 2, 4))                        # [B, R, Hkv, G, Dv]
  else:
    sv = jnp.transpose(state_values, (0, 2, 1, 3))[:, :, :, None]            # [B, R, Hkv, 1, Dv]
  wv = window_values[:, :, :, None]                                          # [B, W, Hkv, 1, Dv]
  if G == 1 and state_values.ndim == 4:
    # One query head per KV head: the temperatures fold into the keys, Hkv heads.
    keys = jnp.concatenate([sk * state_temp[:, 0, None], wk * window_temp[:, 0, None]], axis=1)
    values = jnp.concatenate([sv[:, :, :, 0], wv[:, :, :, 0]], axis=1)
    queries = q.reshape(B, Tq, Hkv, D)
  else:
    # Grouped queries: one key/value copy per query head, each with its head's temperatures.
    keys = jnp.concatenate([sk[:, :, :, None] * state_temp[..., None],
                            wk[:, :, :, None] * window_temp[..., None]], axis=1)
    sv = jnp.broadcast_to(sv, (B, R, Hkv, G, Dv))
    values = jnp.concatenate([sv, jnp.broadcast_to(wv, (B, W, Hkv, G, Dv))], axis=1)
    keys = keys.reshape(B, R + W, Hkv * G, D)
    values = values.reshape(B, R + W, Hkv * G, Dv)
    queries = q.reshape(B, Tq, Hkv * G, D)
  mask = jnp.concatenate([_batch_mask(state_valid, B, Tq, R),
                          _batch_mask(window_valid, B, Tq, W)], axis=-1).astype(bool)
  y = tokamax.dot_product_attention(
      queries, keys.astype(key_dtype), values.astype(value_dtype),
      mask=mask, scale=float(1.0 / np.sqrt(D)),
      precision=precision_for(key_dtype), implementation=implementation)
  return y.reshape(B, Tq, Hkv, G, -1).astype(jnp.float32)
