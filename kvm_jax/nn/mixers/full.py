"""The ``full`` mixer: GPTAlpha-2's causal softmax attention over every previous token; its decode
cache is a ``max_len`` ring (:class:`kvm_jax.ops.attention.dense.RingCache`)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import AuthorsMixer
from kvm_jax.nn.mixers.attention import SoftmaxAttention
from kvm_jax.nn.mixers.mixer import KVMConversion, TransformersLayer
from kvm_jax.ops.attention.api import causal_attention


@dataclasses.dataclass(frozen=True)
class FullOptions:
  """``full`` layers have no options of their own: RoPE (``ModelConfig.rope_dims``) and the
  kernel (``ModelConfig.attention_implementation``) are the model's."""


class FullAttention(SoftmaxAttention):
  """Causal attention over every previous token."""

  Options = FullOptions
  AUTHORS = AuthorsMixer(("gptalpha",), ("model.gptalpha_mixer.SequenceMixer",), "gptalpha",
                         title="full-attention")
  TRANSFORMERS = TransformersLayer("full_attention")

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """None: every earlier key is attended exactly."""
    return None

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    return "all tokens"  # no window: it keeps every token exactly

  @classmethod
  def kvm_conversion(cls, cfg: ModelConfig, layer: int) -> KVMConversion:
    """Any KVM window: inside it a kvm layer is this attention."""
    return KVMConversion()

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    return (seq_len + 1) / 2  # token t sees t + 1 keys

  def attend(self, q, k, v, scale=None):
    return causal_attention(q, k, v, scale=scale, softcap=self.softcap,
                            implementation=self.cfg.attention_implementation)

  def attend_documents(self, q, k, v, documents, scale=None):
    """Packed documents through the layer's backend (splash natively; the others on the document
    window path, see :func:`kvm_jax.ops.attention.api.causal_attention`)."""
    return causal_attention(q, k, v, scale=scale, softcap=self.softcap,
                            implementation=self.cfg.attention_implementation,
                            segment_ids=documents.segment_ids())
