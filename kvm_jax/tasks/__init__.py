"""Tasks and data, shared by training and evaluation: tokenizers, MQAR (with its recall counting),
NIAH (examples, score, training stream), packed text and the embedded corpus, token shards (a
corpus tokenized once by ``kvm-data``, memory-mapped and packed at read time), and the batch
reader. Every stream is a ``grain.MapDataset`` indexed by example number."""

from kvm_jax.util import lazy_exports as _lazy_exports

__all__ = ["IGNORE", "BatchReader", "ByteTokenizer", "HFTokenizer", "MQARSpec", "NIAHSpec",
           "TokenShards", "batched_iterator", "cram_pack", "embedded_corpus", "lm_example",
           "mqar_dataset", "mqar_example", "niah_dataset", "niah_example", "read_documents",
           "read_hf_documents", "recall_counts", "recall_ratios", "shard_dataset", "text_dataset",
           "tokenizer", "write_shards"]

# Imported on first use (kvm_jax.util.lazy_exports): a command's argument parser (kvm-data's) needs
# none of it.
__getattr__, __dir__ = _lazy_exports.exports(__name__, {
    "kvm_jax.tasks.labels": ("IGNORE",),
    "kvm_jax.tasks.mqar": ("MQARSpec", "mqar_dataset", "mqar_example", "recall_counts",
                           "recall_ratios"),
    "kvm_jax.tasks.niah": ("NIAHSpec", "niah_dataset", "niah_example"),
    "kvm_jax.tasks.pipeline": ("BatchReader", "batched_iterator"),
    "kvm_jax.tasks.shards": ("TokenShards", "shard_dataset", "write_shards"),
    "kvm_jax.tasks.text": ("cram_pack", "embedded_corpus", "lm_example", "read_documents",
                           "read_hf_documents", "text_dataset"),
    "kvm_jax.tasks.tokenizers": ("ByteTokenizer", "HFTokenizer", "tokenizer")})
