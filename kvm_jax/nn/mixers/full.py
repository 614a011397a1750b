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

  @classmethod
  def flops_per_token(cls, cfg: ModelConfig, layer: int, seq_len: int
                      ) -> tuple[float, float, float]:
    """``(model, forward, backward)`` (:func:`kvm_jax.nn.registry.mixer_flops`): the model
    counts the visible keys; the run, with the chunked kernel, its blocks
    (:func:`attention_run_flops`)."""
    return attention_run_flops(cfg, seq_len, cls.keys_per_query(cfg, layer, seq_len), None)

  def attend(self, q, k, v, scale=None):
    return causal_attention(q, k, v, scale=scale, softcap=self.softcap,
                            implementation=self.cfg.attention_implementation)

  def attend_documents(self, q, k, v, documents, scale=None):
    """Packed documents through the layer's backend (splash natively; the others on the document
    window path, see :func:`kvm_jax.ops.attention.api.causal_attention`)."""
    return causal_attention(q, k, v, scale=scale, softcap=self.softcap,
                            implementation=self.cfg.attention_implementation,
                            segment_ids=documents.segment_ids())


def attention_run_flops(cfg: ModelConfig, seq_len: int, keys: float, window: Optional[int]
                        ) -> tuple[float, float, float]:
  """``(model, forward, backward)`` matmul FLOPs per token of one softmax-attention layer: the
  model's 12·keys·D·H (QKᵀ and PV over the visible ``keys``, forward and twice backward), and
  what the chunked kernel (``attention_implementation="chunked"``,
  :mod:`kvm_jax.ops.attention.chunked`) runs: every (query block, key block) pair it visits is
  scored whole, masked entries included, 2 matmuls forward, and 7 backward (the query-gradient
  pass recomputes the scores and takes dP and dQ; the key/value pass recomputes the scores and
  dP again and takes dV and dK); 4 when the sequence is one block. Its loops over key blocks
  have bounds that depend on the query block, which ``kvm_jax.util.hlo_flops`` cannot read (it
  counts such a body once), so past one block the compiled count falls short of this. Other implementations are counted as the model (dense XLA
  scores the masked half too; kernels are opaque to the compiled count)."""
  D, H = cfg.qk_head_dim, cfg.num_heads
  model = 12.0 * keys * D * H
  if cfg.attention_implementation != "chunked":
    return model, model / 3.0, 2.0 * model / 3.0
  from kvm_jax.ops.attention.chunked import DEFAULT_BLOCK
  b = min(DEFAULT_BLOCK, seq_len)
  n = -(-seq_len // b)
  pairs = sum(i - (0 if window is None else max(0, (i * b - window + 1) // b)) + 1
              for i in range(n))
  one = 2.0 * b * b * D * H / seq_len  # one b x b x D matmul for every head, per token
  # With one block both backward passes recompute the same scores, which XLA computes once and
  # shares with the forward's: dP, dQ, dV, dK remain.
  return model, 2.0 * pairs * one, (4.0 if n == 1 else 7.0) * pairs * one
