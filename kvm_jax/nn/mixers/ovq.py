"""The ``ovq`` mixer: the paper's OVQ baseline (the authors' ``model/ovq_mixer.py``), online vector
quantization of keys and values behind the shared attention front end.

The front end is the softmax kinds' (projections, value residual, token shift of the projected
q/k/v) without QK-LayerNorm and without RoPE; queries and keys are L2-normalized
(``x / (‖x‖ + 1e-5)``) and scored ``beta·√D · q·k`` with a learned per-head ``beta`` (init 1).
Each chunk attends to the dictionary built from the chunks before it, with ``log(count)`` added to
each centroid's score, and to its own tokens causally (:mod:`kvm_jax.ops.ovq`). In the paper it
alternates with full-RoPE SWA-256 (``kvm_jax.presets.ovq_swa_120m``).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.authors_format import (AuthorsMixer, AuthorsReading, AuthorsWriting,
                                       ConfigError, read_flag, read_int)
from kvm_jax.nn.mixers.attention import AttentionFrontEnd
from kvm_jax.ops.ovq.config import OVQConfig
from kvm_jax.nn.cache import is_resume, piece_counts, step_active
from kvm_jax.nn.mixers.mixer import Mixed
from kvm_jax.ops.ovq.decode import (OVQCache, ovq_decode_step, ovq_init_cache, ovq_prefill,
                                    ovq_resume)
from kvm_jax.ops.ovq.documents import ovq_attention_documents
from kvm_jax.ops.ovq.scan import ovq_attention

Array = jax.Array


def l2_normalize(x: Array, eps: float = 1e-5) -> Array:
  """``x / (‖x‖ + eps)`` over the last axis, computed in float32, in ``x``'s dtype (the authors'
  ``_l2_norm``: the epsilon is added to the norm, not clamped)."""
  x32 = x.astype(jnp.float32)
  return (x32 / (jnp.sqrt(jnp.sum(x32 * x32, -1, keepdims=True)) + eps)).astype(x.dtype)


def _read_authors_options(reading: AuthorsReading) -> OVQConfig:
  """The options of their config's ``ovq_*`` fields."""
  cfg = reading.fields
  try:
    return OVQConfig(chunk_size=read_int(cfg, "ovq_chunk_size", 1),
                     max_centroids=read_int(cfg, "ovq_max_centroids", 1),
                     min_state_size=read_flag(cfg, "ovq_use_min_state_size"),
                     count_bias=not read_flag(cfg, "ovq_use_counts_for_lr_only"),
                     normalize_centroids=read_flag(cfg, "ovq_normalize_centroids"),
                     delta_rule=read_flag(cfg, "ovq_use_delta_rule"))
  except ValueError as e:  # OVQConfig's own validation
    raise ConfigError(f"ovq_chunk_size={cfg['ovq_chunk_size']!r}, ovq_max_centroids="
                      f"{cfg['ovq_max_centroids']!r}: {e}") from None


def _write_authors_options(writing: AuthorsWriting, kind: str) -> None:
  """Their ``ovq_*`` fields (``ovq_window_size`` is never read by their layer; the paper's
  configs set it to the chunk)."""
  o = writing.model.options_of(kind)
  writing.put(kind, ovq_chunk_size=o.chunk_size, ovq_window_size=o.chunk_size,
              ovq_max_centroids=o.max_centroids, ovq_use_min_state_size=int(o.min_state_size),
              ovq_use_counts_for_lr_only=int(not o.count_bias),
              ovq_normalize_centroids=int(o.normalize_centroids),
              ovq_use_delta_rule=int(o.delta_rule))


class OVQAttention(AttentionFrontEnd):
  """Online vector quantization over the attention front end (no QK-LN, no RoPE)."""

  Options = OVQConfig
  AUTHORS = AuthorsMixer(("ovq",), ("model.ovq_mixer.SequenceMixer",), "ovq", rotates=False,
                         title="OVQ", read_options=_read_authors_options,
                         write_options=_write_authors_options)
  QK_NORM = False
  DOCUMENTS = True
  # SOFTCAP stays False: its dictionary readout has no soft-capped form.

  @classmethod
  def exact_window(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Keys at distance below this are attended exactly: the query's own chunk."""
    return cfg.options_of(cfg.layer_mixers[layer]).chunk_size

  @classmethod
  def beyond_window(cls, cfg: ModelConfig, layer: int, seq_len: int) -> Optional[str]:
    """The dictionary's centroids after ``seq_len`` tokens."""
    return f"{cfg.options_of(cfg.layer_mixers[layer]).dictionary_size(seq_len)} centroids"

  @classmethod
  def resume_alignment(cls, cfg: ModelConfig, layer: int) -> Optional[int]:
    """Pieces of whole chunks from a chunk boundary: each folds into the dictionary."""
    return None if cfg.kv_sources(layer) is not None else \
        cfg.options_of(cfg.layer_mixers[layer]).chunk_size

  @classmethod
  def keys_per_query(cls, cfg: ModelConfig, layer: int, seq_len: int) -> float:
    """The dictionary rows at the start of a query's chunk plus its chunk's earlier tokens and
    itself, averaged over the positions."""
    options = cfg.options_of(cfg.layer_mixers[layer])
    C = options.chunk_size
    sizes = np.asarray(options.dictionary_sizes(seq_len), np.float64)
    position = np.arange(seq_len)
    return float(np.mean(sizes[position // C] + position % C + 1))

  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    super().__init__(cfg, layer, rngs=rngs)
    self.beta = nnx.Param(jnp.ones((cfg.num_heads,), cfg.jnp_param_dtype))

  def init_cache(self, batch: int, max_len: int) -> OVQCache:
    cfg = self.cfg
    return ovq_init_cache(self.options, batch=batch, heads=cfg.num_heads,
                          head_dim=cfg.qk_head_dim, value_dim=cfg.v_head_dim, max_len=max_len)

  def mix_own(self, x, q, k, v, mixer_cache, decode, shared, documents=None):
    q, k = l2_normalize(q), l2_normalize(k)
    beta = self.beta[...]
    if documents is not None:  # each document alone (the front end refuses caches with them)
      segment_ids = documents.segment_ids()
      y = ovq_attention_documents(q, k, v, beta, segment_ids, self.options)
      return Mixed(y, None, {"k": k, "v": v})
    if is_resume(decode):
      y, mixer_cache = ovq_resume(q, k, v, beta, self.options, mixer_cache,
                                  counts=piece_counts(decode))
    elif decode:
      y, mixer_cache = ovq_decode_step(q, k, v, beta, self.options, mixer_cache,
                                       active=step_active(decode))
    elif mixer_cache is not None:
      y, mixer_cache = ovq_prefill(q, k, v, beta, self.options, mixer_cache)
    else:
      y, _ = ovq_attention(q, k, v, beta, self.options)
    return Mixed(y, mixer_cache, {"k": k, "v": v})
