"""``kvm-train --memory-report --topology``: the trainer's step compiled for chips this machine does
not have (XLA:TPU and Mosaic run for real through libtpu), its sharding, FLOPs and fit.

The oracle for sharding is the compiler: XLA:TPU's own count of the step's argument bytes per
chip must match the per-chip bytes the report derives from each leaf's partition spec, and those
must be a quarter of the whole when fsdp splits the parameters four ways.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvm_jax.train import memory
from kvm_jax.train.main import load_config, main
from tests.helpers import ROOT

TINY = str(ROOT / "train/configs/tiny_text.py")


def _tiny(**changes):
  cfg = load_config(TINY)
  model = changes.pop("model", {})
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model), **changes)


def test_mesh_sizes_take_the_topologys_chips_and_refuse_what_does_not_divide_them():
  assert memory.mesh_sizes(_tiny(mesh_data=-1), 16, "topology v5e:4x4") == (16, 1, 1)
  assert memory.mesh_sizes(_tiny(mesh_data=2, mesh_fsdp=-1), 16, "t") == (2, 8, 1)
  assert memory.mesh_sizes(_tiny(mesh_data=1, mesh_fsdp=4, mesh_tensor=2), 8, "t") == (1, 4, 2)
  with pytest.raises(ValueError, match=r"fsdp=3 .* topology v5e:2x2, which has 4 chips"):
    memory.mesh_sizes(_tiny(mesh_data=-1, mesh_fsdp=3), 4, "topology v5e:2x2")
  with pytest.raises(ValueError, match="product is 8"):
    memory.mesh_sizes(_tiny(mesh_data=2, mesh_fsdp=2), 8, "t")
  with pytest.raises(ValueError, match="at most one -1"):
    memory.mesh_sizes(_tiny(mesh_data=-1, mesh_fsdp=-1), 8, "t")


def test_topology_flags_need_the_memory_report():
  with pytest.raises(SystemExit, match="--topology goes with --memory-report"):
    main([f"--config={TINY}", "--workdir=/nonexistent", "--topology=v5e:2x2"])


def test_fit_candidates_are_settings_the_batch_allows():
  cfg = _tiny(batch_size=8, mesh_data=-1)
  candidates = dict(memory.fit_candidates(cfg, 4))
  assert "--config.remat=block" in candidates
  assert "--config.mesh_data=1 --config.mesh_fsdp=-1 --config.mesh_tensor=1" in candidates
  # 8 rows over 4 chips: 2 micro-batches of 4 rows split, 4 micro-batches of 2 rows do not.
  assert "--config.grad_accum_steps=2" in candidates
  assert "--config.grad_accum_steps=4" not in candidates
  for _, candidate in candidates.items():
    candidate.validate()


@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_fsdp_over_a_v5e_2x2_shards_parameters_optimizer_and_batch_with_the_kernels():
  """A tiny KVM model on the Pallas kernels, fsdp = 4 on four v5e chips: the step compiles inside
  the trainer's kernel context (outside it, Mosaic refuses to be partitioned automatically);
  parameters and optimizer state per chip are about a quarter of the whole (norm vectors stay
  replicated: 0.25-0.30), the batch is split four ways over the batch axes, and XLA:TPU's count
  of argument bytes per chip agrees with the report's (within 15 %: XLA:TPU pads small arrays
  to its (8, 128) tiles)."""
  pytest.importorskip("libtpu")
  cfg = _tiny(mesh_data=1, mesh_fsdp=-1, batch_size=8, model={"kvm_implementation": "pallas"})
  report = memory.compile_step(cfg, "v5e:2x2")
  assert report.compiled and report.fits, report.error
  assert report.mesh == (("data", 1), ("fsdp", 4), ("tensor", 1))
  rows = {row.role: row for row in report.sharding}
  params = [rows[r] for r in memory.ROLES if r in rows]
  whole, per_chip = sum(r.whole for r in params), sum(r.per_chip for r in params)
  assert 0.25 <= per_chip / whole <= 0.30, (per_chip, whole)
  opt = rows["optimizer state"]
  assert 0.25 <= opt.per_chip / opt.whole <= 0.30, opt
  assert rows["batch"].per_chip * 4 == rows["batch"].whole
  assert rows["batch"].specs == ("P(data+fsdp)",)
  assert any("fsdp" in spec for spec in rows["mlp"].specs)
  derived = per_chip + opt.per_chip + rows["batch"].per_chip
  assert derived <= report.arguments <= 1.15 * derived, (derived, report.arguments)
  assert report.xla_flops > 0 and report.model_flops > 0


def _too_large_for_a_v5e():
  """A tiny model at 2048 x 256 tokens on one chip, vocabulary 8192: its logits and their
  gradient (2048 x 256 x 8192 float32: 16 GiB each) overflow a v5e's 15.75 GiB, while half the
  rows at a time fit."""
  return _tiny(batch_size=2048, remat="block", model={"vocab_size": 8192})


@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_a_step_that_does_not_fit_is_refused_in_the_compilers_words():
  pytest.importorskip("libtpu")
  cfg = _too_large_for_a_v5e()
  report = memory.compile_step(cfg, "v5e:1x1")
  assert report.fits is False and "RESOURCE_EXHAUSTED" in report.error, report.error
  assert "exceeds available HBM (15.75G)" in report.error
  assert "per-chip verdict: DOES NOT FIT one v5e chip" in "\n".join(report.lines(cfg))
  assert [text for text, _ in memory.fit_candidates(cfg, 1)][0] == "--config.grad_accum_steps=2"


@pytest.mark.slow  # XLA:TPU takes ~2.5 min to fit the accumulated step; the refusal above is CI's
@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_the_settings_that_fit_are_found_by_compiling_them():
  pytest.importorskip("libtpu")
  found = memory.fitting_settings(_too_large_for_a_v5e(), "v5e:1x1", limit=1, budget=1)
  assert [text for text, _ in found] == ["--config.grad_accum_steps=2"]
  assert found[0][1].fits and found[0][1].peak <= found[0][1].memory


def test_a_saved_step_loads_and_computes_what_the_trainer_computes(tmp_path):
  """``--save-compiled`` on this machine's CPU: the executable read back takes the trainer's real
  arguments and returns bitwise what the trainer's own jitted step returns."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from kvm_jax.train.start import setup
  from kvm_jax.train.step import make_train_step
  cfg = _tiny(batch_size=2, seq_len=64)
  memory.compile_step(cfg, None, save_compiled=str(tmp_path / "step.bin"))
  loaded = memory.load_executable(str(tmp_path / "step.bin"))
  graphdef, params, opt_state, optimizer, shardings = setup(cfg)
  tokens = jax.device_put(jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, 320), shardings[2])
  batch, halted = {"inputs": tokens, "labels": tokens}, jnp.zeros((), bool)
  want = make_train_step(graphdef, optimizer, shardings, cfg)(
      *jax.tree_util.tree_map(jnp.copy, (params, opt_state)), batch, halted)
  got = loaded(params, opt_state, batch, halted)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
