"""Tasks and data, shared by training and evaluation: tokenizers, MQAR (with its recall counting),
NIAH (examples, score, training stream), packed text and the embedded corpus, token shards (a
corpus tokenized once by ``kvm-data``, memory-mapped and packed at read time), and the batch
reader. Every stream is a ``grain.MapDataset`` indexed by example number."""

from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.mqar import MQARSpec, mqar_dataset, mqar_example, recall_counts, recall_ratios
from kvm_jax.tasks.niah import NIAHSpec, niah_dataset, niah_example
from kvm_jax.tasks.pipeline import BatchReader, batched_iterator
from kvm_jax.tasks.shards import TokenShards, shard_dataset, write_shards
from kvm_jax.tasks.text import (cram_pack, embedded_corpus, lm_example, read_documents,
                                read_hf_documents, text_dataset)
from kvm_jax.tasks.tokenizers import ByteTokenizer, HFTokenizer, tokenizer

__all__ = ["IGNORE", "BatchReader", "ByteTokenizer", "HFTokenizer", "MQARSpec", "NIAHSpec",
           "TokenShards", "batched_iterator", "cram_pack", "embedded_corpus", "lm_example",
           "mqar_dataset", "mqar_example", "niah_dataset", "niah_example", "read_documents",
           "read_hf_documents", "recall_counts", "recall_ratios", "shard_dataset", "text_dataset",
           "tokenizer", "write_shards"]
