"""Metrics: JSONL always (one object per logged step), TensorBoard when it is installed."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsWriter:
  """Appends one JSON object per logged step to ``<workdir>/metrics.jsonl`` (and TensorBoard)."""

  def __init__(self, workdir: str | Path, resume_step: int = 0):
    self.path = Path(workdir) / "metrics.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    # A resumed run rewrites history after its checkpoint: drop lines of steps it will redo.
    if self.path.exists():
      kept = [l for l in self.path.read_text().splitlines()
              if l.strip() and json.loads(l).get("step", 0) <= resume_step]
      self.path.write_text("".join(l + "\n" for l in kept))
    self._tb = None
    try:  # optional
      from tensorboardX import SummaryWriter  # type: ignore
      self._tb = SummaryWriter(str(Path(workdir) / "tb"))
    except Exception:
      self._tb = None

  def write(self, step: int, **scalars) -> None:
    record = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, float(v), step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
