"""``TrainConfig``: everything a training run needs, and what its run directory records.

It lives below both the trainer (:mod:`kvm_jax.train`) and evaluation (:mod:`kvm_jax.eval`), so that
either can read a run directory without importing the other.
"""

from __future__ import annotations

import dataclasses

from kvm_jax.model_config import ModelConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec


@dataclasses.dataclass
class TrainConfig:
  """Everything a run needs; a run directory's ``config.json`` holds one. Python config files
  (``train/configs/*.py``) return one of these.

  Attributes:
    model: the :class:`kvm_jax.ModelConfig` to train.
    task: "mqar" (synthetic recall), "niah" (RULER-style needle retrieval, loss on the answer
      only) or "text" (packed language modelling).
    mqar: MQAR task shape (sequence length, vocabulary, pairs) when ``task == "mqar"``.
    niah: NIAH task (RULER task name, lengths, tokenizer) when ``task == "niah"``.
    text_files: local .txt/.jsonl files for ``task == "text"``; empty = the embedded corpus.
    seq_len: training sequence length (text; MQAR uses ``mqar.seq_len``).
    batch_size: sequences per step (global, split over the data axis of the mesh).
    steps: optimizer steps; warmup_steps: linear warm-up steps of the schedule.
    learning_rate / weight_decay: peak lr and wd of AdamC (wd follows lr, docs/kvm-spec.md §8).
    seed: initialization and data seed.
    log_every / eval_every / checkpoint_every: intervals in steps (0 disables eval).
    eval_batches: batches of the held-out stream per evaluation.
    keep_checkpoints: newest checkpoints kept.
    mesh_data / mesh_fsdp / mesh_tensor: device mesh sizes (one may be -1 = the remaining
      devices); see ``kvm_jax.train.sharding``.
    tokenizer_file: a local ``tokenizer.json`` for text (default: bytes).
    hf_dataset / hf_split / hf_text_field: a HuggingFace dataset already in the local cache
      (needs the ``datasets`` package; nothing is downloaded in tests or the default job).
    peak_tflops_per_device: for the MFU estimate; 0 = look the device kind up (unknown: no MFU).
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  task: str = "mqar"
  mqar: MQARSpec = dataclasses.field(default_factory=MQARSpec)
  niah: NIAHSpec = dataclasses.field(default_factory=NIAHSpec)
  text_files: tuple = ()
  seq_len: int = 256
  batch_size: int = 16
  steps: int = 1000
  warmup_steps: int = 100
  learning_rate: float = 3e-3
  weight_decay: float = 0.1
  seed: int = 0
  log_every: int = 10
  eval_every: int = 0
  checkpoint_every: int = 100
  eval_batches: int = 4
  keep_checkpoints: int = 3
  mesh_data: int = -1
  mesh_fsdp: int = 1
  mesh_tensor: int = 1
  tokenizer_file: str = ""
  hf_dataset: str = ""
  hf_split: str = "train"
  hf_text_field: str = "text"
  peak_tflops_per_device: float = 0.0

  @property
  def sequence_length(self) -> int:
    """Tokens per training sequence (MQAR and NIAH set their own)."""
    return {"mqar": self.mqar.seq_len, "niah": self.niah.seq_len}.get(self.task, self.seq_len)

  def validate(self) -> None:
    if self.task not in ("mqar", "niah", "text"):
      raise ValueError(f"task must be 'mqar', 'niah' or 'text', got {self.task!r}.")
    for name in ("batch_size", "steps", "log_every", "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    if self.task == "mqar" and self.mqar.vocab_size > self.model.vocab_size:
      raise ValueError(f"mqar.vocab_size={self.mqar.vocab_size} exceeds model.vocab_size="
                       f"{self.model.vocab_size}.")
