"""Distillation in the trainer: a frozen teacher, the stages' objectives, frozen parameters.

A run with ``TrainConfig.teacher`` trains its model (the *student*, typically ``kvm-convert``'s
output given as ``init_from``) against the teacher's model (docs/conversion.md):

* :func:`load_teacher` restores the teacher's newest parameters with the student's dtypes and on
  the student's mesh (the same sharding rules), once per process start; they enter the step as its
  undifferentiated ``extra`` input, so a resumed run reloads them instead of checkpointing them.
* :class:`DistillObjective` is the step's objective for each ``DistillSpec.stage``; every stage
  reports ``kl``, the mean per-token KL(teacher ‖ student) at temperature 1.
* :func:`trainable_predicate` says which parameters train (``DistillSpec.trainable``); the
  trainer freezes the rest (:class:`kvm_jax.train.objectives.FrozenParameters` for the gradient,
  :func:`kvm_jax.train.start.make_optimizer` for the optimizer state).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvm_jax.config.kvm import KVMConfig
from kvm_jax.nn.model import LM, REMAT_POLICIES
from kvm_jax.ops.loss import IGNORE, sliced_distill_sums
from kvm_jax.runs.train_config import DistillSpec, TrainConfig
from kvm_jax.runs.directory import is_run_directory, load_config, load_trained
from kvm_jax.train import sharding
from kvm_jax.nn.mixers.kvm import KVMAttention
from kvm_jax.nn.roles import is_kvm_only, parameter_role

# The KVM-only parameters of a kvm layer (what a conversion adds), by owner name under ``attn``.
KVM_ONLY = KVMAttention.OWN_PARAMETERS  # LN_s, W_g and the two temperatures
# Model fields the teacher takes from the student (as fine-tuning's init_from does).
STUDENT_FIELDS = ("param_dtype", "compute_dtype", "kvm_implementation",
                  "attention_implementation")


@dataclasses.dataclass(frozen=True)
class Teacher:
  """A frozen teacher: its model config, graphdef, parameters (placed like the student's) and
  their shardings."""

  cfg: Any
  graphdef: Any
  params: Any
  shardings: Any
  step: int


def teacher_config(cfg: TrainConfig):
  """The teacher's ``ModelConfig`` (with the student's dtypes and kernels), after checking that
  it can teach ``cfg.model``: same vocabulary; for attention transfer also the same depth and
  width and at least one converted layer."""
  if not is_run_directory(cfg.teacher):
    raise ValueError(f"teacher={cfg.teacher!r} is not a run directory (no config.json); give a "
                     "kvm-train workdir or a kvm-import output (kvm-import converts the authors' "
                     "checkpoints).")
  source = load_config(cfg.teacher).model
  model = dataclasses.replace(source, **{f: getattr(cfg.model, f) for f in STUDENT_FIELDS})
  student = cfg.model
  if model.vocab_size != student.vocab_size:
    raise ValueError(f"teacher={cfg.teacher!r} has vocabulary {model.vocab_size} but the student "
                     f"{student.vocab_size}: the KL compares distributions over one vocabulary.")
  needs_layers = cfg.distill.stage == "attention" or cfg.distill.trainable == "converted"
  if needs_layers:
    if (model.num_layers, model.hidden_size) != (student.num_layers, student.hidden_size):
      raise ValueError(f"distill.stage={cfg.distill.stage!r} / trainable="
                       f"{cfg.distill.trainable!r} pair student and teacher layers one to one, but "
                       f"the teacher has {model.num_layers} layers of width {model.hidden_size} "
                       f"and the student {student.num_layers} of {student.hidden_size}.")
    if not converted_layers(student, model):
      raise ValueError(f"the student and teacher={cfg.teacher!r} have the same layer kinds "
                       f"({student.layer_mixers}): no layer is converted, so attention transfer "
                       "or trainable='converted' has nothing to train.")
  return model


def converted_layers(student, teacher) -> tuple[int, ...]:
  """Layers whose mixer kind differs between two configs of equal depth."""
  return tuple(i for i, (a, b) in enumerate(zip(student.layer_mixers, teacher.layer_mixers))
               if a != b)


def load_teacher(cfg: TrainConfig, mesh, model_cfg=None, verbose: bool = False) -> Teacher:
  """The teacher of ``cfg`` (``model_cfg``: its :func:`teacher_config`, read when not given),
  restored from its newest checkpoint onto ``mesh`` with the sharding rules of the student's
  parameters (every process calls it: the read is collective)."""
  model_cfg = model_cfg or teacher_config(cfg)
  abstract = nnx.state(nnx.eval_shape(lambda: LM(model_cfg, rngs=nnx.Rngs(0))))
  shardings = sharding.param_shardings(abstract, mesh)
  run_cfg = dataclasses.replace(load_config(cfg.teacher), model=model_cfg)
  _, model, step = load_trained(cfg.teacher, cfg=run_cfg, shardings=shardings)
  graphdef, params = nnx.split(model)
  if verbose:
    print(f"teacher: {cfg.teacher} (step {step}, mixers {'/'.join(model_cfg.layer_mixers)}); "
          f"distillation stage {cfg.distill.stage!r}, training {cfg.distill.trainable!r}")
    window = max((cfg.model.options_of(kind).window_len for kind in set(cfg.model.layer_mixers)
                  if isinstance(cfg.model.options_of(kind), KVMConfig)), default=None)
    if window is not None and cfg.sequence_length <= window:
      print(f"note: sequences of {cfg.sequence_length} tokens fit the student's exact window "
            f"({window} tokens): its KVM state is never read, and a student converted from the "
            "teacher equals it there. Train on longer sequences (--config.seq_len).")
  return Teacher(model_cfg, graphdef, params, shardings, step)


def trainable_predicate(cfg: TrainConfig, teacher_cfg=None) -> Optional[Callable[[Any], bool]]:
  """``path -> bool`` (a parameter's NNX state path: does it train?) for
  ``cfg.distill.trainable``, or None when everything trains."""
  mode, model = cfg.distill.trainable, cfg.model
  if mode == "all":
    return None
  if mode == "converted":
    layers = set(converted_layers(model, teacher_cfg))

    def converted(path) -> bool:
      role = parameter_role(path)
      return role.part == "mixer" and role.layer in layers
    return converted

  kvm_layers = {i for i in range(model.num_layers) if model.is_kvm(i)}
  if not kvm_layers:
    raise ValueError("distill.trainable='kvm_only' trains the KVM-only parameters, but the model "
                     f"has no kvm layers (mixers {model.layer_mixers}).")

  def kvm_only(path) -> bool:
    return is_kvm_only(parameter_role(path), model)
  return kvm_only


def _labelled(labels) -> jax.Array:
  return (labels != IGNORE).astype(jnp.float32)


@dataclasses.dataclass(frozen=True, eq=False)
class DistillObjective:
  """The objective of one distillation stage (``kvm_jax.train.objectives`` contract; ``extra``
  is the teacher's parameters). Losses are means per labelled token of the whole batch, like the
  language-model objective; ``aux`` holds ``kl`` (KL(teacher ‖ student) at temperature 1),
  ``ce`` (the student's cross-entropy) and, in the attention stage, ``attn_mse``."""

  spec: DistillSpec
  teacher_graphdef: Any
  converted: tuple[int, ...]
  remat: str
  slice_len: int
  compute_dtype: str

  def _logit_sums(self, student: LM, teacher: LM, batch: dict, features_t=None) -> dict:
    """CE and KL sums of the student against the teacher (``features_t``: the teacher's final
    hidden states when already computed)."""
    temperatures = (1.0,) if self.spec.temperature == 1.0 else (1.0, self.spec.temperature)
    if features_t is None:
      features_t = teacher.features(batch["inputs"])
    features_t = jax.lax.stop_gradient(features_t)
    features_s = student.features(batch["inputs"], self.remat)
    return sliced_distill_sums((features_s, student.head_kernel()),
                               (features_t, teacher.head_kernel()), batch["labels"],
                               softcap=student.logit_softcap,
                               teacher_softcap=teacher.logit_softcap,
                               compute_dtype=self.compute_dtype,
                               teacher_compute_dtype=teacher.cfg.compute_dtype,
                               temperatures=temperatures, slice_len=self.slice_len)

  def _attention_transfer_sum(self, student: LM, teacher_io, batch: dict) -> jax.Array:
    """Σ over converted layers and labelled tokens of the per-channel mean squared error between
    the student layer's mixer output on the teacher's residual stream and the teacher's
    (``teacher_io``: the teacher's :meth:`LM.mixer_io`), divided by the number of converted
    layers."""
    inputs, outputs, _ = jax.lax.stop_gradient(teacher_io)
    tokens = batch["inputs"]
    positions = jnp.arange(tokens.shape[1])[None]
    anchors = student.value_anchors(student.embed(tokens))
    weight = _labelled(batch["labels"])
    total = jnp.zeros((), jnp.float32)
    for i in self.converted:
      block = student.blocks[i]

      def mixer(block, x, anchor):
        return block.mix(x, anchor, positions)[0]
      if self.remat != "none":
        mixer = nnx.remat(mixer, policy=REMAT_POLICIES[self.remat], prevent_cse=True)
      h = mixer(block, inputs[i], anchors[student.cfg.value_anchor(i)])
      err = jnp.mean(jnp.square(h.astype(jnp.float32) - outputs[i].astype(jnp.float32)), -1)
      total = total + jnp.sum(err * weight)
    return total / len(self.converted)

  def __call__(self, graphdef, params, batch: dict, extra: Any, total: jax.Array):
    student = nnx.merge(graphdef, params)
    teacher = nnx.merge(self.teacher_graphdef, jax.lax.stop_gradient(extra))
    spec = self.spec
    if spec.stage == "attention":
      teacher_io = teacher.mixer_io(batch["inputs"])  # one teacher forward serves both
      mse = self._attention_transfer_sum(student, teacher_io, batch)
      # The logit metrics cost one more student forward, outside the gradient.
      sums = jax.lax.stop_gradient(self._logit_sums(
          nnx.merge(graphdef, jax.lax.stop_gradient(params)), teacher, batch, teacher_io[2]))
      loss = mse / total
      aux = {"attn_mse": mse / total}
    else:
      sums = self._logit_sums(student, teacher, batch)
      ce = sums["ce"] / total
      if spec.stage == "logits":
        kl_t = sums["kl"][-1] / total
        loss = spec.kl_weight * spec.temperature ** 2 * kl_t + (1 - spec.kl_weight) * ce
      else:
        loss = ce
      aux = {}
    aux.update(kl=jax.lax.stop_gradient(sums["kl"][0] / total),
               ce=jax.lax.stop_gradient(sums["ce"] / total))
    return loss, aux


def objective_for(cfg: TrainConfig, teacher: Teacher) -> DistillObjective:
  """The distillation objective of ``cfg`` with ``teacher``."""
  return DistillObjective(cfg.distill, teacher.graphdef,
                          converted_layers(cfg.model, teacher.cfg), cfg.remat, cfg.loss_slice_len,
                          cfg.model.compute_dtype)
