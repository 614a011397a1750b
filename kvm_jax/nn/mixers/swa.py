"""The ``swa`` mixer: causal softmax attention over the last ``window`` tokens (the paper's
GPTAlpha-2/SWA hybrids: 256 tokens, full RoPE); its decode cache is a window-sized ring."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import AuthorsMixer, AuthorsReading, AuthorsWriting, read_int
from kvm_jax.nn.mixers.attention import SoftmaxAttention
from kvm_jax.nn.mixers.mixer import KVMConversion, TransformersLayer
from kvm_jax.ops.attention.api import causal_attention
from kvm_jax.ops.documents import WindowRule


@dataclasses.dataclass(frozen=True)
class SWAOptions:
  """Options of ``swa`` layers.

  Attributes:
    window: tokens each query sees, itself included (the paper's hybrids: 256).
    rope_dims: rotary channels of these layers; None = the model's ``rope_dims``. The paper's
      hybrids use full RoPE (128 = the head dim); 0 is NoPE, D/2 HalfRoPE.
  """

  window: int = 256
  rope_dims: Optional[int] = None

  def __post_init__(self):
    if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
      raise ValueError(f"SWAOptions.window must be a positive int, got {self.window!r}.")

  def rotary_dims(self, model: ModelConfig) -> int:
    return model.rope_dims if self.rope_dims is None else self.rope_dims


def _read_authors_options(reading: AuthorsReading) -> SWAOptions:
  """The options of their config: the window ``swa_window_size``, where their swa_mixer takes
  ``chunk_len`` for a value <= 0, and the rotary width of the layers' role."""
  window = read_int(reading.fields, "swa_window_size")
  window = window if window > 0 else read_int(reading.fields, "chunk_len", 1)
  return SWAOptions(window=window, rope_dims=reading.rope_dims)


def _write_authors_options(writing: AuthorsWriting, kind: str) -> None:
  """Their ``swa_window_size`` (the rotary width is the role's ``*rope_partial_dim``)."""
  writing.put(kind, swa_window_size=writing.model.options_of(kind).window)


class SlidingWindowAttention(SoftmaxAttention):
  """Causal attention over the last ``SWAOptions.window`` tokens."""

  Options = SWAOptions
  AUTHORS = AuthorsMixer(("swa",), ("model.swa_mixer.SequenceMixer",), "swa", title="SWA",
                         own_rope=True, reshapes_output=True, carried=True,
                         read_options=_read_authors_options,
                         write_options=_write_authors_options)
  TRANSFORMERS = TransformersLayer("sliding_attention", window_option="window")

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Keys at distance below the window are attended; none beyond it."""
    return cfg.options_of(cfg.layer_mixers[layer]).window

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    return None  # a token past the window is gone

  @classmethod
  def kvm_conversion(cls, cfg: ModelConfig, layer: int) -> KVMConversion:
    """The kvm layer must rotate this layer's channels; it is exact up to the shorter of the two
    windows (Mistral's layers, Gemma's local ones)."""
    rotary = cfg.rope_dims_of(layer)
    return KVMConversion(required={"rope_dims": rotary}, description=f"rotating {rotary} channels",
                         advice="kvm layers rotate the model's channels, so only swa layers "
                                "with the model's rotary width convert.")

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    window = cfg.options_of(cfg.layer_mixers[layer]).window
    return float(np.mean(np.minimum(np.arange(1, seq_len + 1, dtype=np.float64), window)))

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, layer: int, seq_len: int
                      ) -> tuple[float, float, float]:
    """``(model, forward, backward)``: the visible keys, and the chunked kernel's blocks
    (:func:`kvm_jax.nn.mixers.full.attention_run_flops`)."""
    from kvm_jax.nn.mixers.full import attention_run_flops
    window = cfg.options_of(cfg.layer_mixers[layer]).window
    return attention_run_flops(cfg, seq_len, cls.keys_per_query(cfg, layer, seq_len), window)

  def attend(self, q, k, v, scale=None):
    return causal_attention(q, k, v, window=self.options.window, scale=scale,
                            softcap=self.softcap,
                            implementation=self.cfg.attention_implementation)

  def attend_documents(self, q, k, v, documents, scale=None):
    """Packed documents through the layer's backend (splash natively; the others on the document
    window path, see :func:`kvm_jax.ops.attention.api.causal_attention`)."""
    return causal_attention(q, k, v, window=self.options.window, scale=scale,
                            softcap=self.softcap,
                            implementation=self.cfg.attention_implementation,
                            segment_ids=documents.segment_ids())

  def window_rule(self):
    return WindowRule("sliding", window=self.options.window)
