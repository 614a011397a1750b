"""Run directories (config, checkpoints, the trained model), shared by training and evaluation."""

from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.config import TrainConfig
from kvm_jax.runs.directory import (CHECKPOINT_DIR, CONFIG_FILE, TRAIN_CLASSES, forward_logits,
                                    is_run_directory, load_config, load_trained, logits_fn,
                                    save_config)

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "Checkpointer", "TRAIN_CLASSES", "TrainConfig",
           "abstract_like", "forward_logits", "is_run_directory", "load_config", "load_trained",
           "logits_fn", "save_config"]
