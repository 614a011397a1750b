"""``kvm-train``: train a kvm_jax model from a Python config file, resuming automatically.

  kvm-train --config=train/configs/tiny_mqar.py --workdir=runs/mqar [--config.steps=200 ...]

Flags:
  --config=PATH           Python file whose get_config() returns a kvm_jax.train.TrainConfig.
  --workdir=DIR           where checkpoints/, metrics.jsonl and tb/ go; re-running the same
                          command on the same DIR resumes from its latest checkpoint.
  --config.FIELD=VALUE    override any config field, nested with dots
                          (e.g. --config.model.num_layers=4, --config.mqar.num_pairs=16).
  --show-config           print the resolved config and exit.
  --resume                require a checkpoint in --workdir and continue from it (without the
                          flag a run resumes when checkpoints exist and starts fresh otherwise).
  --distributed           call jax.distributed.initialize() first (multi-host pods / clusters;
                          each host then reads its own slice of every batch).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax

from kvm_jax.train.loop import train


def load_config(path: str):
  p = Path(path)
  if not p.exists():
    raise SystemExit(f"--config: {path!r} does not exist.")
  spec = importlib.util.spec_from_file_location(f"_kvm_config_{p.stem}", p)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise SystemExit(f"--config: {path!r} defines no get_config().")
  return module.get_config()


def _coerce(old, text: str):
  if isinstance(old, bool):
    if text.lower() in ("1", "true", "yes"):
      return True
    if text.lower() in ("0", "false", "no"):
      return False
    raise ValueError(f"expected a boolean, got {text!r}")
  if isinstance(old, int):
    return int(text)
  if isinstance(old, float):
    return float(text)
  if isinstance(old, str):
    return text
  return ast.literal_eval(text)


def apply_override(cfg, dotted: str, text: str):
  """Returns ``cfg`` with field ``dotted`` set from its string form (frozen dataclasses replaced)."""
  head, _, rest = dotted.partition(".")
  if not dataclasses.is_dataclass(cfg) or head not in {f.name for f in dataclasses.fields(cfg)}:
    names = sorted(f.name for f in dataclasses.fields(cfg)) if dataclasses.is_dataclass(cfg) else []
    raise SystemExit(f"unknown config field {head!r}; known fields: {', '.join(names)}.")
  old = getattr(cfg, head)
  try:
    new = apply_override(old, rest, text) if rest else _coerce(old, text)
  except ValueError as e:
    raise SystemExit(f"--config.{dotted}={text}: {e}") from None
  return dataclasses.replace(cfg, **{head: new})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="kvm-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True, help="Python config file (get_config()).")
  parser.add_argument("--workdir", required=True, help="run directory; resumes if it has "
                      "checkpoints.")
  parser.add_argument("--show-config", action="store_true", help="print the config and exit.")
  parser.add_argument("--resume", action="store_true",
                      help="fail unless --workdir holds a checkpoint to continue from.")
  parser.add_argument("--distributed", action="store_true",
                      help="initialize multi-host JAX (jax.distributed.initialize()) first.")
  args, rest = parser.parse_known_args(argv)
  if args.distributed:
    jax.distributed.initialize()
  cfg = load_config(args.config)
  for item in rest:
    if not item.startswith("--config.") or "=" not in item:
      raise SystemExit(f"unrecognized argument {item!r}; overrides look like "
                       "--config.field=value.")
    key, value = item[len("--config."):].split("=", 1)
    cfg = apply_override(cfg, key, value)
  try:
    cfg.validate()
  except ValueError as e:
    raise SystemExit(f"invalid config: {e}") from None
  if args.show_config:
    print(cfg)
    return 0
  if args.resume:
    ckpt_dir = Path(args.workdir) / "checkpoints"
    if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
      raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}; drop --resume to start a new run.")
  result = train(cfg, args.workdir)
  summary = {k: v for k, v in result.items() if isinstance(v, (int, float))}
  print("final:", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in summary.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
