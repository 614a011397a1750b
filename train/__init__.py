"""Training (installed as ``kvm_jax.train``): AdamC with CompleteP groups, a sharded jitted step,
checkpointed data, exact resume, JSONL metrics, and the ``kvm-train`` / ``kvm-demo`` commands.

    from kvm_jax.train import TrainConfig, train
    result = train(TrainConfig(model=kj.presets.tiny()), "runs/tiny")
"""

from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train.data import task_dataset
from kvm_jax.train.evaluation import evaluate
from kvm_jax.train.loop import train

__all__ = ["TrainConfig", "evaluate", "task_dataset", "train"]
