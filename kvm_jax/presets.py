"""Model presets reproducing the paper's configurations (spec §3; the authors' ``configs/prolong``).

Every function returns a :class:`kvm_jax.ModelConfig`. ``*_120m``: 12 layers, width 768, 6 heads of
128, residual scale 1.0; ``*_350m``: 24 layers, width 1024, 8 heads of 128, residual scale 0.5.
All use vocabulary 50304, MLP ×4, token shift on attention and MLP, value residual, RoPE on the first
64 of 128 channels. ``tiny_*`` presets are the same architectures at CPU-test size.
"""

from __future__ import annotations


from kvm_jax.budget import FixedBudget, PowerLawBudget, SaturatingBudget
from kvm_jax.config import KVMConfig
from kvm_jax.model_config import ModelConfig

_SIZES = {
    "120m": dict(num_layers=12, hidden_size=768, num_heads=6, residual_scale=1.0),
    "350m": dict(num_layers=24, hidden_size=1024, num_heads=8, residual_scale=0.5),
}
_PAPER_KVM = dict(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64)


def _kvm(budget, max_state_rows) -> KVMConfig:
  return KVMConfig(budget=budget, max_state_rows=max_state_rows, **_PAPER_KVM)


def _hybrid(main: str, layers: int) -> tuple[str, ...]:
  """The authors' ``alt_layer_every: 2``: SWA on even layers, ``main`` on odd layers."""
  return tuple("swa" if i % 2 == 0 else main for i in range(layers))


def _build(size: str, **kw) -> ModelConfig:
  kw.setdefault("rope_dims", 64)
  return ModelConfig(vocab_size=50304, **_SIZES[size], **kw)


def _family(size: str) -> dict:
  n = _SIZES[size]["num_layers"]
  return {
      "gpta2": lambda: _build(size, mixers="full"),
      "kvm256": lambda: _build(size, mixers="kvm", kvm=_kvm(FixedBudget(256), 256)),
      "kvm_sqrt16": lambda: _build(size, mixers="kvm", kvm=_kvm(
          PowerLawBudget(16.0, 0.5, min_rows=256), 256 * 10000)),
      "kvm_swa_sat1024": lambda: _build(size, mixers=_hybrid("kvm", n), swa_window=256,
                                        swa_rope_dims=128, kvm=_kvm(
                                            SaturatingBudget(1024, min_rows=1), 256 * 10000)),
      "bswa": lambda: _build(size, mixers="bswa", bswa_chunk_size=256, bswa_window_chunks=3,
                             bswa_sink_rows=0),
      # GPTA-2 full-attention layers with HalfRoPE / NoPE, interleaved with full-RoPE SWA-256.
      "swa_halfrope": lambda: _build(size, mixers=_hybrid("full", n), swa_window=256,
                                     swa_rope_dims=128),
      "swa_nope": lambda: _build(size, mixers=_hybrid("full", n), rope_dims=0, swa_window=256,
                                 swa_rope_dims=128),
  }


def _export():
  table = {}
  for size in _SIZES:
    for name, fn in _family(size).items():
      key = f"{name}_{size}"
      fn.__name__ = key
      fn.__doc__ = f"The paper's {name} model at {size.upper()} (see module docstring)."
      table[key] = fn
  return table


PRESETS = _export()
globals().update(PRESETS)


def tiny(mixers="kvm", **overrides) -> ModelConfig:
  """A CPU-test-sized model (2 layers, width 64, 4 heads of 16, vocab 256, C=8, L=16)."""
  kvm = overrides.pop("kvm", KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                                       budget=PowerLawBudget(4.0, 0.5, min_rows=8)))
  base = dict(vocab_size=256, num_layers=2, hidden_size=64, num_heads=4, mixers=mixers, kvm=kvm,
              rope_dims=8, swa_window=12, swa_rope_dims=16, bswa_chunk_size=8,
              bswa_window_chunks=2, bswa_sink_rows=1, mup_base_dim=64)
  base.update(overrides)
  return ModelConfig(**base)


__all__ = sorted(PRESETS) + ["PRESETS", "tiny"]
