"""The training loop: a jitted AdamC step over ``nnx.split`` state, JSONL metrics, orbax resume.

One step = one batch; the data iterator's position is checkpointed with the parameters, so
``train(cfg, workdir)`` run again on the same workdir continues exactly where the last checkpoint
left off (bitwise on CPU). SIGTERM (TPU preemption) makes the loop save and return after the
current step.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.budget import state_rows_after
from kvm_jax.nn.model import LM
from kvm_jax.ops.kvm.api import kernel_sharding
from kvm_jax.progress import ProgressBar
from kvm_jax.runs.checkpoint import Checkpointer, abstract_like
from kvm_jax.runs.config import TrainConfig
from kvm_jax.runs.directory import CHECKPOINT_DIR, forward_logits, save_config
from kvm_jax.tasks import mqar, niah, text
from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.pipeline import batched_iterator
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


def flops_per_token(cfg: TrainConfig, params) -> float:
  """6·N (matmul parameters, forward + backward) + attention/readout: 12·layers·keys·D·H."""
  m = cfg.model
  T = cfg.sequence_length
  n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params)) - \
      m.vocab_size * m.hidden_size  # the embedding lookup is not a matmul
  keys = 0.0
  for kind in m.layer_mixers:
    if kind == "full":
      keys += T / 2
    elif kind == "swa":
      keys += min(m.swa_window, T)
    elif kind == "bswa":
      keys += min(m.bswa_chunk_size * m.bswa_window_chunks, T)
    else:
      keys += min(m.kvm.window_len, T) + state_rows_after(m.kvm, T)
  return 6.0 * n + 12.0 * keys * m.qk_head_dim * m.num_heads


def masked_loss(logits, labels):
  """Mean cross-entropy over positions whose label is not -100."""
  valid = labels != IGNORE
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return jnp.sum(ce * valid) / jnp.maximum(jnp.sum(valid), 1)


def make_optimizer(cfg: TrainConfig, params) -> optax.GradientTransformation:
  lr_scale, wd_scale = completep.mup_scales(params, cfg.model)
  schedule = completep.lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup_steps)
  opt = adamc_lib.adamc(schedule, peak_learning_rate=cfg.learning_rate,
                        weight_decay=cfg.weight_decay, lr_scale=lr_scale, wd_scale=wd_scale)
  if cfg.model.param_dtype != "float32":
    opt = adamc_lib.with_float32_master(opt)
  return opt


def make_train_step(graphdef, optimizer, shardings=None):
  """A jitted step; with ``shardings = (params, opt_state, batch)`` it is partitioned over a mesh."""
  def step(params, opt_state, batch):
    def loss_fn(p):
      return masked_loss(nnx.merge(graphdef, p)(batch["inputs"]), batch["labels"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    if isinstance(opt_state, adamc_lib.MasterState):
      params = adamc_lib.params_from_master(opt_state, params)
    else:
      params = optax.apply_updates(params, updates)
    return params, opt_state, loss
  if shardings is None:
    return jax.jit(step, donate_argnums=(0, 1))
  p_sh, o_sh, b_sh = shardings
  replicated = NamedSharding(b_sh.mesh, PartitionSpec())
  return jax.jit(step, donate_argnums=(0, 1), in_shardings=(p_sh, o_sh, b_sh),
                 out_shardings=(p_sh, o_sh, replicated))


def setup(cfg: TrainConfig, mesh=None):
  """Model, optimizer and sharded initial state: (graphdef, params, opt_state, optimizer, shardings)."""
  mesh = mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  sharding.check_batch(cfg.batch_size, mesh)
  model = LM(cfg.model, rngs=nnx.Rngs(cfg.seed))
  graphdef, params = nnx.split(model)
  optimizer = make_optimizer(cfg, params)
  p_sh = sharding.param_shardings(params, mesh)
  params = jax.device_put(params, p_sh)
  opt_state = optimizer.init(params)
  o_sh = sharding.like_params_shardings(opt_state, p_sh, mesh)
  opt_state = jax.device_put(opt_state, o_sh)
  return graphdef, params, opt_state, optimizer, (p_sh, o_sh, sharding.batch_sharding(mesh))


def put_batch(batch: dict, batch_sharding) -> dict:
  """Host-local numpy batch -> global sharded arrays (works on one host and on a pod)."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v))
          for k, v in batch.items()}


def evaluate(graphdef, params, cfg: TrainConfig, batches: int,
             dataset=None) -> dict[str, float]:
  """Held-out loss on the same first ``batches`` batches every time; for MQAR also recall split
  by where the queried key lives (``dataset`` avoids rebuilding the held-out split)."""
  it = batched_iterator(dataset or task_dataset(cfg, "eval"), cfg.batch_size)
  loss, counts = 0.0, None
  for _ in range(batches):
    batch = next(it)
    logits = forward_logits(graphdef, params, batch["inputs"])
    loss += float(masked_loss(logits, batch["labels"])) / batches
    if cfg.task == "mqar":
      pred = np.asarray(jnp.argmax(logits, -1))
      c = mqar.recall_counts(pred, batch["labels"], batch["distance"], cfg.model.kvm.window_len)
      counts = c if counts is None else {k: counts[k] + c[k] for k in c}
    elif cfg.task == "niah":  # teacher-forced: every answer token right
      pred = np.asarray(jnp.argmax(logits, -1))
      labels = np.asarray(batch["labels"])
      wrong = ((pred != labels) & (labels != IGNORE)).any(axis=1)
      counts = (0 if counts is None else counts) + np.array([int((~wrong).sum()), len(wrong)])
  if cfg.task == "niah":
    return {"eval_loss": loss, "answer_exact": counts[0] / counts[1]}
  return {"eval_loss": loss, **(mqar.recall_ratios(counts) if counts else {})}


def train(cfg: TrainConfig, workdir: str | Path, *, verbose: bool = True) -> dict[str, Any]:
  """Trains (or resumes) in ``workdir``; returns the last logged metrics plus the final
  ``params`` and ``graphdef``."""
  cfg.validate()
  workdir = Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  graphdef, params, opt_state, optimizer, shardings = setup(cfg)
  iterator = batched_iterator(task_dataset(cfg, "train"), cfg.batch_size,
                              shard_index=jax.process_index(), shard_count=jax.process_count())
  ckpt = Checkpointer(workdir / CHECKPOINT_DIR, keep=cfg.keep_checkpoints)
  save_config(cfg, workdir, verbose)
  start = 0
  if ckpt.latest_step() is not None:
    start, state, data_state = ckpt.restore(abstract_like({"params": params,
                                                          "opt_state": opt_state}))
    params, opt_state = state["params"], state["opt_state"]
    iterator.set_state(data_state)
    if verbose:
      print(f"resumed from step {start} in {workdir}")
  metrics = MetricsWriter(workdir, resume_step=start)
  train_step = make_train_step(graphdef, optimizer, shardings)
  stop = {"sigterm": False}
  previous = signal.signal(signal.SIGTERM, lambda *_: stop.update(sigterm=True)) \
      if _in_main_thread() else None
  progress = ProgressBar(cfg.steps, "step", start)
  peak, fpt = peak_flops(cfg), flops_per_token(cfg, params)
  eval_set = task_dataset(cfg, "eval") if cfg.eval_every else None
  tokens_per_step = cfg.batch_size * cfg.sequence_length
  last: dict[str, Any] = {"step": start}
  t0, ran = time.perf_counter(), 0
  contexts = contextlib.ExitStack()
  if cfg.model.kvm_implementation != "xla":
    # The Pallas kernels run per shard (shard_map) over this trainer's batch and KV-head axes.
    contexts.enter_context(jax.set_mesh(shardings[2].mesh))
    contexts.enter_context(kernel_sharding(batch_axes=sharding.BATCH,
                                           head_axis=sharding.LOGICAL_RULES["kv_heads"]))
  try:
    for step in range(start, cfg.steps):
      batch = put_batch(next(iterator), shardings[2])
      params, opt_state, loss = train_step(params, opt_state, batch)
      done, ran = step + 1, ran + 1
      final = done == cfg.steps or stop["sigterm"]
      if done % cfg.log_every == 0 or final:
        loss = float(loss)  # the only host sync, at log steps
        rate = tokens_per_step * ran / (time.perf_counter() - t0)
        last = {"step": done, "loss": loss, "tokens_per_s": rate}
        if peak:
          last["mfu"] = rate * fpt / peak
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
          last.update(evaluate(graphdef, params, cfg, cfg.eval_batches, eval_set))
        metrics.write(**last)
        extra = f"loss {loss:.4f}  {rate:,.0f} tok/s" + (
            f"  MFU {last['mfu']:.1%}" if "mfu" in last else "")
        if verbose:
          line = progress.draw(done, extra)
          if not progress.tty:
            print(line, flush=True)
      if done % cfg.checkpoint_every == 0 or final:
        ckpt.save(done, {"params": params, "opt_state": opt_state}, iterator.get_state(),
                  force=True)
      if final:
        break
  finally:
    contexts.close()
    ckpt.close()
    metrics.close()
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    if verbose and progress.tty and last.get("step", 0) < cfg.steps:
      print(file=progress.stream)  # the bar ends its own line only when it reaches the end
  last["params"] = params
  last["graphdef"] = graphdef
  return last


def _in_main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()
