"""The decode-cache protocol every mixer kind follows, and the row operations built on it.

A model's decode cache is a list of :class:`kvm_jax.nn.mixers.attention.LayerCache`, one per layer: the
mixer's own cache plus the token-shift history. Every row of the batch is an independent
sequence at a length of its own, so that one cache can hold many requests (the engine's slots,
:mod:`kvm_jax.generation.engine`). What a mixer kind's cache must be for that (:class:`MixerCache`):

* ``length``: ``[B]`` int32, the tokens each row has seen (the position of its next token);
  ``max_len``: the longest sequence it was sized for (static);
* every array in it is *batch-first*: its leading axis is the row. Rows never mix, so resetting,
  copying or selecting rows is the same leaf-wise operation for every kind
  (:func:`select_rows`, :func:`reset_rows`, :func:`copy_row`);
* its decode step advances each row at its own position (``length[b]``).

A kind may also continue its cache by a whole piece of tokens in parallel (``LM.resume``, what the
engine's prefill uses): its classmethod ``resume_alignment(cfg, layer)`` returns the multiple of
positions such a piece must start at and span (its chunk; 1 when any will do), or None when it
cannot. Such a kind also honours a piece's ``counts`` (:class:`Resume`): a row may end its piece
early (a prompt's last, partial chunk), the rest of the piece being padding that leaves no trace
in its cache.

``register_mixer`` checks the first two on a cache built abstractly from the kind's default
options (:func:`check_cache_protocol`); the third is what the engine's tests check per kind. A
reconstruction layer of cross-layer KV sharing may have no cache (``None``): it reads its
sources'.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class Resume:
  """The ``decode`` mode of a layer call that continues every row's cache by a piece of tokens in
  parallel (``LM.resume``). It is truthy, like a decode step, wherever a call reads the previous
  token's history (token shifts, value anchors); a kind that supports it says so with
  ``resume_alignment`` and acts on it (:func:`is_resume`) before its one-token branch.

  Attributes:
    counts: ``[B]`` int32 in ``[1, T]``, the real tokens at the front of each row's piece of
      ``T``; the tokens after them are padding, so that one compiled program serves pieces of
      every length up to ``T``. The row's cache must end as after its ``counts[b]`` tokens alone
      (padding written nowhere, no fold or update it would trigger, the token-shift history that
      of the last real token), and the padding's outputs must stay finite (later layers read
      them, masked). None: every token is real.
  """

  counts: Optional[Array] = None


# A piece whose every token is real.
RESUME = Resume()


def is_resume(decode) -> bool:
  """Whether a layer call's ``decode`` mode is a parallel piece (:class:`Resume`)."""
  return isinstance(decode, Resume)


def piece_counts(decode) -> Optional[Array]:
  """The real tokens per row of a piece (``[B]``), or None: every token (or not a piece)."""
  return decode.counts if isinstance(decode, Resume) else None


def last_tokens(x: Array, counts: Optional[Array]) -> Array:
  """``[B, 1, ...]``: each row's last real token of ``x [B, T, ...]`` (position ``counts[b] -
  1``; the last position when ``counts`` is None), the token-shift history a piece leaves."""
  if counts is None:
    return x[:, -1:]
  index = (counts.astype(jnp.int32) - 1).reshape((-1,) + (1,) * (x.ndim - 1))
  return jnp.take_along_axis(x, index, axis=1)


def real_tokens(counts: Optional[Array], batch: int, width: int) -> Array:
  """``[batch, width]`` bool: which tokens of a piece are real (all, when ``counts`` is None)."""
  if counts is None:
    return jnp.ones((batch, width), bool)
  return jnp.arange(width)[None, :] < counts[:, None]


@runtime_checkable
class MixerCache(Protocol):
  """What a mixer kind's decode cache holds (see the module docstring): a pytree whose array
  leaves are all batch-first, with per-row ``length [B]`` and a static ``max_len``."""

  length: Array
  max_len: int


def _row_mask(rows: Array, leaf: Array) -> Array:
  """``rows [B]`` (bool) shaped to broadcast against the batch-first ``leaf``."""
  return rows.reshape(rows.shape + (1,) * (leaf.ndim - 1))


def select_rows(rows: Array, new, old):
  """The cache (any batch-first pytree) holding ``new``'s rows where ``rows [B]`` is true and
  ``old``'s elsewhere."""
  return jax.tree_util.tree_map(lambda a, b: jnp.where(_row_mask(rows, a), a, b), new, old)


def reset_rows(caches, rows: Array, fresh):
  """``caches`` with the rows where ``rows [B]`` is true replaced by ``fresh``, an empty cache of
  one row (``model.init_cache(1, max_len)``): those rows start new sequences."""
  return jax.tree_util.tree_map(lambda a, f: jnp.where(_row_mask(rows, a), f, a), caches, fresh)


def copy_row(caches, source: Array, rows: Array):
  """``caches`` with row ``source`` (an int, may be traced) copied into every row where
  ``rows [B]`` is true: n continuations of one prefilled prompt."""
  def copy(leaf):
    one = jax.lax.dynamic_index_in_dim(leaf, source, axis=0, keepdims=True)
    return jnp.where(_row_mask(rows, leaf), one, leaf)
  return jax.tree_util.tree_map(copy, caches)


def cache_lengths(caches, batch: int) -> Array:
  """``[batch]`` int32: the tokens each row of a model's caches has seen (the first layer cache
  that holds a length says it; all layers agree)."""
  for layer in caches:
    mixer = getattr(layer, "mixer", layer)
    length = getattr(mixer, "length", None)
    if length is not None:
      return jnp.broadcast_to(jnp.asarray(length, jnp.int32), (batch,))
  raise ValueError("no layer cache holds a length: a model needs at least one layer that stores "
                   "its own cache to decode.")


def check_cache_protocol(kind: str, make_cache) -> None:
  """A TypeError unless the caches ``make_cache(batch)`` builds (abstractly, for two batch
  sizes) follow :class:`MixerCache`: a per-row ``length``, a ``max_len``, and batch-first
  arrays. ``None`` (a layer that stores nothing) passes."""
  for batch in (2, 3):
    cache: Optional[object] = jax.eval_shape(lambda: make_cache(batch))
    if cache is None:
      return
    if not isinstance(cache, MixerCache):
      raise TypeError(f"the decode cache of mixer kind {kind!r} ({type(cache).__name__}) has no "
                      "`length` and `max_len`; see kvm_jax.nn.cache.MixerCache.")
    if tuple(cache.length.shape) != (batch,):
      raise TypeError(f"the decode cache of mixer kind {kind!r} holds length of shape "
                      f"{tuple(cache.length.shape)} for batch {batch}; it must be one per row, "
                      f"({batch},).")
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
      if not leaf.shape or leaf.shape[0] != batch:
        raise TypeError(f"the decode cache of mixer kind {kind!r}: "
                        f"{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}, not "
                        f"batch-first for batch {batch}; every array of a cache must lead with "
                        "the row axis (kvm_jax.nn.cache).")
