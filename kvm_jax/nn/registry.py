"""The one list of mixer kinds: ``register_mixer(kind, cls)`` and what the library asks of a kind.

A kind is a name (``ModelConfig.mixers``) bound to a module class that satisfies the mixer
protocol, :class:`kvm_jax.nn.mixers.mixer.MixerKind` (usually a subclass of
:class:`kvm_jax.nn.mixers.attention.AttentionFrontEnd` or of one of the built-in kinds). Registering a kind makes ``ModelConfig``, ``LM``, ``count_params``, ``generate``, the
trainer (parameter groups, sharding, MFU) and ``kvm-eval`` accept it::

    from kvm_jax.nn import register_mixer
    from kvm_jax.nn.mixers.swa import SlidingWindowAttention

    class WideWindowAttention(SlidingWindowAttention):
      ...

    register_mixer("wide_swa", WideWindowAttention)
    cfg = kj.ModelConfig(mixers=("wide_swa", "kvm"), num_layers=2,
                         options={"wide_swa": WideWindowAttention.Options(window=1024)})

The built-in kinds are registered when :mod:`kvm_jax.nn` is imported: ``full``
(:mod:`kvm_jax.nn.mixers.full`), ``swa`` (:mod:`kvm_jax.nn.mixers.swa`), ``bswa`` (:mod:`kvm_jax.nn.mixers.bswa`),
``kvm`` (:mod:`kvm_jax.nn.mixers.kvm`), ``ovq`` (:mod:`kvm_jax.nn.mixers.ovq`) and ``rwkv7``
(:mod:`kvm_jax.nn.mixers.rwkv7`), the paper's two recurrent baselines.

A kind's decode cache must follow the cache protocol of :mod:`kvm_jax.nn.cache` (per-row
lengths, batch-first arrays; checked here on a cache built abstractly): then ``generate``, the
engine's slots and ``LM.extend`` serve it with nothing more to write.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from flax import nnx

from kvm_jax.config import mixers as mixer_options
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.mixers.bswa import BlockSlidingWindowAttention
from kvm_jax.nn.cache import check_cache_protocol
from kvm_jax.nn.families.family import register_family
from kvm_jax.nn.families.gptalpha2 import GPTAlpha2
from kvm_jax.nn.families.gemma import Gemma
from kvm_jax.nn.families.llama import Llama
from kvm_jax.nn.mixers.full import FullAttention
from kvm_jax.nn.mixers.kvm import KVMAttention
from kvm_jax.nn.mixers.mixer import MixerKind, TransformersLayer, protocol_members
from kvm_jax.nn.mixers.ovq import OVQAttention
from kvm_jax.nn.mixers.rwkv7 import RWKV7TimeMix
from kvm_jax.nn.mixers.swa import SlidingWindowAttention

# What every mixer class must have: the members of the mixer protocol (the block calls some;
# the library asks the rest).
REQUIRED = protocol_members(MixerKind)
#: The vocabularies of the two tables: logical axes (kvm_jax.train.sharding maps each to a mesh
#: axis) and μP/CompleteP groups (kvm_jax.train.completep gives each its learning-rate and
#: weight-decay scales).
LOGICAL_AXIS_NAMES = ("embed", "vocab", "heads", "kv_heads", "mlp", "lora")
PARAM_GROUP_NAMES = ("matrix_params", "lm_head", "wte_embed", "scalars")

_CLASSES: dict[str, type] = {}
# kind -> the owner names of the parameters one of its layers creates (under default options).
_OWNERS: dict[str, frozenset] = {}


def register_mixer(kind: str, cls: type) -> type:
  """Makes ``kind`` a mixer name whose layers are ``cls(cfg, layer, rngs=...)``; returns ``cls``.

  ``cls.Options`` becomes the options class of ``kind`` in ``ModelConfig.options`` (it may be a
  built-in kind's: a subclass registered under a new name keeps its parent's options, under its
  own name). ``LOGICAL_AXES`` maps a parameter's owner name to two of
  :data:`LOGICAL_AXIS_NAMES` (or None: not sharded), ``PARAM_GROUPS`` to one of
  :data:`PARAM_GROUP_NAMES`. Sharding and μP groups look parameters up by owner name across all
  kinds, so the tables may repeat what a registered kind says (a subclass inherits them), but may
  not give a name other axes or another group than a registered kind's layers get, and a name no
  registered kind uses must be a parameter that ``cls`` creates: a misspelt name would otherwise
  leave its parameter silently in the default group. The parameters are read from one layer
  built abstractly (nothing allocated) from ``cls.Options()``'s defaults. Registering the same
  class again under the same name is a no-op; a registration that fails a check leaves the
  registry as it was."""
  name = getattr(cls, "__name__", repr(cls))
  missing = [member for member in REQUIRED if not _has_member(cls, member)]
  if missing:
    raise TypeError(f"mixer class {name!r} for kind {kind!r} lacks {missing} of the mixer "
                    "protocol (kvm_jax.nn.mixers.mixer.MixerKind); subclass a built-in mixer, or "
                    "kvm_jax.nn.mixers.attention.AttentionFrontEnd and add what it lacks.")
  known = _CLASSES.get(kind)
  if known is cls:
    return cls
  if known is not None:
    raise ValueError(f"mixer kind {kind!r} is already registered to {known.__name__}; choose "
                     f"another name for {name}.")
  _check_table_values(cls)
  new_kind = kind not in mixer_options.mixer_kinds()
  mixer_options.register_options(kind, cls.Options)
  try:
    owners = _parameter_owners(kind, cls)
    _check_table_names(cls, owners)
    _check_cache(kind, cls)
  except Exception:
    if new_kind:
      mixer_options.unregister_options(kind)
    raise
  _CLASSES[kind], _OWNERS[kind] = cls, owners
  return cls


def _has_member(cls: type, member: str) -> bool:
  """Whether ``cls`` defines ``member``; ``__call__`` must come from a class of its own (every
  class has the metaclass's ``__call__``, which makes instances, not outputs)."""
  if member == "__call__":
    return any("__call__" in vars(c) for c in getattr(cls, "__mro__", ())[:-1])
  return hasattr(cls, member)


def _is_axes(value) -> bool:
  return (isinstance(value, tuple) and len(value) == 2
          and all(axis is None or axis in LOGICAL_AXIS_NAMES for axis in value))


def _check_table_values(cls: type) -> None:
  """Each entry of ``cls``'s two tables is well formed."""
  for what, valid, choices in (
      ("LOGICAL_AXES", _is_axes, f"a pair of {LOGICAL_AXIS_NAMES} or None (not sharded)"),
      ("PARAM_GROUPS", lambda v: v in PARAM_GROUP_NAMES, f"one of {PARAM_GROUP_NAMES}")):
    table = getattr(cls, what)
    if not isinstance(table, dict):
      raise TypeError(f"{cls.__name__}.{what} must be a dict by parameter owner name, got "
                      f"{table!r}.")
    for owner, value in table.items():
      if not valid(value):
        raise ValueError(f"{cls.__name__}.{what}[{owner!r}] = {value!r} is not {choices}.")


def _parameter_owners(kind: str, cls: type) -> frozenset:
  """The owner names of the parameters of one ``kind`` layer built abstractly from the kind's
  default options: every part of a parameter's path but the leaf's own name (``c_q`` of
  ``c_q/kernel``, ``beta`` of ``beta``)."""
  try:
    cfg = ModelConfig(mixers=kind, num_layers=1, options={kind: cls.Options()})
    layer = nnx.eval_shape(lambda: cls(cfg, 0, rngs=nnx.Rngs(0)))
  except Exception as e:
    raise ValueError(f"register_mixer({kind!r}, {cls.__name__}) builds one layer from "
                     f"{cls.__name__}.Options() defaults to read its parameter names, and that "
                     f"failed: {e}") from e
  return frozenset(str(part) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))
                   for part in (path[:-1] if len(path) > 1 else path))


def _check_cache(kind: str, cls: type) -> None:
  """The decode cache of one ``kind`` layer (default options) follows the cache protocol
  (:func:`kvm_jax.nn.cache.check_cache_protocol`): per-row lengths and batch-first arrays, which
  the engine's row operations rely on."""
  cfg = ModelConfig(mixers=kind, num_layers=1, options={kind: cls.Options()})
  layer = nnx.eval_shape(lambda: cls(cfg, 0, rngs=nnx.Rngs(0)))
  check_cache_protocol(kind, lambda batch: layer.init_cache(batch, 64))


def _check_table_names(cls: type, owners: frozenset) -> None:
  """``cls``'s table entries agree with the registered kinds' and name parameters that exist."""
  registered = {"LOGICAL_AXES": logical_axes(), "PARAM_GROUPS": param_groups()}
  unknown = []
  for what, theirs in registered.items():
    for owner, value in getattr(cls, what).items():
      if owner in theirs and theirs[owner] != value:
        raise ValueError(f"{cls.__name__}.{what}[{owner!r}] = {value!r}, but a registered mixer "
                         f"gives {owner!r} {theirs[owner]!r}; name the parameter differently.")
      holders = [k for k, names in _OWNERS.items() if owner in names]
      if what == "PARAM_GROUPS" and owner not in theirs and holders:
        # a registered kind keeps this parameter in its default group; groups are looked up by
        # name, so the entry would regroup that kind's parameter as well
        raise ValueError(f"{cls.__name__}.PARAM_GROUPS[{owner!r}] = {value!r} names a parameter "
                         f"of the registered kind(s) {holders}, which keep it in its default "
                         "group, and would apply to their layers too; name the parameter "
                         "differently.")
      if owner not in theirs and owner not in owners:
        unknown.append(f"{what}[{owner!r}]")
  if unknown:
    raise ValueError(f"{cls.__name__} names parameters it does not create: "
                     f"{', '.join(sorted(unknown))} (its parameters: {sorted(owners)}); fix the "
                     "name, or drop the entry.")


def mixer_class(kind: str) -> type:
  """The module class of ``kind``; a ValueError naming the registered kinds otherwise."""
  if kind not in _CLASSES:
    raise ValueError(f"unknown mixer {kind!r}; registered: {tuple(_CLASSES)} "
                     "(kvm_jax.nn.register_mixer adds a kind).")
  return _CLASSES[kind]


def registered_mixers() -> dict[str, type]:
  """``{kind: class}`` of every registered kind (a copy)."""
  return dict(_CLASSES)


def own_members(name: str) -> dict:
  """``{kind: member}`` of every registered kind whose own class declares ``name`` (not None):
  what a class says of its format or conversion is not inherited by a subclass registered under
  another name, whose layers may compute something else."""
  return {kind: vars(cls)[name] for kind, cls in _CLASSES.items()
          if vars(cls).get(name) is not None}


def transformers_layers() -> dict[str, TransformersLayer]:
  """``{kind: TRANSFORMERS row}`` of every registered kind that transformers' Llama and Gemma
  formats have (:func:`own_members`)."""
  return own_members("TRANSFORMERS")


def kinds_of_layer_types() -> dict[str, str]:
  """transformers' ``layer_types`` names -> the kind whose layers they are (the first registered
  where two kinds declare one)."""
  out: dict[str, str] = {}
  for kind, row in transformers_layers().items():
    out.setdefault(row.layer_type, kind)
  return out


def sliding_kinds() -> tuple[str, ...]:
  """The kinds whose layers slide a window in transformers' format (their options' window is
  ``config.json``'s ``sliding_window``)."""
  return tuple(kind for kind, row in transformers_layers().items()
               if row.window_option is not None)


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


class MixerFlops(NamedTuple):
  """Matmul FLOPs per token of one layer's core in training, beyond its parameter matmuls (which
  the trainer counts as 6 per parameter): attention's QKᵀ and PV, a recurrence's state products,
  KVM's routing scores.

  Attributes:
    model: the algorithm's work, forward and backward: what MFU counts (e.g. attention over the
      keys a query may see, not the masked ones a blocked implementation also scores).
    forward: what the implementation runs in the forward pass (also what ``remat="block"`` runs
      again in the backward pass).
    backward: what it runs in the backward pass, including anything it recomputes itself.
  """

  model: float
  forward: float
  backward: float


def mixer_flops(cfg: ModelConfig, seq_len: int) -> tuple[MixerFlops, ...]:
  """Per layer, its :class:`MixerFlops` for a ``seq_len``-token training sequence: the kind's
  classmethod ``flops_per_token(cfg, layer, seq_len) -> (model, forward, backward)`` where it has
  one, else attention's count from ``keys_per_query``: 4·D·H FLOPs per key forward (QKᵀ and PV,
  a multiply-add being 2 FLOPs), twice that backward (the gradients of both operands of each)."""
  out = []
  for layer, kind in enumerate(cfg.layer_mixers):
    cls = mixer_class(kind)
    if hasattr(cls, "flops_per_token"):
      out.append(MixerFlops(*map(float, cls.flops_per_token(cfg, layer, seq_len))))
    else:
      forward = 4.0 * float(cls.keys_per_query(cfg, layer, seq_len)) * cfg.qk_head_dim * cfg.num_heads
      out.append(MixerFlops(3.0 * forward, forward, 2.0 * forward))
  return tuple(out)


def exact_window(cfg: ModelConfig) -> Optional[int]:
  """The longest distance at which some layer of ``cfg`` still attends a key exactly (each kind's
  ``exact_window``): None when a layer sees every earlier key (full attention), 0 when none keeps
  any (RWKV-7 alone). MQAR splits recall here: a key farther back can be recalled only through a
  compressed state."""
  reach = 0
  for layer, kind in enumerate(cfg.layer_mixers):
    window = mixer_class(kind).exact_window(cfg, layer)
    if window is None:
      return None
    reach = max(reach, int(window))
  return reach


def memory_in_words(cfg: ModelConfig, seq_len: int) -> str:
  """What ``cfg`` keeps of tokens beyond its layers' exact windows after ``seq_len`` tokens, in
  words: each kind's ``beyond_window`` (a classmethod ``(cfg, layer, seq_len) -> str | None``,
  None: nothing), the distinct answers in layer order, or "window only"."""
  said = []
  for layer, kind in enumerate(cfg.layer_mixers):
    words = mixer_class(kind).beyond_window(cfg, layer, seq_len)
    if words is not None and words not in said:
      said.append(words)
  return ", ".join(said) or "window only"


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
  """Per layer, the bytes of its decode cache (0 for a layer that reads its sources' caches)."""
  return tuple(int(mixer_class(kind).cache_bytes(cfg, layer, batch, max_len))
               for layer, kind in enumerate(cfg.layer_mixers))


# The families first: building a layer (the checks of register_mixer) needs the default one.
register_family("gptalpha2", GPTAlpha2)
register_family("llama", Llama)
register_family("gemma", Gemma)

for _kind, _cls in (("full", FullAttention), ("swa", SlidingWindowAttention),
                    ("bswa", BlockSlidingWindowAttention), ("kvm", KVMAttention),
                    ("ovq", OVQAttention), ("rwkv7", RWKV7TimeMix)):
  register_mixer(_kind, _cls)
