"""What ``kvm-train`` and ``kvm-eval`` share before they start: the ``--distributed`` flags and
``jax.distributed.initialize`` with them, and ``--plugin`` (code that registers mixer kinds).

Every process of a job runs the same command. On TPU pods, SLURM and Open MPI JAX finds the
coordinator, process count and index itself; elsewhere (several local CPU processes, hand-started
GPU nodes) ``--coordinator``, ``--num-processes`` and ``--process-id`` give them.

CPU devices exchange data through collectives: gloo when several processes take part, and by
default XLA's in-process implementation when one process holds them all. The two sum across
devices in different orders, so their results differ in the last bits, and a training run
amplifies that (3% in the loss after 400 steps of ``tiny_mqar``). ``--cpu-collectives=gloo`` (the
default of ``kvm-train``) gives a single multi-device CPU process the gloo collectives too, through
a one-process coordination service on a free local port, so one process and several compute
bitwise the same numbers; ``in-process`` is about 3x faster per step and otherwise equivalent.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys

from kvm_jax.util.plugins import add_plugin_flag, load_plugins  # noqa: F401  (kvm-train's, kvm-eval's)


def add_flags(parser: argparse.ArgumentParser) -> None:
  """``--plugin``, ``--distributed``, ``--coordinator``, ``--num-processes``, ``--process-id``
  and ``--cpu-collectives``."""
  add_plugin_flag(parser)
  parser.add_argument("--distributed", action="store_true",
                      help="start multi-process JAX (jax.distributed.initialize) first.")
  parser.add_argument("--coordinator", metavar="HOST:PORT",
                      help="with --distributed: process 0's address (auto-detected on pods).")
  parser.add_argument("--num-processes", type=int, metavar="N",
                      help="with --distributed: number of processes (auto-detected on pods).")
  parser.add_argument("--process-id", type=int, metavar="I",
                      help="with --distributed: this process's index 0..N-1 (auto-detected).")
  parser.add_argument("--cpu-collectives", choices=("gloo", "in-process"), default="gloo",
                      help="how the devices of a single CPU process exchange data: gloo (default; "
                      "the same arithmetic as several processes, bitwise) or in-process "
                      "(faster; last-bit differences from a multi-process run). Several "
                      "processes always use gloo.")


def check_flags(args: argparse.Namespace) -> None:
  """A clear error for launch flags given without ``--distributed`` (nothing is started)."""
  given = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
           "--process-id": args.process_id}
  if not args.distributed and any(v is not None for v in given.values()):
    flags = ", ".join(k for k, v in given.items() if v is not None)
    raise SystemExit(f"{flags} only apply with --distributed; add --distributed.")


def start(args: argparse.Namespace) -> None:
  """Starts multi-process JAX when ``args.distributed``, else gloo collectives for a single
  multi-device CPU process when ``args.cpu_collectives == "gloo"``; must run before anything
  uses JAX's backends."""
  if args.distributed:
    start_distributed(args.coordinator, args.num_processes, args.process_id)
  elif args.cpu_collectives == "gloo" and requested_cpu_devices() > 1:
    start_local_gloo()


def requested_cpu_devices() -> int:
  """CPU devices this process will have when its platform is the CPU (1 otherwise): read from
  ``JAX_PLATFORMS``, ``XLA_FLAGS`` (``--xla_force_host_platform_device_count``) and
  ``jax_num_cpu_devices`` before any backend starts."""
  import jax  # on first use: parsing and checking the flags needs no JAX
  platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
  if platforms and platforms.split(",")[0].strip() != "cpu":
    return 1
  count = max(int(jax.config.jax_num_cpu_devices), 1)
  forced = re.search(r"--xla_force_host_platform_device_count=(\d+)",
                     os.environ.get("XLA_FLAGS", ""))
  return max(count, int(forced.group(1))) if forced else count


def free_local_port() -> int:
  """A TCP port on 127.0.0.1 that is free now (for a local coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_local_gloo() -> None:
  """A one-process ``jax.distributed`` job on a free local port, so that this process's CPU
  devices use gloo collectives, like a multi-process run. Does nothing (with a note) when JAX's
  backends are already running, e.g. when called from a notebook after other JAX work."""
  import jax  # on first use: parsing and checking the flags needs no JAX
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  for _ in range(3):  # another program may take the free port before the service binds it
    try:
      jax.distributed.initialize(coordinator_address=f"127.0.0.1:{free_local_port()}",
                                 num_processes=1, process_id=0)
      return
    except RuntimeError as e:
      error = e
      if "before any JAX" in str(e) or "only be called once" in str(e):
        break
  print(f"note: CPU devices keep XLA's in-process collectives ({error}); results can differ "
        "in the last bits from a multi-process run.", file=sys.stderr)


def start_distributed(coordinator: str | None, num_processes: int | None,
                      process_id: int | None) -> None:
  """``jax.distributed.initialize`` with the launch flags, checked first; gloo collectives so that
  CPU processes can run the same program (GPUs and TPUs use their own)."""
  import jax  # on first use: parsing and checking the flags needs no JAX
  given = {"--coordinator": coordinator, "--num-processes": num_processes,
           "--process-id": process_id}
  if coordinator is not None:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
      raise SystemExit(f"--coordinator={coordinator!r} must look like HOST:PORT "
                       "(e.g. 10.0.0.2:1234 or 127.0.0.1:29500).")
  if num_processes is not None and num_processes < 1:
    raise SystemExit(f"--num-processes={num_processes} must be >= 1.")
  if process_id is not None and (process_id < 0 or (num_processes is not None
                                                     and process_id >= num_processes)):
    raise SystemExit(f"--process-id={process_id} must lie in 0 .. --num-processes - 1.")
  if None in given.values() and any(v is not None for v in given.values()):
    missing = [k for k, v in given.items() if v is None]
    print(f"note: {', '.join(missing)} not given: JAX auto-detects them (TPU pod, SLURM, "
          "Open MPI) or fails to connect.", file=sys.stderr)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                               process_id=process_id)
  except (RuntimeError, ValueError) as e:
    raise SystemExit(f"--distributed: could not start multi-process JAX ({e}). Outside a TPU pod "
                     "or a SLURM/Open MPI job give --coordinator, --num-processes and "
                     "--process-id.") from None
