"""Tasks and data, shared by training and evaluation: tokenizers, MQAR (with its recall counting),
NIAH (examples, score, training stream), packed text and the embedded corpus, and the batched,
checkpointable iterator. Every stream is a ``grain.MapDataset`` indexed by example number."""

from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.mqar import MQARSpec, mqar_dataset, mqar_example, recall_counts, recall_ratios
from kvm_jax.tasks.niah import NIAHSpec, niah_dataset, niah_example
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.tasks.text import (cram_pack, embedded_corpus, lm_example, read_documents,
                                read_hf_documents, text_dataset)
from kvm_jax.tasks.tokenizers import ByteTokenizer, HFTokenizer, tokenizer

__all__ = ["IGNORE", "ByteTokenizer", "HFTokenizer", "MQARSpec", "NIAHSpec", "batched_iterator",
           "cram_pack", "embedded_corpus", "lm_example", "mqar_dataset", "mqar_example",
           "niah_dataset", "niah_example", "read_documents", "read_hf_documents", "recall_counts",
           "recall_ratios", "text_dataset", "tokenizer"]
