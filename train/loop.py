"""The training loop: a jitted AdamC step over ``nnx.split`` state, JSONL metrics, orbax resume.

One step = one global batch; the data reader's position is checkpointed with the parameters, so
``train(cfg, workdir)`` run again on the same workdir continues exactly where the last checkpoint
left off (bitwise on CPU), on one host or many. Each host reads only the rows of each batch its
devices hold. SIGTERM (preemption) makes every host save the same step and return: one host
alone through its own flag, many through JAX's preemption sync point, which picks a step that
all of them reach. Only process 0 writes ``config.json``, metrics and the console.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.budget import average_visible_keys, average_window_keys
from kvm_jax.hf.load import checkpoint_kind
from kvm_jax.nn.model import LM
from kvm_jax.ops.attention_api import runs_pallas
from kvm_jax.ops.kvm.api import kernel_sharding
from kvm_jax.ops.loss import IGNORE, cross_entropy_sums, sliced_loss_sums
from kvm_jax.progress import ProgressBar
from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.config import TrainConfig
from kvm_jax.runs.directory import (CHECKPOINT_DIR, IMPORT_RECORD, is_run_directory, load_config,
                                    save_config)
from kvm_jax.tasks import mqar, niah, text
from kvm_jax.tasks.pipeline import BatchReader
from kvm_jax.tasks.shards import TokenShards, shard_dataset
from kvm_jax.tasks.tokenizers import tokenizer
from kvm_jax.train import adamc as adamc_lib
from kvm_jax.train import completep, sharding
from kvm_jax.train.metrics import MetricsWriter


def task_dataset(cfg: TrainConfig, split: str):
  """The ``grain.MapDataset`` of a run's task: ``split`` "train", or "eval" (a held-out stream:
  another seed for the synthetic tasks, the first 5% of the packed windows for text)."""
  seed = cfg.seed if split == "train" else cfg.seed + 10_000
  if cfg.task == "mqar":
    return mqar.mqar_dataset(seed, cfg.mqar)
  if cfg.task == "niah":
    return niah.niah_dataset(seed, cfg.niah)
  if cfg.data_dir:  # token shards written by kvm-data, packed at read time
    corpus = TokenShards(cfg.data_dir)
    if corpus.vocab_size > cfg.model.vocab_size:
      raise ValueError(f"data_dir={cfg.data_dir!r} was tokenized with a vocabulary of "
                       f"{corpus.vocab_size} ids but model.vocab_size={cfg.model.vocab_size}; "
                       "raise model.vocab_size or tokenize with the model's tokenizer.")
    return shard_dataset(corpus, cfg.seq_len, seed, split)
  tok = tokenizer(cfg.tokenizer_file)
  if cfg.hf_dataset:
    docs = text.read_hf_documents(cfg.hf_dataset, cfg.hf_split, cfg.hf_text_field)
  elif cfg.text_files:
    docs = text.read_documents(cfg.text_files)
  else:
    docs = text.embedded_corpus()
  windows = text.cram_pack(docs, tok, cfg.seq_len)
  n_eval = max(1, len(windows) // 20)
  windows = windows[n_eval:] if split == "train" else windows[:n_eval]
  return text.text_dataset(windows, tok.eos_id, seed)


# Dense bf16 peak per device, for the MFU estimate (matched against device_kind).
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0,
                "TPU v4": 275.0, "TPU v6": 918.0}


def peak_flops(cfg: TrainConfig) -> float:
  """Peak FLOP/s of all devices (0 when unknown, e.g. on CPU)."""
  per = cfg.peak_tflops_per_device
  if not per:
    kind = jax.devices()[0].device_kind
    per = next((v for k, v in _PEAK_TFLOPS.items() if k.lower() in kind.lower()), 0.0)
  return per * 1e12 * jax.device_count()


def visible_keys(cfg: TrainConfig) -> float:
  """Keys per query, averaged over the positions of a training sequence and summed over layers:
  causal full attention (T + 1) / 2, a sliding window the mean of min(t + 1, window), block SWA
  its chunk-aligned window, KVM its window plus the state rows of its schedule at each chunk."""
  m, T = cfg.model, cfg.sequence_length
  t = np.arange(1, T + 1, dtype=np.float64)  # keys up to and including each query
  keys = 0.0
  for kind in m.layer_mixers:
    if kind == "full":
      keys += (T + 1) / 2
    elif kind == "swa":
      keys += float(np.mean(np.minimum(t, m.swa_window)))
    elif kind == "bswa":
      keys += average_window_keys(T, m.bswa_chunk_size, m.bswa_window_chunks)
    else:
      keys += average_visible_keys(m.kvm, T)
  return keys


def flops_per_token(cfg: TrainConfig, params) -> float:
  """Training FLOPs per token: 6·N (matmul parameters, forward + backward) plus attention,
  12·keys·D·H with ``keys`` the :func:`visible_keys` of every layer (QKᵀ and PV, 2 FLOPs per
  multiply-add each, tripled for the backward pass). KVM's merge and compression are not
  counted (a few percent at the paper's shapes), so its MFU is a slight underestimate."""
  m = cfg.model
  n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)) - \
      m.vocab_size * m.hidden_size  # the embedding lookup is not a matmul
  return 6.0 * n + 12.0 * visible_keys(cfg) * m.qk_head_dim * m.num_heads


def masked_loss(logits, labels):
  """Mean cross-entropy over positions whose label is not -100."""
  loss, count = cross_entropy_sums(logits, labels)
  return loss / jnp.maximum(count, 1)


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
  lr_scale, wd_scale = completep.mup_scales(params, cfg.model)
  schedule = completep.lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps)
  opt = adamc_lib.adamc(schedule, peak_learning_rate=cfg.learning_rate,
                        weight_decay=cfg.weight_decay, lr_scale=lr_scale, wd_scale=wd_scale)
  if cfg.model.param_dtype != "float32":
    opt = adamc_lib.with_float32_master(opt)
  return opt


def micro_batches(x: jax.Array, count: int, batch_sharding=None) -> jax.Array:
  """``[B, ...]`` -> ``[count, B / count, ...]``: micro-batch j holds rows j, j + count, ...

  Interleaving keeps every device's rows in every micro-batch: a batch split over devices in
  contiguous blocks stays split the same way inside each micro-batch."""
  B = x.shape[0]
  out = jnp.swapaxes(x.reshape(B // count, count, *x.shape[1:]), 0, 1)
  if batch_sharding is not None:
    spec = PartitionSpec(None, *batch_sharding.spec)
    out = jax.lax.with_sharding_constraint(out, NamedSharding(batch_sharding.mesh, spec))
  return out


def loss_sums(graphdef, params, inputs, labels, *, remat: str, slice_len: int, compute_dtype,
              predictions: bool = False):
  """(loss sum, token count, argmax or None) of one (micro-)batch: the model's features with
  ``remat``, then the LM head and cross-entropy over ``slice_len`` slices."""
  model = nnx.merge(graphdef, params)
  return sliced_loss_sums(model.features(inputs, remat), model.lm_head.kernel[...], labels,
                          compute_dtype=compute_dtype, slice_len=slice_len,
                          predictions=predictions)


def global_norm(tree) -> jax.Array:
  """sqrt(sum of squares) of every leaf, in float32."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree_util.tree_leaves(tree)))


def loss_and_grads(graphdef, params, batch: dict, cfg: TrainConfig, batch_sharding=None):
  """(mean loss over every labelled token of ``batch``, its gradient) with ``cfg``'s remat and
  loss slicing, the batch run as ``cfg.grad_accum_steps`` micro-batches (``lax.scan``).

  Each micro-batch's loss sum is divided by the token count of the *whole* batch, so summing
  micro-batch gradients gives exactly the large batch's gradient even when micro-batches hold
  different numbers of labelled tokens. Accumulated gradients are float32."""
  inputs, labels = batch["inputs"], batch["labels"]
  accum = cfg.grad_accum_steps
  total = jnp.maximum(jnp.sum(labels != IGNORE), 1).astype(jnp.float32)

  def loss_fn(p, inp, lab):
    return loss_sums(graphdef, p, inp, lab, remat=cfg.remat, slice_len=cfg.loss_slice_len,
                     compute_dtype=cfg.model.compute_dtype)[0] / total

  if accum == 1:
    return jax.value_and_grad(loss_fn)(params, inputs, labels)

  def one(carry, xs):
    loss, grads = jax.value_and_grad(loss_fn)(params, *xs)
    return (carry[0] + loss, jax.tree_util.tree_map(
        lambda a, g: a + g.astype(jnp.float32), carry[1], grads)), None

  zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  split = lambda x: micro_batches(x, accum, batch_sharding)
  (loss, grads), _ = jax.lax.scan(one, (jnp.zeros((), jnp.float32), zeros),
                                  (split(inputs), split(labels)))
  return loss, grads


def clip_to_norm(grads, norm: jax.Array, max_norm: float):
  """``grads`` scaled by ``min(1, max_norm / norm)`` (``norm`` their global norm)."""
  factor = jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30))
  return jax.tree_util.tree_map(lambda g: (g * factor).astype(g.dtype), grads)


def make_train_step(graphdef, optimizer, shardings=None, cfg: TrainConfig | None = None):
  """A jitted step ``(params, opt_state, batch, halted) -> (params, opt_state, stats)``.

  ``cfg`` gives remat, ``grad_accum_steps``, ``loss_slice_len``, ``grad_clip_norm`` and
  ``on_nonfinite`` (default: a plain step). The loss is the mean over every labelled token of
  the whole batch, however it is split into micro-batches. ``stats`` holds device scalars:
  ``loss``, ``grad_norm`` (before clipping), ``finite`` (this step's loss and gradients) and
  ``halted``, which the caller feeds back as the next ``halted``: after a non-finite step with
  ``on_nonfinite="stop"`` every later update is dropped, so the parameters stay those of the last
  good step until the host sees the flag. With ``shardings = (params, opt_state, batch)`` the
  step is partitioned over a mesh.
  """
  cfg = cfg or TrainConfig()
  batch_sharding = None if shardings is None else shardings[2]

  def step(params, opt_state, batch, halted):
    loss, grads = loss_and_grads(graphdef, params, batch, cfg, batch_sharding)
    norm = global_norm(grads)
    if cfg.grad_clip_norm > 0:
      grads = clip_to_norm(grads, norm, cfg.grad_clip_norm)
    finite = jnp.isfinite(loss) & jnp.isfinite(norm)

    def update(params, opt_state, grads):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      if isinstance(opt_state, adamc_lib.MasterState):
        return adamc_lib.params_from_master(opt_state, params), opt_state
      return optax.apply_updates(params, updates), opt_state

    # A conditional, not a select: its untaken branch returns the donated buffers unchanged, so
    # no second copy of the parameters and optimizer state is ever alive.
    params, opt_state = jax.lax.cond(finite & ~halted, update,
                                     lambda p, o, g: (p, o), params, opt_state, grads)
    if cfg.on_nonfinite == "stop":
      halted = halted | ~finite
    stats = {"loss": loss, "grad_norm": norm, "finite": finite, "halted": halted}
    return params, opt_state, stats

  if shardings is None:
    return jax.jit(step, donate_argnums=(0, 1))
  p_sh, o_sh, b_sh = shardings
  replicated = NamedSharding(b_sh.mesh, PartitionSpec())
  return jax.jit(step, donate_argnums=(0, 1), in_shardings=(p_sh, o_sh, b_sh, replicated),
                 out_shardings=(p_sh, o_sh, replicated))


# Model fields a fine-tuning run (TrainConfig.init_from) takes from its own config; every other
# field comes from the run it starts from, whose parameters fix the architecture.
FINE_TUNE_FIELDS = ("param_dtype", "compute_dtype", "kvm_implementation",
                    "attention_implementation")


def with_init_model(cfg: TrainConfig, workdir=None) -> TrainConfig:
  """``cfg`` with ``model`` taken from ``cfg.init_from``'s run directory (except
  :data:`FINE_TUNE_FIELDS`), or from ``workdir``'s own config once the fine-tuning run has
  started there (so resuming does not need ``init_from`` any more); ``cfg`` itself when it starts
  from scratch."""
  if not cfg.init_from:
    return cfg
  if workdir is not None and is_run_directory(workdir):
    source = load_config(workdir).model
  elif not is_run_directory(cfg.init_from):
    raise ValueError(f"init_from={cfg.init_from!r} is not a run directory (no config.json); give "
                     "a kvm-train workdir or a kvm-import output (kvm-import converts the "
                     "authors' checkpoints).")
  elif checkpoint_kind(cfg.init_from) != "run":
    raise ValueError(f"init_from={cfg.init_from!r} is a checkpoint in the authors' format; "
                     f"convert it first: kvm-import {cfg.init_from} RUN_DIR, then "
                     "--config.init_from=RUN_DIR.")
  else:
    source = load_config(cfg.init_from).model
  model = dataclasses.replace(source, **{f: getattr(cfg.model, f) for f in FINE_TUNE_FIELDS})
  return dataclasses.replace(cfg, model=model)


def setup(cfg: TrainConfig, mesh=None):
  """Model, optimizer and sharded initial state: (graphdef, params, opt_state, optimizer, shardings)."""
  mesh = mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  if jax.process_count() > 1:
    sharding.check_processes(mesh)
  sharding.check_batch(cfg.batch_size, mesh, cfg.grad_accum_steps)
  model = LM(cfg.model, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model)
  optimizer = make_optimizer(cfg, params)
  p_sh = sharding.param_shardings(params, mesh)
  params = jax.device_put(params, p_sh)
  opt_state = optimizer.init(params)
  o_sh = sharding.like_params_shardings(opt_state, p_sh, mesh)
  opt_state = jax.device_put(opt_state, o_sh)
  return graphdef, params, opt_state, optimizer, (p_sh, o_sh, sharding.batch_sharding(mesh))


def put_batch(batch: dict, batch_sharding, rows: Optional[np.ndarray] = None,
              batch_size: Optional[int] = None) -> dict:
  """This host's rows of a batch -> global arrays placed by ``batch_sharding``.

  ``rows`` are the global row indices the host holds (:func:`sharding.host_rows`) and
  ``batch_size`` the global batch; by default the host holds the whole batch (one host)."""
  if rows is None:
    batch_size = len(next(iter(batch.values())))
    rows = np.arange(batch_size)
  return sharding.global_batch(batch, batch_sharding, batch_size, rows)


@dataclasses.dataclass(frozen=True)
class EvalSpec:
  """What the eval step's program depends on besides the model (hashable: a static argument)."""

  task: str
  window: int
  grad_accum_steps: int
  loss_slice_len: int
  compute_dtype: str
  batch_sharding: Any = None

  @classmethod
  def of(cls, cfg: TrainConfig, batch_sharding=None) -> "EvalSpec":
    return cls(cfg.task, cfg.model.kvm.window_len, cfg.grad_accum_steps, cfg.loss_slice_len,
               cfg.model.compute_dtype, batch_sharding)


@functools.partial(jax.jit, static_argnums=(0, 1))
def eval_sums(graphdef, spec: EvalSpec, params, batch: dict) -> dict:
  """Sums of one eval batch, computed where the batch and parameters live (their shardings
  propagate; only scalars come back): ``loss_sum``, ``tokens``; MQAR: ``hits_*``/``answers_*`` of
  all answers, those whose key is within the exact window and those beyond it; NIAH: ``exact``
  answers and ``examples``. The batch runs in ``grad_accum_steps`` micro-batches and the loss
  over ``loss_slice_len`` slices, like training. Compiled once per model, spec and shape."""

  def sums(batch):
    loss, count, pred = loss_sums(graphdef, params, batch["inputs"], batch["labels"],
                                  remat="none", slice_len=spec.loss_slice_len,
                                  compute_dtype=spec.compute_dtype,
                                  predictions=spec.task in ("mqar", "niah"))
    out = {"loss_sum": loss, "tokens": count}
    labels = batch["labels"]
    valid = labels != IGNORE
    if spec.task == "mqar":
      correct = (pred == labels) & valid
      near = valid & (batch["distance"] < spec.window)
      for name, mask in (("all", valid), ("in_window", near), ("state_only", valid & ~near)):
        out[f"hits_{name}"] = jnp.sum(correct & mask).astype(jnp.int32)
        out[f"answers_{name}"] = jnp.sum(mask).astype(jnp.int32)
    elif spec.task == "niah":  # teacher-forced: every answer token right
      wrong = ((pred != labels) & valid).any(axis=1)
      out["exact"] = jnp.sum(~wrong).astype(jnp.int32)
      out["examples"] = jnp.asarray(labels.shape[0], jnp.int32)
    return out

  if spec.grad_accum_steps == 1:
    return sums(batch)
  split = {k: micro_batches(v, spec.grad_accum_steps, spec.batch_sharding)
           for k, v in batch.items()}
  return jax.tree_util.tree_map(lambda x: jnp.sum(x, 0), jax.lax.map(sums, split))


def make_eval_step(graphdef, cfg: TrainConfig, batch_sharding=None):
  """``(params, batch) -> sums`` (:func:`eval_sums`) for ``cfg``'s task; micro-batches keep
  ``batch_sharding`` (the training batch sharding)."""
  spec = EvalSpec.of(cfg, batch_sharding if cfg.grad_accum_steps > 1 else None)
  return functools.partial(eval_sums, graphdef, spec)


def evaluate(graphdef, params, cfg: TrainConfig, batches: int, dataset=None,
             eval_step=None, batch_sharding=None) -> dict[str, float]:
  """Held-out loss (mean over every labelled token) on the same first ``batches`` batches every
  time; for MQAR also recall split by where the queried key lives, for NIAH the exact-answer
  rate. ``dataset`` avoids rebuilding the held-out split, ``eval_step`` (:func:`make_eval_step`)
  recompiling; ``batch_sharding`` places each batch like training's."""
  if batch_sharding is None:  # parameters on a trainer's mesh: batches split like training's
    leaf = jax.tree_util.tree_leaves(params)[0]
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
      batch_sharding = sharding.batch_sharding(leaf.sharding.mesh)
  eval_step = eval_step or make_eval_step(graphdef, cfg, batch_sharding)
  rows = None if batch_sharding is None else sharding.host_rows(batch_sharding, cfg.batch_size)
  reader = BatchReader(dataset or task_dataset(cfg, "eval"), cfg.batch_size, rows,
                       prefetch=False)
  total: dict[str, int | float] = {}
  for index in range(batches):
    batch = reader.read(index)
    batch = {k: v for k, v in batch.items() if k in ("inputs", "labels", "distance")}
    if batch_sharding is not None:
      batch = put_batch(batch, batch_sharding, rows, cfg.batch_size)
    for k, v in jax.device_get(eval_step(params, batch)).items():
      total[k] = total.get(k, 0) + v.item()
  out = {"eval_loss": total["loss_sum"] / max(total["tokens"], 1)}
  if cfg.task == "mqar":
    out.update(mqar.recall_ratios({name: np.array([total[f"hits_{name}"],
                                                   total[f"answers_{name}"]])
                                   for name in ("all", "in_window", "state_only")}))
  elif cfg.task == "niah":
    out["answer_exact"] = total["exact"] / total["examples"]
  return out


class NonFiniteError(RuntimeError):
  """A non-finite loss or gradient with ``on_nonfinite="stop"``; the run saved nothing after it."""


def _check_finite(cfg: TrainConfig, pending, stats, ckpt, workdir, verbose) -> int:
  """Host side of the non-finite guard at a sync point: raises :class:`NonFiniteError` ("stop")
  or returns how many of the ``pending`` steps dropped their update ("skip")."""
  bad = [(step, s) for step, s in zip(pending, stats) if not s["finite"]]
  if not bad:
    return 0
  step, s = bad[0]
  what = "loss" if not np.isfinite(s["loss"]) else "gradient"
  if cfg.on_nonfinite == "stop":
    last = ckpt.latest_step()
    kept = (f"the newest checkpoint (step {last}) holds the last parameters saved before it"
            if last is not None else "no checkpoint had been written yet")
    raise NonFiniteError(
        f"non-finite {what} at step {step} (loss={s['loss']}, grad_norm={s['grad_norm']}); the "
        f"update was not applied and nothing was saved after it: {kept} in {workdir}. Check "
        "the data of that step or lower the learning rate; --config.grad_clip_norm clips the "
        "gradient and --config.on_nonfinite=skip drops such updates instead of stopping.")
  if verbose:
    steps = ", ".join(str(step) for step, _ in bad)
    print(f"skipped the update of step(s) {steps}: non-finite {what}", flush=True)
  return len(bad)


@dataclasses.dataclass
class StepClock:
  """Honest throughput: wall time per step between host syncs, after ``block_until_ready``.

  The clock starts only once the first step of a (resumed) run has finished, so warm-up is never
  counted, and it restarts after every evaluation and checkpoint, which are not training time.
  ``data_wait`` is the host time spent producing batches (reading rows, placing them)."""

  start: Optional[float] = None
  steps: int = 0
  data_wait: float = 0.0

  def restart(self) -> None:
    self.start, self.steps, self.data_wait = time.perf_counter(), 0, 0.0

  def tick(self, data_wait: float) -> None:
    if self.start is not None:
      self.steps += 1
      self.data_wait += data_wait

  def report(self) -> dict[str, float]:
    """``step_time_s`` and ``data_wait_s`` per step of the interval (empty before any step)."""
    if self.start is None or self.steps == 0:
      return {}
    elapsed = time.perf_counter() - self.start
    return {"step_time_s": elapsed / self.steps, "data_wait_s": self.data_wait / self.steps}


def parse_profile_steps(text: str) -> tuple[int, int]:
  """``"A:B"`` -> (A, B): trace steps A through B (1-based, as numbered in metrics.jsonl)."""
  try:
    first, last = (int(x) for x in text.split(":"))
  except ValueError:
    raise ValueError(f"profile steps {text!r} must look like A:B (e.g. 10:15).") from None
  if not 1 <= first <= last:
    raise ValueError(f"profile steps {text!r} need 1 <= A <= B.")
  return first, last


def train(cfg: TrainConfig, workdir, *, verbose: bool = True,
          profile_steps: Optional[tuple[int, int]] = None) -> dict[str, Any]:
  """Trains (or resumes) in ``workdir`` (a local or ``gs://`` path); returns the last logged
  metrics plus the final ``params`` and ``graphdef``. On a pod every process calls it with the
  same arguments. ``profile_steps=(A, B)`` writes a ``jax.profiler`` trace of steps A..B to
  ``workdir/profile`` on process 0. Raises :class:`NonFiniteError` when a step's loss or gradient
  is not finite and ``cfg.on_nonfinite == "stop"``."""
  cfg = with_init_model(cfg, workdir)
  cfg.validate()
  primary = jax.process_index() == 0
  verbose = verbose and primary
  workdir = epath.Path(workdir)  # save_config and the metrics writer create it (process 0)
  if (workdir / IMPORT_RECORD).exists():
    raise ValueError(f"{workdir} was written by kvm-import: it holds parameters without an "
                     f"optimizer state. Fine-tune from it in a new directory: "
                     f"--config.init_from={workdir} --workdir=NEW_DIR.")
  if cfg.init_from and epath.Path(cfg.init_from).resolve() == workdir.resolve():
    raise ValueError(f"init_from={cfg.init_from!r} is the workdir itself; write the fine-tuning "
                     "run to another directory.")
  graphdef, params, opt_state, optimizer, shardings = setup(cfg)
  batch_sh = shardings[2]
  rows = sharding.host_rows(batch_sh, cfg.batch_size)
  reader = BatchReader(task_dataset(cfg, "train"), cfg.batch_size, rows)
  ckpt = Checkpointer(workdir / CHECKPOINT_DIR, keep=cfg.keep_checkpoints)
  if primary:
    save_config(cfg, workdir, verbose)
  start, skipped = 0, 0
  if ckpt.latest_step() is not None:
    start, state, data_state = ckpt.restore(abstract_like({"params": params,
                                                          "opt_state": opt_state}))
    params, opt_state = state["params"], state["opt_state"]
    skipped = int(data_state.pop(_SKIPPED_KEY, 0))
    reader.set_state(data_state)
    if verbose:
      print(f"resumed from step {start} in {workdir}")
  elif cfg.init_from:
    source = Checkpointer(epath.Path(cfg.init_from) / CHECKPOINT_DIR)
    try:  # onto this run's shardings and parameter dtype
      init_step, params = source.restore_params(abstract_like(params))
    finally:
      source.close()
    if verbose:
      print(f"fine-tuning from {cfg.init_from} (step {init_step}): its model and parameters, a "
            "fresh optimizer and data stream")
  metrics = MetricsWriter(workdir, resume_step=start, enabled=primary)
  train_step = make_train_step(graphdef, optimizer, shardings, cfg)
  halted = jax.device_put(jnp.zeros((), bool), NamedSharding(batch_sh.mesh, PartitionSpec()))
  # Preemption: one process watches SIGTERM itself; several use JAX's preemption sync point (its
  # notifier catches SIGTERM on any host and every host learns the same step to stop at).
  many = jax.process_count() > 1
  stop = {"sigterm": False}
  previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True)) \
      if not many and _in_main_thread() else None
  progress = ProgressBar(cfg.steps, "step", start)
  peak, fpt = peak_flops(cfg), flops_per_token(cfg, params)
  eval_set = task_dataset(cfg, "eval") if cfg.eval_every else None
  eval_step = make_eval_step(graphdef, cfg, batch_sh) if cfg.eval_every else None
  tokens_per_step = cfg.batch_size * cfg.sequence_length
  last: dict[str, Any] = {"step": start}
  clock, compile_s, compile_logged = StepClock(), None, False
  pending_steps, pending_stats = [], []   # device stats of the steps since the last host sync
  tracing = False
  contexts = contextlib.ExitStack()
  if cfg.model.kvm_implementation != "xla" or runs_pallas(cfg.model.attention_implementation):
    # Pallas kernels run per shard (shard_map) over this trainer's batch and KV-head axes.
    contexts.enter_context(jax.set_mesh(batch_sh.mesh))
    contexts.enter_context(kernel_sharding(batch_axes=sharding.BATCH,
                                           head_axis=sharding.LOGICAL_RULES["kv_heads"]))
  try:
    for step in range(start, cfg.steps):
      done = step + 1
      t0 = time.perf_counter()
      batch = put_batch(next(reader), batch_sh, rows, cfg.batch_size)
      waited = time.perf_counter() - t0
      if compile_s is None:  # compiled ahead of the first step, so its time is known exactly
        t0 = time.perf_counter()
        train_step = train_step.lower(params, opt_state, batch, halted).compile()
        compile_s = time.perf_counter() - t0
      if primary and profile_steps and done == profile_steps[0]:
        jax.profiler.start_trace(str(workdir / "profile"))
        tracing = True
      params, opt_state, stats = train_step(params, opt_state, batch, halted)
      halted = stats["halted"]
      clock.tick(waited)
      if step == start:  # the first step warms up (allocation, autotuning): not timed
        jax.block_until_ready(stats)
        clock.restart()
      if tracing and done == profile_steps[1]:
        jax.block_until_ready(stats)
        jax.profiler.stop_trace()
        tracing = False
        if verbose:
          print(f"profile of steps {profile_steps[0]}..{done} written to {workdir / 'profile'}")
      pending_steps.append(done)
      pending_stats.append({k: stats[k] for k in ("loss", "grad_norm", "finite")})
      # Every host calls the sync point at every step with the same step number (its contract).
      preempted = multihost_utils.reached_preemption_sync_point(done) if many else \
          stop["sigterm"]
      final = done == cfg.steps or preempted
      log_now = done % cfg.log_every == 0 or final
      save_now = done % cfg.checkpoint_every == 0 or final
      if log_now or save_now:  # the only host syncs
        host = jax.device_get(pending_stats)
        skipped += _check_finite(cfg, pending_steps, host, ckpt, workdir, verbose)
        pending_steps, pending_stats = [], []
      if log_now:
        loss = float(host[-1]["loss"])
        last = {"step": done, "loss": loss, "grad_norm": float(host[-1]["grad_norm"])}
        timing = clock.report()
        if timing:
          last.update(timing, tokens_per_s=tokens_per_step / timing["step_time_s"])
          if peak:
            last["mfu"] = last["tokens_per_s"] * fpt / peak
        if not compile_logged:  # once per process start: what this run paid to compile
          last["compile_s"] = compile_s
          compile_logged = True
        if cfg.on_nonfinite == "skip":
          last["skipped_steps"] = skipped
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
          last.update(evaluate(graphdef, params, cfg, cfg.eval_batches, eval_set, eval_step,
                               batch_sh))
        metrics.write(**last)
        extra = f"loss {loss:.4f}"
        if "tokens_per_s" in last:
          extra += f"  {last['tokens_per_s']:,.0f} tok/s  {1e3 * last['step_time_s']:.0f} ms/step"
        if "mfu" in last:
          extra += f"  MFU {last['mfu']:.1%}"
        if verbose:
          line = progress.draw(done, extra)
          if not progress.tty:
            print(line, flush=True)
      if save_now:
        ckpt.save(done, {"params": params, "opt_state": opt_state},
                  {**reader.get_state(), _SKIPPED_KEY: skipped}, force=True)
        if preempted and verbose:
          print(f"preempted: saved step {done} in {workdir}; the same command resumes it",
                flush=True)
      if log_now or save_now:
        clock.restart()  # evaluation and checkpointing are not step time
      if final:
        break
  finally:
    if tracing:
      jax.profiler.stop_trace()
    contexts.close()
    reader.close()
    ckpt.close()
    metrics.close()
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if verbose and progress.tty and last.get("step", 0) < cfg.steps:
      print(file=progress.stream)  # the bar ends its own line only when it reaches the end
  last["params"] = params
  last["graphdef"] = graphdef
  return last


# Key of the skipped-update count stored next to the data iterator's state in a checkpoint.
_SKIPPED_KEY = "kvm_skipped_steps"


def _in_main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()
