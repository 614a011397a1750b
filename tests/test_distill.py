"""Distillation in the trainer (kvm_jax.train.distill): the KL objective against float64 numpy,
exactly zero for a student equal to its teacher; frozen parameters bitwise unchanged with no
optimizer state; a distillation run resumed bitwise; the attention-transfer stage."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.runs.conversion import write_converted
from kvm_jax.ops.loss import IGNORE, kl_sums, sliced_distill_sums
from kvm_jax.runs.config import DistillSpec, TrainConfig
from kvm_jax.runs.directory import load_trained
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.train import distill
from kvm_jax.train.default_job import model_configs
from kvm_jax.train.loop import train
from kvm_jax.train.start import make_optimizer
from tests.conftest import in_ci, random_model, write_run


def _softmax64(x):
  x = x - x.max(-1, keepdims=True)
  e = np.exp(x)
  return e / e.sum(-1, keepdims=True)


def test_kl_and_its_gradient_match_float64_numpy():
  rng = np.random.default_rng(0)
  student, teacher = (rng.normal(size=(2, 5, 7)) * 3 for _ in range(2))
  labels = rng.integers(0, 7, (2, 5))
  labels[0, 1] = labels[1, 4] = IGNORE
  temperature, total = 2.0, 9.0
  p_s, p_t = _softmax64(student / temperature), _softmax64(teacher / temperature)
  valid = (labels != IGNORE)[..., None]
  want = np.sum(valid * p_t * (np.log(p_t) - np.log(p_s))) / total
  # d/ds KL(p_t || softmax(s/T)) = (p_s - p_t) / T at every labelled position.
  want_grad = valid * (p_s - p_t) / temperature / total
  f = lambda s: kl_sums(s, jnp.asarray(teacher, jnp.float32), jnp.asarray(labels),
                        temperature)[0] / total
  value, grad = jax.value_and_grad(f)(jnp.asarray(student, jnp.float32))
  np.testing.assert_allclose(float(value), want, rtol=1e-5)  # float32 vs float64
  np.testing.assert_allclose(np.asarray(grad), want_grad, atol=1e-6)
  assert int(kl_sums(student, teacher, jnp.asarray(labels))[1]) == 8


def test_sliced_distill_sums_equal_whole_sequence():
  rng = np.random.default_rng(1)
  f_s, f_t = (jnp.asarray(rng.normal(size=(2, 11, 6)), jnp.float32) for _ in range(2))
  k_s, k_t = (jnp.asarray(rng.normal(size=(6, 9)), jnp.float32) for _ in range(2))
  labels = jnp.asarray(rng.integers(0, 9, (2, 11)))
  kw = dict(compute_dtype="float32", teacher_compute_dtype="float32", temperatures=(1.0, 3.0))
  whole = sliced_distill_sums((f_s, k_s), (f_t, k_t), labels, **kw)
  sliced = sliced_distill_sums((f_s, k_s), (f_t, k_t), labels, slice_len=4, **kw)
  for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(sliced)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5)


def _objective(spec, teacher_cfg, student_cfg=None):
  student_cfg = student_cfg or teacher_cfg
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: kj.LM(teacher_cfg, rngs=nnx.Rngs(0))))
  return distill.DistillObjective(spec, graphdef,
                                  distill.converted_layers(student_cfg, teacher_cfg), "none", 0,
                                  "float32")


def test_kl_objective_is_exactly_zero_for_a_student_equal_to_its_teacher():
  model = random_model(kj.presets.tiny(mixers=("kvm", "full"), vocab_size=64), seed=2)
  graphdef, params = nnx.split(model)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 24))
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(tokens[:, 1:])}
  total = jnp.asarray(46.0)
  spec = DistillSpec(stage="logits", temperature=2.0, kl_weight=1.0)
  objective = _objective(spec, model.cfg)
  # The teacher's parameters are the student's: the two forwards are the same computation on
  # the same numbers, so the KL is zero to the bit (also in the differentiated program).
  (loss, aux), grads = jax.jit(jax.value_and_grad(
      lambda p: objective(graphdef, p, batch, p, total), has_aux=True))(params)
  assert float(aux["kl"]) == 0.0 and float(loss) == 0.0
  # Its gradient (p_s - p_t)/T vanishes up to the rounding of sum(p_t) = 1 in float32.
  assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grads)) < 1e-7
  assert float(aux["ce"]) > 1.0  # an untrained model: the LM loss is not what vanished
  mixed = _objective(dataclasses.replace(spec, kl_weight=0.25), model.cfg)
  loss, aux = jax.jit(lambda p: mixed(graphdef, p, batch, p, total))(params)
  assert float(loss) == pytest.approx(0.75 * float(aux["ce"]), rel=1e-6)


# -- training ------------------------------------------------------------------------------------

MQAR = MQARSpec(seq_len=64, vocab_size=64, num_pairs=8)


def _run(model, **kw) -> TrainConfig:
  base = dict(model=model, task="mqar", mqar=MQAR, batch_size=8, steps=4, warmup_steps=1,
              log_every=1, checkpoint_every=2, eval_every=0)
  return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def teacher_and_student(tmp_path_factory):
  """A full-attention teacher (the demo's full model with random parameters), and its
  conversion to KVM."""
  root = tmp_path_factory.mktemp("distill")
  cfg = _run(model_configs()["full"])
  write_run(root / "teacher", cfg, random_model(cfg.model, seed=7))
  write_converted(root / "teacher", root / "student", layers="odd", progress=False)
  return root / "teacher", root / "student"


def _params(workdir):
  return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(load_trained(workdir)[1]))}


@pytest.mark.slow  # CI: the loss against its oracle below, frozen parameters in the resume test
def test_attention_transfer_trains_only_kvm_parameters(teacher_and_student, tmp_path):
  teacher, student = teacher_and_student
  cfg = _run(kj.presets.tiny(), init_from=str(student), teacher=str(teacher), steps=3,
             learning_rate=1e-2,
             distill=DistillSpec(stage="attention", trainable="kvm_only"))
  train(cfg, tmp_path / "run", verbose=False)
  before, after = _params(student), _params(tmp_path / "run")
  changed = {p for p in before if not np.array_equal(before[p], after[p])}
  want = {p for p in before if p[:3] == ("blocks", 1, "attn") and p[3] in distill.KVM_ONLY}
  assert changed == want  # everything else bitwise unchanged (weight decay never reached it)
  lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert all({"kl", "ce", "attn_mse"} <= set(line) for line in lines)
  assert lines[-1]["attn_mse"] < lines[0]["attn_mse"]
  assert lines[0]["loss"] == lines[0]["attn_mse"]


def test_frozen_parameters_have_no_optimizer_state():
  cfg = _run(kj.presets.tiny())
  params = nnx.state(random_model(cfg.model))
  keep = distill.trainable_predicate(dataclasses.replace(
      cfg, distill=DistillSpec(trainable="kvm_only")))
  state = make_optimizer(cfg, params, keep).init(params)
  trainable = [path for path, _ in nnx.to_flat_state(params) if keep(path)]
  assert 0 < len(trainable) < len(jax.tree_util.tree_leaves(params))
  # AdamC keeps a count, and first and second moments of the trainable leaves only.
  assert len(jax.tree_util.tree_leaves(state)) == 1 + 2 * len(trainable)


def _distill_flags(teacher, student) -> list[str]:
  """kvm-train flags of a logit distillation (T = 2) of the converted layers on the demo task."""
  return ["--config=train/configs/distill.py", f"--config.init_from={student}",
          f"--config.teacher={teacher}", "--config.task=mqar", "--config.mqar.seq_len=64",
          "--config.mqar.vocab_size=64", "--config.mqar.num_pairs=8", "--config.batch_size=8",
          "--config.steps=4", "--config.warmup_steps=1", "--config.log_every=1",
          "--config.checkpoint_every=2", "--config.eval_every=0",
          "--config.distill.temperature=2", "--config.distill.trainable=converted"]


@pytest.fixture(scope="module")
def distilled(teacher_and_student, tmp_path_factory):
  """A 4-step distillation run on one device (kvm-train's own entry point) and its final
  parameters."""
  from kvm_jax.train.main import main
  run = tmp_path_factory.mktemp("distilled") / "run"
  assert main([f"--workdir={run}", *_distill_flags(*teacher_and_student),
               "--config.mesh_data=1"]) == 0
  return run, _params(run)


def test_distillation_resumes_bitwise(teacher_and_student, distilled, tmp_path):
  """The distillation run interrupted after its step-2 checkpoint and rerun: it resumes there
  (teacher reloaded, frozen parameters and their absent optimizer state restored) and ends
  bitwise where the uninterrupted run ended; only the converted layer's mixer trained."""
  done, first = distilled
  run = tmp_path / "run"
  shutil.copytree(done, run)
  lines = (run / "metrics.jsonl").read_text().splitlines()
  shutil.rmtree(run / "checkpoints" / "4")
  from kvm_jax.train.main import main
  assert main([f"--workdir={run}", *_distill_flags(*teacher_and_student),
               "--config.mesh_data=1"]) == 0
  again = _params(run)
  assert all(np.array_equal(first[p], again[p]) for p in first)
  after = (run / "metrics.jsonl").read_text().splitlines()
  assert json.loads(after[-1])["loss"] == json.loads(lines[-1])["loss"]
  assert all("kl" in json.loads(line) for line in after)
  frozen = _params(teacher_and_student[1])
  changed = {p for p in frozen if not np.array_equal(frozen[p], first[p])}
  assert changed and all(p[:3] == ("blocks", 1, "attn") for p in changed)


def test_distillation_config_errors(teacher_and_student, tmp_path):
  teacher, student = teacher_and_student
  with pytest.raises(ValueError, match="distill.stage='logits' needs a teacher"):
    _run(kj.presets.tiny(), distill=DistillSpec(stage="logits")).validate()
  with pytest.raises(ValueError, match="distill.stage='none'; choose a stage"):
    _run(kj.presets.tiny(), teacher=str(teacher)).validate()
  wrong_vocab = _run(dataclasses.replace(kj.presets.tiny(), vocab_size=64), teacher=str(teacher),
                     distill=DistillSpec(stage="logits"))
  with pytest.raises(ValueError, match="has vocabulary 320 but the student 64"):
    distill.teacher_config(wrong_vocab)
  same = _run(model_configs()["full"], teacher=str(teacher), distill=DistillSpec(stage="attention"))
  with pytest.raises(ValueError, match="no layer is converted"):
    distill.teacher_config(same)


def test_attention_transfer_loss_is_each_layer_on_the_teachers_stream():
  """The attention-transfer loss against an independent computation: for each converted layer
  i, a model that is the teacher with only layer i converted (carrying the student's layer i)
  computes, through its own forward, that layer's output on the teacher's residual stream."""
  kvm = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=8,
                     budget=kj.FixedBudget(6))
  teacher = random_model(kj.presets.tiny(mixers="full", vocab_size=64), seed=4)
  student = kj.convert_to_kvm(teacher, "all", kvm)
  rng = np.random.default_rng(5)
  graphdef, params = nnx.split(student)  # KVM-only parameters away from their neutral start
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.3 * rng.normal(size=x.shape).astype(x.dtype)
      if distill.path_names(path)[3:4] in [(n,) for n in distill.KVM_ONLY] else x, params)
  student = nnx.merge(graphdef, params)
  tokens = rng.integers(0, 64, (2, 33))
  labels = tokens[:, 1:].copy()
  labels[:, :5] = IGNORE
  batch = {"inputs": jnp.asarray(tokens[:, :-1]), "labels": jnp.asarray(labels)}
  objective = _objective(DistillSpec(stage="attention"), teacher.cfg, student.cfg)
  assert objective.converted == (0, 1)
  loss, aux = objective(graphdef, params, batch, nnx.state(teacher), jnp.asarray(54.0))
  _, reference, features = teacher.mixer_io(batch["inputs"])
  np.testing.assert_allclose(features, teacher.features(batch["inputs"]), atol=1e-6)
  student_state = dict(nnx.to_flat_state(params))
  want = 0.0
  for i in (0, 1):
    hybrid = kj.convert_to_kvm(teacher, [i], kvm)
    g, state = nnx.split(hybrid)
    state = nnx.from_flat_state([(p, student_state[p] if p[:2] == ("blocks", i) else v)
                                 for p, v in nnx.to_flat_state(state)])
    h = nnx.merge(g, state).mixer_io(batch["inputs"])[1][i]
    err = np.mean((np.asarray(h, np.float64) - np.asarray(reference[i], np.float64)) ** 2, -1)
    want += np.sum(err * (labels != IGNORE)) / 2 / 54.0
  assert float(aux["attn_mse"]) == pytest.approx(want, rel=1e-5) and want > 1e-4
  assert float(loss) == float(aux["attn_mse"])


@pytest.mark.parametrize("devices, processes", in_ci([(1, 1), (4, 1), (4, 2)], {"(1, 1)"}))
def test_distillation_accumulated_sharded_and_on_two_processes_matches_one_device(
    teacher_and_student, distilled, tmp_path, devices, processes):
  """The same distillation as 2 micro-batches: on one device in this process (CI), on 4 devices
  (data 2 x fsdp 2: teacher and student sharded alike) in one process or two (jax.distributed,
  gloo; nightly), against the plain single-device run: the same losses and KL per step."""
  from tests.test_multihost import _finish, _launch, _metrics
  plain, _ = distilled
  run = tmp_path / "run"
  flags = [f"--workdir={run}", *_distill_flags(*teacher_and_student), "--config.grad_accum_steps=2"]
  if devices == 1:
    from kvm_jax.train.main import main
    assert main([*flags, "--config.mesh_data=1"]) == 0
  else:
    cmd = [sys.executable, "-m", "kvm_jax.train.main", *flags, "--config.mesh_data=2",
           "--config.mesh_fsdp=2"]
    for i, (code, _, err) in enumerate(_finish(_launch(cmd, processes))):
      assert code == 0, f"process {i}:\n{err[-3000:]}"
  want, got = _metrics(plain), _metrics(run)
  assert sorted(want) == sorted(got) == [1, 2, 3, 4]
  # float32, reductions over devices and micro-batches in another order; the KL of a student
  # this close to its teacher is ~1e-6, so it also gets an absolute margin far below that.
  for step in want:
    for key in ("loss", "kl", "ce", "grad_norm"):
      assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-7), (step, key)
  assert max(got[step]["kl"] for step in got) > 1e-7


def test_teacher_is_sharded_like_the_student(teacher_and_student):
  """The teacher's parameters are placed by the student's sharding rules: every parameter the
  two models share by name gets the same partition spec on the trainer's mesh (CI has one
  device, but the specs name the mesh axes all the same)."""
  from kvm_jax.train import sharding
  from kvm_jax.train.start import setup, with_init_model
  teacher, student = teacher_and_student
  cfg = with_init_model(_run(kj.presets.tiny(), init_from=str(student), teacher=str(teacher),
                             distill=DistillSpec(stage="logits")))
  mesh = sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  _, _, _, _, (student_sh, _, _) = setup(cfg, mesh)
  loaded = distill.load_teacher(cfg, mesh)
  specs = lambda tree: {p: s.spec for p, s in jax.tree_util.tree_leaves_with_path(tree)}
  mine, theirs = specs(student_sh), specs(loaded.shardings)
  shared = set(mine) & set(theirs)
  assert len(shared) > 20 and any(mine[p] != jax.sharding.PartitionSpec() for p in shared)
  assert {p: theirs[p] for p in shared} == {p: mine[p] for p in shared}
  assert all(x.sharding.spec == theirs[p]
             for p, x in jax.tree_util.tree_leaves_with_path(loaded.params))
