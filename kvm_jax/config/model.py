"""``ModelConfig``: a decoder-only backbone of one family (GPTAlpha-2, the paper's, by default;
Llama and its relatives) with one sequence mixer per layer (docs/kvm-spec.md §3–§4)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence, Union

import jax.numpy as jnp

from kvm_jax.config.kvm import KVM_IMPLEMENTATIONS, KVMConfig
from kvm_jax.config.families import family_options_class
from kvm_jax.config.mixers import KindOptions, check_options, options_class, rotary_dims

KV_SHARING = ("none", "fusedkv", "fusedkv_lite", "yoco", "cla")
KVM_KV_SHARING = ("window", "shared_routing")
#: What ``ModelConfig.attention_implementation`` accepts; ``kvm_jax.ops.attention.api`` gives each
#: name its meaning.
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "chunked", "cudnn", "splash", "tokamax")
_DTYPES = ("float32", "bfloat16")


def mixer_pattern(mixers: Union[str, Sequence[str]]) -> tuple[str, ...]:
  """The kinds a ``ModelConfig.mixers`` value names, in order: ``"kvm"`` -> ``("kvm",)``,
  ``"swa,kvm"`` (the command line's spelling) -> ``("swa", "kvm")``, a sequence as it is."""
  if isinstance(mixers, str):
    return tuple(m.strip() for m in mixers.split(","))
  return tuple(mixers)


def lora_width(width: int, multiplier: float, power: float) -> int:
  """The authors' LoRA widths for model width ``width``: max(32, round(multiplier·width^power /
  32)·32)."""
  return max(32, int(round(multiplier * width ** power / 32) * 32))


def value_lora_width(width: int) -> int:
  """Width of the value-residual LoRA for model width ``width``: max(32, round(1.3·√width / 32)·32)
  (docs/kvm-spec.md §4; 32 for widths 768 and 1024)."""
  return lora_width(width, 1.3, 0.5)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only LM. Fields mirror the authors' ``MixerConfigDataclass`` where they exist.

  Attributes:
    vocab_size: V (paper 50304: GPT-2's 50257 padded).
    num_layers / hidden_size / num_heads: depth, width C_model, query heads H.
    num_kv_heads: Hkv for GQA (None = H).
    head_dim / value_head_dim: D / Dv (None = hidden_size // num_heads).
    mixers: one mixer kind for all layers ("kvm"), one per layer, or a pattern repeated to the
      depth (("swa", "kvm") or "swa,kvm" for the paper's hybrids): "full", "swa", "bswa", "kvm",
      "ovq", "rwkv7" or any kind added with :func:`kvm_jax.nn.register_mixer`.
    options: ``{kind: options}``, each kind's own frozen options (a :class:`KindOptions`; a dict
      is converted): :class:`kvm_jax.KVMConfig` for ``kvm``, ``kvm_jax.nn.mixers.swa.SWAOptions``
      (window, rotary width) for ``swa``, ``kvm_jax.nn.mixers.bswa.BSWAOptions`` (chunk geometry, sinks)
      for ``bswa``. A kind without an entry uses its options' defaults (:meth:`options_of`).
    family: the backbone family ("gptalpha2", "llama", "gemma" or one added with
      :func:`kvm_jax.nn.register_family`): its block (norms, MLP), embedding, head, attention
      front end (projections, q/k norms, RoPE style and score scale) and checkpoint mapping
      (docs/pretrained.md).
    family_options: the family's own frozen options (``kvm_jax.nn.GPTAlpha2Options``: MLP
      width factor, token shift, value residual, shared anchor; ``kvm_jax.nn.LlamaOptions``: MLP
      width, norm epsilon, biases, q/k norms, RoPE scaling, tied embeddings;
      ``kvm_jax.nn.GemmaOptions``: also the local layers and their RoPE base, the score scale);
      None (or a dict) means the family's defaults (or those fields).
    rope_dims / rope_theta: rotary channels (first ``rope_dims`` of D) and base (docs/kvm-spec.md
      §5) of every layer whose kind does not set its own (``swa`` may); the ``kvm`` options'
      ``rope_dims`` must equal it.
    residual_scale: multiplies both branches of every block (CompleteP depth rule 12/L); None = 1.
    mup_base_dim: width the value-residual LoRA rule is relative to (768).
    param_dtype / compute_dtype: parameter and activation dtypes; logits, loss and the KVM state
      are float32 regardless.
    rope_table_dtype: "float32" (default) or "bfloat16" (the authors' cast cos/sin tables).
    kvm_implementation: the KVM core of every ``kvm`` layer in forward, prefill and decode: "xla"
      (the chunked scan), "pallas" (fused kernels; interpret mode on CPU) or "auto".
    attention_implementation: the kernel of the ``full`` and ``swa`` layers' softmax attention
      (forward and prefill): "auto" (default: cuDNN on GPU for bf16, splash on TPU, the chunked
      XLA path elsewhere; dense ``[T, T]`` scores only for T <= 512), "xla" (dense), "chunked",
      "cudnn", "splash" or "tokamax" (see ``kvm_jax.ops.attention.api``).
    kv_sharing: cross-layer KV sharing (``docs/fusedkv.md``). With n = num_layers / 2,
      layers >= n are *reconstruction* layers (no K/V projections, no K/V cache):
      "none"; "fusedkv" (``K^i = a_i1⊙K^1 + a_in⊙K^n``, ``V^i = b_i1⊙V^1 + b_in⊙V^n``, learnable
      channel-wise weights, rotary pairs tied); "fusedkv_lite" (``K^i = K^n``, ``V^i = V^1``);
      "yoco" (every upper layer uses layer n's K/V); "cla" (odd layers use the layer below).
    fusedkv_init: "lite" (default: a_n = b_1 = 1, a_1 = b_n = 0, so FusedKV starts as Lite) or
      "mean" (all four weights 0.5).
    kvm_kv_sharing: how a ``kvm`` reconstruction layer shares: "window" (window-only fusion: its
      exact window comes from the source layers' windows on demand, while it keeps its own
      compressed state, updated from the fused per-token K/V with its own merge gates) or
      "shared_routing" (every KVM source layer applies layer 0's routing decisions, so source
      states are row-aligned; reconstruction layers fuse the source *states* row by row and store
      nothing at all).
  """

  vocab_size: int = 50304
  num_layers: int = 12
  hidden_size: int = 768
  num_heads: int = 6
  num_kv_heads: Optional[int] = None
  head_dim: Optional[int] = None
  value_head_dim: Optional[int] = None
  mixers: Union[str, tuple[str, ...]] = "kvm"
  options: Union[KindOptions, Mapping[str, Any]] = KindOptions()
  family: str = "gptalpha2"
  family_options: Any = None
  rope_dims: int = 64
  rope_theta: float = 10000.0
  residual_scale: Optional[float] = None
  mup_base_dim: int = 768
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  rope_table_dtype: str = "float32"
  kvm_implementation: str = "xla"
  attention_implementation: str = "auto"
  kv_sharing: str = "none"
  fusedkv_init: str = "lite"
  kvm_kv_sharing: str = "window"

  def __post_init__(self):
    def pos(name):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}.")
    for name in ("vocab_size", "num_layers", "hidden_size", "num_heads", "mup_base_dim"):
      pos(name)
    if not isinstance(self.options, KindOptions):
      object.__setattr__(self, "options", KindOptions(self.options))
    self._resolve_family_options()
    pattern = mixer_pattern(self.mixers)
    if not pattern or self.num_layers % len(pattern):
      raise ValueError(f"ModelConfig.mixers={self.mixers!r} has {len(pattern)} entries but "
                       f"num_layers={self.num_layers}; give one mixer per layer, a single name, "
                       "or a pattern whose length divides the depth (\"swa,kvm\" repeats).")
    for m in pattern:
      try:
        options_class(m)
      except ValueError as e:
        raise ValueError(f"ModelConfig.mixers: {e}") from None
    mixers = pattern * (self.num_layers // len(pattern))
    # One spelling per layout, so that configs compare equal however they were written: the
    # shortest repeating pattern, a single name when every layer is one kind.
    period = next(p for p in range(1, self.num_layers + 1)
                  if self.num_layers % p == 0 and mixers == mixers[:p] * (self.num_layers // p))
    object.__setattr__(self, "mixers", mixers[0] if period == 1 else mixers[:period])
    kv = self.num_kv_heads if self.num_kv_heads is not None else self.num_heads
    if kv < 1 or self.num_heads % kv:
      raise ValueError(f"ModelConfig.num_kv_heads={self.num_kv_heads} must divide num_heads="
                       f"{self.num_heads}.")
    if self.head_dim is None and self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_heads="
                       f"{self.num_heads}; set head_dim explicitly.")
    D = self.qk_head_dim
    if self.rope_dims % 2 or not 0 <= self.rope_dims <= D:
      raise ValueError(f"ModelConfig.rope_dims={self.rope_dims} must be even and in [0, head dim "
                       f"{D}].")
    for kind in dict.fromkeys(mixers):
      options = self.options_of(kind)
      r = rotary_dims(options, self)
      if r % 2 or not 0 <= r <= D:
        raise ValueError(f"ModelConfig.options[{kind!r}]: rotary dims {r} must be even and in "
                         f"[0, head dim {D}].")
      try:
        check_options(options, self)
      except ValueError as e:
        raise ValueError(f"ModelConfig.options[{kind!r}]: {e}") from None
    for name in ("param_dtype", "compute_dtype", "rope_table_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name} must be one of {_DTYPES}, got {getattr(self, name)!r}.")
    if self.kvm_implementation not in KVM_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.kvm_implementation={self.kvm_implementation!r}; choose "
                       f"from {KVM_IMPLEMENTATIONS}.")
    if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"ModelConfig.attention_implementation={self.attention_implementation!r}; "
                       f"choose from {ATTENTION_IMPLEMENTATIONS}.")
    self._validate_kv_sharing(mixers)
    check = getattr(self.family_options, "check", None)
    if check is not None:
      try:
        check(self)
      except ValueError as e:
        raise ValueError(f"ModelConfig.family_options ({self.family}): {e}") from None

  def _resolve_family_options(self) -> None:
    """``family_options`` as an instance of the family's options class (None: its defaults)."""
    cls = family_options_class(self.family)
    options = self.family_options
    if options is None:
      options = cls()
    elif isinstance(options, Mapping):  # from JSON or a command line: a plain dict of fields
      options = cls(**options)
    if not isinstance(options, cls):
      raise TypeError(f"ModelConfig.family_options must be a {cls.__name__} for family "
                      f"{self.family!r}, got {type(options).__name__} {options!r}; when "
                      "changing the family, give its options too (None: its defaults).")
    object.__setattr__(self, "family_options", options)

  def _validate_kv_sharing(self, mixers) -> None:
    if self.kv_sharing not in KV_SHARING:
      raise ValueError(f"ModelConfig.kv_sharing={self.kv_sharing!r}; choose from {KV_SHARING}.")
    if self.fusedkv_init not in ("lite", "mean"):
      raise ValueError(f"ModelConfig.fusedkv_init={self.fusedkv_init!r}; choose 'lite' or 'mean'.")
    if self.kvm_kv_sharing not in KVM_KV_SHARING:
      raise ValueError(f"ModelConfig.kvm_kv_sharing={self.kvm_kv_sharing!r}; choose from "
                       f"{KVM_KV_SHARING}.")
    if (self.kvm_kv_sharing == "shared_routing" and self.kv_sharing != "none"
        and any(self.is_kvm(i) and self.options_of(m).readout_value_dtype is not None
                for i, m in enumerate(mixers))):
      raise ValueError("kvm_kv_sharing='shared_routing' fuses float32 readout states; it does not "
                       "support kvm.readout_value_dtype (set it to None).")
    if self.kv_sharing == "none":
      return
    L = self.num_layers
    if L < 2 or L % 2:
      split = "adjacent pairs" if self.kv_sharing == "cla" else "a lower and an upper half"
      raise ValueError(f"kv_sharing={self.kv_sharing!r} splits the layers into {split}, which "
                       f"needs an even num_layers >= 2, got {L}.")
    for layer in range(L):
      sources = self.kv_sources(layer)
      if sources is None:
        continue
      for src in sorted(set(sources[0] + sources[1])):
        if self.kv_layout(src) != self.kv_layout(layer):
          raise ValueError(
              f"kv_sharing={self.kv_sharing!r}: layer {layer} ({mixers[layer]}) would reuse the "
              f"K/V of layer {src} ({mixers[src]}), but their K/V layouts differ "
              f"(mixer, kv heads, head dims, rotary dims: {self.kv_layout(src)} vs "
              f"{self.kv_layout(layer)}); share only between layers of the same mixer and "
              "geometry.")

  # Derived sizes ------------------------------------------------------------------------------
  @property
  def layer_mixers(self) -> tuple[str, ...]:
    """One mixer name per layer (``mixers`` may be a single name for all layers, or a pattern
    repeated to the depth)."""
    pattern = mixer_pattern(self.mixers)
    return pattern * (self.num_layers // len(pattern))

  @property
  def kv_heads(self) -> int:
    return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

  @property
  def qk_head_dim(self) -> int:
    return self.head_dim or self.hidden_size // self.num_heads

  @property
  def v_head_dim(self) -> int:
    return self.value_head_dim or self.head_dim or self.hidden_size // self.num_heads

  def options_of(self, kind: str) -> Any:
    """The options of mixer ``kind``: its entry in ``options``, or its options' defaults."""
    return self.options.resolve(kind)

  @property
  def kvm(self) -> KVMConfig:
    """Shorthand for ``options_of("kvm")``: the options of the ``kvm`` layers."""
    return self.options_of("kvm")

  def is_kvm(self, layer: int) -> bool:
    """A layer whose options are a :class:`KVMConfig` (``kvm``, or a kind registered on it):
    cross-layer KV sharing treats it as a KVM layer (states, routing)."""
    return isinstance(self.options_of(self.layer_mixers[layer]), KVMConfig)

  @property
  def mlp_width(self) -> int:
    """The MLP's hidden width (the family's rule)."""
    return int(self.family_options.mlp_width(self))

  # The GPTAlpha-2 front end's switches, read from the family's options: a family without the
  # field does not have the feature (Llama's layers shift no tokens and mix no value residual).
  @property
  def tokenshift_attention(self) -> bool:
    return bool(getattr(self.family_options, "tokenshift_attention", False))

  @property
  def tokenshift_mlp(self) -> bool:
    return bool(getattr(self.family_options, "tokenshift_mlp", False))

  @property
  def value_residual(self) -> bool:
    return bool(getattr(self.family_options, "value_residual", False))

  @property
  def share_value_anchor(self) -> bool:
    return bool(getattr(self.family_options, "share_value_anchor", False))

  def with_family_options(self, **fields) -> "ModelConfig":
    """A copy whose family options have ``fields`` replaced."""
    return dataclasses.replace(self, family_options=dataclasses.replace(self.family_options,
                                                                        **fields))

  @property
  def value_lora_width(self) -> int:
    return value_lora_width(self.hidden_size)

  @property
  def scale(self) -> float:
    return 1.0 if self.residual_scale is None else float(self.residual_scale)

  def rope_dims_of(self, layer: int) -> int:
    """Rotary channels of ``layer`` (its kind's options may set their own)."""
    return rotary_dims(self.options_of(self.layer_mixers[layer]), self)

  def kv_sources(self, layer: int) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(key source layers, value source layers)`` of a reconstruction layer; None for a layer
    that computes and stores its own K/V."""
    n = self.num_layers // 2
    mode = self.kv_sharing
    if mode == "none" or (mode != "cla" and layer < n) or (mode == "cla" and layer % 2 == 0):
      return None
    if mode == "fusedkv":
      return (0, n - 1), (0, n - 1)
    if mode == "fusedkv_lite":
      return (n - 1,), (0,)
    if mode == "yoco":
      return (n - 1,), (n - 1,)
    return (layer - 1,), (layer - 1,)  # cla

  def shares_state(self, layer: int) -> bool:
    """A ``kvm`` reconstruction layer whose compressed state is fused from its sources' states."""
    return (self.kvm_kv_sharing == "shared_routing" and self.is_kvm(layer)
            and self.kv_sources(layer) is not None)

  def routing_leader(self, layer: int) -> Optional[int]:
    """The layer whose routing decisions this storage ``kvm`` layer applies (shared routing: the
    second source of FusedKV/Lite follows layer 0 so that both source states are row-aligned)."""
    if self.kv_sources(layer) is not None or layer == 0:
      return None
    for upper in range(self.num_layers):
      if self.shares_state(upper):
        key_sources, value_sources = self.kv_sources(upper)
        if layer in key_sources + value_sources and len(set(key_sources + value_sources)) > 1:
          return 0
    return None

  def kv_layout(self, layer: int) -> tuple:
    """What must agree between a layer and the layers whose K/V it reuses."""
    return (self.layer_mixers[layer], self.kv_heads, self.qk_head_dim, self.v_head_dim,
            self.rope_dims_of(layer))

  def value_anchor(self, layer: int) -> int:
    """Layer whose ``c_v(ln_attn(x0))`` is this layer's value-residual anchor ``v_first``."""
    if self.share_value_anchor:
      return 0
    return self.layer_mixers.index(self.layer_mixers[layer])

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def jnp_compute_dtype(self):
    return jnp.dtype(self.compute_dtype)
