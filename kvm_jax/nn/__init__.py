"""Flax NNX modules: the attention front end and one mixer class per kind (``attention.py``,
``kvm.py``), cross-layer KV sharing (``kv_sharing.py``), and the GPTAlpha-2 block and LM
(``model.py``)."""

from kvm_jax.nn.attention import (AttentionFrontEnd, BlockSlidingWindowAttention, FullAttention,
                                  LayerCache, SlidingWindowAttention)
from kvm_jax.nn.kvm import KVMAttention
from kvm_jax.nn.model import LM, MIXERS, Block, count_params

__all__ = ["AttentionFrontEnd", "BlockSlidingWindowAttention", "Block", "FullAttention",
           "KVMAttention", "LM", "LayerCache", "MIXERS", "SlidingWindowAttention", "count_params"]
