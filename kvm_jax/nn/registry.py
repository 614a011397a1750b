"""The one list of mixer kinds: ``register_mixer(kind, cls)`` and what the library asks of a kind.

A kind is a name (``ModelConfig.mixers``) bound to a module class that implements the protocol of
:class:`kvm_jax.nn.attention.AttentionFrontEnd` (usually a subclass of it or of one of the built-in
kinds). Registering a kind makes ``ModelConfig``, ``LM``, ``count_params``, ``generate``, the
trainer (parameter groups, sharding, MFU) and ``kvm-eval`` accept it::

    from kvm_jax.nn import register_mixer
    from kvm_jax.nn.swa import SlidingWindowAttention

    class WideWindowAttention(SlidingWindowAttention):
      ...

    register_mixer("wide_swa", WideWindowAttention)
    cfg = kj.ModelConfig(mixers=("wide_swa", "kvm"), num_layers=2,
                         options={"wide_swa": WideWindowAttention.Options(window=1024)})

The built-in kinds are registered when :mod:`kvm_jax.nn` is imported: ``full``
(:mod:`kvm_jax.nn.full`), ``swa`` (:mod:`kvm_jax.nn.swa`), ``bswa`` (:mod:`kvm_jax.nn.bswa`),
``kvm`` (:mod:`kvm_jax.nn.kvm`), ``ovq`` (:mod:`kvm_jax.nn.ovq`) and ``rwkv7``
(:mod:`kvm_jax.nn.rwkv7`), the paper's two recurrent baselines.
"""

from __future__ import annotations

from kvm_jax import mixer_options
from kvm_jax.model_config import ModelConfig
from kvm_jax.nn.bswa import BlockSlidingWindowAttention
from kvm_jax.nn.full import FullAttention
from kvm_jax.nn.kvm import KVMAttention
from kvm_jax.nn.ovq import OVQAttention
from kvm_jax.nn.rwkv7 import RWKV7TimeMix
from kvm_jax.nn.swa import SlidingWindowAttention

# What every mixer class must have (the block calls these; the library asks the rest).
REQUIRED = ("Options", "LOGICAL_AXES", "PARAM_GROUPS", "mup_d_in_ratios", "keys_per_query",
            "cache_bytes", "init_cache", "init_tails", "anchor_value", "__call__")

_CLASSES: dict[str, type] = {}


def register_mixer(kind: str, cls: type) -> type:
  """Makes ``kind`` a mixer name whose layers are ``cls(cfg, layer, rngs=...)``; returns ``cls``.

  ``cls.Options`` becomes the options class of ``kind`` in ``ModelConfig.options`` (it may be a
  built-in kind's: a subclass registered under a new name keeps its parent's options, under its
  own name). Its ``LOGICAL_AXES`` and ``PARAM_GROUPS`` may not give a parameter name other axes or
  another group than a registered kind does (sharding and μP groups look parameters up by name).
  Registering the same class again under the same name is a no-op."""
  missing = [name for name in REQUIRED if not hasattr(cls, name)]
  if missing:
    raise TypeError(f"mixer class {getattr(cls, '__name__', cls)!r} for kind {kind!r} lacks "
                    f"{missing}; subclass kvm_jax.nn.attention.AttentionFrontEnd or a built-in "
                    "mixer.")
  known = _CLASSES.get(kind)
  if known is not None and known is not cls:
    raise ValueError(f"mixer kind {kind!r} is already registered to {known.__name__}; choose "
                     f"another name for {cls.__name__}.")
  for table, what in ((logical_axes(), "LOGICAL_AXES"), (param_groups(), "PARAM_GROUPS")):
    for name, value in getattr(cls, what).items():
      if name in table and table[name] != value:
        raise ValueError(f"{cls.__name__}.{what}[{name!r}] = {value!r}, but a registered mixer "
                         f"gives {name!r} {table[name]!r}; name the parameter differently.")
  mixer_options.register_options(kind, cls.Options)
  _CLASSES[kind] = cls
  return cls


def mixer_class(kind: str) -> type:
  """The module class of ``kind``; a ValueError naming the registered kinds otherwise."""
  if kind not in _CLASSES:
    raise ValueError(f"unknown mixer {kind!r}; registered: {tuple(_CLASSES)} "
                     "(kvm_jax.nn.register_mixer adds a kind).")
  return _CLASSES[kind]


def registered_mixers() -> dict[str, type]:
  """``{kind: class}`` of every registered kind (a copy)."""
  return dict(_CLASSES)


def logical_axes() -> dict[str, tuple]:
  """Logical axes of every registered mixer's 2-D parameters, by the owning layer's name."""
  out: dict[str, tuple] = {}
  for cls in _CLASSES.values():
    out.update(cls.LOGICAL_AXES)
  return out


def param_groups() -> dict[str, str]:
  """μP/CompleteP groups that registered mixers give their parameters, by the owner's name."""
  out: dict[str, str] = {}
  for cls in _CLASSES.values():
    out.update(cls.PARAM_GROUPS)
  return out


def keys_per_query(cfg: ModelConfig, seq_len: int) -> tuple[float, ...]:
  """Per layer, the keys a query attends to averaged over a ``seq_len``-token sequence."""
  return tuple(float(mixer_class(kind).keys_per_query(cfg, layer, seq_len))
               for layer, kind in enumerate(cfg.layer_mixers))


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
  """Per layer, the bytes of its decode cache (0 for a layer that reads its sources' caches)."""
  return tuple(int(mixer_class(kind).cache_bytes(cfg, layer, batch, max_len))
               for layer, kind in enumerate(cfg.layer_mixers))


for _kind, _cls in (("full", FullAttention), ("swa", SlidingWindowAttention),
                    ("bswa", BlockSlidingWindowAttention), ("kvm", KVMAttention),
                    ("ovq", OVQAttention), ("rwkv7", RWKV7TimeMix)):
  register_mixer(_kind, _cls)
