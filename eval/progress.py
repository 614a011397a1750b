"""A dependency-free progress bar for evaluation loops (a bar on a terminal, sparse lines in logs)."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: Optional[int] = None, desc: str = "",
             stream=None) -> Iterator[T]:
  """Yields ``items``, drawing ``desc [#####.....] i/total  elapsed  ETA`` on stderr.

  On a terminal the bar is redrawn in place; otherwise one line is written at every 25% so that
  CI logs show progress without thousands of lines.
  """
  stream = stream or sys.stderr
  if total is None:
    try:
      total = len(items)  # type: ignore[arg-type]
    except TypeError:
      total = 0
  tty = hasattr(stream, "isatty") and stream.isatty()
  start, next_report = time.perf_counter(), 0.25
  done = 0
  for item in items:
    yield item
    done += 1
    elapsed = time.perf_counter() - start
    eta = elapsed / done * (total - done) if total else 0.0
    frac = done / total if total else 0.0
    msg = f"{desc} {done}/{total or '?'}  {elapsed:,.0f}s  ETA {eta:,.0f}s"
    if tty:
      filled = int(20 * frac)
      stream.write("\r" + msg.replace(" ", " [" + "#" * filled + "." * (20 - filled) + "] ", 1)
                   if desc else "\r" + msg)
      if done == total:
        stream.write("\n")
      stream.flush()
    elif total and (frac >= next_report or done == total):
      stream.write(msg + "\n")
      stream.flush()
      while next_report <= frac:
        next_report += 0.25
