"""The paper's training recipe for any preset (docs/kvm-spec.md §8): 64 x 8192 tokens per step,
AdamC with lr ∝ 1/sqrt(tokens) and wd = 100·lr, 200 warm-up steps, bf16 parameters with float32
masters; 3B tokens (6000 steps) for the 120M models, 7.5B (15000 steps) for the 350M ones.

  kvm-train --config=train/configs/paper.py:kvm_sqrt16_120m --workdir=W ...

Memory: the recipe keeps only each block's inputs for the backward pass (``remat="block"``) and
computes the LM head and loss over 1024-token slices. At 8 sequences x 8192 tokens per chip the
120M KVM recipes and full attention's compile within a 16 GiB TPU v5e (8.35–11.05 GiB per chip
on v5e:4x4, docs/hardware.md's table); a 350M step is larger (see the table, or
``kvm-train ... --memory-report --topology=v5e:4x4``, which also names the settings that make a
step fit). On fewer than 8 devices raise ``--config.grad_accum_steps`` to keep 8 sequences per
device per micro-batch.

Text comes from a local or locally cached dataset: pass --config.text_files=... or
--config.hf_dataset=... and a GPT-2 tokenizer file with --config.tokenizer_file=... (vocab 50304).
"""

import dataclasses

from kvm_jax import presets
from kvm_jax.train import TrainConfig, completep

# Token budget, steps and evaluation interval of the paper's runs, by model size.
SIZES = {"120m": (3e9, 6000, 250), "350m": (7.5e9, 15000, 625)}


def paper_config(model: str, tokens: float, steps: int, eval_every: int) -> TrainConfig:
  """``model`` is any preset name of ``kvm_jax.presets.PRESETS`` (e.g. "kvm_sqrt16_120m")."""
  if model not in presets.PRESETS:
    raise ValueError(f"unknown preset {model!r}; choose from {sorted(presets.PRESETS)}.")
  cfg = dataclasses.replace(presets.PRESETS[model](), param_dtype="bfloat16",
                            compute_dtype="bfloat16")
  return TrainConfig(model=cfg, task="text", seq_len=8192, batch_size=64, steps=steps,
                     warmup_steps=200, learning_rate=completep.reference_lr(tokens),
                     weight_decay=completep.reference_wd(tokens), log_every=10,
                     eval_every=eval_every, checkpoint_every=eval_every, mesh_data=-1,
                     remat="block", loss_slice_len=1024)


def get_config(preset: str) -> TrainConfig:
  """The paper recipe for ``preset``, sized by its suffix (``_120m`` or ``_350m``)."""
  size = preset.rsplit("_", 1)[-1]
  if preset not in presets.PRESETS or size not in SIZES:
    paper = sorted(p for p in presets.PRESETS if p.rsplit("_", 1)[-1] in SIZES)
    raise ValueError(f"no paper recipe for {preset!r}; choose a preset from {paper}.")
  return paper_config(preset, *SIZES[size])
