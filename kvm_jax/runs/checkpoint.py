"""Orbax checkpoints: train state (params, optimizer, step) and the data iterator, saved together.

Saves are asynchronous and atomic (orbax writes a temporary directory and renames it), keep the
newest ``keep`` steps, and a restore returns exactly what was saved, so a run killed at any moment
resumes from its last complete checkpoint without repeating or skipping a batch. Evaluation reads
the parameters alone (:meth:`Checkpointer.restore_params`), without knowing the optimizer.

On a pod every process opens the same directory (a shared file system or a ``gs://`` bucket) and
takes part in every save and restore: each writes and reads the shards its devices hold, and a
step's directory appears only once all of them have finished it.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp
from etils import epath


class Checkpointer:
  """The checkpoints of one run directory (``<workdir>/checkpoints/<step>/``)."""

  def __init__(self, directory, keep: int = 3):
    # epath: gs:// stays a bucket path (pathlib would make it a local folder "gs:/...").
    directory = epath.Path(directory if is_remote(directory) else os.path.abspath(directory))
    if directory.exists() and not directory.is_dir():
      raise ValueError(f"checkpoint path {str(directory)!r} exists and is not a directory.")
    self.manager = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, train_state: Any, data_state: dict, force: bool = False) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(train_state), data=ocp.args.JsonSave(data_state)), force=force)

  def restore(self, abstract_state: Any, step: Optional[int] = None) -> tuple[int, Any, dict]:
    """(step, train_state, data_state) of ``step`` (default: latest)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise ValueError("no checkpoint to restore.")
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises a variety of errors for damaged directories
      raise ValueError(f"checkpoint at step {step} in {self.manager.directory} cannot be read "
                       f"({type(e).__name__}: {e}); delete that step's directory to fall back "
                       "to an earlier one.") from e
    return step, restored["state"], restored["data"]

  def restore_params(self, abstract_params: Any, step: Optional[int] = None) -> tuple[int, Any]:
    """(step, params) of ``step`` (default: latest): only the ``params`` subtree of the saved train
    state is read, onto the shardings of ``abstract_params`` (``jax.ShapeDtypeStruct`` leaves)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"{self.manager.directory} holds no checkpoint.")
    target = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item=target, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(state=args))
    except Exception as e:  # orbax raises a variety of errors for damaged directories
      raise ValueError(f"the parameters at step {step} in {self.manager.directory} cannot be read "
                       f"({type(e).__name__}: {e}).") from e
    return step, restored["state"]["params"]

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def is_remote(path) -> bool:
  """Whether ``path`` names an object store (``gs://``, ``s3://``, ...) rather than local files."""
  return "://" in str(path)


def abstract_like(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` leaves (with shardings) of a tree of arrays: a restore target."""
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
