"""Bad input fails early with a ValueError that names the bad value and the fix."""

from __future__ import annotations

import dataclasses

from pathlib import Path

import pytest

import kvm_jax as kj
from kvm_jax.ops.kvm.cases import random_inputs, random_params
from kvm_jax.runs import TrainConfig

from tests.helpers import ROOT  # noqa: E402

CFG = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                   budget=kj.FixedBudget(4))


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(window_chunks=0), "window_chunks"),
    (dict(rope_dims=3), "rope_dims must be even"),
    (dict(sink_rows=4), "sink_rows=4 must be < chunk_size=4"),
    (dict(budget=kj.FixedBudget(1)), "not above sink_rows"),
    (dict(budget=kj.SaturatingBudget(limit=1)), "not above sink_rows"),
    (dict(budget="sqrt"), "budget"),
    (dict(max_state_rows=1), "max_state_rows"),
    (dict(value_norm="mean"), "value_norm"),
    (dict(readout_value_dtype="int8"), "readout_value_dtype"),
    (dict(gate_keys=1), "gate_keys must be a bool"),
])
def test_config_validation(kwargs, match):
  base = dict(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2, budget=kj.FixedBudget(4))
  base.update(kwargs)
  with pytest.raises(ValueError, match=match):
    kj.KVMConfig(**base)


@pytest.mark.parametrize("budget, match", [
    (lambda: kj.FixedBudget(0), "rows must be >= 1"),
    (lambda: kj.PowerLawBudget(factor=-1.0), "factor"),
    (lambda: kj.PowerLawBudget(factor=16.0, exponent=2.0), "exponent"),
    (lambda: kj.SaturatingBudget(limit=0), "limit"),
    (lambda: kj.PowerLawBudget(factor=16.0, round_down=0), "round_down"),
])
def test_budget_validation(budget, match):
  with pytest.raises(ValueError, match=match):
    budget()


def test_config_is_hashable_and_frozen():
  assert hash(CFG) == hash(kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=2,
                                        budget=kj.FixedBudget(4)))
  with pytest.raises(Exception):
    CFG.chunk_size = 8


def _inputs():
  q, k, v, g = random_inputs(0, 1, 9, 4, 2, 8, 6)
  return q, k, v, g, random_params(0, 8, 4)


@pytest.mark.parametrize("mutate, match", [
    (lambda q, k, v, g, p: (q[0], k, v, g, p), "q must have rank 4"),
    (lambda q, k, v, g, p: (q, k[:, :5], v, g, p), "inconsistent shapes"),
    (lambda q, k, v, g, p: (q, k, v, g[..., 0], p), "merge_gate must have rank 3"),
    (lambda q, k, v, g, p: (q[..., :3, :], k, v, g, p), "multiple of kv heads"),
    (lambda q, k, v, g, p: (q, k[..., :4], v, g, p), "head dim"),
    (lambda q, k, v, g, p: (q, k, v, g.at[0, 3, 1].set(0.0), p), "merge_gate must be > 0"),
    (lambda q, k, v, g, p: (q, k, v, g, kj.KVMParams.init(8, 2)), "window_temperature"),
    (lambda q, k, v, g, p: (q, k, v, g, kj.KVMParams.init(6, 4)), "ln_scale"),
])
def test_input_validation(mutate, match):
  args = mutate(*_inputs())
  with pytest.raises(ValueError, match=match):
    kj.kvm_attention(*args, CFG)
  with pytest.raises(ValueError, match=match):
    kj.kvm_attention_reference(*args, CFG)


def test_rope_dims_larger_than_head_dim():
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, rope_dims=10, budget=kj.FixedBudget(4))
  q, k, v, g, p = _inputs()
  with pytest.raises(ValueError, match="rope_dims=10 exceeds the q/k head dim 8"):
    kj.kvm_attention(q, k, v, g, p, cfg)
  with pytest.raises(ValueError, match="rope_dims"):
    kj.kvm_init_cache(cfg, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=16)


def test_decode_input_validation():
  q, k, v, g, p = _inputs()
  cache = kj.kvm_init_cache(CFG, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=16)
  with pytest.raises(ValueError, match="exactly one token"):
    kj.kvm_decode_step(q[:, :2], k[:, :2], v[:, :2], g[:, :2], p, CFG, cache)
  other = kj.kvm_init_cache(CFG, batch=2, kv_heads=2, head_dim=8, value_dim=6, max_len=16)
  with pytest.raises(ValueError, match="do not match the cache"):
    kj.kvm_decode_step(q[:, :1], k[:, :1], v[:, :1], g[:, :1], p, CFG, other)
  with pytest.raises(ValueError, match="max_len must be a positive int"):
    kj.kvm_init_cache(CFG, batch=1, kv_heads=2, head_dim=8, value_dim=6, max_len=0)


def test_unknown_implementation():
  with pytest.raises(ValueError, match="implementation='triton' is not available"):
    kj.resolve_kvm_backend(CFG, implementation="triton")


@pytest.mark.parametrize("steps, warmup, match", [
    (5, 5, r"steps=5 must exceed warmup_steps=5 .*: raise steps or lower warmup_steps"),
    (3, 10, r"steps=3 must exceed warmup_steps=10 "),
    (5, -1, r"warmup_steps must be >= 0 \(0 = no warm-up\), got -1"),
])
def test_train_config_schedule_validation(steps, warmup, match):
  # completep.lr_schedule raises too, but only once training has started: the config must.
  with pytest.raises(ValueError, match=match):
    TrainConfig(steps=steps, warmup_steps=warmup).validate()


def test_train_config_schedule_boundaries_are_accepted():
  TrainConfig(steps=6, warmup_steps=5).validate()  # one step of decay after the warm-up
  TrainConfig(steps=1, warmup_steps=0).validate()  # no warm-up at all


def test_kvm_train_reports_a_bad_schedule_as_an_invalid_config(tmp_path):
  from kvm_jax.train.main import main
  with pytest.raises(SystemExit, match=r"^invalid config: steps=5 must exceed warmup_steps=5 "):
    main([f"--config={ROOT / 'train/configs/tiny_mqar.py'}", f"--workdir={tmp_path}",
          "--config.steps=5", "--config.warmup_steps=5", "--show-config"])


def _shipped_configs() -> list[str]:
  """Every config spec under train/configs: each file, and paper.py with each preset it takes."""
  from kvm_jax.train.configs import paper
  specs = [f.name for f in sorted((ROOT / "train/configs").glob("*.py"))
           if f.name not in ("__init__.py", "paper.py")]
  return specs + [f"paper.py:{name}" for name in sorted(kj.presets.PRESETS)
                  if name.rsplit("_", 1)[-1] in paper.SIZES] + [
                      "pretrained.py:gemma3_1b,attention", "pretrained.py:llama3_2_1b,kvm"]


@pytest.mark.parametrize("spec", _shipped_configs())
def test_shipped_configs_validate(spec):
  from kvm_jax.train.main import load_config
  cfg = load_config(str(ROOT / "train/configs" / spec))
  if cfg.distill.stage != "none":  # distill.py: its command line names the teacher, whose
    # task (text, say) the trainer takes for task="teacher"
    cfg = dataclasses.replace(cfg, teacher="runs/teacher",
                              task="text" if cfg.task == "teacher" else cfg.task)
  cfg.validate()


@pytest.mark.parametrize("steps", [1, 2, 4, 30, 600])
def test_default_job_configs_validate(steps):
  from kvm_jax.train import demo as default_job
  for model in default_job.model_configs().values():
    default_job.train_config(model, steps, seed=0).validate()
