"""Run directories (config, checkpoints, the trained model) and multi-process launch, shared by
training and evaluation."""

from kvm_jax import renamed as _renamed
from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.runs.directory import (CHECKPOINT_DIR, CONFIG_FILE, IMPORT_RECORD, TRAIN_CLASSES,
                                    default_placement, forward_logits, is_run_directory,
                                    load_config, load_trained, logits_fn, save_config)
from kvm_jax.runs.launch import start_distributed

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "IMPORT_RECORD", "Checkpointer", "TRAIN_CLASSES",
           "TrainConfig", "abstract_like", "default_placement", "forward_logits", "is_run_directory",
           "load_config", "load_trained", "logits_fn", "save_config", "start_distributed"]


# ``kvm_jax.runs.config``, the old path of a renamed module, still resolves.
__getattr__ = _renamed.old_submodules(__name__, "config")
