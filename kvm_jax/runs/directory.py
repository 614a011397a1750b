"""Run directories: what ``kvm-train`` / ``kvm-demo`` write and evaluation reads back.

A run directory holds ``config.json`` (the :class:`TrainConfig`, tagged JSON through
:mod:`kvm_jax.config.io`), ``checkpoints/<step>/`` (orbax: train state and data iterator),
``metrics.jsonl`` and optionally ``tb/``. :func:`load_trained` rebuilds the model from the config
and restores its parameters; :func:`logits_fn` gives a jitted ``tokens -> logits`` for any model.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable, Optional, Sequence

import jax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvm_jax.config import io as config_io
from kvm_jax.generation.generate import pod_mesh, replicate_on
from kvm_jax.nn.model import LM
from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.runs.train_config import DistillSpec, TrainConfig
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.niah import NIAHSpec

#: The file of a run directory that holds its config.
CONFIG_FILE = "config.json"
# The key of config.json under which a run keeps the settings its resumes changed.
HISTORY_KEY = "history"
#: The folder of a run directory that holds its checkpoints.
CHECKPOINT_DIR = "checkpoints"
#: Written by kvm-import (kvm_jax.hf): where the parameters came from. Such a directory holds
#: parameters without an optimizer state: it is a starting point (TrainConfig.init_from), not a run
#: to resume.
IMPORT_RECORD = "import.json"
# Written by kvm-convert (kvm_jax.nn.convert): the run it converted. Like an import, a starting point.
CONVERSION_RECORD = "conversion.json"
#: Classes a run's config.json may name, beyond the model configs config_io always knows.
TRAIN_CLASSES = (TrainConfig, MQARSpec, NIAHSpec, DistillSpec)


def save_config(cfg: TrainConfig, workdir, verbose: bool = True,
                history: Sequence[dict] = ()) -> None:
  """Writes ``workdir/config.json`` so evaluation can rebuild the model from the directory alone
  (``gs://`` paths included; on a pod only process 0 should call it). ``history`` (the settings
  each resume changed, :func:`kvm_jax.runs.resume.change_record`) is kept under ``"history"``."""
  epath.Path(workdir).mkdir(parents=True, exist_ok=True)
  try:
    data = config_io.to_jsonable(cfg)
  except ValueError as e:  # a callable budget: training still works, loading needs the config
    if verbose:
      print(f"note: {CONFIG_FILE} not written ({e}); pass the config to load_trained().")
    return
  data = config_io.with_format(data)
  if history:
    data[HISTORY_KEY] = list(history)
  (epath.Path(workdir) / CONFIG_FILE).write_text(json.dumps(data, indent=2) + "\n")


def config_history(workdir) -> list[dict]:
  """The history ``config.json`` keeps of a run's resumes with changed settings (oldest first;
  empty without one)."""
  path = epath.Path(workdir) / CONFIG_FILE
  return json.loads(path.read_text()).get(HISTORY_KEY, []) if path.exists() else []


def save_starting_point(workdir, cfg: TrainConfig, params, data_state: dict) -> None:
  """Writes a run directory holding parameters without an optimizer state (what kvm-import and
  kvm-convert write): ``config.json`` and ``checkpoints/0/`` with ``params`` and ``data_state``
  (a note of where they came from). ``init_from`` starts from it; nothing resumes it."""
  save_config(cfg, workdir)
  ckpt = Checkpointer(epath.Path(workdir) / CHECKPOINT_DIR)
  try:
    ckpt.save(0, {"params": params}, data_state, force=True)
  finally:
    ckpt.close()


def load_config(workdir) -> TrainConfig:
  """The :class:`TrainConfig` recorded in a run directory."""
  path = epath.Path(workdir) / CONFIG_FILE
  if not path.exists():
    raise ValueError(f"{workdir} has no {CONFIG_FILE}: is it a kvm-train / kvm-demo run "
                     "directory (one model per directory, e.g. runs/demo/kvm-fixed)?")
  data = json.loads(path.read_text())
  data.pop(HISTORY_KEY, None)
  return config_io.read_config(data, TRAIN_CLASSES)


def is_run_directory(path) -> bool:
  """Whether ``path`` holds a run's ``config.json`` (one model per run directory)."""
  return (epath.Path(path) / CONFIG_FILE).exists()


def checkpoint_steps(workdir) -> list[int]:
  """The steps of the checkpoints in a run directory (read from the directory names, without
  opening anything), oldest first."""
  folder = epath.Path(workdir) / CHECKPOINT_DIR
  if not folder.is_dir():
    return []
  return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def default_placement():
  """Where :func:`load_trained` puts parameters by default: the first device on one host; on a
  pod, replicated over every device of every process (each host can then run the model on its
  own rows; pass ``shardings`` to split large models instead)."""
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return NamedSharding(Mesh(jax.devices(), ("devices",)), PartitionSpec())


def load_trained(workdir, step: int | None = None, cfg: TrainConfig | None = None,
                 shardings: Any = None) -> tuple[TrainConfig, Any, int]:
  """(train config, ``nnx`` model with the checkpointed parameters, step) of a run directory.

  ``step`` defaults to the newest checkpoint; ``cfg`` defaults to the run's ``config.json``. Only
  the parameters are read, whatever optimizer the run used. ``shardings`` places them: one
  sharding for every parameter, a tree of shardings like the parameters (e.g. the trainer's
  ``kvm_jax.train.sharding.param_shardings(params, mesh)``), or ``None`` for
  :func:`default_placement`. On a pod every process must call it (the read is collective).
  """
  workdir = epath.Path(workdir)
  cfg = load_config(workdir) if cfg is None else cfg
  if step is None and not checkpoint_steps(workdir):
    raise ValueError(f"{workdir} holds no checkpoint: its run stopped before its first save "
                     f"(every checkpoint_every={cfg.checkpoint_every} steps, and at the end); "
                     "resume it with the same kvm-train command, or give a run that saved one.")
  graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: LM(cfg.model, rngs=nnx.Rngs(0))))
  shardings = default_placement() if shardings is None else shardings
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree_util.tree_map(lambda _: shardings, abstract_params)
  target = jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_params, shardings)
  ckpt = Checkpointer(workdir / CHECKPOINT_DIR)
  try:
    step, params = ckpt.restore_params(target, step)
  finally:
    ckpt.close()
  return cfg, nnx.merge(graphdef, params), step


@functools.partial(jax.jit, static_argnums=0)
def forward_logits(graphdef, params, tokens: jax.Array,
                   segment_ids: Optional[jax.Array] = None) -> jax.Array:
  """Logits ``[B, T, V]`` (float32) of ``nnx.merge(graphdef, params)`` on ``tokens [B, T]``
  (with ``segment_ids [B, T]``: packed documents, each computed as if alone), jitted once per
  shape."""
  return nnx.merge(graphdef, params)(tokens, segment_ids=segment_ids)


def logits_fn(model) -> Callable[..., jax.Array]:
  """``(tokens [B, T], segment_ids=None) -> logits [B, T, V]`` of an ``nnx`` model, jitted once
  per shape.

  With parameters spanning processes (a pod), every process passes the same tokens and gets the
  same logits back, replicated so that each can read them."""
  graphdef, params = nnx.split(model)
  mesh = pod_mesh(params)
  if mesh is None:
    return lambda tokens, segment_ids=None: forward_logits(graphdef, params, tokens, segment_ids)

  def replicated(tokens, segment_ids=None):
    segment_ids = None if segment_ids is None else replicate_on(mesh, segment_ids)
    return replicate_on(mesh, forward_logits(graphdef, params, replicate_on(mesh, tokens),
                                             segment_ids))
  return replicated
