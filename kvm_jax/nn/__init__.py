"""Flax NNX modules: the attention front end (``attention.py``), one module per mixer kind
(``full.py``, ``swa.py``, ``bswa.py``, ``kvm.py``, ``ovq.py``, ``rwkv7.py``) and the list of kinds
(``registry.py``: :func:`register_mixer`; the protocol a kind's class and its cache satisfy in
``mixer.py`` and ``cache.py``), cross-layer KV sharing (``kv_sharing.py``), one module
per backbone family (``gptalpha2.py``, ``llama.py``, ``gemma.py``; ``family.py``:
:func:`register_family`), and the block and LM (``model.py``)."""

from kvm_jax.nn.mixers.attention import AttentionFrontEnd, LayerCache, SoftmaxAttention
from kvm_jax.nn.mixers.bswa import BlockSlidingWindowAttention, BSWAOptions
from kvm_jax.nn.mixers.full import FullAttention, FullOptions
from kvm_jax.nn.mixers.kvm import KVMAttention
from kvm_jax.nn.mixers.ovq import OVQAttention
from kvm_jax.nn.mixers.rwkv7 import RWKV7Cache, RWKV7Options, RWKV7TimeMix
from kvm_jax.nn.families.family import register_family, registered_families
from kvm_jax.nn.families.gemma import Gemma, GemmaOptions
from kvm_jax.nn.families.gptalpha2 import GPTAlpha2, GPTAlpha2Options
from kvm_jax.nn.families.llama import Llama, LlamaOptions
from kvm_jax.nn.cache import MixerCache
from kvm_jax.nn.mixers.mixer import Mixed, MixerKind, MixerOutput
from kvm_jax.nn.registry import mixer_class, register_mixer, registered_mixers
from kvm_jax.nn.mixers.swa import SlidingWindowAttention, SWAOptions
from kvm_jax.nn.model import LM, Block, BlockOutput, count_params

__all__ = ["AttentionFrontEnd", "BlockSlidingWindowAttention", "Block", "BlockOutput", "BSWAOptions",
           "FullAttention", "FullOptions", "GPTAlpha2", "GPTAlpha2Options", "Gemma",
           "GemmaOptions", "KVMAttention", "LM", "LayerCache", "Llama", "LlamaOptions", "MixerCache",
           "Mixed", "MixerKind", "MixerOutput",
           "OVQAttention", "RWKV7Cache", "RWKV7Options", "RWKV7TimeMix",
           "SlidingWindowAttention", "SoftmaxAttention", "SWAOptions", "count_params",
           "mixer_class", "register_family", "register_mixer", "registered_families",
           "registered_mixers"]
