"""The GPTAlpha-2 family's checkpoint mapping: kvm_jax's parameter paths and the authors'
``RWKV7BackboneForCausalLM`` state dict (docs/checkpoints.md has the table; reading and writing
files is :mod:`kvm_jax.hf.params`).

Their ``nn.Linear`` stores ``weight [out, in]``, kvm_jax's ``nnx.Linear`` ``kernel [in, out]``:
every projection is transposed. Their LayerNorms (and RWKV-7's GroupNorm) hold ``weight``/``bias``,
kvm_jax's ``scale``/``bias``. ``v_gate0``, the MLP's ``x_k`` and RWKV-7's per-channel vectors carry
two leading singleton axes in their code.
Their value-residual layers without token shift (every kind but RWKV-7) also hold an ``attn.x_v`` of
zeros that nothing reads; it is written on export and required (its values ignored) on import.

Each kind their code has says what its layers are in their format with an ``AUTHORS`` row
(:class:`AuthorsMixer`) in its own module: names, flags for what their layer reads of the
model-wide fields, and hooks reading and writing its options (with :func:`read_int` and the other
field readers, :class:`AuthorsReading` and :class:`AuthorsWriting`) and naming its own parameters.
:mod:`kvm_jax.hf.authors_config` translates ``config.json`` with them, never by a kind's name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import numpy as np

from kvm_jax.config.model import ModelConfig

# kvm_jax leaf names -> theirs, per module kind.
_PROJECTIONS = {"c_q", "c_k", "c_v", "c_proj", "v_gate1", "v_gate2", "key_weighting", "c_fc",
                "lm_head"}
LN_LEAVES = {"scale": "weight", "bias": "bias"}
_LAYER_NORMS = {"ln_attn": "ln_attn", "ln_mlp": "ln_mlp", "ln_q": "ln_q", "ln_k": "ln_k",
                "ln_s": "ln_s_k", "ln_emb": "ln_emb", "ln_head": "ln_head"}
_VECTORS = {"x_q": "x_q", "x_k": "x_k", "x_v": "x_v", "window_temperature": "front_head_temp",
            "state_temperature": "state_head_temp", "v_gate0": "v_gate0", "beta": "beta"}


class ConfigError(ValueError):
  """A configuration that cannot be translated; the message names the field and the value."""


class ExportError(ValueError):
  """A kvm_jax model the authors' code cannot express; the message says which setting and why."""


def read_flag(cfg: Mapping, name: str) -> bool:
  """Their 0/1 field ``name`` of ``cfg`` (their config, defaults filled in)."""
  value = cfg[name]
  if value in (0, 1, True, False):
    return bool(value)
  raise ConfigError(f"{name}={value!r} must be 0 or 1.")


def read_int(cfg: Mapping, name: str, minimum: Optional[int] = None) -> int:
  """Their integer field ``name`` (a whole float reads too), at least ``minimum``."""
  value = cfg[name]
  if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
      or int(value) != value):
    raise ConfigError(f"{name}={value!r} must be an integer.")
  if minimum is not None and value < minimum:
    raise ConfigError(f"{name}={value!r} must be >= {minimum}.")
  return int(value)


def read_opt_int(cfg: Mapping, name: str, minimum: int = 1) -> Optional[int]:
  """An integer field whose ``None`` (and, like their ``x or default``, 0) means "derive it"."""
  return None if cfg[name] in (None, 0) else read_int(cfg, name, minimum)


def read_float(cfg: Mapping, name: str, *, allow_none: bool = False) -> Optional[float]:
  """Their finite number ``name`` (None too, with ``allow_none``)."""
  value = cfg[name]
  if value is None and allow_none:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise ConfigError(f"{name}={value!r} must be a finite number.")
  return float(value)


def shared_window(cfg: Mapping) -> tuple[int, int, int]:
  """(chunk_len, n_bswa_chunks, sink_len): the window geometry their KVM and block-SWA layers
  share (one set of fields for both)."""
  return (read_int(cfg, "chunk_len", 1), read_int(cfg, "n_bswa_chunks", 1),
          read_int(cfg, "sink_len", 0))


@dataclasses.dataclass(frozen=True)
class AuthorsReading:
  """What a kind's ``read_options`` gets: their config's fields (defaults filled in) and what the
  model-wide fields already resolved.

  Attributes:
    fields: every field of their config.
    rope_dims: the rotary width their roles give this kind's layers (``rope_partial_dim`` or
      ``alt_rope_partial_dim``; 0 for a kind that does not rotate), None when the model has no
      layer of this kind.
    qk_head_dim: the q/k head width of every layer.
  """

  fields: Mapping[str, Any]
  rope_dims: Optional[int]
  qk_head_dim: int


class AuthorsWriting:
  """The fields an export writes for the mixer kinds, gathered kind by kind: each kind's
  ``write_options(writing, kind)`` calls :meth:`put`. Their config holds one value per field, so
  two kinds the model uses that write one field (their KVM and block-SWA layers share chunk_len,
  n_bswa_chunks and sink_len) must write the same value; a kind the model does not use writes a
  field only where no kind it uses does.

  Attributes:
    model: the model being exported.
    rope_partial_dim: the main mixer's rotary width, as written (``rope_partial_dim``).
    fields: what the kinds wrote so far.
  """

  def __init__(self, model: ModelConfig, rope_partial_dim: int, rows: Mapping[str, Any]):
    self.model, self.rope_partial_dim, self.fields = model, rope_partial_dim, {}
    self._rows, self._writers = rows, {}

  def put(self, kind: str, **fields) -> None:
    """Writes ``fields`` for ``kind``'s layers, or :class:`ExportError` naming the fields when a
    kind the model also uses wrote other values for them."""
    used = set(self.model.layer_mixers)
    if kind not in used:
      fields = {name: v for name, v in fields.items() if self._writers.get(name) not in used}
    for other in dict.fromkeys(self._writers.get(name) for name in fields):
      shared = [name for name in fields if self._writers.get(name) == other]
      if other in used and other != kind and any(self.fields[name] != fields[name]
                                                 for name in shared):
        raise ExportError(
            f"their {self._title(kind)} and {self._title(other)} layers share "
            f"{_in_words(shared)}, but {kind} has ({', '.join(str(fields[n]) for n in shared)}) "
            f"and {other} ({', '.join(str(self.fields[n]) for n in shared)}).")
    self.fields.update(fields)
    self._writers.update(dict.fromkeys(fields, kind))

  def _title(self, kind: str) -> str:
    row = self._rows.get(kind)
    return (row.title if row is not None else None) or kind


def _in_words(names: list[str]) -> str:
  """``a``, ``a and b``, ``a, b and c``."""
  return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


@dataclasses.dataclass(frozen=True)
class AuthorsMixer:
  """How the authors' code names one kvm_jax mixer kind, and what its layers read and write in
  their config.

  Attributes:
    token_mixers: their ``token_mixer`` / ``alt_token_mixer`` names for it; the first is what an
      export writes ("kvm_triton" selects their Triton KVM class through their
      "model.<name>_mixer" rule).
    class_paths: their ``*_class_path`` values for it (the Triton kernels and the fp32-routing
      variant hold the eager layer's parameters and compute the same function, their own numerics
      aside).
    mode_prefix: which ``<prefix>_value_residual_mode`` / ``_token_shift_mode`` fields it reads;
      None for a mixer without their shared attention front end (RWKV-7's time mix: its token
      shift follows ``use_tokenshift_att`` alone, and its layers hold no unused ``attn.x_v``).
    rotates: whether their layer applies RoPE (their OVQ layer never does, whatever
      ``rope_partial_dim`` says; RWKV-7 has none).
    title: its name in messages ("block-SWA"); empty: the kind's name.
    own_rope: its layers keep the rotary width of their role in the kind's options (SWA's
      ``rope_dims``) rather than sharing the model's one width with the other rotating layers.
    own_head_width: their layer sizes its heads itself (RWKV-7's time mix): ``d_head`` (or
      hidden / heads) wide, one K/V head per head, whatever ``d_qk_head``, ``d_v_head`` and
      ``num_key_value_heads`` say.
    always_value_residual: their layer mixes the first layer's value in whatever
      ``use_value_residual`` says (RWKV-7's time mix).
    grouped_kv: their layer takes fewer K/V heads than query heads (KVM); the others call
      ``scaled_dot_product_attention`` without ``enable_gqa``.
    reshapes_output: their layer reshapes its output to the input's shape, so heads x value head
      width must be the model width (SWA).
    carried: their config holds its fields whatever layers the model has, and kvm_jax keeps them
      in the kind's options: ``read_options`` and ``write_options`` run for a model without such
      layers too (SWA's window, block SWA's chunk geometry).
    read_options: ``(AuthorsReading) -> options`` of its layers, or :class:`ConfigError` naming
      the field; None: the kind has no options entry. A kind the model does not use (and that is
      not ``carried``) gets its options' defaults instead.
    write_options: ``(AuthorsWriting, kind) -> None``, putting its fields for the model's
      options, or :class:`ExportError`; None: it writes none.
    layout: ``(prefix, owners, leaf, shape) -> Layout | None`` for parameters its layers name
      their own way (RWKV-7's time mix); None, or a None answer: the shared rules of
      :func:`layout_of`.

  A kind their code has declares its row as the class attribute ``AUTHORS``. Readers run in
  kind-name order, after the model-wide fields; writers likewise.
  """

  token_mixers: tuple[str, ...]
  class_paths: tuple[str, ...]
  mode_prefix: Optional[str]
  rotates: bool = True
  title: str = ""
  own_rope: bool = False
  own_head_width: bool = False
  always_value_residual: bool = False
  grouped_kv: bool = False
  reshapes_output: bool = False
  carried: bool = False
  read_options: Optional[Callable] = None
  write_options: Optional[Callable] = None
  layout: Optional[Callable] = None


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one kvm_jax parameter is stored in their state dict: ``name``, ``shape`` there, and the
  two maps between the layouts."""

  name: str
  shape: tuple[int, ...]
  to_authors: Callable
  from_authors: Callable


def _same(x):
  return x


def _transpose(x):
  return np.swapaxes(x, -1, -2)


def _leading_ones(x):
  return x.reshape((1, 1) + x.shape)


def _drop_leading_ones(x):
  return x.reshape(x.shape[2:])


def copied(name: str, shape) -> Layout:
  """A tensor stored as kvm_jax holds it."""
  return Layout(name, tuple(shape), _same, _same)


def transposed(name: str, shape) -> Layout:
  """A projection kernel ``[in, out]`` stored as their ``nn.Linear`` weight ``[out, in]``."""
  return Layout(name, tuple(shape)[::-1], _transpose, _transpose)


def with_leading_ones(name: str, shape) -> Layout:
  """A vector stored with two leading singleton axes."""
  return Layout(name, (1, 1) + tuple(shape), _leading_ones, _drop_leading_ones)


def layout_of(names: list[str], shape: tuple[int, ...],
              row: Optional[AuthorsMixer] = None) -> Optional[Layout]:
  """The :class:`Layout` of the kvm_jax parameter at path ``names`` (``["blocks", "3", "attn",
  "c_q", "kernel"]``) with shape ``shape``, or None when their model has no such tensor;
  ``row`` is the ``AUTHORS`` row of the mixer kind of the block it belongs to (its ``layout``
  names the parameters its layers name their own way: RWKV-7's)."""
  if names[0] == "blocks" and len(names) >= 4:
    prefix, path = f"transformer.h.{names[1]}.", names[2:]
  else:
    prefix, path = ("" if names[0] == "lm_head" else "transformer."), names
  *owners, leaf = path
  if row is not None and row.layout is not None:
    layout = row.layout(prefix, owners, leaf, shape)
    if layout is not None:
      return layout
  if owners and owners[-1] in _LAYER_NORMS and leaf in LN_LEAVES:
    name = ".".join(owners[:-1] + [_LAYER_NORMS[owners[-1]], LN_LEAVES[leaf]])
    return Layout(prefix + name, shape, _same, _same)
  if owners and owners[-1] in _PROJECTIONS and leaf == "kernel":
    return Layout(prefix + ".".join(owners + ["weight"]), shape[::-1], _transpose, _transpose)
  if path == ["wte", "embedding"]:
    return Layout("transformer.wte.weight", shape, _same, _same)
  if owners in (["attn"], ["mlp"]) and leaf in _VECTORS:
    name = prefix + f"{owners[0]}.{_VECTORS[leaf]}"
    if (owners[0], leaf) in (("attn", "v_gate0"), ("mlp", "x_k")):
      return Layout(name, (1, 1) + tuple(shape), _leading_ones, _drop_leading_ones)
    return Layout(name, shape, _same, _same)
  return None  # no counterpart (cross-layer KV sharing weights, for example)


def unused_zeros(cfg: ModelConfig, rows: Mapping[str, AuthorsMixer]
                 ) -> dict[str, tuple[int, ...]]:
  """Tensors their model holds that compute nothing: ``attn.x_v`` of a value-residual layer
  without token shift (their mixin creates it as zeros so that one code path serves both; a kind
  whose row in ``rows`` has no ``mode_prefix``, RWKV-7's time mix, is no such mixin)."""
  if not cfg.value_residual or cfg.tokenshift_attention:
    return {}
  dv = cfg.kv_heads * cfg.v_head_dim
  return {f"transformer.h.{i}.attn.x_v": (dv,) for i, kind in enumerate(cfg.layer_mixers)
          if kind not in rows or rows[kind].mode_prefix is not None}
