"""Metrics: JSONL always (one object per logged step), TensorBoard when it is installed.

Only one process of a multi-host run writes them (``enabled``); the others get a writer that
does nothing, so every line appears once. Paths go through ``etils.epath``: a ``gs://`` run
directory is written in the bucket.
"""

from __future__ import annotations

import json
import math

from etils import epath

from kvm_jax.runs.checkpoint import is_remote


class MetricsWriter:
  """Appends one JSON object per logged step to ``<workdir>/metrics.jsonl`` (and TensorBoard).

  Non-finite values are written as JSON ``null``. A resumed run first drops the lines of steps
  after its checkpoint, which it is about to redo.
  """

  def __init__(self, workdir, resume_step: int = 0, enabled: bool = True):
    self.enabled = enabled
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self._tb = None
    if not enabled:
      return
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._lines: list[str] = []
    if self.path.exists():
      self._lines = [l for l in self.path.read_text().splitlines()
                     if l.strip() and json.loads(l).get("step", 0) <= resume_step]
      self.path.write_text("".join(l + "\n" for l in self._lines))
    try:  # optional
      from tensorboardX import SummaryWriter  # type: ignore
      self._tb = SummaryWriter(str(epath.Path(workdir) / "tb"))
    except Exception:
      self._tb = None

  def write(self, step: int, **scalars) -> None:
    if not self.enabled:
      return
    values = {k: float(v) for k, v in scalars.items()}
    record = {"step": int(step), **{k: v if math.isfinite(v) else None
                                    for k, v in values.items()}}
    self._append(json.dumps(record))
    if self._tb is not None:
      for k, v in values.items():
        self._tb.add_scalar(k, v, step)

  def _append(self, line: str) -> None:
    self._lines.append(line)
    if is_remote(self.path):  # object stores cannot append: rewrite the (small) file
      self.path.write_text("".join(l + "\n" for l in self._lines))
    else:
      with self.path.open("a") as f:
        f.write(line + "\n")

  def note(self, step: int, **fields) -> None:
    """A line that is not a step's metrics (e.g. ``config_changed`` when a run resumes with other
    settings): ``step`` and ``fields`` as they are, JSON-encoded; no TensorBoard scalar."""
    if self.enabled:
      self._append(json.dumps({"step": int(step), **fields}))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
