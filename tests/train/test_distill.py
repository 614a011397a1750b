"""Distillation in the trainer (kvm_jax.train.distill): each stage's loss, and the logits stage's
gradient, for a student unlike its teacher against float64 computations (numpy, and the
reference model of tests/helpers/reference_model.py); exactly zero KL for a student equal to its teacher;
the exact parameters each ``trainable`` choice trains, freezes and keeps optimizer state for;
a distillation run resumed bitwise, accumulated and sharded."""

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
from kvm_jax.runs.train_config import DistillSpec, TrainConfig
from kvm_jax.runs.directory import load_trained
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.nn.layers import path_names
from kvm_jax.train import distill
from kvm_jax.train.demo import model_configs
from kvm_jax.train.loop import train
from kvm_jax.train.adamc import PartlyFrozen
from kvm_jax.train.start import make_optimizer
from tests.helpers import in_ci, random_model, write_run


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


def _objective(spec, teacher_cfg, student_cfg=None, slice_len=0):
  student_cfg = student_cfg or teacher_cfg
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: kj.LM(teacher_cfg, rngs=nnx.Rngs(0))))
  return distill.DistillObjective(spec, graphdef,
                                  distill.converted_layers(student_cfg, teacher_cfg), "none",
                                  slice_len, "float32")


@pytest.fixture(scope="module")
def unlike_pair():
  """A teacher (full attention) and a student (sliding-window attention, 12 tokens) with every
  parameter drawn independently, a 45-token batch with some unlabelled positions, and both
  models' float64 final hidden states from the reference model of tests/helpers/reference_model.py.
  (The objective does not look inside the models: any two unlike models serve, and these two
  compile fastest.)"""
  from tests.helpers.reference_model import lm_mixer_io
  from tests.helpers.reference_cases import reference_config, reference_params, routing_tokens
  teacher = random_model(kj.presets.tiny(mixers="full"), seed=21)
  student = random_model(kj.presets.tiny(mixers="swa"), seed=22)
  tokens = routing_tokens(256)
  labels = np.random.default_rng(23).integers(0, 256, tokens.shape)
  labels[0, :7] = labels[1, 30:33] = IGNORE
  features = [lm_mixer_io(reference_params(m), reference_config(m.cfg), tokens)[2]
              for m in (student, teacher)]
  heads = [np.asarray(m.lm_head.kernel[...], np.float64) for m in (student, teacher)]
  batch = {"inputs": jnp.asarray(tokens), "labels": jnp.asarray(labels)}
  return teacher, student, batch, features, heads


def _logit_stage_in_float64(features, heads, labels, temperature, kl_weight, total):
  """The logits stage by hand in float64: its loss, KL at T = 1, cross-entropy, and the loss's
  gradient with respect to the student's head kernel and final hidden states.

  loss = kl_weight·T²·KL_T + (1 − kl_weight)·CE, each a sum over labelled positions divided by
  ``total``; KL_T = Σ_v p_t (log p_t − log p_s) with p = softmax(logits / T); CE = −log
  softmax(student logits)[label]. d loss / d student logits = kl_weight·T²·(p_s − p_t)/T
  + (1 − kl_weight)·(softmax − onehot), per labelled position, over ``total``."""
  (f_s, f_t), (w_s, w_t) = features, heads
  z_s, z_t = f_s @ w_s, f_t @ w_t
  valid = (labels != IGNORE)[..., None]
  onehot = np.eye(z_s.shape[-1])[np.where(labels == IGNORE, 0, labels)]

  def kl(T):
    p_t, p_s = _softmax64(z_t / T), _softmax64(z_s / T)
    return np.sum(valid * p_t * (np.log(p_t) - np.log(p_s))), p_s, p_t
  kl_t, p_s_t, p_t_t = kl(temperature)
  kl_1 = kl(1.0)[0]
  p = _softmax64(z_s)
  ce = -np.sum(valid * onehot * np.log(p))
  loss = (kl_weight * temperature ** 2 * kl_t + (1 - kl_weight) * ce) / total
  d_logits = valid * (kl_weight * temperature * (p_s_t - p_t_t)
                      + (1 - kl_weight) * (p - onehot)) / total
  return dict(loss=loss, kl=kl_1 / total, ce=ce / total,
              d_head=np.einsum("btc,btv->cv", f_s, d_logits), d_features=d_logits @ w_s.T)


@pytest.mark.parametrize("temperature, kl_weight, slice_len", [(2.0, 0.7, 0), (0.5, 0.3, 16)])
def test_logits_stage_loss_and_gradient_match_float64(unlike_pair, temperature, kl_weight,
                                                      slice_len):
  """The logits stage's loss (KL at T ≠ 1 with its T² factor, mixed with the cross-entropy by
  ``kl_weight``), its ``kl`` and ``ce`` metrics and its gradient, for a student unlike its teacher,
  against :func:`_logit_stage_in_float64`; whole and over loss slices (16 of 45 tokens: the last
  slice padded). The gradient is compared for the head kernel directly and, for every other
  parameter, as the student's own backward pass from the float64 gradient at its final hidden
  states. ``total`` (the global batch's labelled tokens) is not this batch's count, as on a
  device that holds part of the batch."""
  teacher, student, batch, features, heads = unlike_pair
  total = 123.0
  spec = DistillSpec(stage="logits", temperature=temperature, kl_weight=kl_weight)
  objective = _objective(spec, teacher.cfg, student.cfg, slice_len)
  graphdef, params = nnx.split(student)
  (loss, aux), grads = jax.jit(jax.value_and_grad(
      lambda p: objective(graphdef, p, batch, nnx.state(teacher), jnp.asarray(total)),
      has_aux=True))(params)
  want = _logit_stage_in_float64(features, heads, np.asarray(batch["labels"]), temperature,
                                 kl_weight, total)
  # float32 forwards against float64: ~1e-6 relative on logits, sums of ~80 positions
  for key in ("loss", "kl", "ce"):
    np.testing.assert_allclose(float(aux.get(key, loss)), want[key], rtol=2e-5, err_msg=key)
  assert want["kl"] > 0.1 and want["ce"] > 1.0  # far from the trivial student == teacher
  head = np.asarray(grads["lm_head"]["kernel"][...])
  np.testing.assert_allclose(head, want["d_head"], rtol=0, atol=1e-4 * np.abs(want["d_head"]).max())
  if slice_len:
    return  # the rest of the chain rule is the same program as the whole-sequence case
  through_features = jax.jit(lambda p, d: jax.vjp(
      lambda p: nnx.merge(graphdef, p).features(batch["inputs"]), p)[1](d)[0])(
          params, jnp.asarray(want["d_features"], jnp.float32))
  for path, g in nnx.to_flat_state(through_features):
    if path[0] == "lm_head":
      continue
    got = np.asarray(dict(nnx.to_flat_state(grads))[path][...])
    np.testing.assert_allclose(got, g[...], rtol=0, atol=1e-4 * max(np.abs(g[...]).max(), 1e-6),
                               err_msg=str(path))


def test_finetune_and_unit_temperature_losses_match_float64(unlike_pair):
  """The finetune stage is the cross-entropy alone; the logits stage at T = 1 (one KL, no second
  temperature) mixes it with that KL."""
  teacher, student, batch, features, heads = unlike_pair
  graphdef, params = nnx.split(student)
  labels = np.asarray(batch["labels"])
  for spec in (DistillSpec(stage="finetune"), DistillSpec(stage="logits", kl_weight=0.6)):
    objective = _objective(spec, teacher.cfg, student.cfg)
    loss, aux = jax.jit(lambda p: objective(graphdef, p, batch, nnx.state(teacher),
                                            jnp.asarray(77.0)))(params)
    want = _logit_stage_in_float64(features, heads, labels, 1.0,
                                   0.0 if spec.stage == "finetune" else 0.6, 77.0)
    for key in ("loss", "kl", "ce"):
      np.testing.assert_allclose(float(aux.get(key, loss)), want[key], rtol=2e-5,
                                 err_msg=f"{spec.stage} {key}")


@pytest.mark.slow  # CI: the float64 comparisons above catch a wrong KL, mix or head
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


# -- which parameters train --------------------------------------------------------------------

# The parameters of each kind's layer under ``attn`` in the tiny preset (value residual, token
# shift, QK-LN), and those of a block and of the model outside the blocks, written out.
FRONT_END = {"c_q/kernel", "c_k/kernel", "c_v/kernel", "c_proj/kernel", "ln_q/scale", "ln_q/bias",
             "ln_k/scale", "ln_k/bias", "v_gate0", "v_gate1/kernel", "v_gate2/kernel", "x_q",
             "x_k", "x_v"}
KVM_OWN = {"ln_s/scale", "ln_s/bias", "key_weighting/kernel", "window_temperature",
           "state_temperature"}
ATTN = {
    "full": FRONT_END, "swa": FRONT_END, "bswa": FRONT_END, "kvm": FRONT_END | KVM_OWN,
    "ovq": {"c_q/kernel", "c_k/kernel", "c_v/kernel", "c_proj/kernel", "v_gate0",
            "v_gate1/kernel", "v_gate2/kernel", "x_q", "x_k", "x_v", "beta"},
    "rwkv7": {"receptance/kernel", "key/kernel", "value/kernel", "output/kernel", "ln_x/scale",
              "ln_x/bias", "w0", "w1/kernel", "w2/kernel", "a0", "a1/kernel", "a2/kernel", "v0",
              "v1/kernel", "v2/kernel", "g1/kernel", "g2/kernel", "k_k", "k_a", "r_k", "x_r",
              "x_w", "x_k", "x_v", "x_a", "x_g"},
}
BLOCK = {"ln_attn/scale", "ln_attn/bias", "ln_mlp/scale", "ln_mlp/bias", "mlp/c_fc/kernel",
         "mlp/c_proj/kernel", "mlp/x_k"}
OUTSIDE = {"wte/embedding", "ln_emb/scale", "ln_emb/bias", "ln_head/scale", "ln_head/bias",
           "lm_head/kernel"}


def _every_path(mixers) -> set[str]:
  return OUTSIDE | {f"blocks/{i}/{name}" for i, kind in enumerate(mixers)
                    for name in BLOCK | {f"attn/{a}" for a in ATTN[kind]}}


def _attn_paths(layer: int, names) -> set[str]:
  return {f"blocks/{layer}/attn/{name}" for name in names}


# (trainable, student mixers, teacher mixers, the parameters that train)
TRAINABLE = {
    "all_kvm_ovq": ("all", ("kvm", "ovq"), ("full", "full"), _every_path(("kvm", "ovq"))),
    "all_rwkv7": ("all", ("rwkv7", "rwkv7"), ("full", "full"), _every_path(("rwkv7", "rwkv7"))),
    "converted_kvm": ("converted", ("kvm", "full"), ("full", "full"),
                      _attn_paths(0, ATTN["kvm"])),
    "converted_ovq": ("converted", ("swa", "ovq"), ("swa", "full"), _attn_paths(1, ATTN["ovq"])),
    "converted_rwkv7": ("converted", ("rwkv7", "swa"), ("full", "swa"),
                        _attn_paths(0, ATTN["rwkv7"])),
    "converted_bswa_kvm": ("converted", ("bswa", "kvm", "bswa", "kvm"), ("bswa",) * 4,
                           _attn_paths(1, ATTN["kvm"]) | _attn_paths(3, ATTN["kvm"])),
    "kvm_only_kvm": ("kvm_only", ("kvm", "kvm"), ("full", "full"),
                     _attn_paths(0, KVM_OWN) | _attn_paths(1, KVM_OWN)),
    "kvm_only_kvm_ovq": ("kvm_only", ("kvm", "ovq"), ("full", "full"), _attn_paths(0, KVM_OWN)),
    "kvm_only_rwkv7_kvm": ("kvm_only", ("rwkv7", "kvm"), ("full", "full"),
                           _attn_paths(1, KVM_OWN)),
    "kvm_only_swa_kvm": ("kvm_only", ("swa", "kvm", "swa", "kvm"), ("full",) * 4,
                         _attn_paths(1, KVM_OWN) | _attn_paths(3, KVM_OWN)),
}


def _trainable_case(name, **model_fields):
  mode, mixers, teacher_mixers, trains = TRAINABLE[name]
  cfg = _run(kj.presets.tiny(mixers=mixers, num_layers=len(mixers), **model_fields),
             distill=DistillSpec(stage="logits", trainable=mode))
  teacher = kj.presets.tiny(mixers=teacher_mixers, num_layers=len(mixers))
  params = nnx.state(random_model(cfg.model, seed=3))
  paths = ["/".join(map(str, path_names(p)))
           for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert set(paths) == _every_path(mixers)  # the table above is the model's parameters
  return cfg, teacher, params, paths, trains


@pytest.mark.parametrize("name", list(TRAINABLE))
def test_trainable_sets_and_optimizer_state_are_exact(name):
  """For every ``trainable`` choice over every mixer kind and the hybrids: the parameters that
  train are exactly the listed ones, the optimizer's mask says the same, and its moments exist
  for those parameters only, shaped like them, in order."""
  cfg, teacher, params, paths, trains = _trainable_case(name)
  keep = distill.trainable_predicate(cfg, teacher)
  leaves = jax.tree_util.tree_leaves_with_path(params)
  chosen = {"/".join(map(str, path_names(p))) for p, _ in leaves
            if keep is None or keep(p)}
  assert chosen == trains
  optimizer = make_optimizer(cfg, params, keep)
  state = optimizer.init(params)
  trained_shapes = [x.shape for path, x in zip(paths, jax.tree_util.tree_leaves(params))
                    if path in trains]
  if cfg.distill.trainable == "all":
    assert keep is None and not isinstance(optimizer, PartlyFrozen)
  else:
    assert isinstance(optimizer, PartlyFrozen)
    assert {path for path, flag in zip(paths, optimizer.trainable) if flag} == trains
  assert [m.shape for m in jax.tree_util.tree_leaves(state.mu)] == trained_shapes
  assert [v.shape for v in jax.tree_util.tree_leaves(state.nu)] == trained_shapes


def test_kvm_only_needs_kvm_layers():
  cfg = _run(kj.presets.tiny(mixers=("swa", "ovq")), distill=DistillSpec(trainable="kvm_only"))
  with pytest.raises(ValueError, match=r"no kvm layers \(mixers \('swa', 'ovq'\)\)"):
    distill.trainable_predicate(cfg)


@pytest.mark.parametrize("name, param_dtype", [("converted_ovq", "float32"),
                                               ("kvm_only_rwkv7_kvm", "bfloat16")])
def test_frozen_parameters_get_no_gradient_and_no_update(name, param_dtype):
  """Through the trainer's own pieces (the partly frozen optimizer and
  :class:`FrozenParameters` with its mask): the gradient of Σ p² is 2p for the listed parameters
  and exactly 0 for the rest, one update changes exactly the listed parameters, and with
  bfloat16 parameters the float32 masters exist for them alone."""
  from kvm_jax.train.objectives import FrozenParameters
  from kvm_jax.train.step import apply_update
  cfg, teacher, params, paths, trains = _trainable_case(name, param_dtype=param_dtype)
  optimizer = make_optimizer(cfg, params, distill.trainable_predicate(cfg, teacher))
  squares = lambda graphdef, p, batch, extra, total: (
      sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(p)), {})
  objective = FrozenParameters(squares, optimizer.mask_like(params))

  @jax.jit
  def step(params):
    grads = jax.grad(lambda p: objective(None, p, None, None, None)[0])(params)
    return grads, apply_update(optimizer, params, optimizer.init(params), grads)

  grads, (new_params, state) = step(params)
  for path, old, grad, new in zip(paths, *(jax.tree_util.tree_leaves(t)
                                          for t in (params, grads, new_params))):
    if path in trains:
      np.testing.assert_allclose(grad, 2 * np.asarray(old, np.float32), rtol=1e-6, err_msg=path)
      assert not np.array_equal(new, old), path
    else:
      assert not np.any(grad) and np.array_equal(new, old), path
  if param_dtype == "bfloat16":
    assert len(jax.tree_util.tree_leaves(state.master)) == len(trains)


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


def test_attention_transfer_loss_matches_float64():
  """The attention-transfer loss against the float64 reference model: for each converted layer
  (0 and 2 of 3; layer 1 stays full attention and is not compared), the student's layer on the
  teacher's residual stream x_i (with the student's own value anchor) against the teacher's mixer
  output h_i there, the squared error averaged over channels, summed over labelled positions,
  averaged over the converted layers and divided by ``total``. Every student parameter is drawn
  independently of the teacher's, and 45 tokens take the KVM layers past their 16-token window."""
  from tests.helpers.reference_model import (anchor_layer, attention_layer, embed, layer_norm,
                                             lm_mixer_io, value_anchors)
  from tests.helpers.reference_cases import (MIN_DECISION_GAP, reference_config, reference_params,
                                             routing_tokens)
  teacher = random_model(kj.presets.tiny(mixers="full", num_layers=3), seed=24)
  converted = kj.convert_to_kvm(teacher, "0,2")
  student = random_model(converted.cfg, seed=25)
  tokens = routing_tokens(256)
  labels = np.random.default_rng(26).integers(0, 256, tokens.shape)
  labels[:, :5] = labels[1, 40:] = IGNORE
  batch = {"inputs": jnp.asarray(tokens), "labels": jnp.asarray(labels)}
  objective = _objective(DistillSpec(stage="attention"), teacher.cfg, student.cfg)
  assert objective.converted == (0, 2)
  graphdef, params = nnx.split(student)
  loss, aux = jax.jit(lambda p: objective(graphdef, p, batch, nnx.state(teacher),
                                          jnp.asarray(54.0)))(params)
  inputs, outputs, _ = lm_mixer_io(reference_params(teacher), reference_config(teacher.cfg),
                                   tokens)
  sp, scfg = reference_params(student), reference_config(student.cfg)
  anchors = value_anchors(sp, scfg, embed(sp, tokens))
  want, log = 0.0, []
  for i in (0, 2):
    block = sp["blocks"][i]
    h = attention_layer(block["attn"], layer_norm(inputs[i], block["ln_attn"]),
                        anchors[anchor_layer(scfg, i)], "kvm", scfg, log)
    want += np.sum(np.mean((h - outputs[i]) ** 2, -1) * (labels != IGNORE))
  want = want / 2 / 54.0
  assert min(r[k] for r in log for k in ("append_gap", "route_gap") if k in r) > MIN_DECISION_GAP
  assert float(aux["attn_mse"]) == pytest.approx(want, rel=1e-5) and want > 1e-3
  assert float(loss) == float(aux["attn_mse"])
  # the teacher's mixer inputs and outputs as the objective reads them (LM.mixer_io)
  (got_inputs, got_outputs, features), plain = nnx.jit(
      lambda m, t: (m.mixer_io(t), m.features(t)))(teacher, batch["inputs"])
  for got, ref in ((got_inputs, inputs), (got_outputs, outputs)):
    for i in range(3):
      np.testing.assert_allclose(got[i], ref[i], rtol=0, atol=1e-5 * np.abs(ref[i]).max())
  np.testing.assert_allclose(features, plain, atol=1e-6)


@pytest.mark.parametrize("devices, processes", in_ci([(1, 1), (4, 1), (4, 2)], {"(1, 1)"}))
def test_distillation_accumulated_sharded_and_on_two_processes_matches_one_device(
    teacher_and_student, distilled, tmp_path, devices, processes):
  """The same distillation as 2 micro-batches: on one device in this process (CI), on 4 devices
  (data 2 x fsdp 2: teacher and student sharded alike) in one process or two (jax.distributed,
  gloo; nightly), against the plain single-device run: the same losses and KL per step."""
  from tests.helpers.processes import finish, launch, run_metrics
  plain, _ = distilled
  run = tmp_path / "run"
  flags = [f"--workdir={run}", *_distill_flags(*teacher_and_student), "--config.grad_accum_steps=2"]
  if devices == 1:
    from kvm_jax.train.main import main
    assert main([*flags, "--config.mesh_data=1"]) == 0
  else:
    cmd = [sys.executable, "-m", "kvm_jax.train.main", *flags, "--config.mesh_data=2",
           "--config.mesh_fsdp=2"]
    for i, (code, _, err) in enumerate(finish(launch(cmd, processes))):
      assert code == 0, f"process {i}:\n{err[-3000:]}"
  want, got = run_metrics(plain), run_metrics(run)
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
