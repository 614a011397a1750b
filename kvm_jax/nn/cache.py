"""The decode-cache protocol every mixer kind follows, and the row operations built on it.

A model's decode cache is a list of :class:`kvm_jax.nn.mixers.attention.LayerCache`, one per layer: the
mixer's own cache plus the token-shift history. Every row of the batch is an independent
sequence at a length of its own, so that one cache can hold many requests (the engine's slots,
:mod:`kvm_jax.generation.engine`). What a mixer kind's cache must be for that (:class:`MixerCache`):

* ``length``: ``[B]`` int32, the tokens each row has seen (the position of its next token);
  ``max_len``: the longest sequence it was sized for (static);
* every array in it is *batch-first*: its leading axis is the row. Rows never mix, so resetting,
  copying or selecting rows is the same leaf-wise operation for every kind
  (:func:`select_rows`, :func:`reset_rows`, :func:`copy_row`; :func:`put_rows` in place);
* its decode step advances each row at its own position (``length[b]``), and only the rows a
  :class:`Step` names active: the others come out exactly as they went in, so that a caller
  keeping some rows through a step needs no second copy of the caches to put them back (the
  engine's rounds, :meth:`kvm_jax.nn.model.LM.extend`).

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


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
  """The ``decode`` mode of a one-token layer call (truthy, as ``decode=True`` is) in which only
  some rows advance.

  Attributes:
    active: ``[B]`` bool, the rows this token is fed to; every other row's cache must come out
      of the step exactly as it went in. A kind does that where it writes: a ring's one-slot
      write puts back what the slot held (so the ring is still updated in place, never
      copied); arrays a step recomputes whole (lengths, a recurrent state) keep their old rows
      with :func:`keep_inactive`. The outputs of an inactive row mean nothing. None: every row.
  """

  active: Optional[Array] = None


def step_active(decode) -> Optional[Array]:
  """The rows a one-token step feeds (``[B]`` bool), or None: every row (or not a
  :class:`Step`)."""
  return decode.active if isinstance(decode, Step) else None


def keep_inactive(active: Optional[Array], new, old):
  """``new`` (any batch-first pytree) on the rows ``active [B]`` names and ``old`` on the
  others; ``new`` when ``active`` is None. Meant for arrays a step recomputes whole anyway (a
  length, a recurrent state): one fused select per array (a ring written one slot at a time
  puts the slot's old contents back instead: a select over the whole ring would copy it)."""
  return new if active is None else select_rows(active, new, old)


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


def put_rows(caches, rows: Array, source, source_rows: Array):
  """``caches`` (batch-first pytree, ``B`` rows) with row ``source_rows[b]`` of ``source`` (a
  pytree of the same structure, any number of rows; it may be ``caches`` itself) written into
  every row ``b`` where ``rows [B]`` holds: an empty row (``source`` a one-row fresh cache,
  ``source_rows`` zeros), or n continuations of one prompt.

  One row at a time, in a loop over just those rows, each a dynamic-update-slice of one row,
  so that the caches are updated in place: a select or gather over all rows would build a
  second copy of them. Rows written are read from ``source`` as it stands when written; a row
  copied from ``caches`` must not itself be written here."""
  B = rows.shape[0]
  (targets,) = jnp.nonzero(rows, size=B, fill_value=0)
  sources = jnp.take(source_rows, targets)

  def put(i, tree):
    def one(leaf, src):
      row = jax.lax.dynamic_index_in_dim(src, sources[i], axis=0, keepdims=True)
      return jax.lax.dynamic_update_slice_in_dim(leaf, row.astype(leaf.dtype), targets[i], axis=0)
    return jax.tree_util.tree_map(one, tree, source if source is not caches else tree)

  return jax.lax.fori_loop(0, jnp.sum(rows.astype(jnp.int32)), put, caches)


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
