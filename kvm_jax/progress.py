"""One dependency-free progress display for long work (training steps, evaluation loops).

On a terminal, a bar redrawn in place on stderr; elsewhere (CI logs, files) the caller decides
which lines to print, so that logs show progress without thousands of lines.
"""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")
_WIDTH = 20


class ProgressBar:
  """``desc [#####.....] done/total  elapsed  ETA  extra``.

  ``start`` is where a resumed job begins: the ETA is extrapolated from the work done since then.
  """

  def __init__(self, total: int, desc: str = "", start: int = 0, stream=None):
    self.total, self.desc, self.start = total, desc, start
    self.stream = stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.t0 = time.perf_counter()

  def message(self, done: int, extra: str = "") -> str:
    """The status line at ``done`` items, without the bar."""
    elapsed = time.perf_counter() - self.t0
    rate_done = max(done - self.start, 1)
    eta = elapsed / rate_done * (self.total - done) if self.total else 0.0
    line = f"{self.desc} {done}/{self.total or '?'}  {elapsed:,.0f}s  ETA {eta:,.0f}s"
    return line + (f"  {extra}" if extra else "")

  def draw(self, done: int, extra: str = "") -> str:
    """Redraws the bar on a terminal (a newline once ``done == total``); returns the message."""
    msg = self.message(done, extra)
    if self.tty:
      filled = int(_WIDTH * done / self.total) if self.total else 0
      bar = "[" + "#" * filled + "." * (_WIDTH - filled) + "]"
      self.stream.write(f"\r{self.desc} {bar} {msg[len(self.desc) + 1:]}")
      if self.total and done >= self.total:
        self.stream.write("\n")
      self.stream.flush()
    return msg


def progress(items: Iterable[T], total: Optional[int] = None, desc: str = "",
             stream=None) -> Iterator[T]:
  """Yields ``items`` with a :class:`ProgressBar`; off a terminal, one line at every 25%."""
  if total is None:
    try:
      total = len(items)  # type: ignore[arg-type]
    except TypeError:
      total = 0
  bar = ProgressBar(total, desc, stream=stream)
  next_report, done = 0.25, 0
  for item in items:
    yield item
    done += 1
    msg = bar.draw(done)
    frac = done / total if total else 0.0
    if not bar.tty and total and (frac >= next_report or done == total):
      bar.stream.write(msg + "\n")
      bar.stream.flush()
      while next_report <= frac:
        next_report += 0.25
