"""Run directories (config, checkpoints, the trained model) and multi-process launch, shared by
training and evaluation."""

from kvm_jax.util import lazy_exports as _lazy_exports

__all__ = ["CHECKPOINT_DIR", "CONFIG_FILE", "IMPORT_RECORD", "Checkpointer", "TRAIN_CLASSES",
           "TrainConfig", "abstract_like", "default_placement", "forward_logits", "is_run_directory",
           "load_config", "load_trained", "logits_fn", "save_config", "start_distributed"]


# Imported on first use (kvm_jax.util.lazy_exports): a command's argument parser reads
# kvm_jax.runs.launch without orbax and JAX.
__getattr__, __dir__ = _lazy_exports.exports(__name__, {
    "kvm_jax.runs.checkpoint": ("Checkpointer", "abstract_like"),
    "kvm_jax.runs.train_config": ("TrainConfig",),
    "kvm_jax.runs.directory": ("CHECKPOINT_DIR", "CONFIG_FILE", "IMPORT_RECORD", "TRAIN_CLASSES",
                               "default_placement", "forward_logits", "is_run_directory",
                               "load_config", "load_trained", "logits_fn", "save_config"),
    "kvm_jax.runs.launch": ("start_distributed",)})
