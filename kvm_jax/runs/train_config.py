"""``TrainConfig``: everything a training run needs, and what its run directory records.

It lives below both the trainer (:mod:`kvm_jax.train`) and evaluation (:mod:`kvm_jax.eval`), so that
either can read a run directory without importing the other.
"""

from __future__ import annotations

import dataclasses

from kvm_jax.config.row_plan import check_packing
from kvm_jax.config.model import ModelConfig
from kvm_jax.nn.model import REMAT_POLICIES
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec


DISTILL_STAGES = ("none", "attention", "logits", "finetune")
TASKS = ("mqar", "niah", "text")
# ``TrainConfig.task`` that stands for the teacher run's task and data (resolved by the trainer,
# kvm_jax.train.start.with_teacher_task, before the config is validated).
TEACHER_TASK = "teacher"
TRAINABLE = ("all", "converted", "kvm_only")


@dataclasses.dataclass(frozen=True)
class DistillSpec:
  """How a student trains against a frozen teacher (``TrainConfig.teacher``; docs/conversion.md).

  Attributes:
    stage: "none" (no teacher: plain training; the default), "attention" (layer-wise attention
      transfer: each converted layer, run on the teacher's residual stream, is matched to the
      teacher layer's mixer output, mean squared error per channel over labelled tokens,
      averaged over the converted layers; metric ``attn_mse``),
      "logits" (``kl_weight · T² · KL_T(teacher ‖ student) + (1 − kl_weight) · CE`` per
      token, T = ``temperature``, CE the cross-entropy) or "finetune" (cross-entropy alone, ``kl`` still logged).
      Every stage but "none" needs ``TrainConfig.teacher``.
    temperature: T of the "logits" stage's KL (T² keeps its gradient's scale as T changes).
    kl_weight: the KL's share of the "logits" stage's loss, in [0, 1].
    trainable: which parameters train: "all", "converted" (the mixers of the converted layers:
      the layers whose kind differs from the teacher's) or "kvm_only" (LN_s, W_g and the two
      temperatures of every kvm layer). The others are frozen: bitwise unchanged, no optimizer
      state.
  """

  stage: str = "none"
  temperature: float = 1.0
  kl_weight: float = 0.5
  trainable: str = "all"

  def __post_init__(self):
    if self.stage not in DISTILL_STAGES:
      raise ValueError(f"distill.stage={self.stage!r}; choose from {DISTILL_STAGES}.")
    if self.trainable not in TRAINABLE:
      raise ValueError(f"distill.trainable={self.trainable!r}; choose from {TRAINABLE}.")
    if not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
      raise ValueError(f"distill.temperature must be > 0, got {self.temperature!r}.")
    if not (isinstance(self.kl_weight, (int, float)) and 0 <= self.kl_weight <= 1):
      raise ValueError(f"distill.kl_weight must be in [0, 1], got {self.kl_weight!r}.")


@dataclasses.dataclass
class TrainConfig:
  """Everything a run needs; a run directory's ``config.json`` holds one. Python config files
  (``train/configs/*.py``) return one of these.

  Attributes:
    model: the :class:`kvm_jax.ModelConfig` to train.
    task: "mqar" (synthetic recall), "niah" (RULER-style needle retrieval, loss on the answer
      only) or "text" (packed language modelling); "teacher" takes the task and its data fields
      (mqar, niah, text_files, tokenizer_file, hf_*, data_dir; not seq_len) from the teacher's
      run (the distillation configs' default).
    mqar: MQAR task shape (sequence length, vocabulary, pairs) when ``task == "mqar"``.
    niah: NIAH task (RULER task name, lengths, tokenizer) when ``task == "niah"``.
    text_files: local .txt/.jsonl files for ``task == "text"``; empty = the embedded corpus.
    seq_len: training sequence length (text; MQAR uses ``mqar.seq_len``).
    packing: how text documents become rows (:mod:`kvm_jax.tasks.packing`): "cram" (the paper's
      training rows: a row's state runs from one document into the next), "pad" (one document
      per row from its first token, truncated or padded: the paper's validation rows) or
      "documents" (whole documents packed with segment ids, each computed as if alone; needs
      layers that take them).
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
    data_dir: a token-shard directory written by ``kvm-data`` (:mod:`kvm_jax.tasks.shards`), for
      ``task == "text"``: read memory-mapped instead of tokenizing at start-up; replaces
      ``text_files``/``hf_dataset`` (setting both is an error). Tokenize it with the run's
      ``tokenizer_file``.
    peak_tflops_per_device: for the MFU estimate; 0 = look the device kind up (unknown: no MFU).
    remat: what each block keeps for the backward pass (``kvm_jax.nn.model.REMAT_POLICIES``):
      "none", "block" (only its inputs; least memory) or "block_dots" (also its weight matmuls).
    grad_accum_steps: micro-batches per optimizer step; ``batch_size`` is split into this many
      micro-batches run one after another (``lax.scan``), their loss and gradients weighted by
      token counts, so a step equals the whole batch at 1/grad_accum_steps of the activations.
    loss_slice_len: tokens per slice of the sequence for the LM head and loss (0 = the whole
      sequence at once); the float32 logits ``[B, T, V]`` then never exist whole.
    grad_clip_norm: clip the global gradient norm to this value (0 = no clipping, the paper's).
    on_nonfinite: what a non-finite loss or gradient does: "stop" (the run stops with an error;
      parameters stay those before the bad step and no checkpoint is written) or "skip" (that
      update is dropped, counted in ``skipped_steps``, and training goes on).
    init_from: a run directory (``kvm-train``'s, or ``kvm-import``'s from the authors' released
      checkpoints) to fine-tune: a new run starts from its newest parameters with a fresh optimizer
      and data stream, and its model config replaces ``model`` except for ``model``'s
      param_dtype, compute_dtype, kvm_implementation and attention_implementation
      (``kvm_jax.train.start.FINE_TUNE_FIELDS``). A run that already has checkpoints resumes from
      them instead. "" = train from a fresh initialization.
    teacher: a run directory whose model is a frozen teacher (distillation, :class:`DistillSpec`):
      its parameters are restored with the student's dtypes and shardings and its forward pass is
      not differentiated; every metrics line then carries ``kl``, the mean per-token
      KL(teacher ‖ student) at temperature 1. "" = no teacher.
    distill: the distillation stage, temperature, weights and trainable parameters
      (:class:`DistillSpec`); ``trainable`` applies with or without a teacher, the rest needs one.
  """

  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  task: str = "mqar"
  mqar: MQARSpec = dataclasses.field(default_factory=MQARSpec)
  niah: NIAHSpec = dataclasses.field(default_factory=NIAHSpec)
  text_files: tuple = ()
  seq_len: int = 256
  packing: str = "cram"
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
  data_dir: str = ""
  peak_tflops_per_device: float = 0.0
  remat: str = "none"
  grad_accum_steps: int = 1
  loss_slice_len: int = 0
  grad_clip_norm: float = 0.0
  on_nonfinite: str = "stop"
  init_from: str = ""
  teacher: str = ""
  distill: DistillSpec = DistillSpec()

  @property
  def sequence_length(self) -> int:
    """Tokens per training sequence (MQAR and NIAH set their own)."""
    return {"mqar": self.mqar.seq_len, "niah": self.niah.seq_len}.get(self.task, self.seq_len)

  def validate(self) -> None:
    if self.task not in TASKS:
      hint = (" (it is resolved from the teacher's run before validation: give teacher=RUN_DIR)"
              if self.task == TEACHER_TASK else "")
      raise ValueError(f"task must be 'mqar', 'niah' or 'text', got {self.task!r}{hint}.")
    for name in ("batch_size", "steps", "log_every", "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
    # Checked here, not left to completep.lr_schedule, so that kvm-train reports
    # "invalid config: ..." before anything is built.
    if self.warmup_steps < 0:
      raise ValueError(f"warmup_steps must be >= 0 (0 = no warm-up), got {self.warmup_steps}.")
    if self.steps <= self.warmup_steps:
      raise ValueError(f"steps={self.steps} must exceed warmup_steps={self.warmup_steps} (the "
                       "schedule warms up, then decays to 0 at the last step): raise steps or "
                       "lower warmup_steps.")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat={self.remat!r}; choose from {tuple(REMAT_POLICIES)}.")
    if self.grad_accum_steps < 1 or self.batch_size % self.grad_accum_steps:
      raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must be >= 1 and divide "
                       f"batch_size={self.batch_size}.")
    if self.loss_slice_len < 0:
      raise ValueError(f"loss_slice_len must be >= 0 (0 = whole sequence), got "
                       f"{self.loss_slice_len}.")
    if not self.grad_clip_norm >= 0:
      raise ValueError(f"grad_clip_norm must be >= 0 (0 = no clipping), got "
                       f"{self.grad_clip_norm}.")
    if self.on_nonfinite not in ("stop", "skip"):
      raise ValueError(f"on_nonfinite={self.on_nonfinite!r}; choose 'stop' or 'skip'.")
    check_packing(self.packing)
    if self.packing != "cram" and self.task != "text":
      raise ValueError(f"packing={self.packing!r} packs text documents, but task={self.task!r} "
                       "makes its own rows; set task='text' or packing='cram'.")
    if self.data_dir and self.task != "text":
      raise ValueError(f"data_dir={self.data_dir!r} is a text corpus but task={self.task!r}; set "
                       "task='text' or clear data_dir.")
    if self.data_dir and (self.text_files or self.hf_dataset):
      given = "text_files" if self.text_files else "hf_dataset"
      raise ValueError(f"data_dir={self.data_dir!r} and {given} are both set; data_dir (token "
                       f"shards from kvm-data) replaces them: clear {given}, or data_dir.")
    if not self.teacher and (self.distill.stage != "none"
                             or self.distill.trainable == "converted"):
      what = (f"distill.stage={self.distill.stage!r}" if self.distill.stage != "none"
              else "distill.trainable='converted' (the layers whose kind differs from the "
                   "teacher's)")
      raise ValueError(f"{what} needs a teacher: set teacher=RUN_DIR (e.g. "
                       "--config.teacher=runs/full), or distill.stage='none' to train without one.")
    if self.teacher and self.distill.stage == "none":
      raise ValueError(f"teacher={self.teacher!r} is set but distill.stage='none'; choose a stage "
                       "('attention', 'logits' or 'finetune'), or clear teacher.")
    # The data's ids against model.vocab_size: kvm_jax.train.data.check_vocabulary (it reads
    # tokenizers and shard manifests, which validating a config does not).
