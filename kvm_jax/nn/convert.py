"""Changing a trained model's memory: test-time KVM schedules and attention layers made KVM layers.

Two things the paper leaves open (docs/conversion.md):

* :func:`with_kvm` — the same parameters under another schedule of the ``kvm`` layers (budget,
  ``max_state_rows``, chunk geometry, sinks): a model trained with one state budget evaluated
  under another.
* :func:`convert_to_kvm` — chosen ``full`` (or ``swa``, or geometry-compatible ``bswa``) layers
  of a trained model of any backbone family become ``kvm`` layers. A KVM layer is its source
  layer's attention front end plus LN_s, the merge-gate projection W_g and two key
  temperatures, and its first
  ``window_chunks · chunk_size`` tokens are plain causal attention (docs/kvm-spec.md §6.5). Every
  source parameter is kept; the new ones start at window temperature 1 (window scores unchanged),
  state temperature 1, LN_s the identity and W_g = 0 (merge gate g = 1: merges weighted by counts
  alone). So on any sequence no longer than the window the converted model's logits are the
  source's, and beyond it the compressed state takes over.

:func:`kvm_jax.runs.conversion.write_converted` writes the result as a run directory
(``kvm-convert``), which ``load_trained``, ``kvm-eval``, ``generate`` and ``kvm-train
--config.init_from`` accept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import jax.numpy as jnp
from flax import nnx

from kvm_jax.config.budget import budget_label
from kvm_jax.config.io import parse_field
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.mixers.kvm import KVMAttention
from kvm_jax.nn.mixers.mixer import KVMConversion
from kvm_jax.nn.registry import mixer_class, own_members
from kvm_jax.nn.model import LM
from kvm_jax.nn.roles import conversion_value, parameter_role

#: The kind every conversion produces (the one place this module names it).
TARGET_KIND = "kvm"
#: KVMConfig fields a trained model's parameters do not depend on: what a test-time schedule may
#: change. The others add, remove or reinterpret parameters.
SCHEDULE_FIELDS = ("budget", "max_state_rows", "chunk_size", "window_chunks", "sink_rows",
                   "value_norm", "gate_appends", "gate_initial_state", "readout_value_dtype",
                   "ln_eps", "gate_keys", "gate_values")
# Why each remaining field cannot change under trained parameters.
SHAPE_FIELDS = {
    "rope_dims": "the state zeroes exactly the model's rotary channels, which the trained q/k "
                 "projections fix (ModelConfig.rope_dims)",
    "head_temperatures": "it adds or removes the window_temperature / state_temperature "
                         "parameters",
    "state_rope_dims": "the trained LN_s and state temperatures fit the channels the state "
                       "keys keep",
    "logit_softcap": "it is the family's attention soft-cap, under which the layer was trained",
}
# Parameters a kvm layer has that its full-attention source has not, and the values that leave
# in-window logits unchanged (module docstring); the KVM layer's own table.
KVM_ONLY_PARAMS = KVMAttention.CONVERSION_VALUES

LayerSpec = Union[str, Sequence[int]]


def convertible_kinds() -> tuple[str, ...]:
  """The registered kinds whose layers convert to kvm: those whose class says what a conversion
  asks of the KVM options (``kvm_conversion``, :class:`kvm_jax.nn.mixers.mixer.KVMConversion`): full
  attention always, block sliding-window attention into the same window plus a state,
  sliding-window attention exact up to the shorter window."""
  return tuple(own_members("kvm_conversion"))  # a class's own, not a parent's


def _conversion(cfg: ModelConfig, layer: int) -> Optional[KVMConversion]:
  """What converting ``layer`` asks of the KVM options, or None when its kind does not convert."""
  kind = cfg.layer_mixers[layer]
  return mixer_class(kind).kvm_conversion(cfg, layer) if kind in convertible_kinds() else None


def has_kvm_layers(cfg: ModelConfig) -> bool:
  """Whether any layer of ``cfg`` is a ``kvm`` layer (what ``with_kvm`` changes)."""
  return TARGET_KIND in cfg.layer_mixers


def _same_parameters(cfg: ModelConfig, new_cfg: ModelConfig, model: LM) -> nnx.GraphDef:
  """The graphdef of ``new_cfg``'s model, after checking that its parameters are ``model``'s
  (names, shapes, dtypes)."""
  abstract = nnx.eval_shape(lambda: LM(new_cfg, rngs=nnx.Rngs(0)))
  graphdef, new_state = nnx.split(abstract)
  shapes = lambda state: {path: (v.shape, v.dtype) for path, v in nnx.to_flat_state(state)}
  if shapes(new_state) != shapes(nnx.state(model)):
    raise ValueError("the new KVM options change the model's parameters; only schedule fields "
                     f"{SCHEDULE_FIELDS} may change under trained weights.")
  return graphdef


def kvm_options_with(options: KVMConfig, fields: Mapping[str, Any]) -> KVMConfig:
  """``options`` with ``fields`` replaced (a budget may be a spec such as ``"sqrt:16@256"``),
  validated; an unknown field or one that would change parameters is refused by name."""
  known = {f.name for f in dataclasses.fields(KVMConfig)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(f"unknown KVMConfig field(s) {unknown}; the schedule fields are "
                     f"{SCHEDULE_FIELDS}.")
  try:
    return dataclasses.replace(options, **fields)
  except ValueError as e:
    raise ValueError(f"the KVM options {fields}: {e}") from None


def with_kvm(model: LM, **fields) -> LM:
  """``model`` with the same parameters and new options for its ``kvm`` layers.

  Any of :data:`SCHEDULE_FIELDS` may change: ``budget`` (a budget object or a spec string,
  :func:`kvm_jax.config.budget.parse_budget`), ``max_state_rows``, ``chunk_size``, ``window_chunks``,
  ``sink_rows``, ... ; ``gate_keys``/``gate_values`` only while at least one stays on (W_g
  exists either way). ``rope_dims`` and ``head_temperatures`` would change what the parameters
  mean or which exist and are refused by name. The schedule the new model follows is
  ``kj.kvm_schedule(new.cfg.kvm, T)``. Parameters are shared with ``model``, not copied.

  Raises:
    ValueError: ``model`` has no ``kvm`` layer, or a field is unknown, refused or invalid.
  """
  cfg = model.cfg
  if not has_kvm_layers(cfg):
    raise ValueError(f"the model has no kvm layers (mixers {cfg.layer_mixers}); "
                     "kj.convert_to_kvm makes attention layers kvm layers first.")
  refused = sorted(set(fields) & set(SHAPE_FIELDS))
  if refused:
    raise ValueError("; ".join(f"{name} cannot change under trained parameters: "
                               f"{SHAPE_FIELDS[name]}" for name in refused) + ".")
  options = kvm_options_with(cfg.kvm, fields)
  if options.uses_gate != cfg.kvm.uses_gate:
    raise ValueError("gate_keys/gate_values: turning both off (or one back on) removes (adds) "
                     "the merge-gate projection W_g; keep at least one as trained.")
  new_cfg = dataclasses.replace(cfg, options=cfg.options.set(TARGET_KIND, options))
  graphdef = _same_parameters(cfg, new_cfg, model)
  return nnx.merge(graphdef, nnx.state(model))


# -- conversion ----------------------------------------------------------------------------------


# Layer sets named by the kind of their attention: "global" layers see every earlier token (full
# attention: Gemma's global layers, or every layer of Llama), "local" ones a sliding window.
NAMED_LAYER_SETS = {"global": "full", "local": "swa"}


def select_layers(spec: LayerSpec, num_layers: int,
                  mixers: Optional[Sequence[str]] = None) -> tuple[int, ...]:
  """Layer indices of ``spec``: "all", "odd" (1, 3, ...), "even" (0, 2, ...), "global" (the
  full-attention layers of ``mixers``), "local" (its sliding-window layers), "I,J,..." or a
  sequence of ints; out-of-range or repeated indices are refused."""
  if isinstance(spec, str) and spec.strip() in NAMED_LAYER_SETS:
    kind = NAMED_LAYER_SETS[spec.strip()]
    chosen = tuple(i for i, k in enumerate(mixers or ()) if k == kind)
    if not chosen:
      raise ValueError(f"layers={spec!r} selects the {kind} layers, and the model has none "
                       f"(mixers {tuple(mixers or ())}).")
    return chosen
  if isinstance(spec, str):
    text = spec.strip()
    if text in ("all", "odd", "even"):
      start, step = {"all": (0, 1), "odd": (1, 2), "even": (0, 2)}[text]
      chosen = tuple(range(start, num_layers, step))
      if not chosen:
        raise ValueError(f"layers={spec!r} selects no layer of a {num_layers}-layer model.")
      return chosen
    try:
      indices = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
      raise ValueError(f"layers={spec!r}: give 'all', 'odd', 'even', 'global', 'local' or "
                       "comma-separated layer indices such as '1,3'.") from None
  else:
    indices = [int(x) for x in spec]
  if not indices:
    raise ValueError(f"layers={spec!r} selects no layer.")
  bad = [i for i in indices if not 0 <= i < num_layers]
  if bad:
    raise ValueError(f"layers {bad} are outside the model's layers 0..{num_layers - 1}.")
  if len(set(indices)) != len(indices):
    raise ValueError(f"layers={spec!r} names a layer twice.")
  return tuple(sorted(indices))


def default_state_rope_dims(cfg: ModelConfig) -> Optional[int]:
  """How many rotary channels a converted layer's state keys zero (``KVMConfig.state_rope_dims``):
  None (the paper's rule: all of them) when some channels of the head are left unrotated, else
  half of them. Every channel rotates in Llama, Qwen, Mistral and Gemma: zeroing them all would
  leave the state keys without content, so the state keeps the slower half of the pairs, as the
  paper's state keeps the unrotated half of its heads."""
  return cfg.rope_dims // 2 if cfg.rope_dims == cfg.qk_head_dim else None


def default_kvm_options(cfg: ModelConfig, layers: Sequence[int]) -> KVMConfig:
  """The KVM options a conversion uses when none are given: those of the model's kvm layers when
  it has some (all kvm layers share one set); otherwise the ``kvm`` options the model records
  (e.g. the demo's models; an imported checkpoint's, from the authors' config) or
  :class:`KVMConfig`'s defaults, with the model's rotary width (the only one a state can use)
  and, when ``bswa`` layers are converted, their chunk geometry."""
  if has_kvm_layers(cfg):
    return cfg.kvm
  base = cfg.options_of(TARGET_KIND)
  fields: dict[str, Any] = {"rope_dims": cfg.rope_dims}
  if base.state_rope_dims is None:
    fields["state_rope_dims"] = default_state_rope_dims(cfg)
  for i in layers:
    terms = _conversion(cfg, i)
    fields.update(terms.defaults if terms is not None else {})
  fields["sink_rows"] = min(base.sink_rows, fields.get("chunk_size", base.chunk_size) - 1)
  return dataclasses.replace(base, **fields)


def _check_convertible(cfg: ModelConfig, layers: Sequence[int], kvm: KVMConfig) -> None:
  for i in layers:
    kind, terms = cfg.layer_mixers[i], _conversion(cfg, i)
    if terms is None:
      kinds = convertible_kinds()
      candidates = [j for j, k in enumerate(cfg.layer_mixers) if k in kinds]
      hint = (f"Choose layers of those kinds: layers={candidates}." if candidates else
              f"This model has none (mixers {cfg.layer_mixers}).")
      raise ValueError(f"layer {i} is a {kind!r} layer; only {kinds} layers convert to kvm "
                       f"(a kvm layer is an attention layer plus a compressed state). {hint}")
    wrong = {f: getattr(kvm, f) for f, v in terms.required.items() if getattr(kvm, f) != v}
    if wrong:
      fix = terms.advice or "Set kvm " + ", ".join(f"{f}={v}" for f, v in terms.required.items())
      raise ValueError(
          f"layer {i} is a {kind} layer {terms.description}, but the kvm options have "
          f"{', '.join(f'{f}={v}' for f, v in wrong.items())}: a {kind} layer converts only "
          f"into kvm layers that compute it inside their window. {fix}")


def exact_length(cfg: ModelConfig, layers: Sequence[int], kvm: KVMConfig) -> int:
  """The longest sequence on which a model converted from ``cfg`` (``layers`` made kvm layers
  under ``kvm``) computes the source's logits: the KVM window, or a converted ``swa`` layer's
  window when shorter (past it the source forgot what the KVM layer still sees)."""
  windows = [mixer_class(cfg.layer_mixers[i]).exact_window(cfg, i) for i in layers]
  return min([kvm.window_len, *(w for w in windows if w is not None)])


def converted_config(cfg: ModelConfig, layers: Sequence[int],
                     kvm: Optional[KVMConfig] = None) -> ModelConfig:
  """``cfg`` with ``layers`` made ``kvm`` layers under options ``kvm`` (default
  :func:`default_kvm_options`). The value-residual anchors stay those of ``cfg``: where the new
  layer kinds would anchor elsewhere (each kind anchors on its own first layer), every layer
  shares layer 0's anchor instead, which is what the source used; a layout that cannot keep its
  anchors is refused."""
  kvm = kvm if kvm is not None else default_kvm_options(cfg, layers)
  _check_convertible(cfg, layers, kvm)
  mixers = tuple(TARGET_KIND if i in layers else kind for i, kind in enumerate(cfg.layer_mixers))
  try:
    new = dataclasses.replace(cfg, mixers=mixers, options=cfg.options.set(TARGET_KIND, kvm))
    anchors = [cfg.value_anchor(i) for i in range(cfg.num_layers)]
    if cfg.value_residual and [new.value_anchor(i) for i in range(cfg.num_layers)] != anchors:
      new = new.with_family_options(share_value_anchor=True)
      if [new.value_anchor(i) for i in range(cfg.num_layers)] != anchors:
        raise ValueError(
            f"the source's layers take their value-residual anchors from layers {anchors}, and "
            "no anchor layout of the converted model keeps them (each kind anchors on its first "
            "layer, or every layer on layer 0 with share_value_anchor); convert a set of layers "
            "that keeps them, e.g. only the layers of one kind.")
  except ValueError as e:
    raise ValueError(f"converting layers {list(layers)} to kvm: {e}") from None
  return new


def convert_to_kvm(model: LM, layers: LayerSpec = "all",
                   kvm: Union[KVMConfig, Mapping[str, Any], None] = None) -> LM:
  """A model whose ``layers`` are ``kvm`` layers and which keeps every parameter of ``model``.

  Args:
    model: a trained ``kvm_jax.LM`` (e.g. ``kj.load_pretrained(path)``).
    layers: "all", "odd", "even", "global" (the full-attention layers), "local" (the
      sliding-window ones), "I,J,..." or a sequence of layer indices. Each must be a ``full``
      layer, a ``swa`` layer (exact up to the shorter of its window and KVM's:
      :func:`exact_length`), or a ``bswa`` layer whose chunk size and window equal the KVM
      window's; other kinds are refused by name. The kvm layers keep the family's attention
      front end (projections, biases, q/k norms, RoPE).
    kvm: the options of the new ``kvm`` layers: a :class:`KVMConfig`, a mapping of fields
      replacing those of :func:`default_kvm_options` (a budget may be a spec string such as
      ``"sqrt:16@256"``), or None for the defaults.

  The new parameters (LN_s, W_g, the temperatures) start where the converted model's logits equal
  ``model``'s on every sequence of at most ``window_chunks · chunk_size`` tokens (module
  docstring); beyond that, the state changes them.
  """
  cfg = model.cfg
  chosen = select_layers(layers, cfg.num_layers, cfg.layer_mixers)
  if isinstance(kvm, Mapping):
    kvm = kvm_options_with(default_kvm_options(cfg, chosen), kvm)
  new_cfg = converted_config(cfg, chosen, kvm)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: LM(new_cfg, rngs=nnx.Rngs(0))))
  source = dict(nnx.to_flat_state(nnx.state(model)))
  filled, used = [], set()
  for path, variable in nnx.to_flat_state(abstract):
    if path in source:
      old = source[path]
      if (old.shape, old.dtype) != (variable.shape, variable.dtype):
        raise AssertionError(f"parameter {path} changed shape in conversion")  # not user input
      filled.append((path, old))
      used.add(path)
      continue
    role = parameter_role(path)
    start = conversion_value(role, str(path[-1]))
    if role.layer not in chosen or start is None:
      raise AssertionError(f"conversion made an unexpected parameter {path}")
    value = jnp.full(variable.shape, start, variable.dtype)
    filled.append((path, variable.replace(value)))
  dropped = sorted(set(source) - used)
  if dropped:
    raise AssertionError(f"conversion would drop source parameters {dropped}")
  return nnx.merge(graphdef, nnx.from_flat_state(filled))


def new_parameter_paths(converted: LM, source: LM) -> list[tuple]:
  """Paths of the parameters ``converted`` has and ``source`` has not (the KVM-only ones)."""
  old = {path for path, _ in nnx.to_flat_state(nnx.state(source))}
  return [path for path, _ in nnx.to_flat_state(nnx.state(converted)) if path not in old]


# -- run directories -----------------------------------------------------------------------------


def describe_kvm(kvm: KVMConfig, only: Optional[Sequence[str]] = None) -> dict:
  """A JSON-able summary of KVM options (for records and reports); ``only`` keeps those fields."""
  out = {f.name: getattr(kvm, f.name) for f in dataclasses.fields(kvm)
         if only is None or f.name in only}
  if "budget" in out:
    out["budget"] = budget_label(kvm.budget)
  return out


# -- command-line fields -------------------------------------------------------------------------

def parse_kvm_value(field: str, text: str) -> Any:
  """The value of KVMConfig ``field`` written as ``text`` on a command line (``--kvm.FIELD=...``),
  spelled as every CLI reads values (:data:`kvm_jax.config.io.VALUE_SPEC_HELP`: a budget spec,
  ``none`` for an optional field, true/false for a flag)."""
  fields = {f.name: f for f in dataclasses.fields(KVMConfig)}
  if field not in fields:
    raise ValueError(f"--kvm.{field}: KVMConfig has no field {field!r}; the schedule fields are "
                     f"{', '.join(SCHEDULE_FIELDS)}.")
  try:
    return parse_field(fields[field], fields[field].default, text)
  except ValueError as e:
    raise ValueError(f"--kvm.{field}={text}: {e}") from None


def parse_kvm_flags(items: Sequence[str]) -> dict[str, Any]:
  """``["--kvm.budget=sqrt:4", "--kvm.chunk_size=16"]`` -> ``{"budget": PowerLawBudget(4.0),
  "chunk_size": 16}``; anything else is refused by name."""
  fields: dict[str, Any] = {}
  for item in items:
    if not item.startswith("--kvm.") or "=" not in item:
      raise ValueError(f"unrecognized argument {item!r}; KVM options look like "
                       "--kvm.FIELD=VALUE (e.g. --kvm.budget=fixed:64).")
    field, text = item[len("--kvm."):].split("=", 1)
    fields[field] = parse_kvm_value(field, text)
  return fields


def kvm_flags(args, rest: Sequence[str]) -> dict[str, Any]:
  """The KVMConfig fields of the ``--kvm.FIELD=VALUE`` arguments argparse left over (``rest``
  of ``parse_known_args``); a ValueError for anything else, or for the placeholder itself."""
  if getattr(args, "kvm_help", None) is not None:
    raise ValueError("--kvm.FIELD stands for a field name: write e.g. --kvm.budget=fixed:64")
  return parse_kvm_flags(rest)
