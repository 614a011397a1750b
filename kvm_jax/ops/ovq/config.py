"""Options of the OVQ layer and the dictionary-size schedule (docs/ovq-rwkv7.md, "OVQ").

Online vector quantization (the paper's OVQ/SWA baseline) attends each chunk of ``chunk_size``
queries to a dictionary of key/value centroids built from the chunks before it, plus the chunk's
own tokens causally. The dictionary grows by a schedule that depends only on positions, so every
size in it is a Python int known when a call is traced.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class OVQConfig:
  """Hyper-parameters of one OVQ layer (the authors' ``ovq_*`` fields).

  Attributes:
    chunk_size: tokens per chunk (``ovq_chunk_size``; the paper 256). A query sees the dictionary
      built from the chunks before its own, then its own chunk causally.
    max_centroids: dictionary rows at most (``ovq_max_centroids``; the paper 1024).
    min_state_size: the schedule ``min(t, max_centroids)`` instead of the plateau
      ``floor(t·M / (t + M))`` (``ovq_use_min_state_size``).
    count_bias: add ``log(count)`` of each centroid to its attention score (the paper; False is
      the authors' ``ovq_use_counts_for_lr_only=1``, counts then only set learning rates).
    normalize_centroids: L2-normalize every centroid after each update
      (``ovq_normalize_centroids``; with ``delta_rule`` the keys only).
    delta_rule: centroid values move by the prediction error ``v - readout(k)`` instead of toward
      ``v`` (``ovq_use_delta_rule``).
  """

  chunk_size: int = 256
  max_centroids: int = 1024
  min_state_size: bool = False
  count_bias: bool = True
  normalize_centroids: bool = False
  delta_rule: bool = False

  def __post_init__(self):
    for name in ("chunk_size", "max_centroids"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"OVQConfig.{name} must be a positive int, got {value!r}.")
    for name in ("min_state_size", "count_bias", "normalize_centroids", "delta_rule"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"OVQConfig.{name} must be a bool, got {getattr(self, name)!r}.")

  def dictionary_size(self, tokens: int) -> int:
    """Rows after ``tokens`` tokens have been folded in (0 for none)."""
    if tokens <= 0:
      return 0
    M = self.max_centroids
    if self.min_state_size:
      return min(tokens, M)
    # The authors evaluate floor(t·M / (t + M)) in float64; integer division is the same value
    # for every t·M below 2**53 (a quotient that is not an integer stays below the next one).
    return min(tokens * M // (tokens + M), M)

  def dictionary_sizes(self, seq_len: int) -> tuple[int, ...]:
    """Rows before chunk c, for c = 0 … n_chunks (the last entry: after every chunk of a
    ``seq_len``-token sequence; a partial last chunk counts its tokens)."""
    C = self.chunk_size
    n_chunks = -(-seq_len // C)
    sizes = [0]
    for c in range(1, n_chunks + 1):
      sizes.append(max(sizes[-1], self.dictionary_size(min(seq_len, c * C))))
    return tuple(sizes)

  def capacity(self, seq_len: int) -> int:
    """Rows a state must hold for sequences of up to ``seq_len`` tokens (at least 1)."""
    return max(1, self.dictionary_sizes(seq_len)[-1])

  # As the options of a mixer kind (kvm_jax.config.mixers).
  def rotary_dims(self, model) -> int:
    """OVQ layers use no rotary embedding (the authors' layer never applies it)."""
    return 0

  def check(self, model) -> None:
    """One dictionary per query head, so no GQA; no cross-layer sharing (``model`` is the
    :class:`kvm_jax.ModelConfig`)."""
    if model.kv_heads != model.num_heads:
      raise ValueError(f"ovq layers need one key/value head per query head (num_kv_heads="
                       f"{model.num_kv_heads}, num_heads={model.num_heads}): each head keeps "
                       "its own dictionary. Set num_kv_heads=None.")
    if model.kv_sharing != "none":
      raise ValueError(f"ovq layers cannot take part in kv_sharing={model.kv_sharing!r}; set "
                       "kv_sharing='none'.")


__all__ = ["OVQConfig"]
