"""Model presets reproducing the paper's configurations (docs/kvm-spec.md §3; the authors'
``configs/prolong``).

Every function returns a :class:`kvm_jax.ModelConfig`. ``*_120m``: 12 layers, width 768, 6 heads of
128, residual scale 1.0; ``*_350m``: 24 layers, width 1024, 8 heads of 128, residual scale 0.5.
All use vocabulary 50304, MLP ×4, token shift on attention and MLP, value residual, RoPE on the first
64 of 128 channels (the SWA layers of the hybrids rotate all 128; OVQ and RWKV-7 layers none).
:func:`tiny` is the same architecture at CPU-test size. :data:`PRESETS` maps each paper preset's
name to its function.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from kvm_jax.config.budget import FixedBudget, PowerLawBudget, SaturatingBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.mixers.bswa import BSWAOptions
from kvm_jax.nn.families.gemma import GemmaOptions
from kvm_jax.nn.families.llama import LlamaOptions
from kvm_jax.nn.registry import mixer_class, registered_mixers
from kvm_jax.nn.mixers.rwkv7 import RWKV7Options
from kvm_jax.nn.mixers.swa import SWAOptions
from kvm_jax.ops.ovq.config import OVQConfig

_SIZES = {
    "120m": dict(num_layers=12, hidden_size=768, num_heads=6, residual_scale=1.0),
    "350m": dict(num_layers=24, hidden_size=1024, num_heads=8, residual_scale=0.5),
}
_PAPER_KVM = dict(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64)
_NO_CAP = 256 * 10000  # the authors' n_max_d_chunks = 10000: no cap in practice
_PAPER_SWA = SWAOptions(window=256, rope_dims=128)  # the hybrids' SWA layers: full RoPE


def _paper(size: str, **kw) -> ModelConfig:
  kw.setdefault("rope_dims", 64)
  return ModelConfig(vocab_size=50304, **_SIZES[size], **kw)


def _hybrid(main: str, size: str) -> tuple[str, ...]:
  """The authors' ``alt_layer_every: 2``: SWA on even layers, ``main`` on odd layers."""
  return tuple("swa" if i % 2 == 0 else main for i in range(_SIZES[size]["num_layers"]))


# One builder per family; the presets below bind the size.

def _gpta2(size: str) -> ModelConfig:
  return _paper(size, mixers="full")


def _kvm256(size: str) -> ModelConfig:
  return _paper(size, mixers="kvm", options={"kvm": KVMConfig(
      budget=FixedBudget(256), max_state_rows=256, **_PAPER_KVM)})


def _kvm_sqrt16(size: str) -> ModelConfig:
  return _paper(size, mixers="kvm", options={"kvm": KVMConfig(
      budget=PowerLawBudget(16.0, 0.5, min_rows=256), max_state_rows=_NO_CAP, **_PAPER_KVM)})


def _kvm_swa_sat1024(size: str) -> ModelConfig:
  kvm = KVMConfig(budget=SaturatingBudget(1024, min_rows=1), max_state_rows=_NO_CAP, **_PAPER_KVM)
  return _paper(size, mixers=_hybrid("kvm", size), options={"swa": _PAPER_SWA, "kvm": kvm})


def _bswa(size: str) -> ModelConfig:
  return _paper(size, mixers="bswa",
                options={"bswa": BSWAOptions(chunk_size=256, window_chunks=3, sink_rows=0)})


def _swa_halfrope(size: str) -> ModelConfig:
  return _paper(size, mixers=_hybrid("full", size), options={"swa": _PAPER_SWA})


def _swa_nope(size: str) -> ModelConfig:
  return _paper(size, mixers=_hybrid("full", size), rope_dims=0, options={"swa": _PAPER_SWA})


def _ovq_swa(size: str) -> ModelConfig:
  # configs/prolong/*/ovq_swa_ts_c256_s1024_wd.yaml: rope_partial_dim 0 (the OVQ layers use none)
  return _paper(size, mixers=_hybrid("ovq", size), rope_dims=0,
                options={"swa": _PAPER_SWA,
                         "ovq": OVQConfig(chunk_size=256, max_centroids=1024)})


def _rwkv7(size: str) -> ModelConfig:
  # rwkv_wd.yaml leaves rope_partial_dim at its default, which no RWKV-7 layer reads
  return _paper(size, mixers="rwkv7", rope_dims=0, options={"rwkv7": RWKV7Options()})


def gpta2_120m() -> ModelConfig:
  """GPTAlpha-2, the full-attention baseline, at 120M."""
  return _gpta2("120m")


def gpta2_350m() -> ModelConfig:
  """GPTAlpha-2, the full-attention baseline, at 350M."""
  return _gpta2("350m")


def kvm256_120m() -> ModelConfig:
  """KVM with a fixed 256-row state (``kvm_wd``) at 120M."""
  return _kvm256("120m")


def kvm256_350m() -> ModelConfig:
  """KVM with a fixed 256-row state (``kvm_wd``) at 350M."""
  return _kvm256("350m")


def kvm_sqrt16_120m() -> ModelConfig:
  """KVM with a 16·√N-row state, at least 256 (``kvm_sqrt16_wd``), at 120M."""
  return _kvm_sqrt16("120m")


def kvm_sqrt16_350m() -> ModelConfig:
  """KVM with a 16·√N-row state, at least 256 (``kvm_sqrt16_wd``), at 350M."""
  return _kvm_sqrt16("350m")


def kvm_swa_sat1024_120m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, KVM saturating toward 1024 rows on odd layers
  (``kvm_swa_saturate1024_wd``), at 120M."""
  return _kvm_swa_sat1024("120m")


def kvm_swa_sat1024_350m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, KVM saturating toward 1024 rows on odd layers
  (``kvm_swa_saturate1024_wd``), at 350M."""
  return _kvm_swa_sat1024("350m")


def bswa_120m() -> ModelConfig:
  """Block sliding window, 3 chunks of 256, no sink (the BSWA baseline), at 120M."""
  return _bswa("120m")


def bswa_350m() -> ModelConfig:
  """Block sliding window, 3 chunks of 256, no sink (the BSWA baseline), at 350M."""
  return _bswa("350m")


def swa_halfrope_120m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, HalfRoPE full attention on odd layers, 120M."""
  return _swa_halfrope("120m")


def swa_halfrope_350m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, HalfRoPE full attention on odd layers, 350M."""
  return _swa_halfrope("350m")


def swa_nope_120m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, NoPE full attention on odd layers, 120M."""
  return _swa_nope("120m")


def swa_nope_350m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, NoPE full attention on odd layers, 350M."""
  return _swa_nope("350m")


def ovq_swa_120m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, OVQ (chunks of 256, at most 1024 centroids, no
  RoPE) on odd layers (``ovq_swa_ts_c256_s1024_wd``), at 120M."""
  return _ovq_swa("120m")


def ovq_swa_350m() -> ModelConfig:
  """Hybrid: full-RoPE SWA-256 on even layers, OVQ (chunks of 256, at most 1024 centroids, no
  RoPE) on odd layers (``ovq_swa_ts_c256_s1024_wd``), at 350M."""
  return _ovq_swa("350m")


def rwkv7_120m() -> ModelConfig:
  """RWKV-7's time mix in every layer of the same backbone (``rwkv_wd``), at 120M."""
  return _rwkv7("120m")


def rwkv7_350m() -> ModelConfig:
  """RWKV-7's time mix in every layer of the same backbone (``rwkv_wd``), at 350M."""
  return _rwkv7("350m")


#: Each paper preset's name -> its function.
PRESETS: dict[str, Callable[[], ModelConfig]] = {f.__name__: f for f in (
    gpta2_120m, kvm256_120m, kvm_sqrt16_120m, kvm_swa_sat1024_120m, bswa_120m, swa_halfrope_120m,
    swa_nope_120m, ovq_swa_120m, rwkv7_120m, gpta2_350m, kvm256_350m, kvm_sqrt16_350m,
    kvm_swa_sat1024_350m, bswa_350m, swa_halfrope_350m, swa_nope_350m, ovq_swa_350m,
    rwkv7_350m)}


# Published shapes of pretrained families (their config.json values; no weights): what
# ``--memory-report`` sizes a conversion by. ``converted(cfg)`` makes their attention KVM-256.

def qwen3_0_6b() -> ModelConfig:
  """Qwen3-0.6B: 28 layers of width 1024, 16 query heads on 8 KV heads of 128, q/k norms, tied
  embeddings, vocabulary 151936."""
  return ModelConfig(
      family="llama", family_options=LlamaOptions(intermediate_size=3072, norm_eps=1e-6,
                                                  qk_norm=True, tie_embeddings=True),
      vocab_size=151936, num_layers=28, hidden_size=1024, num_heads=16, num_kv_heads=8,
      head_dim=128, mixers="full", rope_dims=128, rope_theta=1e6)


def llama3_2_1b() -> ModelConfig:
  """Llama-3.2-1B: 16 layers of width 2048, 32 query heads on 8 KV heads of 64, llama3 RoPE
  scaling (factor 32 from 8192 tokens), tied embeddings, vocabulary 128256."""
  return ModelConfig(
      family="llama", family_options=LlamaOptions(
          intermediate_size=8192, norm_eps=1e-5, tie_embeddings=True, rope_scaling="llama3",
          rope_factor=32.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
          rope_original_max_len=8192),
      vocab_size=128256, num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
      mixers="full", rope_dims=64, rope_theta=500000.0)


def gemma3_1b() -> ModelConfig:
  """Gemma-3-1B (text): 26 layers of width 1152, 4 query heads on 1 KV head of 256, five local
  layers (window 512, RoPE base 10^4) to each global one (base 10^6), vocabulary 262144."""
  local = tuple(i for i in range(26) if (i + 1) % 6)  # every sixth layer is global
  kinds = tuple("swa" if i in local else "full" for i in range(26))
  return ModelConfig(
      family="gemma", family_options=GemmaOptions(
          intermediate_size=6912, norm_eps=1e-6, query_pre_attn_scalar=256,
          local_layers=local),
      vocab_size=262144, num_layers=26, hidden_size=1152, num_heads=4, num_kv_heads=1,
      head_dim=256, mixers=kinds, options={"swa": SWAOptions(window=512)}, rope_dims=256,
      rope_theta=1e6)


PRETRAINED_SHAPES: dict[str, Callable[[], ModelConfig]] = {
    f.__name__: f for f in (qwen3_0_6b, llama3_2_1b, gemma3_1b)}


def converted(cfg: ModelConfig, layers: str = "global") -> ModelConfig:
  """``cfg`` with its full-attention layers (``layers="global"``; "all" adds the sliding-window
  ones) made KVM-256 layers (the paper's chunks of 256, two window chunks, a fixed 256-row state)
  rotating the model's channels: the config ``kj.convert_to_kvm`` would give."""
  from kvm_jax.nn.convert import (converted_config, default_state_rope_dims,  # the model layer,
                                  select_layers)                               # above presets
  kvm = KVMConfig(budget=FixedBudget(256), max_state_rows=256,
                  **{**_PAPER_KVM, "rope_dims": cfg.rope_dims,
                     "state_rope_dims": default_state_rope_dims(cfg)})
  return converted_config(cfg, select_layers(layers, cfg.num_layers, cfg.layer_mixers), kvm)


#: The options of tiny(): KVM with C=8, L=16; SWA over 12 tokens with full RoPE; BSWA like KVM's
#: window with one sink; OVQ chunks of 8 with at most 12 centroids; RWKV-7 chunks of 16.
TINY_OPTIONS = {
    "kvm": KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                     budget=PowerLawBudget(4.0, 0.5, min_rows=8)),
    "swa": SWAOptions(window=12, rope_dims=16),
    "bswa": BSWAOptions(chunk_size=8, window_chunks=2, sink_rows=1),
    "ovq": OVQConfig(chunk_size=8, max_centroids=12),
    "rwkv7": RWKV7Options(chunk_size=16),
}


def _tiny_options_by_type(mixers) -> dict:
  """{kind: the tiny options of the built-in kind whose options type it shares} for the kinds
  of ``mixers`` (a name or a pattern) that have no entry in :data:`TINY_OPTIONS`."""
  by_type = {type(o): o for o in TINY_OPTIONS.values()}
  kinds = (mixers,) if isinstance(mixers, str) else tuple(mixers)
  return {kind: by_type[mixer_class(kind).Options] for kind in kinds
          if kind not in TINY_OPTIONS and kind in registered_mixers()
          and mixer_class(kind).Options in by_type}


def tiny(mixers="kvm", options=None, **overrides) -> ModelConfig:
  """A CPU-test-sized model (2 layers, width 64, 4 heads of 16, vocab 256, C=8, L=16).

  ``options`` replaces entries of :data:`TINY_OPTIONS` (``{"kvm": KVMConfig(...)}``); the other
  keywords are ``ModelConfig`` fields. A kind without tiny options whose options are of a
  built-in kind's type (a subclass registered from outside) takes that kind's tiny ones."""
  table = {**_tiny_options_by_type(mixers), **TINY_OPTIONS, **(options or {})}
  table.update(overrides.pop("options", {}))
  base = dict(vocab_size=256, num_layers=2, hidden_size=64, num_heads=4, mixers=mixers,
              options=table, rope_dims=8, mup_base_dim=64)
  base.update(overrides)
  return ModelConfig(**base)


__all__ = sorted(PRESETS) + sorted(PRETRAINED_SHAPES) + ["PRESETS", "PRETRAINED_SHAPES",
                                                        "TINY_OPTIONS", "converted", "tiny"]
