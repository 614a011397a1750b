"""Run directories: what ``kvm-train`` / ``kvm-demo`` write and evaluation reads back.

A run directory holds ``config.json`` (the :class:`TrainConfig`, tagged JSON through
:mod:`kvm_jax.config_io`), ``checkpoints/<step>/`` (orbax: train state and data iterator),
``metrics.jsonl`` and optionally ``tb/``. :func:`load_trained` rebuilds the model from the config
and restores its parameters; :func:`logits_fn` gives a jitted ``tokens -> logits`` for any model.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import jax
from flax import nnx

from kvm_jax import config_io
from kvm_jax.nn.model import LM
from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.runs.config import TrainConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec

CONFIG_FILE = "config.json"
CHECKPOINT_DIR = "checkpoints"
# Classes a run's config.json may name, beyond the model configs config_io always knows.
TRAIN_CLASSES = (TrainConfig, MQARSpec, NIAHSpec)


def save_config(cfg: TrainConfig, workdir: str | Path, verbose: bool = True) -> None:
  """Writes ``workdir/config.json`` so evaluation can rebuild the model from the directory alone."""
  try:
    config_io.save(Path(workdir) / CONFIG_FILE, cfg)
  except ValueError as e:  # a callable budget: training still works, loading needs the config
    if verbose:
      print(f"note: {CONFIG_FILE} not written ({e}); pass the config to load_trained().")


def load_config(workdir: str | Path) -> TrainConfig:
  """The :class:`TrainConfig` recorded in a run directory."""
  path = Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise ValueError(f"{workdir} has no {CONFIG_FILE}: is it a kvm-train / kvm-demo run "
                     "directory (one model per directory, e.g. runs/demo/kvm-fixed)?")
  return config_io.load(path, TRAIN_CLASSES)


def is_run_directory(path: str | Path) -> bool:
  """Whether ``path`` holds a run's ``config.json`` (one model per run directory)."""
  return (Path(path) / CONFIG_FILE).exists()


def load_trained(workdir: str | Path, step: int | None = None,
                 cfg: TrainConfig | None = None) -> tuple[TrainConfig, Any, int]:
  """(train config, ``nnx`` model with the checkpointed parameters, step) of a run directory.

  ``step`` defaults to the newest checkpoint; ``cfg`` defaults to the run's ``config.json``. Only
  the parameters are read (onto the first device), whatever optimizer the run used.
  """
  workdir = Path(workdir)
  cfg = load_config(workdir) if cfg is None else cfg
  graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: LM(cfg.model, rngs=nnx.Rngs(0))))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract_params)
  ckpt = Checkpointer(workdir / CHECKPOINT_DIR)
  try:
    step, params = ckpt.restore_params(target, step)
  finally:
    ckpt.close()
  return cfg, nnx.merge(graphdef, params), step


@functools.partial(jax.jit, static_argnums=0)
def forward_logits(graphdef, params, tokens: jax.Array) -> jax.Array:
  """Logits ``[B, T, V]`` (float32) of ``nnx.merge(graphdef, params)`` on ``tokens [B, T]``,
  jitted once per shape."""
  return nnx.merge(graphdef, params)(tokens)


def logits_fn(model) -> Callable[[jax.Array], jax.Array]:
  """``tokens [B, T] -> logits [B, T, V]`` of an ``nnx`` model, jitted once per shape."""
  graphdef, params = nnx.split(model)
  return lambda tokens: forward_logits(graphdef, params, tokens)
