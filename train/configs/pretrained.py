"""Convert a pretrained transformer (Qwen3-0.6B, Llama-3.2-1B, Gemma-3-1B, or any model of their
families) to KVM on one accelerator host, in three distillation stages (docs/pretrained.md)::

  kvm-import ~/models/Qwen3-0.6B runs/qwen3                      # transformers -> run directory
  kvm-convert runs/qwen3 runs/qwen3-kvm --layers global --kvm.budget=fixed:256
  kvm-train --config=train/configs/pretrained.py:qwen3_0_6b,attention --workdir=runs/s1 \
      --config.init_from=runs/qwen3-kvm --config.teacher=runs/qwen3 \
      --config.text_files=corpus/*.txt --config.tokenizer_file=runs/qwen3/tokenizer.json
  kvm-train --config=train/configs/pretrained.py:qwen3_0_6b,logits --workdir=runs/s2 \
      --config.init_from=runs/s1 --config.teacher=runs/qwen3 ...
  kvm-train --config=train/configs/pretrained.py:qwen3_0_6b,finetune --workdir=runs/s3 \
      --config.init_from=runs/s2 --config.teacher=runs/qwen3 ...

The argument is ``MODEL[,STAGE]``: MODEL one of ``kvm_jax.presets.PRETRAINED_SHAPES``, STAGE
``attention`` (layer-wise attention transfer of the KVM-only parameters, 100M tokens at 2048),
``logits`` (KL against the teacher mixed with the LM loss, every parameter, 250M tokens at 2048)
or ``finetune`` (the LM loss at 8192 tokens, 100M tokens): 450M tokens in all, within the
350–700M that RADLADS reports for converting attention to linear attention at these sizes.
Without a stage, the unconverted model fine-tuned with the LM loss; ``MODEL,kvm`` the converted
model the same way, without a teacher (the two shapes ``--memory-report`` compares). The model below stands in for ``init_from``'s (the same shapes: what
``--memory-report`` sizes); the text fields come from the command line.
"""

import dataclasses

from kvm_jax import presets
from kvm_jax.runs.train_config import DistillSpec
from kvm_jax.train import TrainConfig

# stage -> (tokens, sequence length, sequences per step, trainable parameters)
STAGES = {"attention": (100e6, 2048, 64, "kvm_only"), "logits": (250e6, 2048, 64, "all"),
          "finetune": (100e6, 8192, 32, "all")}
# The stage that trains the converted model as it is, with no teacher.
CONVERTED = "kvm"


def get_config(spec: str = "qwen3_0_6b") -> TrainConfig:
  model_name, _, stage = spec.partition(",")
  if model_name not in presets.PRETRAINED_SHAPES:
    raise ValueError(f"unknown model {model_name!r}; choose from "
                     f"{sorted(presets.PRETRAINED_SHAPES)} (then ,attention / ,logits / "
                     ",finetune for a distillation stage).")
  if stage and stage not in (*STAGES, CONVERTED):
    raise ValueError(f"unknown stage {stage!r}; choose from {sorted(STAGES) + [CONVERTED]}.")
  model = presets.PRETRAINED_SHAPES[model_name]()
  tokens, seq_len, batch, trainable = STAGES.get(stage if stage in STAGES else "finetune")
  if stage:
    model = presets.converted(model)
  model = dataclasses.replace(model, param_dtype="bfloat16", compute_dtype="bfloat16")
  steps = max(int(tokens // (seq_len * batch)), 1)
  teacher = stage in STAGES
  distill = DistillSpec(stage=stage, trainable=trainable) if teacher else DistillSpec()
  return TrainConfig(model=model, task="teacher" if teacher else "text", seq_len=seq_len,
                     batch_size=batch, steps=steps, warmup_steps=min(100, steps // 10 + 1),
                     learning_rate=1e-4 if stage != "attention" else 1e-3, weight_decay=0.01,
                     log_every=10, eval_every=max(steps // 10, 1),
                     checkpoint_every=max(steps // 20, 1), mesh_data=-1, remat="block",
                     loss_slice_len=1024, distill=distill)
