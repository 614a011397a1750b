"""The ``bswa`` mixer: block sliding-window softmax attention with sinks (the paper's BSWA
baseline: 256-token chunks, 3 chunks, no sink); its decode cache is a window-sized ring."""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvm_jax.config.budget import average_window_keys
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import (AuthorsMixer, AuthorsReading, AuthorsWriting,
                                       shared_window)
from kvm_jax.nn.mixers.attention import SoftmaxAttention
from kvm_jax.nn.mixers.mixer import KVMConversion
from kvm_jax.ops.attention import dense as attn_ops
from kvm_jax.ops.documents import (WindowRule, combine_partials, document_sink_partials,
                                   document_window_partials)


@dataclasses.dataclass(frozen=True)
class BSWAOptions:
  """Options of ``bswa`` layers (their own; KVM layers have their own chunk geometry).

  Attributes:
    chunk_size: tokens per chunk; a query sees its own chunk (causally) and the previous
      ``window_chunks - 1`` whole chunks.
    window_chunks: chunks in the window.
    sink_rows: the first tokens every query also sees.
  """

  chunk_size: int = 256
  window_chunks: int = 3
  sink_rows: int = 0

  def __post_init__(self):
    for name, low in (("chunk_size", 1), ("window_chunks", 1), ("sink_rows", 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"BSWAOptions.{name} must be an int >= {low}, got {value!r}.")


def _read_authors_options(reading: AuthorsReading) -> BSWAOptions:
  """The options of their config: the window geometry it shares with their KVM layers."""
  chunk, window_chunks, sink = shared_window(reading.fields)
  return BSWAOptions(chunk_size=chunk, window_chunks=window_chunks, sink_rows=sink)


def _write_authors_options(writing: AuthorsWriting, kind: str) -> None:
  """Their chunk_len, n_bswa_chunks and sink_len."""
  o = writing.model.options_of(kind)
  writing.put(kind, chunk_len=o.chunk_size, n_bswa_chunks=o.window_chunks, sink_len=o.sink_rows)


class BlockSlidingWindowAttention(SoftmaxAttention):
  """Block sliding window with sinks."""

  Options = BSWAOptions
  AUTHORS = AuthorsMixer(("gptalpha_bswa",), ("model.gptalpha_bswa_mixer.SequenceMixer",),
                         "gptalpha", title="block-SWA", carried=True,
                         read_options=_read_authors_options,
                         write_options=_write_authors_options)

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """The block window's span, ``window_chunks · chunk_size`` (sinks aside)."""
    options = cfg.options_of(cfg.layer_mixers[layer])
    return options.window_chunks * options.chunk_size

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    return None  # the sink rows aside, a token past the window is gone

  @classmethod
  def kvm_conversion(cls, cfg: ModelConfig, layer: int) -> KVMConversion:
    """The same window plus a state: the KVM chunks must be this layer's."""
    o = cfg.options_of(cfg.layer_mixers[layer])
    window = {"chunk_size": o.chunk_size, "window_chunks": o.window_chunks}
    return KVMConversion(required=window, defaults=window,
                         description=f"of {o.window_chunks} chunks of {o.chunk_size} tokens")

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    options = cfg.options_of(cfg.layer_mixers[layer])
    return average_window_keys(seq_len, options.chunk_size, options.window_chunks)

  def attend(self, q, k, v, scale=None):
    o = self.options
    return attn_ops.block_sliding_window_attention(q, k, v, o.chunk_size, o.window_chunks,
                                                   o.sink_rows, scale=scale,
                                                   softcap=self.softcap)

  def sink_rows(self):
    return self.options.sink_rows

  def window_rule(self):
    o = self.options
    return WindowRule("chunks", chunk=o.chunk_size, window_chunks=o.window_chunks)

  def attend_documents(self, q, k, v, documents, scale=None):
    """The window of each document's own chunk grid, plus its first ``sink_rows`` tokens while
    they lie before that window, in one softmax."""
    o = self.options
    B, T, H, D = q.shape
    key_scale = D ** -0.5 if scale is None else scale
    Hkv = k.shape[2]
    q5 = q.reshape(B, T, Hkv, H // Hkv, D)
    parts = [document_window_partials(q5, k, v, documents, self.window_rule(),
                                      key_scale=key_scale, softcap=self.softcap)]
    if o.sink_rows:
      parts.append(document_sink_partials(q5, k, v, documents, o.sink_rows, o.chunk_size,
                                          o.window_chunks, key_scale=key_scale,
                                          softcap=self.softcap))
    return combine_partials(*parts).reshape(B, T, H, v.shape[-1]).astype(q.dtype)
