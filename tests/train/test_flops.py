"""The trainer's FLOP count of a step (``step_flops``) against the matmul FLOPs of the step XLA
compiles for this CPU (``kvm_jax.util.hlo_flops``, every loop counted by its trip count), for every
mixer kind, with and without block remat.

The model is tiny but shaped so that each kind's mixing work is a large share of the step: heads
of 64 on a width of 32 (D·H = 256, eight times the width) over 128 tokens, so attention, KVM's
routing scores and RWKV-7's state products are each well above the 10 % the two counts may differ
by. 10 %: the compiled step also runs small matmuls no FLOP model names (the value residual's
LoRA, whose gradient XLA may reorder), and blocked implementations score some masked entries
(chunked attention's diagonal block, KVM's masked half-chunk of window) that only the step's
count, not the model's, is meant to include approximately.
"""

from __future__ import annotations

import dataclasses

import pytest

import kvm_jax as kj
from kvm_jax.config.budget import FixedBudget, PowerLawBudget
from kvm_jax.nn.mixers.swa import SWAOptions
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train.memory import compile_step

T = 128
KVM = dict(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8)
KINDS = {
    "full": ("full", {}),
    "swa": ("swa", {"swa": SWAOptions(window=24, rope_dims=16)}),
    # fixed: 32 rows from the start (four chunks folded into one state of 32 rows)
    "kvm_fixed": ("kvm", {"kvm": kj.KVMConfig(budget=FixedBudget(32), max_state_rows=32, **KVM)}),
    # growing: 8·√N rows (90 at T = 128), appending at every fold
    "kvm_sqrt": ("kvm", {"kvm": kj.KVMConfig(budget=PowerLawBudget(8.0, 0.5, min_rows=8),
                                            **KVM)}),
    "ovq": ("ovq", {"ovq": kj.OVQConfig(chunk_size=8, max_centroids=24)}),
    # RWKV-7 splits the width into its heads: 4 heads of 64 on a width of 256
    "rwkv7": ("rwkv7", {"rwkv7": kj.RWKV7Options(16)}),
}
SHAPES = {"rwkv7": dict(hidden_size=256, head_dim=None)}


def _config(kind: str, remat: str) -> TrainConfig:
  mixers, options = KINDS[kind]
  shape = {**dict(hidden_size=32, head_dim=64), **SHAPES.get(kind, {})}
  model = kj.presets.tiny(mixers=mixers, options=options, num_layers=1, vocab_size=64,
                          num_heads=4, rope_dims=8, attention_implementation="chunked",
                          kvm_implementation="xla", **shape)
  return TrainConfig(model=model, task="text", seq_len=T, batch_size=1, remat=remat)


# OVQ's run is not modelled yet: its chunks read the dictionary's whole capacity and its updates
# score and accumulate by matmuls, which the step runs (compiled / trainer ~1.2 here) but
# OVQAttention counts only as the attention over its visible rows.
OVQ_UNMODELLED = pytest.mark.xfail(strict=True, reason="OVQ's executed work is not counted yet")


@pytest.mark.parametrize("remat", ["none", "block"])
@pytest.mark.parametrize("kind", [pytest.param(k, marks=OVQ_UNMODELLED) if k == "ovq" else k
                                  for k in KINDS])
def test_step_flops_agree_with_the_compiled_step(kind, remat):
  report = compile_step(_config(kind, remat), "local")
  assert report.compiled and report.opaque_calls == 0
  assert report.flops_ratio == pytest.approx(1.0, abs=0.10), (
      f"compiled {report.xla_flops:.4g} vs trainer {report.model_flops:.4g}")
