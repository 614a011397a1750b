"""Tiny KVM language model on the embedded CPython documentation corpus (bytes), CPU."""

from kvm_jax import presets
from kvm_jax.config.budget import PowerLawBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.train import TrainConfig


def get_config() -> TrainConfig:
  kvm = KVMConfig(chunk_size=32, window_chunks=2, sink_rows=1, rope_dims=16,
                  budget=PowerLawBudget(8.0, 0.5, min_rows=32))
  model = presets.tiny(mixers="kvm", options={"kvm": kvm}, vocab_size=320, num_layers=2,
                       hidden_size=128, num_heads=4, rope_dims=16, mup_base_dim=128)
  return TrainConfig(model=model, task="text", seq_len=256, batch_size=8, steps=300,
                     warmup_steps=30, learning_rate=3e-3, weight_decay=0.1, log_every=20,
                     eval_every=100, checkpoint_every=100)
