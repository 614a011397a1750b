"""``kvm-train``: train a kvm_jax model from a Python config file, resuming automatically.

  kvm-train --config=train/configs/tiny_mqar.py --workdir=runs/mqar [--config.steps=200 ...]
  kvm-train --config=train/configs/paper.py:kvm_sqrt16_120m --workdir=W --memory-report

Flags:
  --config=PATH[:ARG]     Python file whose get_config() returns a kvm_jax.train.TrainConfig;
                          with ":ARG", get_config(ARG) is called (ml_collections' convention),
                          e.g. paper.py:PRESET gives the paper recipe for any preset. Paths
                          under train/configs/ also resolve to the installed copies.
  --workdir=DIR           where checkpoints/, metrics.jsonl and tb/ go; re-running the same
                          command on the same DIR resumes from its latest checkpoint. A command
                          that changes the model, task, data, batch, seed or teacher of a run
                          with checkpoints is refused before anything is written; steps, the
                          schedule, logging, eval and checkpoint cadence, memory settings and
                          the mesh may change (announced, and kept in config.json's history and
                          metrics.jsonl). Ctrl-C or SIGTERM finishes the step, saves it and
                          exits 0 (the same command resumes); a second Ctrl-C aborts at once.
  --config.FIELD=VALUE    override any config field, nested with dots
                          (e.g. --config.model.num_layers=4, --config.mqar.num_pairs=16); a
                          mixer kind's options are model.options.KIND.FIELD (e.g.
                          --config.model.options.kvm.chunk_size=128, .swa.window=512).
                          Values as every kvm_jax CLI reads them: true/false, numbers, text,
                          none for an unset optional field; a budget as a spec (fixed:256,
                          sqrt:16@256, pow:4:0.75, sat:1024@1: --config.model.options.kvm
                          .budget=sqrt:8); a sequence as a comma list; mixers as one name,
                          one per layer, or a pattern repeated to the depth
                          (--config.model.mixers=swa,kvm).
  --config.init_from=DIR  fine-tune: start from the newest parameters of run directory DIR (a
                          kvm-train workdir, or kvm-import's conversion of the authors' released
                          checkpoints) with a fresh optimizer and data stream. DIR's model config
                          replaces the config file's, except param_dtype, compute_dtype,
                          kvm_implementation and attention_implementation. Once --workdir has
                          checkpoints, re-running resumes from them instead.
  --config.teacher=DIR    distil against the frozen model of run directory DIR (with
                          --config.distill.stage=attention|logits|finetune; see
                          train/configs/distill.py and docs/conversion.md): its parameters are
                          restored with the student's dtypes and shardings, every metrics line
                          carries kl. --config.distill.trainable=all|converted|kvm_only freezes
                          the other parameters (bitwise unchanged, no optimizer state).
  --show-config           print the resolved config, one FIELD = VALUE a line, and exit.
  --resume                require a checkpoint in --workdir and continue from it (without the
                          flag a run resumes when checkpoints exist and starts fresh otherwise).
  --distributed           start multi-process JAX first (TPU pods, multi-node GPU, or several
                          local CPU processes). Every process runs the same command; each
                          reads only its own rows of every batch; process 0 alone writes
                          config.json, metrics and the console; SIGTERM on any host makes all
                          of them save the same step and exit.
  --coordinator=HOST:PORT process 0's address, the same for every process.
  --num-processes=N       how many processes take part.
  --process-id=I          this process's index, 0 .. N-1.
                          The last three are auto-detected when omitted (TPU pods, SLURM,
                          Open MPI); on CPU (or anywhere without a cluster environment) give
                          all three. CPU processes talk through gloo collectives, set up here.
  --cpu-collectives=gloo|in-process
                          how the devices of ONE CPU process exchange data. gloo (default) is
                          what several processes use, so one process with 4 devices computes
                          bitwise what 2 processes x 2 devices compute; in-process is ~3x
                          faster but sums across devices in another order (last-bit
                          differences, which training amplifies).
  --profile-steps=A:B     write a jax.profiler trace of steps A..B (as numbered in
                          metrics.jsonl) to WORKDIR/profile on process 0; open it with
                          TensorBoard's profile plugin or Perfetto.
  --compilation-cache=DIR|off
                          JAX's persistent compilation cache (default: $KVM_JAX_COMPILATION_CACHE,
                          else JAX's own JAX_COMPILATION_CACHE_DIR, else
                          ~/.cache/kvm_jax/jax-compilation-cache): a second start or a resume of
                          the same run loads the compiled step programs instead of compiling
                          them again; off compiles everything anew.
  --memory-report         compile the configured train step for the configured shapes from
                          abstract inputs (no data read, no weights allocated): the trainer's own
                          program (kernel context, shardings, donation, accumulation, remat,
                          loss slices). Prints per chip: how each parameter role is sharded
                          (partition spec, bytes whole and per chip), XLA's FLOPs beside the
                          trainer's count, arguments, temporaries, outputs, and whether it fits
                          the chip; then exits. The last line is "per-device peak: X.XX GiB
                          (arguments ..., temporaries ..., outputs ...)".
  --topology=NAME         with --memory-report: compile for that many chips of that kind instead
                          of this machine's devices, from any host (pip install
                          'kvm_jax[compile]'): TPU topologies as JAX spells them (v5e:4x4,
                          v5p:2x2x1, v6e:2x2, v5p:4x4x4), GPUs as CHIP:HOSTSxDEVICES (h100:1x8,
                          h200:2x8). A mesh size of -1 takes the topology's remaining chips. A
                          step that does not fit is compiled again with the settings that trade
                          compute for memory (remat, loss slices, fsdp, accumulation) and the
                          report lists those that fit.
  --save-compiled=FILE    with --memory-report: also write the compiled step to FILE
                          (jax.experimental.serialize_executable); see docs/hardware.md for
                          what a run may do with it.
Memory at long sequences: --config.remat=block keeps only each block's inputs for the backward
pass, --config.grad_accum_steps=N runs the batch as N micro-batches, --config.loss_slice_len=S
computes the LM head and loss S tokens at a time; --memory-report shows what each one buys.
A non-finite loss or gradient stops the run (--config.on_nonfinite=skip drops the update
instead); --config.grad_clip_norm clips the global gradient norm, which is logged as grad_norm.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from pathlib import Path

from kvm_jax.util import compilation_cache
from kvm_jax.config.mixers import KindOptions
from kvm_jax.runs import launch

# JAX, the configs and the trainer are imported once the flags are parsed: --help and a bad flag
# answer without them.


INSTALLED_CONFIGS = Path(__file__).resolve().parent / "configs"


def config_file(path: str) -> Path:
  """``path`` itself, or for ``train/configs/NAME.py`` that is not here, the installed copy."""
  p = Path(path)
  if p.exists():
    return p
  installed = INSTALLED_CONFIGS / p.name
  if p.parent.as_posix().endswith("train/configs") and installed.exists():
    return installed
  raise SystemExit(f"--config: {path!r} does not exist.")


def load_config(spec: str):
  """The ``TrainConfig`` of ``PATH`` (``get_config()``) or ``PATH:ARG`` (``get_config(ARG)``)."""
  path, arg = spec, None
  if ":" in spec and not Path(spec).exists():
    path, arg = spec.rsplit(":", 1)
  p = config_file(path)
  module_spec = importlib.util.spec_from_file_location(f"_kvm_config_{p.stem}", p)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise SystemExit(f"--config: {path!r} defines no get_config().")
  try:
    return module.get_config() if arg is None else module.get_config(arg)
  except TypeError as e:
    if arg is None:
      raise SystemExit(f"--config: {path!r} needs an argument ({e}); pass --config={path}:ARG."
                       ) from None
    raise SystemExit(f"--config: {path!r} takes no argument, got {arg!r} ({e}).") from None
  except ValueError as e:
    raise SystemExit(f"--config={spec}: {e}") from None


def apply_override(cfg, dotted: str, text: str):
  """Returns ``cfg`` with field ``dotted`` set from its string form (frozen dataclasses replaced;
  in the mixers' options table, ``options.KIND.FIELD`` replaces one kind's options). A field or
  value that does not fit exits with a message naming the flag."""
  try:
    return _override(cfg, dotted, text)
  except ValueError as e:
    raise SystemExit(f"--config.{dotted}={text}: {e}") from None


def _override(cfg, dotted: str, text: str):
  from kvm_jax.config import io as config_io
  head, _, rest = dotted.partition(".")
  if isinstance(cfg, KindOptions):
    if not rest:
      raise ValueError(f"give a field of the {head!r} options, e.g. options.{head}.FIELD=VALUE.")
    return cfg.set(head, _override(cfg.resolve(head), rest, text))
  if not dataclasses.is_dataclass(cfg) or head not in {f.name for f in dataclasses.fields(cfg)}:
    names = sorted(f.name for f in dataclasses.fields(cfg)) if dataclasses.is_dataclass(cfg) else []
    raise ValueError(f"unknown config field {head!r}; known fields: {', '.join(names)}.")
  old = getattr(cfg, head)
  field = next(f for f in dataclasses.fields(cfg) if f.name == head)
  new = _override(old, rest, text) if rest else config_io.parse_field(field, old, text)
  return dataclasses.replace(cfg, **{head: new})


def build_parser() -> argparse.ArgumentParser:
  """kvm-train's flags (module docstring); ``--config.FIELD=VALUE`` overrides are what
  ``parse_known_args`` leaves over."""
  parser = argparse.ArgumentParser(prog="kvm-train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", required=True,
                      help="Python config file (get_config()), or FILE:ARG (get_config(ARG)).")
  parser.add_argument("--workdir", required=True, help="run directory; resumes if it has "
                      "checkpoints.")
  parser.add_argument("--show-config", action="store_true",
                      help="print the resolved config, one FIELD = VALUE a line, and exit.")
  parser.add_argument("--resume", action="store_true",
                      help="fail unless --workdir holds a checkpoint to continue from.")
  launch.add_flags(parser)
  parser.add_argument("--profile-steps", metavar="A:B",
                      help="write a jax.profiler trace of steps A..B to WORKDIR/profile "
                      "(process 0).")
  parser.add_argument("--memory-report", action="store_true",
                      help="compile the trainer's step from abstract inputs, print its sharding, "
                      "FLOPs and memory per chip and whether it fits, and exit (reads no data, "
                      "allocates no weights).")
  parser.add_argument("--topology", metavar="NAME",
                      help="with --memory-report: compile for a TPU topology (v5e:4x4, "
                      "v5p:2x2x1) or GPUs (h100:1x8) instead of this machine; when the step does "
                      "not fit, the settings that make it fit are tried and listed.")
  parser.add_argument("--save-compiled", metavar="FILE",
                      help="with --memory-report: write the compiled step to FILE.")
  compilation_cache.add_flag(parser)
  return parser


def memory_report_command(cfg, topology, save_compiled) -> int:
  """``--memory-report [--topology=NAME] [--save-compiled=FILE]``: prints the report and, when the
  step does not fit the chip, the settings that do (each compiled); exit status 0 either way (the
  report is the answer), 1 when nothing tried fits."""
  from kvm_jax.train import memory
  try:
    report = memory.compile_step(cfg, topology, save_compiled)
  except (ValueError, RuntimeError) as e:
    raise SystemExit(f"--memory-report: {e}") from None
  print("\n".join(report.lines(cfg)), flush=True)
  if report.fits is not False or topology is None:
    return 0
  print("trying the settings that trade compute or communication for memory:", flush=True)
  found = memory.fitting_settings(
      cfg, topology, progress=lambda text: print(f"  compiling with {text} ...", flush=True))
  for text, fitted in found:
    print(f"fits with {text}: {fitted.peak / memory.GIB:.2f} of "
          f"{fitted.memory / memory.GIB:.2f} GiB per chip")
  if not found:
    print("nothing tried fits: a larger topology (more chips to shard over) or a smaller batch "
          "per chip is needed.")
  return 0 if found else 1


def main(argv=None) -> int:
  args, rest = build_parser().parse_known_args(argv)
  launch.check_flags(args)
  for flag in ("topology", "save_compiled"):
    if getattr(args, flag) and not args.memory_report:
      raise SystemExit(f"--{flag.replace('_', '-')} goes with --memory-report (it compiles the "
                       "step for that report); add --memory-report.")
  compilation_cache.enable(args.compilation_cache)  # before anything compiles
  import jax
  from etils import epath
  from kvm_jax.config import io as config_io
  from kvm_jax.train import memory
  from kvm_jax.train.hooks import NonFiniteError, parse_profile_steps
  from kvm_jax.train.loop import train
  from kvm_jax.train.start import with_init_model, with_teacher_task
  launch.load_plugins(args)
  profile_steps = None
  if args.profile_steps:
    try:
      profile_steps = parse_profile_steps(args.profile_steps)
    except ValueError as e:
      raise SystemExit(f"--profile-steps: {e}") from None
  if args.memory_report:
    memory.prefer_memory_order()  # before anything starts JAX's backend
  if args.distributed or not (args.memory_report or args.show_config):
    launch.start(args)  # before anything starts JAX's backends
  cfg = load_config(args.config)
  for item in rest:
    if not item.startswith("--config.") or "=" not in item:
      raise SystemExit(f"unrecognized argument {item!r}; overrides look like "
                       "--config.field=value.")
    key, value = item[len("--config."):].split("=", 1)
    cfg = apply_override(cfg, key, value)
  try:
    cfg = with_teacher_task(with_init_model(cfg, args.workdir))
    cfg.validate()
  except ValueError as e:
    raise SystemExit(f"invalid config: {e}") from None
  if args.show_config:  # one field a line, each as --config.FIELD=VALUE would set it
    print("\n".join(f"{field} = {config_io.value_text(value)}"
                    for field, value in config_io.flat_fields(cfg).items()))
    return 0
  if args.memory_report:
    return memory_report_command(cfg, args.topology, args.save_compiled)
  if args.resume:
    ckpt_dir = epath.Path(args.workdir) / "checkpoints"
    if not ckpt_dir.is_dir() or not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
      raise SystemExit(f"--resume: no checkpoint in {ckpt_dir}; drop --resume to start a new run.")
  if cfg.steps < (profile_steps or (0, 0))[1]:
    raise SystemExit(f"--profile-steps={args.profile_steps} ends after the last step "
                     f"({cfg.steps}).")
  try:
    result = train(cfg, args.workdir, profile_steps=profile_steps)
  except NonFiniteError as e:
    print(f"kvm-train: {e}", file=sys.stderr)
    return 1
  except KeyboardInterrupt:  # a second Ctrl-C: the first one's save did not wait for it
    print(f"kvm-train: aborted; {args.workdir} keeps its newest finished checkpoint, from which "
          "the same command resumes.", file=sys.stderr)
    return 130
  except ValueError as e:  # a config that does not fit the devices or processes
    raise SystemExit(f"kvm-train: {e}") from None
  if jax.process_index() == 0:
    summary = {k: v for k, v in result.items() if isinstance(v, (int, float))}
    print("final:", ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                              for k, v in summary.items()))
  return 0


if __name__ == "__main__":
  sys.exit(main())
