"""Distil a converted model against its teacher (docs/conversion.md), on the teacher's task.

  kvm-convert runs/text runs/text-kvm --layers all
  kvm-train --config=train/configs/distill.py --workdir=runs/distill \
      --config.init_from=runs/text-kvm --config.teacher=runs/text

``distill.py:STAGE`` picks the stage, each a run of its own that the next starts from
(``--config.init_from`` the previous workdir):

* ``attention`` — layer-wise attention transfer: each converted layer, fed the teacher's residual
  stream, is fitted to the teacher layer's mixer output (MSE); only the KVM-only parameters (LN_s,
  W_g, temperatures) train;
* ``logits`` (the default) — KL(teacher ‖ student) at ``distill.temperature`` mixed with the LM
  loss (``distill.kl_weight``), every parameter training;
* ``finetune`` — the LM loss alone (``kl`` is still logged against the teacher).

The student's model comes from ``init_from`` (the model below only stands in for it), and the
task and its data (MQAR's spec, or the text corpus and tokenizer) from the teacher's run
(``task="teacher"``), so a demo MQAR model distils on MQAR; ``seq_len`` (text) stays this
config's unless overridden, and --config.task=text (or mqar, niah) with that task's fields trains
on other data. Override anything with
--config.FIELD=VALUE, e.g. --config.distill.trainable=converted or
--config.distill.temperature=2.
"""

import dataclasses

from kvm_jax import presets
from kvm_jax.runs.train_config import DISTILL_STAGES, DistillSpec
from kvm_jax.train import TrainConfig

TRAINABLE_BY_STAGE = {"attention": "kvm_only", "logits": "all", "finetune": "all"}


def get_config(stage: str = "logits") -> TrainConfig:
  if stage not in TRAINABLE_BY_STAGE:
    raise ValueError(f"unknown distillation stage {stage!r}; choose from "
                     f"{[s for s in DISTILL_STAGES if s != 'none']}.")
  kvm = dataclasses.replace(presets.TINY_OPTIONS["kvm"], chunk_size=32, rope_dims=16)
  model = presets.tiny(mixers="kvm", options={"kvm": kvm}, vocab_size=320, num_layers=2,
                       hidden_size=128, num_heads=4, rope_dims=16, mup_base_dim=128)
  return TrainConfig(model=model, task="teacher", seq_len=256, batch_size=8, steps=200,
                     warmup_steps=20, learning_rate=1e-3, weight_decay=0.1, log_every=10,
                     eval_every=100, checkpoint_every=50,
                     distill=DistillSpec(stage=stage, trainable=TRAINABLE_BY_STAGE[stage]))
