"""A run's data: the task's dataset for a split, and a host's rows placed as global arrays."""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvm_jax.nn.model import documents_kinds
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.tasks import mqar, niah, packing, text
from kvm_jax.tasks.shards import TokenShards, shard_dataset
from kvm_jax.tasks.tokenizers import tokenizer
from kvm_jax.train import sharding


def data_vocabulary(cfg: TrainConfig) -> tuple[str, int]:
  """(what produces the run's token ids, how many distinct ids it can produce): the MQAR spec,
  the NIAH or text tokenizer, or the token shards' manifest."""
  if cfg.task == "mqar":
    return "mqar.vocab_size", cfg.mqar.vocab_size
  if cfg.task == "niah":
    return (f"the NIAH tokenizer ({cfg.niah.tokenizer_file or 'bytes'})",
            tokenizer(cfg.niah.tokenizer_file).vocab_size)
  if cfg.data_dir:
    return f"the token shards in data_dir={cfg.data_dir!r}", TokenShards(cfg.data_dir).vocab_size
  return (f"the text tokenizer ({cfg.tokenizer_file or 'bytes'})",
          tokenizer(cfg.tokenizer_file).vocab_size)


def smaller_data(cfg: TrainConfig, size: int) -> str:
  """How to make the run's data produce at most ``size`` distinct ids."""
  if cfg.task == "mqar":
    return f"--config.mqar.vocab_size={size} (or less)"
  if cfg.task == "niah":
    return f"a NIAH tokenizer of at most {size} ids (--config.niah.tokenizer_file)"
  what = "token shards tokenized with" if cfg.data_dir else "a text tokenizer of"
  return f"{what} at most {size} ids (e.g. the tokenizer of the run it starts from)"


def check_vocabulary(cfg: TrainConfig) -> None:
  """Refuses, before anything is built or compiled, data whose ids the model cannot embed (an id
  at or past ``model.vocab_size`` would read outside the embedding table: NaN or garbage, not an
  error, inside a jitted step).

  Run it on the config the trainer builds (after :func:`kvm_jax.train.start.with_init_model`):
  under ``init_from`` the model, its vocabulary included, is that run's, so the way out is other
  data or another starting point, never ``--config.model.vocab_size``."""
  source, size = data_vocabulary(cfg)
  vocab = cfg.model.vocab_size
  if size <= vocab:
    return
  if cfg.init_from:
    raise ValueError(
        f"{source} produces ids up to {size - 1} but the model comes from init_from="
        f"{cfg.init_from!r}, whose model.vocab_size={vocab} (a --config.model.vocab_size does "
        f"not change a model that init_from gives): use {smaller_data(cfg, vocab)}, start from "
        f"a run whose model.vocab_size is {size} or more, or train from scratch without "
        f"init_from (--config.init_from= --config.model.vocab_size={size}).")
  raise ValueError(f"{source} produces ids up to {size - 1} but model.vocab_size={vocab}: set "
                   f"--config.model.vocab_size={size} (or more), or use data tokenized for this "
                   "model.")


def task_dataset(cfg: TrainConfig, split: str):
  """The ``grain.MapDataset`` of a run's task: ``split`` "train", or "eval" (a held-out stream:
  another seed for the synthetic tasks, the first 5% of the packed windows for text)."""
  seed = cfg.seed if split == "train" else cfg.seed + 10_000
  if cfg.task == "mqar":
    return mqar.mqar_dataset(seed, cfg.mqar)
  if cfg.task == "niah":
    return niah.niah_dataset(seed, cfg.niah)
  if cfg.data_dir:  # token shards written by kvm-data, packed at read time
    shards = TokenShards(cfg.data_dir)
    if cfg.packing == "cram":
      return shard_dataset(shards, cfg.seq_len, seed, split)
    plan = packing.plan_rows(shards.doc_lengths, cfg.seq_len + 1, cfg.packing)
    return packing.packed_dataset(packing.PackedRows(plan, shards.doc), seed, split)
  tok = tokenizer(cfg.tokenizer_file)
  if cfg.hf_dataset:
    docs = text.read_hf_documents(cfg.hf_dataset, cfg.hf_split, cfg.hf_text_field)
  elif cfg.text_files:
    docs = text.read_documents(cfg.text_files)
  else:
    docs = text.embedded_corpus()
  if cfg.packing != "cram":
    ids = [np.asarray(tok.encode(d) + [tok.eos_id], np.int32) for d in docs]
    plan = packing.plan_rows(np.array([len(x) for x in ids]), cfg.seq_len + 1, cfg.packing)
    return packing.packed_dataset(packing.PackedRows(plan, ids.__getitem__), seed, split)
  windows = text.cram_pack(docs, tok, cfg.seq_len)
  n_eval = max(1, len(windows) // 20)
  windows = windows[n_eval:] if split == "train" else windows[:n_eval]
  return text.text_dataset(windows, tok.eos_id, seed)


def check_packing_model(cfg: TrainConfig) -> None:
  """A ValueError, before anything is built, when ``packing="documents"`` meets a model with
  layers that cannot keep packed documents apart (naming them and the other packings)."""
  if cfg.packing != "documents":
    return
  kinds = documents_kinds()
  refused = sorted(set(cfg.model.layer_mixers) - set(kinds))
  if refused:
    raise ValueError(f"packing='documents' needs layers that take segment ids ({', '.join(kinds)}"
                     f"); this model has {', '.join(refused)}: use packing='pad' or 'cram'.")
  if cfg.model.kv_sharing != "none" and cfg.model.kvm_kv_sharing == "shared_routing" and any(
      cfg.model.is_kvm(i) for i in range(cfg.model.num_layers)):
    raise ValueError("packing='documents' does not run with kvm_kv_sharing='shared_routing' "
                     "(one routing replayed over whole rows): use kvm_kv_sharing='window', or "
                     "packing='pad' or 'cram'.")


def put_batch(batch: dict, batch_sharding, rows: Optional[np.ndarray] = None,
              batch_size: Optional[int] = None) -> dict:
  """This host's rows of a batch -> global arrays placed by ``batch_sharding``.

  ``rows`` are the global row indices the host holds (:func:`sharding.host_rows`) and
  ``batch_size`` the global batch; by default the host holds the whole batch (one host)."""
  if rows is None:
    batch_size = len(next(iter(batch.values())))
    rows = np.arange(batch_size)
  return sharding.global_batch(batch, batch_sharding, batch_size, rows)
