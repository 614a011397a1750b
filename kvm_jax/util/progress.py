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

  ``start`` is where a resumed job begins: the ETA is extrapolated from the work done since then,
  or, once :meth:`steady_from` has marked the end of a warm-up (a first training step that also
  compiles), from the work done after it ("ETA ?" until there is some).
  """

  def __init__(self, total: int, desc: str = "", start: int = 0, stream=None):
    self.total, self.desc, self.start = total, desc, start
    self.stream = stream or sys.stderr
    self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.t0 = time.perf_counter()
    self.steady: Optional[tuple[float, int]] = None

  def steady_from(self, done: int) -> None:
    """Items up to ``done`` were warm-up: the ETA extrapolates only the time after now."""
    self.steady = (time.perf_counter(), done)

  def eta(self, done: int) -> Optional[float]:
    """Seconds left at ``done`` items (None: no steady-state item yet)."""
    if not self.total:
      return 0.0
    since, first = self.steady or (self.t0, self.start)
    if self.steady is not None and done <= first:
      return None
    return (time.perf_counter() - since) / max(done - first, 1) * (self.total - done)

  def message(self, done: int, extra: str = "") -> str:
    """The status line at ``done`` items, without the bar."""
    elapsed = time.perf_counter() - self.t0
    eta = self.eta(done)
    line = (f"{self.desc} {done}/{self.total or '?'}  {elapsed:,.0f}s  ETA "
            f"{'?' if eta is None else f'{eta:,.0f}s'}")
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


class ProgressReport:
  """A :class:`ProgressBar` for loops that only say how far they are, with the off-terminal policy
  in one place: on a terminal the bar is redrawn (at most every ``min_interval`` seconds, for
  loops whose items are too quick to redraw each); elsewhere one line at every 25% of a known
  total (every 30 s when the total is unknown) and one at the end (``final=True``)."""

  def __init__(self, total: Optional[int], desc: str = "", stream=None,
               min_interval: float = 0.0):
    self.bar = ProgressBar(total or 0, desc, stream=stream)
    self.min_interval = min_interval
    self.last_draw = self.last_line = time.perf_counter() - min_interval
    self.next_quarter = 0.25

  def update(self, done: int, extra: str = "", final: bool = False) -> None:
    now = time.perf_counter()
    if not final and now - self.last_draw < self.min_interval:
      return
    self.last_draw = now
    msg = self.bar.draw(done, extra)
    total, stream = self.bar.total, self.bar.stream
    if self.bar.tty:
      if final and not (total and done >= total):  # draw() ends the line only at done == total
        stream.write("\n")
        stream.flush()
      return
    frac = done / total if total else 0.0
    if final or (total and frac >= self.next_quarter) or (not total and now - self.last_line > 30):
      stream.write(msg + "\n")
      stream.flush()
      self.last_line = now
      while total and self.next_quarter <= frac:
        self.next_quarter += 0.25


def progress(items: Iterable[T], total: Optional[int] = None, desc: str = "",
             stream=None) -> Iterator[T]:
  """Yields ``items`` with a :class:`ProgressReport`."""
  if total is None:
    try:
      total = len(items)  # type: ignore[arg-type]
    except TypeError:
      total = 0
  report = ProgressReport(total, desc, stream)
  done = 0
  for item in items:
    yield item
    done += 1
    report.update(done, final=bool(total) and done == total)
