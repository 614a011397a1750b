"""The paper's 120M KVM run (spec §8): 64 x 8192 tokens per step, 6000 steps (~3.1B tokens),
AdamC lr 2e-3 / wd 0.2, 200 warm-up steps, bf16 parameters with float32 masters. Text comes from
a local or locally cached dataset: pass --config.text_files=... or --config.hf_dataset=... and a
GPT-2 tokenizer file with --config.tokenizer_file=... (vocab 50304). Choose the model with
--config.model=... overrides or edit MODEL below (any preset of kvm_jax.presets)."""

import dataclasses

from kvm_jax import presets
from train import completep
from train.loop import TrainConfig

MODEL = "kvm256_120m"
TOKENS = 3e9


def get_config() -> TrainConfig:
  model = dataclasses.replace(getattr(presets, MODEL)(), param_dtype="bfloat16",
                              compute_dtype="bfloat16")
  return TrainConfig(model=model, task="text", seq_len=8192, batch_size=64, steps=6000,
                     warmup_steps=200, learning_rate=completep.reference_lr(TOKENS),
                     weight_decay=completep.reference_wd(TOKENS), log_every=10,
                     eval_every=250, checkpoint_every=250, mesh_data=-1)
