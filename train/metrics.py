"""Metrics: JSONL always (one object per logged step), TensorBoard when it is installed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Optional


class MetricsWriter:
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


class Progress:
  """A one-line progress display on a terminal, periodic log lines otherwise."""

  def __init__(self, total: int, start: int = 0):
    self.total, self.start, self.t0 = total, start, time.perf_counter()
    self.tty = sys.stderr.isatty()

  def line(self, step: int, loss: float, tokens_per_s: float, extra: Optional[str] = None) -> str:
    done = step - self.start
    elapsed = time.perf_counter() - self.t0
    eta = elapsed / max(done, 1) * (self.total - step)
    msg = (f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  "
           f"ETA {eta:,.0f}s" + (f"  {extra}" if extra else ""))
    if self.tty:
      width = 20
      filled = int(width * step / self.total)
      sys.stderr.write("\r[" + "#" * filled + "." * (width - filled) + "] " + msg)
      sys.stderr.flush()
    return msg
