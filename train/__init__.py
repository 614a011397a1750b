"""Training (installed as ``kvm_jax.train``): AdamC with CompleteP groups, a sharded jitted step,
checkpointed data, exact resume, JSONL metrics, and the ``kvm-train`` / ``kvm-demo`` commands.

    from kvm_jax.train import TrainConfig, train
    result = train(TrainConfig(model=kj.presets.tiny()), "runs/tiny")
"""

from kvm_jax.util import lazy_exports as _lazy_exports

__all__ = ["TrainConfig", "evaluate", "task_dataset", "train"]

# Imported on first use (kvm_jax.util.lazy_exports): kvm-train's and kvm-demo's --help need none.
__getattr__, __dir__ = _lazy_exports.exports(__name__, {
    "kvm_jax.runs.train_config": ("TrainConfig",), "kvm_jax.train.data": ("task_dataset",),
    "kvm_jax.train.evaluation": ("evaluate",), "kvm_jax.train.loop": ("train",)})
