"""The ``rwkv7`` mixer: the RWKV-7 time mix of the paper's RWKV-7 baseline (the authors'
``model/rwkv7_mixer.py``), with its recurrence from :mod:`kvm_jax.ops.rwkv7`.

For a layer input ``x [B, T, C]`` (the block's ``ln_attn`` output), with ``xx`` the token-shift
difference ``x_{t-1} - x_t`` (``x_{-1} = 0``) and ``x_• = x + xx ⊙ mix_•`` for • in r, w, k, v,
a, g::

    r = W_r x_r                       k = W_k x_k                 v = W_v x_v
    w = -exp(-softplus(-(w0 + W_w2 tanh(W_w1 x_w))) - ½)          (log decay, in (-e^-½, 0))
    v ← v + (v_first - v) ⊙ σ(v0 + W_v2 W_v1 x_v)                (value residual, always on)
    a = σ(a0 + W_a2 W_a1 x_a)         g = W_g2 σ(W_g1 x_g)
    kk = normalize_per_head(k ⊙ k_k)  k ← k ⊙ (1 + (a - 1) ⊙ k_a)
    o = recurrence(r, w, k, v, -kk, kk ⊙ a)                       (state Dv × Dk per head, O(1))
    o = GroupNorm_H(o) + (Σ_head r ⊙ k ⊙ r_k) v
    out = W_o (o ⊙ g)

``v_first`` is layer 0's ``W_v x_v`` (its own value, so layer 0's residual is the identity). The
output projection starts at zero. Decoding keeps the state and the last input (:class:`RWKV7Cache`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig, lora_width
from kvm_jax.nn.authors_format import (LN_LEAVES, AuthorsMixer, AuthorsReading, Layout,
                                       copied, transposed, with_leading_ones)
from kvm_jax.nn.mixers.attention import cache_bytes_from_shapes
from kvm_jax.nn.cache import (is_resume, keep_inactive, last_tokens, piece_counts, real_tokens,
                              step_active)
from kvm_jax.nn.mixers.mixer import MixerOutput
from kvm_jax.nn.layers import GroupNorm, float32_init, linear, shift_delta, zeros_init
from kvm_jax.ops.kvm.state import safe_l2_norm
from kvm_jax.ops.rwkv7.scan import MAX_CHUNK, rwkv7_recurrence, rwkv7_step

Array = jax.Array


# (multiplier, power) of each LoRA, by the name of its input projection.
LORAS = {"w": (1.8, 0.5), "a": (1.8, 0.5), "v": (1.3, 0.5), "g": (0.6, 0.8)}
SHIFTS = ("r", "w", "k", "v", "a", "g")
# Exponents of the token-shift mixes' init 1 - (i/C)^(p·ρ), ρ falling from 1 with depth.
SHIFT_POWERS = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}


@dataclasses.dataclass(frozen=True)
class RWKV7Options:
  """Options of ``rwkv7`` layers.

  Attributes:
    chunk_size: tokens per chunk of the chunk-parallel recurrence in whole-sequence calls (even,
      2 to 256; 64 by default). A compute setting: every value gives the same function up to
      float32 rounding (the decay factors within a chunk reach e^±(chunk_size/2 · e^-½), which
      float32 holds up to 256).
  """

  chunk_size: int = 64

  def __post_init__(self):
    if (isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int)
        or not 2 <= self.chunk_size <= MAX_CHUNK or self.chunk_size % 2):
      raise ValueError(f"RWKV7Options.chunk_size must be an even int in [2, {MAX_CHUNK}], got "
                       f"{self.chunk_size!r}.")

  def rotary_dims(self, model) -> int:
    """RWKV-7 layers use no rotary embedding."""
    return 0

  def check(self, model) -> None:
    """The time mix's shapes: C → C projections split into heads of the model's head dim."""
    if model.kv_heads != model.num_heads:
      raise ValueError(f"rwkv7 layers have one key/value head per head; num_kv_heads="
                       f"{model.num_kv_heads} must be None.")
    if model.num_heads * model.qk_head_dim != model.hidden_size:
      raise ValueError(f"rwkv7 layers split the width into heads: num_heads x head_dim = "
                       f"{model.num_heads} x {model.qk_head_dim} must equal hidden_size="
                       f"{model.hidden_size}.")
    if model.v_head_dim != model.qk_head_dim:
      raise ValueError(f"rwkv7 layers have value heads of the key width; value_head_dim="
                       f"{model.value_head_dim} must be None.")
    # A family with a value-residual switch (GPTAlpha-2) must have it on; in one without it
    # (Llama) the residual is the time mix's own.
    if hasattr(model.family_options, "value_residual") and not model.value_residual:
      raise ValueError("rwkv7 layers always mix the first layer's value in (the authors' time "
                       "mix has no switch for it); set value_residual=True.")
    if model.kv_sharing != "none":
      raise ValueError(f"rwkv7 layers cannot take part in kv_sharing={model.kv_sharing!r}; set "
                       "kv_sharing='none'.")
    first = next(i for i, kind in enumerate(model.layer_mixers)
                 if isinstance(model.options_of(kind), RWKV7Options))
    if first > 0 and not model.share_value_anchor:
      raise ValueError(
          f"the first RWKV-7 layer is layer {first}: RWKV-7's value anchor is its first layer's "
          "value of the token-shifted ln_attn(x0), and a decode step keeps only the shift of "
          "that layer's own input, which differs from ln_attn(x0) past layer 0; put an rwkv7 "
          "layer first (or set share_value_anchor=True).")


@dataclasses.dataclass(frozen=True)
class RWKV7Cache:
  """Decode state of one RWKV-7 layer: the recurrence's state ``[B, H, Dk, Dv]`` float32, the
  last layer input ``[B, 1, C]`` (the next token's shift), the tokens each row has seen
  (``[B]`` int32) and the longest sequence it was made for (static; the state does not grow)."""

  state: Array
  last_input: Array
  length: Array
  max_len: int


jax.tree_util.register_dataclass(RWKV7Cache, data_fields=["state", "last_input", "length"],
                                 meta_fields=["max_len"])


# Their time mix (model/rwkv7_mixer.py) names its tensors its own way: projections, the
# per-channel vectors (stored with two leading singleton axes), r_k [H, N] and the GroupNorm ln_x.
_AUTHORS_PROJECTIONS = {"receptance", "key", "value", "output", "w1", "w2", "a1", "a2", "v1", "v2",
                        "g1", "g2"}
_AUTHORS_VECTORS = {"x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0", "v0", "k_k", "k_a"}


def _authors_layout(prefix: str, owners: list[str], leaf: str, shape) -> Optional[Layout]:
  """The authors' layout of an ``rwkv7`` layer's own parameter (None for the block's shared
  ones, which :func:`kvm_jax.nn.authors_format.layout_of` maps)."""
  if owners == ["attn"] and leaf in _AUTHORS_VECTORS:
    return with_leading_ones(f"{prefix}attn.{leaf}", shape)
  if owners == ["attn"] and leaf == "r_k":
    return copied(f"{prefix}attn.r_k", shape)
  if owners == ["attn", "ln_x"] and leaf in LN_LEAVES:
    return copied(f"{prefix}attn.ln_x.{LN_LEAVES[leaf]}", shape)
  if len(owners) == 2 and owners[1] in _AUTHORS_PROJECTIONS and leaf == "kernel":
    return transposed(f"{prefix}attn.{owners[1]}.weight", shape)
  return None


def _read_authors_options(reading: AuthorsReading) -> RWKV7Options:
  """Their config has no RWKV-7 options (``chunk_size`` is kvm_jax's compute setting): the
  defaults."""
  return RWKV7Options()


def _ramp(n: int, power: float, dtype) -> Array:
  return jnp.asarray(1.0 - np.power(np.arange(n) / n, power), dtype)


class RWKV7TimeMix(nnx.Module):
  """RWKV-7's time mix; a mixer kind (:class:`kvm_jax.nn.mixers.mixer.MixerKind`) that shares none of
  the attention front end."""

  Options = RWKV7Options
  AUTHORS = AuthorsMixer(("rwkv7",), ("model.rwkv7_mixer.SequenceMixer",), None, rotates=False,
                         title="RWKV-7", own_head_width=True, always_value_residual=True,
                         read_options=_read_authors_options, layout=_authors_layout)
  # A soft-capping family (Gemma 2) caps attention scores; the time mix computes none, so it
  # computes the family's model as it is.
  SOFTCAP = True
  LOGICAL_AXES = {"receptance": ("embed", "heads"), "key": ("embed", "heads"),
                  "value": ("embed", "heads"), "output": ("heads", "embed"),
                  "w1": ("embed", "lora"), "w2": ("lora", "heads"),
                  "a1": ("embed", "lora"), "a2": ("lora", "heads"),
                  "v1": ("embed", "lora"), "v2": ("lora", "heads"),
                  "g1": ("embed", "lora"), "g2": ("lora", "heads"),
                  "r_k": (None, None)}
  PARAM_GROUPS: dict = {}
  DOCUMENTS = True  # packed documents: the shift and the recurrence restart at each one

  @classmethod
  def mup_d_in_ratios(cls, cfg: ModelConfig) -> dict:
    """Each LoRA's output projection reads its LoRA's channels: ratio lora / lora at the base."""
    return {f"{name}2": lora_width(cfg.hidden_size, m, p) / lora_width(cfg.mup_base_dim, m, p)
            for name, (m, p) in LORAS.items()}

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """0: no key is kept exactly; every token lives on only in the recurrent state."""
    return 0

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    """The recurrent state's size, which does not grow with ``seq_len``."""
    return f"{cfg.qk_head_dim}x{cfg.v_head_dim} state/head"

  @classmethod
  def resume_alignment(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Any piece from any position: the recurrence continues from the cached state."""
    return 1

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """The recurrence costs about 9·Dk·Dv FLOPs per token and head (state update and readout),
    what attention spends on 9·Dv/4 keys (4·D FLOPs each): independent of the position."""
    return 9.0 * cfg.v_head_dim / 4.0

  cache_bytes = classmethod(cache_bytes_from_shapes)

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.cfg, self.layer = cfg, layer
    self.kind = cfg.layer_mixers[layer]
    self.options = cfg.options_of(self.kind)
    self.sources = None
    C, H, N, L = cfg.hidden_size, cfg.num_heads, cfg.qk_head_dim, cfg.num_layers
    pd = cfg.jnp_param_dtype
    depth = layer / (L - 1) if L > 1 else 0.0                 # 0 at the first layer, 1 at the last
    rho = 1.0 - layer / L
    i = np.arange(C)
    linear_ramp = i / (C - 1) - 0.5
    zigzag = ((i % N) - (N - 1) / 2) / ((N - 1) / 2)
    zigzag = zigzag * np.abs(zigzag)
    decay_speed = -6 + 6 * (i / (C - 1)) ** (1 + depth ** 0.3)
    vector = lambda values: nnx.Param(jnp.asarray(values, pd))
    if cfg.tokenshift_attention:
      for name in SHIFTS:
        setattr(self, f"x_{name}", nnx.Param(_ramp(C, SHIFT_POWERS[name] * rho, pd)))
    lora_out = float32_init(jax.nn.initializers.orthogonal(scale=0.1))
    for name, (m, p) in LORAS.items():
      width = lora_width(C, m, p)
      setattr(self, f"{name}1", linear(cfg, C, width, rngs, init=zeros_init))
      setattr(self, f"{name}2", linear(cfg, width, C, rngs, init=lora_out))
    self.w0 = vector(decay_speed + 0.5 + zigzag * 2.5)
    self.a0 = vector(-0.19 + zigzag * 0.3 + linear_ramp * 0.4)
    self.v0 = vector(0.73 - linear_ramp * 0.4)
    self.k_k = vector(0.71 - linear_ramp * 0.1)
    self.k_a = vector(np.full(C, 1.02))
    self.r_k = nnx.Param(jnp.full((H, N), -0.04, pd))
    orthogonal = lambda gain: float32_init(jax.nn.initializers.orthogonal(scale=gain))
    self.receptance = linear(cfg, C, C, rngs, init=orthogonal(1.0))
    self.key = linear(cfg, C, C, rngs, init=orthogonal(0.1))
    self.value = linear(cfg, C, C, rngs, init=orthogonal(1.0))
    self.output = linear(cfg, C, C, rngs, init=zeros_init)
    self.ln_x = GroupNorm(C, H, 64e-5, pd, scale_init=((1 + layer) / L) ** 0.7)

  # -- the protocol of a mixer kind ---------------------------------------------------------
  def init_cache(self, batch: int, max_len: int) -> RWKV7Cache:
    cfg = self.cfg
    N = cfg.qk_head_dim
    return RWKV7Cache(state=jnp.zeros((batch, cfg.num_heads, N, N), jnp.float32),
                      last_input=jnp.zeros((batch, 1, cfg.hidden_size), cfg.jnp_compute_dtype),
                      length=jnp.zeros((batch,), jnp.int32), max_len=max_len)

  def init_tails(self, batch: int) -> tuple:
    return (None, None, None)  # the shift history lives in the mixer cache

  def _shifted(self, x: Array, prev: Optional[Array],
               starts: Optional[Array] = None) -> dict[str, Array]:
    """``x_•`` of each projection ``[B, T, C]`` (``starts``: packed documents' first tokens, where
    the shift restarts)."""
    if not self.cfg.tokenshift_attention:
      return {name: x for name in SHIFTS}
    delta = shift_delta(x, prev, "zero", starts)
    return {name: x + delta * getattr(self, f"x_{name}")[...].astype(x.dtype) for name in SHIFTS}

  def anchor_value(self, x_normed: Array, cache=None, documents=None) -> Array:
    """``v_first`` = W_v x_v of this (the first) layer (``documents``: packed documents)."""
    prev = None if cache is None else cache.mixer.last_input
    starts = None if documents is None else documents.position == 0
    return self.value(self._shifted(x_normed, prev, starts)["v"])

  def __call__(self, x: Array, v_first: Array, positions: Array, cache=None, decode=False,
               shared=None, documents=None):
    """Whole sequence (``decode=False``; fills the cache when one is given) or one token.
    Returns a :class:`MixerOutput` (no token-shift tails: the history is in the cache; no
    exports).
    ``documents``: packed documents (whole sequences without a cache), each computed alone."""
    del positions, shared
    cfg = self.cfg
    B, T, C = x.shape
    H, N = cfg.num_heads, cfg.qk_head_dim
    mixer_cache = None if cache is None else cache.mixer
    segment_ids = starts = None
    if documents is not None:
      if decode or cache is not None:
        raise ValueError("segment_ids: packed documents run as whole sequences without a cache; "
                         "prefill and decode take one sequence per row.")
      segment_ids = documents.segment_ids()
      starts = documents.position == 0
    xs = self._shifted(x, mixer_cache.last_input if decode else None, starts)
    f32 = lambda y: y.astype(jnp.float32)
    heads = lambda y: y.reshape(B, T, H, N)
    r = self.receptance(xs["r"])
    decay = f32(self.w0[...]) + f32(self.w2(jnp.tanh(self.w1(xs["w"]))))
    log_w = -jnp.exp(-jax.nn.softplus(-decay) - 0.5)
    k = self.key(xs["k"])
    v = self.value(xs["v"])
    gate_v = jax.nn.sigmoid(f32(self.v0[...]) + f32(self.v2(self.v1(xs["v"]))))
    v = v + (v_first.astype(v.dtype) - v) * gate_v.astype(v.dtype)
    a = jax.nn.sigmoid(f32(self.a0[...]) + f32(self.a2(self.a1(xs["a"]))))
    g = self.g2(jax.nn.sigmoid(self.g1(xs["g"])))
    kk = heads(f32(k) * f32(self.k_k[...]))
    kk = kk / jnp.maximum(safe_l2_norm(kk)[..., None], 1e-12)   # F.normalize
    k = f32(k) * (1.0 + (a - 1.0) * f32(self.k_a[...]))
    rh, kh, vh, ah = heads(f32(r)), heads(k), heads(f32(v)), heads(a)
    inputs = (rh, heads(log_w), kh, vh, -kk, kk * ah)
    counts = piece_counts(decode)
    if is_resume(decode):
      if counts is not None:  # padding: no decay, no key, no removal (the state passes it by)
        real = real_tokens(counts, B, T)[:, :, None, None]
        r_, w_, k_, v_, a_, b_ = inputs
        inputs = (r_, *(jnp.where(real, z, 0.0) for z in (w_, k_)), v_,
                  *(jnp.where(real, z, 0.0) for z in (a_, b_)))
      y, state = rwkv7_recurrence(*inputs, initial_state=mixer_cache.state,
                                  chunk_size=self.options.chunk_size)
      length = mixer_cache.length + (T if counts is None else counts)
    elif decode:
      y, state = rwkv7_step(*(z[:, 0] for z in inputs), mixer_cache.state)
      y, length = y[:, None], mixer_cache.length + 1
    else:
      y, state = rwkv7_recurrence(*inputs, chunk_size=self.options.chunk_size,
                                  segment_ids=segment_ids)
      length = jnp.full((B,), T, jnp.int32)
    if mixer_cache is not None:
      last = last_tokens(x, counts).astype(mixer_cache.last_input.dtype)
      # A row the step does not feed keeps its state (recomputed whole anyway: one select).
      state, last, length = keep_inactive(step_active(decode), (state, last, length),
                                          (mixer_cache.state, mixer_cache.last_input,
                                           mixer_cache.length))
      mixer_cache = RWKV7Cache(state=state, last_input=last, length=length,
                               max_len=mixer_cache.max_len)
    y = self.ln_x(y.reshape(B, T, C))
    bonus = jnp.sum(rh * kh * f32(self.r_k[...]), -1, keepdims=True) * vh
    y = (y + bonus.reshape(B, T, C)).astype(x.dtype)
    return MixerOutput(self.output(y * g.astype(x.dtype)), mixer_cache, (None, None, None), {})
