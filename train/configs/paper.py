"""Shared recipe of the paper's runs (docs/kvm-spec.md §8): 64 x 8192 tokens per step, AdamC with
lr ∝ 1/sqrt(tokens) and wd = 100·lr, 200 warm-up steps, bf16 parameters with float32 masters.

Text comes from a local or locally cached dataset: pass --config.text_files=... or
--config.hf_dataset=... and a GPT-2 tokenizer file with --config.tokenizer_file=... (vocab 50304).
"""

import dataclasses

from kvm_jax import presets
from kvm_jax.train import TrainConfig, completep


def paper_config(model: str, tokens: float, steps: int, eval_every: int) -> TrainConfig:
  """``model`` is any preset name of ``kvm_jax.presets.PRESETS`` (e.g. "kvm_sqrt16_120m")."""
  if model not in presets.PRESETS:
    raise ValueError(f"unknown preset {model!r}; choose from {sorted(presets.PRESETS)}.")
  cfg = dataclasses.replace(presets.PRESETS[model](), param_dtype="bfloat16",
                            compute_dtype="bfloat16")
  return TrainConfig(model=cfg, task="text", seq_len=8192, batch_size=64, steps=steps,
                     warmup_steps=200, learning_rate=completep.reference_lr(tokens),
                     weight_decay=completep.reference_wd(tokens), log_every=10,
                     eval_every=eval_every, checkpoint_every=eval_every, mesh_data=-1)
