"""The mixer protocol: what a mixer kind's class must provide, as one ``typing.Protocol``.

A kind is a name bound by :func:`kvm_jax.nn.register_mixer` to a class that satisfies
:class:`MixerKind`; its decode cache satisfies :class:`kvm_jax.nn.cache.MixerCache`. The
registry checks a class against both before it binds the name (its required members are read
from :class:`MixerKind`, so the two cannot drift apart). The built-in kinds get most members from
:class:`kvm_jax.nn.mixers.attention.AttentionFrontEnd`; a new kind usually subclasses it or a built-in.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Optional, Protocol

import jax

from kvm_jax.config.model import ModelConfig

Array = jax.Array


class MixerOutput(NamedTuple):
  """What a mixer layer's call returns, whatever the kind and the mode (whole sequence, prefill,
  decode step or parallel piece)."""

  #: ``[B, T, C]``: the mixer branch after its output projection, before the residual scale.
  output: Array
  #: The new mixer cache (a :class:`kvm_jax.nn.cache.MixerCache`), or None without a cache.
  cache: Any
  #: The token-shift history ``(last_q, last_k, last_v)`` a decode cache keeps (each None for a
  #: kind that keeps its own history in ``cache``).
  tails: tuple
  #: What layers above may read (cross-layer KV sharing: keys, values, state, routing); ``{}``
  #: for none.
  exports: dict


class Mixed(NamedTuple):
  """What an attention kind computes from its queries (``mix_own`` and ``mix_reconstructed`` of
  :class:`kvm_jax.nn.mixers.attention.AttentionFrontEnd`): the heads before the output projection, the
  new mixer cache and the exports (``{}`` for a layer that reads other layers' keys)."""

  #: ``[B, T, H, Dv]``.
  heads: Array
  cache: Any
  exports: dict


class MixerKind(Protocol):
  """A mixer kind's class. Class-level members describe the kind to the rest of the library;
  instances are the layers (``cls(cfg, layer, rngs=...)``).

  Not required, and read from the kind's own class only (a subclass registered under another
  name does not inherit them): ``AUTHORS``, a :class:`kvm_jax.nn.authors_format.AuthorsMixer`
  (the authors' names for the kind and what its layers read and write in their config.json;
  without it the authors' format has no such layer), ``TRANSFORMERS``, a
  :class:`TransformersLayer` (its layer type in transformers' config.json; without it the
  transformers format has no such layer), and the classmethod ``kvm_conversion``
  (:class:`KVMConversion`)."""

  #: The kind's options: a frozen dataclass (``ModelConfig.options[kind]``).
  Options: ClassVar[type]
  #: A 2-D parameter's owner name -> its two logical axes (``kvm_jax.train.sharding``).
  LOGICAL_AXES: ClassVar[dict]
  #: A parameter's owner name -> its μP/CompleteP group where the default rule is not the
  #: authors' (``kvm_jax.train.completep``).
  PARAM_GROUPS: ClassVar[dict]

  @classmethod
  def mup_d_in_ratios(cls, cfg: ModelConfig) -> dict:
    """Owner name -> μP width ratio, for parameters whose input is not the model width."""

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """Keys a query of layer ``layer`` attends, averaged over ``seq_len`` tokens (MFU)."""

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """The longest distance at which a key is still attended exactly (None: every key; 0:
    none), where MQAR recall splits."""

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    """What the layer keeps of tokens past its exact window after ``seq_len`` tokens, in words
    (None: nothing)."""

  @classmethod
  def cache_bytes(cls, cfg: ModelConfig, layer: int, batch: int, max_len: int) -> int:
    """Bytes of the layer's decode cache for ``batch`` rows of ``max_len`` tokens."""

  def init_cache(self, batch: int, max_len: int) -> Any:
    """An empty decode cache (a :class:`kvm_jax.nn.cache.MixerCache`, or None for a layer that
    reads its sources' caches)."""

  def init_tails(self, batch: int) -> Optional[tuple]:
    """The token-shift history a decode cache starts with (None: the kind keeps its own)."""

  def anchor_value(self, x_normed: Array, cache: Any = None, documents: Any = None) -> Array:
    """``v_first`` of a value-residual anchor layer (the layer's cache in a decode step; packed
    documents)."""

  def __call__(self, x: Array, v_first: Optional[Array], positions: Array, cache: Any = None,
               decode: Any = False, shared: Any = None, documents: Any = None
               ) -> MixerOutput:
    """A :class:`MixerOutput` for a whole sequence, a decode step or (``decode`` a
    :class:`kvm_jax.nn.cache.Resume`) a parallel piece, whose rows may end early (its
    ``counts``)."""


@dataclasses.dataclass(frozen=True)
class KVMConversion:
  """What converting one layer of a kind into a ``kvm`` layer asks of the KVM options: a kind
  that converts says it with a classmethod ``kvm_conversion(cfg, layer) -> KVMConversion``
  (``kvm_jax.nn.convert``; kinds without it do not convert).

  Attributes:
    required: KVMConfig fields the options must hold for the converted layer to compute the
      source inside the window (e.g. a block window's chunk geometry).
    defaults: fields the default conversion options take from this layer.
    description: the layer in words for an error (e.g. "rotating 16 channels").
    advice: what to do when ``required`` does not hold, where setting those fields is not the
      fix (None: set them).

  A subclass registered as another kind does not inherit its parent's conversion: it converts
  only when its own class says how (its function may differ from the parent's).
  """

  required: dict = dataclasses.field(default_factory=dict)
  defaults: dict = dataclasses.field(default_factory=dict)
  description: str = ""
  advice: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class TransformersLayer:
  """How transformers' Llama and Gemma families write one kind's layers in ``config.json``: a
  kind they have declares it as the class attribute ``TRANSFORMERS`` (kinds without it have no
  transformers format; a subclass registered as another kind does not inherit it).

  Attributes:
    layer_type: its name in ``layer_types`` ("full_attention", "sliding_attention"); where two
      kinds declare one, the first registered reads it.
    window_option: the field of the kind's options that holds ``sliding_window`` (Mistral's and
      Gemma's local layers slide one window); None: its layers see every earlier token.
  """

  layer_type: str
  window_option: Optional[str] = None


def protocol_members(protocol: type) -> tuple[str, ...]:
  """The names a class must have to satisfy ``protocol``: its annotated attributes and its
  methods (``__call__`` included), in the order the protocol declares them."""
  names = list(getattr(protocol, "__annotations__", {}))
  for name, value in vars(protocol).items():
    if (callable(value) or isinstance(value, classmethod)) and \
        (not name.startswith("_") or name == "__call__") and name not in names:
      names.append(name)
  return tuple(names)
