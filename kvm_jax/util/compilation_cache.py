"""JAX's persistent compilation cache, on by default for every kvm_jax command.

XLA compiles a model's step programs anew in every process: tens of seconds on a CPU, minutes for
a large model on an accelerator. With the cache on, a second start of ``kvm-serve`` or a resumed
``kvm-train`` loads the executables the first one compiled instead. A cache entry is keyed by the
program, the compiler's flags and version and the device kind, so a hit runs the very executable
the first process compiled (bitwise the same results).

Where it lives, first match wins:

1. the command's ``--compilation-cache DIR`` flag (``off`` turns it off);
2. the environment variable ``KVM_JAX_COMPILATION_CACHE`` (a directory, or ``off``);
3. a cache directory JAX was already given (``JAX_COMPILATION_CACHE_DIR`` or
   ``jax.config.update("jax_compilation_cache_dir", ...)``);
4. ``$XDG_CACHE_HOME/kvm_jax/jax-compilation-cache`` (``~/.cache/...`` without XDG_CACHE_HOME).

This module imports nothing heavy at import time: the commands' ``--help`` stays fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ENV = "KVM_JAX_COMPILATION_CACHE"
OFF = frozenset({"off", "none", "0", "false", "no"})
FLAG_HELP = ("JAX's persistent compilation cache: a directory, or 'off' (default: "
             f"${ENV}, else JAX's own JAX_COMPILATION_CACHE_DIR, else "
             "~/.cache/kvm_jax/jax-compilation-cache): a second start of the same programs "
             "loads them instead of compiling")


def default_dir(environ=None) -> Path:
  """The cache directory used when nothing else names one (``environ``: default ``os.environ``)."""
  environ = os.environ if environ is None else environ
  root = environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
  return Path(root) / "kvm_jax" / "jax-compilation-cache"


def is_off(setting: Optional[str]) -> bool:
  return setting is not None and setting.strip().lower() in OFF


def choose_dir(flag: Optional[str] = None, environ=None,
               jax_dir: Optional[str] = None) -> Optional[Path]:
  """The cache directory the settings name (module docstring), None when the cache is off.

  ``flag``: the command's ``--compilation-cache`` value (None: not given); ``environ``: the
  environment (default ``os.environ``); ``jax_dir``: the directory JAX's config already holds."""
  environ = os.environ if environ is None else environ
  for setting in (flag, environ.get(ENV)):
    if setting is None or not setting.strip():
      continue
    return None if is_off(setting) else Path(setting).expanduser()
  if jax_dir:
    return Path(jax_dir)
  return default_dir(environ)


def enable(flag: Optional[str] = None) -> Optional[Path]:
  """Turns the persistent cache on in this process (before its first compile) for the directory
  :func:`choose_dir` picks, caching every program however quickly it compiled; returns the
  directory, or None when the settings turn it off (then JAX's own settings stay as they are)."""
  import jax

  current = jax.config.jax_compilation_cache_dir
  where = choose_dir(flag, jax_dir=current)
  if where is None:
    return None
  where.mkdir(parents=True, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", str(where))
  # JAX skips programs that compile in under a second by default; a CLI's many small programs
  # (the engine's steps on a tiny model, every eval program) add up to most of a start.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return where


def add_flag(parser) -> None:
  """Adds ``--compilation-cache DIR|off`` to an argparse parser (read by :func:`enable`)."""
  parser.add_argument("--compilation-cache", metavar="DIR|off", default=None, help=FLAG_HELP)
