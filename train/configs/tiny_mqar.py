"""Tiny KVM model on MQAR, on CPU in minutes (the building block of the default job)."""

from kvm_jax import presets
from kvm_jax.config.budget import PowerLawBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.train import TrainConfig


def get_config() -> TrainConfig:
  kvm = KVMConfig(chunk_size=16, window_chunks=2, sink_rows=1, rope_dims=16,
                  budget=PowerLawBudget(4.0, 0.5, min_rows=16))
  model = presets.tiny(mixers="kvm", options={"kvm": kvm}, vocab_size=128, num_layers=2,
                       hidden_size=64, num_heads=2, rope_dims=16, mup_base_dim=64)
  return TrainConfig(model=model, task="mqar",
                     mqar=MQARSpec(seq_len=128, vocab_size=128, num_pairs=8),
                     batch_size=32, steps=400, warmup_steps=40, learning_rate=3e-3,
                     weight_decay=0.1, log_every=20, eval_every=100, checkpoint_every=100)
