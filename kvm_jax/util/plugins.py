"""``--plugin``: code a command imports before it reads its arguments' names, e.g. a module that
registers a mixer kind with :func:`kvm_jax.nn.register_mixer` (``kvm-train``, ``kvm-eval``,
``kvm-check``, ``kvm-bench``). Kept apart from :mod:`kvm_jax.runs.launch` so that commands run
where the training stack (grain, orbax) is absent can take it too."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys


def add_plugin_flag(parser: argparse.ArgumentParser) -> None:
  """``--plugin`` alone (commands that start no multi-process JAX: kvm-check, kvm-bench)."""
  parser.add_argument("--plugin", action="append", default=[], metavar="MODULE_OR_FILE",
                      help="import this Python module (dotted name) or .py file first, e.g. one "
                      "that registers a mixer kind with kvm_jax.nn.register_mixer, so that run "
                      "directories, configs and command-line names using that kind load "
                      "(repeatable).")


def load_plugins(args: argparse.Namespace) -> None:
  """Imports every ``--plugin`` (a dotted module name or a ``.py`` file), in order."""
  for spec in args.plugin:
    if spec.endswith(".py"):
      if not os.path.isfile(spec):
        raise SystemExit(f"--plugin {spec}: no such file.")
      name = "kvm_plugin_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(spec))[0])
      module_spec = importlib.util.spec_from_file_location(name, spec)
      module = importlib.util.module_from_spec(module_spec)
      sys.modules[name] = module
      module_spec.loader.exec_module(module)
    else:
      try:
        importlib.import_module(spec)
      except ImportError as e:
        raise SystemExit(f"--plugin {spec}: {e}") from None
