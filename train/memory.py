"""``kvm-train --memory-report [--topology=NAME]``: the compiled train step per chip, without running it.

The step is compiled for the configured model, batch, sequence length, mesh, remat, accumulation
and loss slicing, from abstract inputs (``jax.ShapeDtypeStruct`` with shardings): no weight is
allocated and no data is read, so a paper-sized step is measured on a laptop's CPU. It is the
trainer's own program: the same step function, shardings, donation and kernel context
(:func:`kvm_jax.train.step.kernel_context`, inside which Pallas kernels run per shard).

Where it compiles: this machine's devices by default, or with ``topology`` (``v5e:4x4``,
``v5p:2x2x1``, ``h100:1x8``; :func:`kvm_jax.config.target.parse_target`) that chip's compiler for
that many chips, from a CPU-only host (libtpu for TPUs, the CUDA compile plugins for GPUs: the
``[compile]`` extra). Every backend decision (kernels, tiles, layouts, attention implementation)
is then the chip's.

XLA's buffer assignment says what one chip holds at the step's peak:

* **arguments**: parameters, optimizer state (float32 moments and masters) and the batch;
* **temporaries**: everything the step allocates while it runs (activations kept for the
  backward pass, gradients, logits, scratch);
* **outputs**: the new parameters and optimizer state, less what is written in place into the
  donated arguments (aliased).

The peak is ``arguments + temporaries + outputs - aliased``, compared with the chip's memory:
XLA:TPU refuses a program that does not fit (reported as such, in its words); XLA:GPU compiles
anything, so the comparison is the report's. When the step does not fit, :func:`fitting_settings`
compiles the step again with the settings that trade compute or communication for memory and
says which fit.

Beside memory, the report shows how each parameter role is sharded (partition spec and bytes per
chip) and the step's FLOPs per chip as XLA counts them (``cost_analysis``) beside the trainer's
own count (:func:`kvm_jax.train.accounting.step_flops`).

A CPU figure is an estimate of an accelerator's: XLA:CPU computes bf16 matmuls through float32
copies, and the report compiles with its parallelism-first scheduler off
(:data:`CPU_MEMORY_FLAG`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.config.target import Target, compile_target, compiler_reason, parse_target
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.model import LM
from kvm_jax.nn.roles import is_kvm_only, parameter_role
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train import distill, sharding
from kvm_jax.train.accounting import step_flops
from kvm_jax.train.adamc import PartlyFrozen
from kvm_jax.train.objectives import FrozenParameters, LMObjective
from kvm_jax.train.start import make_optimizer
from kvm_jax.train.step import kernel_context, make_train_step
from kvm_jax.util.hlo_flops import hlo_flops

GIB = 1024 ** 3

#: XLA:CPU's default instruction order is chosen for thread parallelism (breadth first) and, at
#: these shapes, keeps ~25-50% more temporaries alive than its depth-first, memory-minimizing order;
#: accelerator compilers schedule under a memory limit. A memory report on CPU therefore compiles
#: with the breadth-first scheduler off, so that a CPU figure estimates an accelerator's.
CPU_MEMORY_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def prefer_memory_order() -> None:
  """Adds :data:`CPU_MEMORY_FLAG` to ``XLA_FLAGS`` (it affects XLA:CPU only). JAX reads the flags
  once, when its backend starts: call this before anything runs on a device, as
  ``kvm-train --memory-report`` does first thing."""
  flags = os.environ.get("XLA_FLAGS", "")
  if CPU_MEMORY_FLAG.split("=")[0] not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {CPU_MEMORY_FLAG}".strip()


# ----------------------------------------------------------------------------------------------
# The mesh of a topology
# ----------------------------------------------------------------------------------------------


def mesh_sizes(cfg: TrainConfig, chips: int, where: str) -> tuple[int, int, int]:
  """``(data, fsdp, tensor)`` of ``cfg``'s mesh on ``chips`` chips, one size -1 taking the rest;
  a clear error (naming ``where``, e.g. "topology v5e:4x4") unless the product is ``chips``."""
  sizes = (cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  given = " x ".join(f"{a}={s}" for a, s in zip(sharding.AXES, sizes))
  if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh {given}: sizes must be positive, and at most one -1 (the rest of the "
                     f"chips); {where} has {chips} chips.")
  known = math.prod(s for s in sizes if s != -1)
  if chips % known or (-1 not in sizes and known != chips):
    raise ValueError(f"mesh {given} does not fit {where}, which has {chips} chips: choose sizes "
                     f"whose product is {chips}, or set one of them to -1 (e.g. "
                     f"--config.mesh_data=-1) to take the rest.")
  return tuple(chips // known if s == -1 else s for s in sizes)


def train_mesh(cfg: TrainConfig, target: Target):
  """The trainer's ``data x fsdp x tensor`` mesh over ``target``'s devices (checked first)."""
  devices = target.devices()
  sizes = mesh_sizes(cfg, len(devices), f"{'this machine' if target.local else 'topology'} "
                     f"{target.name}")
  return sharding.make_mesh(*sizes, devices=devices)


# ----------------------------------------------------------------------------------------------
# The trainer's step, from shapes alone
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AbstractStep:
  """What compiling the trainer's step needs, with no array allocated: the jitted step, its
  abstract arguments (``ShapeDtypeStruct`` leaves carrying the trainer's shardings), the mesh
  and the abstract parameters (for the sharding table and the FLOP count)."""

  step: Callable
  args: tuple
  mesh: object
  params: object
  opt_state: object
  batch: dict


def abstract_train_state(cfg: TrainConfig, mesh, trainable=None):
  """(graphdef, optimizer, abstract params, abstract optimizer state, shardings) with no array
  allocated: ``ShapeDtypeStruct`` leaves carrying the trainer's shardings
  (:func:`kvm_jax.train.start.setup` without the arrays)."""
  model = nnx.eval_shape(lambda: LM(cfg.model, rngs=nnx.Rngs(cfg.seed)))
  graphdef, params = nnx.split(model)
  optimizer = make_optimizer(cfg, params, trainable)
  p_sh = sharding.param_shardings(params, mesh)
  opt_shape = jax.eval_shape(optimizer.init, params)
  # A partly frozen optimizer's state is shaped like the list of trainable leaves.
  like = optimizer.pick(p_sh) if isinstance(optimizer, PartlyFrozen) else p_sh
  o_sh = sharding.like_params_shardings(opt_shape, like, mesh)
  with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
  params = jax.tree_util.tree_map(with_sharding, params, p_sh)
  opt_state = jax.tree_util.tree_map(with_sharding, opt_shape, o_sh)
  return graphdef, optimizer, params, opt_state, (p_sh, o_sh, sharding.batch_sharding(mesh))


def abstract_step(cfg: TrainConfig, mesh) -> AbstractStep:
  """The trainer's step for ``cfg`` on ``mesh`` and its abstract arguments: the objective the
  training loop builds (the LM loss; frozen parameters' gradients zeroed when
  ``cfg.distill.trainable`` freezes some), the same shardings and donation."""
  if cfg.teacher:
    raise ValueError("--memory-report compiles runs without a teacher; for a distillation stage, "
                     "report the student's fine-tuning shape (e.g. "
                     "train/configs/pretrained.py:MODEL,kvm) or set --config.teacher=''.")
  sharding.check_batch(cfg.batch_size, mesh, cfg.grad_accum_steps)
  graphdef, optimizer, params, opt_state, shardings = abstract_train_state(
      cfg, mesh, distill.trainable_predicate(cfg))
  objective = LMObjective.of(cfg)
  if isinstance(optimizer, PartlyFrozen):
    objective = FrozenParameters(objective, optimizer.mask_like(params))
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.sequence_length), jnp.int32,
                                sharding=shardings[2])
  batch = {"inputs": tokens, "labels": tokens}
  if cfg.packing == "documents":  # packed rows also carry their documents' segment ids
    batch["segment_ids"] = tokens
  halted = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, PartitionSpec()))
  step = make_train_step(graphdef, optimizer, shardings, cfg, objective)
  return AbstractStep(step, (params, opt_state, batch, halted), mesh, params, opt_state, batch)


# ----------------------------------------------------------------------------------------------
# Sharding you can see
# ----------------------------------------------------------------------------------------------

#: The roles the sharding table groups parameters into, in the order it prints them.
ROLES = ("embedding", "attention", "kvm state", "mlp", "norms", "head")


def table_role(path, cfg) -> str:
  """A parameter's row of the sharding table: ``embedding``, ``attention`` (a mixer's
  projections), ``kvm state`` (a KVM layer's own parameters: LN_s, W_g, temperatures), ``mlp``,
  ``norms`` (block, embedding and final norms) or ``head``."""
  role = parameter_role(path)
  if role.part == "token_embedding":
    return "embedding"
  if role.part == "head":
    return "head"
  if role.part == "mlp":
    return "mlp"
  if role.part == "mixer":
    return "kvm state" if is_kvm_only(role, cfg.model) else "attention"
  return "norms"


def chip_bytes(x) -> int:
  """Bytes of one chip's shard of ``x`` (a ``ShapeDtypeStruct`` with a sharding)."""
  shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
  return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def whole_bytes(x) -> int:
  return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def spec_text(x) -> str:
  """A leaf's partition spec as ``P(fsdp, tensor)``; ``P()`` replicated."""
  spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else PartitionSpec()
  parts = ["None" if p is None else "+".join(p) if isinstance(p, tuple) else str(p)
           for p in spec]
  while parts and parts[-1] == "None":
    parts.pop()
  return f"P({', '.join(parts)})"


@dataclasses.dataclass(frozen=True)
class ShardingRow:
  """One line of the sharding table: a role (or "optimizer state", "batch"), the partition specs
  its leaves carry (most bytes first), and its bytes whole and per chip."""

  role: str
  specs: tuple
  whole: int
  per_chip: int


def sharding_rows(cfg: TrainConfig, params, opt_state, batch: dict) -> tuple[ShardingRow, ...]:
  """The sharding table of an :class:`AbstractStep`'s arguments."""
  by_role = collections.defaultdict(lambda: [collections.Counter(), 0, 0])
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    row = by_role[table_role(path_names(path), cfg)]
    row[0][spec_text(x)] += whole_bytes(x)
    row[1] += whole_bytes(x)
    row[2] += chip_bytes(x)
  rows = [ShardingRow(role, tuple(s for s, _ in by_role[role][0].most_common()),
                      by_role[role][1], by_role[role][2]) for role in ROLES if role in by_role]
  for name, tree in (("optimizer state", opt_state), ("batch", batch)):
    leaves = jax.tree_util.tree_leaves(tree)
    specs = collections.Counter()
    for x in leaves:
      specs[spec_text(x)] += whole_bytes(x)
    rows.append(ShardingRow(name, tuple(s for s, _ in specs.most_common()),
                            sum(map(whole_bytes, leaves)), sum(map(chip_bytes, leaves))))
  return tuple(rows)


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """One compiled (or refused) train step, per chip (see the module docstring).

  ``error`` is the compiler's refusal in its own words (a step that does not fit a TPU), else
  "". ``memory``: the chip's bytes (0: unknown, no verdict). ``xla_flops``: the compiled step's
  matmul FLOPs per chip, every loop counted as often as it runs
  (:func:`kvm_jax.util.hlo_flops.hlo_flops`; -1: not compiled); ``cost_analysis_flops``: XLA's
  own ``cost_analysis()`` figure, which counts each loop body once; ``opaque_calls``: custom
  calls (Pallas kernels) whose FLOPs neither count sees; ``unknown_loops``: loops whose trip
  count the HLO does not say (bounds that depend on an outer loop), counted once; ``model_flops``: the trainer's count per
  chip for the same step (:func:`kvm_jax.train.accounting.step_flops`, recomputation included)."""

  arguments: int
  temporaries: int
  outputs: int
  aliased: int
  code: int
  devices: int
  platform: str             # "cpu", "gpu" or "tpu": the compiler that built the step
  chip: str = ""            # the target's chip ("cpu", "v5e", "h100"): the report's label
  memory_order: bool = False  # XLA:CPU compiled with CPU_MEMORY_FLAG
  target: str = ""
  memory: int = 0
  mesh: tuple = ()          # ((axis, size), ...)
  sharding: tuple = ()      # ShardingRow, ...
  xla_flops: float = -1.0
  cost_analysis_flops: float = -1.0
  opaque_calls: int = 0
  unknown_loops: int = 0
  model_flops: float = 0.0
  error: str = ""

  @property
  def compiled(self) -> bool:
    return not self.error

  @property
  def peak(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased

  @property
  def fits(self) -> Optional[bool]:
    """Whether the step fits the chip: False when the compiler refused it, None when the chip's
    memory is unknown (a CPU host)."""
    if self.error:
      return False
    return None if not self.memory else self.peak <= self.memory

  @property
  def flops_ratio(self) -> Optional[float]:
    """XLA's FLOPs over the trainer's (None when XLA gave none)."""
    if self.xla_flops < 0 or not self.model_flops:
      return None
    return self.xla_flops / self.model_flops

  def verdict(self) -> str:
    gib = self.memory / GIB
    if self.error:
      return f"DOES NOT FIT one {self.chip} chip ({gib:.2f} GiB): {self.error}"
    if self.fits is None:
      return "fits: unknown (this machine's memory is not known)"
    return (f"{'fits' if self.fits else 'DOES NOT FIT'} one {self.chip} chip ({self.peak / GIB:.2f} "
            f"of {gib:.2f} GiB)")

  def lines(self, cfg: TrainConfig) -> list[str]:
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    mesh = " x ".join(f"{a}={s}" for a, s in self.mesh)
    shape = (f"{cfg.batch_size} x {cfg.sequence_length} tokens per step over {self.devices} "
             f"{self.chip or self.platform} chip(s)"
             + (f" ({self.target}; mesh {mesh})" if mesh else ""))
    setup = (f"remat={cfg.remat}, grad_accum_steps={cfg.grad_accum_steps}, "
             f"loss_slice_len={cfg.loss_slice_len}, params {cfg.model.param_dtype}, compute "
             f"{cfg.model.compute_dtype}, attention {cfg.model.attention_implementation}, kvm "
             f"{cfg.model.kvm_implementation}")
    order = ("; XLA:CPU depth-first (memory-minimizing) order" if self.memory_order else
             "; XLA:CPU default (parallelism-first) order" if self.platform == "cpu" else "")
    out = [f"train step: {shape}", f"  {setup}{order}"]
    if self.sharding:
      out.append(f"  {'sharding':<16} {'partition spec':<28} {'whole':>10} {'per chip':>10}")
      for row in self.sharding:
        specs = ", ".join(row.specs[:2]) + (" ..." if len(row.specs) > 2 else "")
        out.append(f"  {row.role:<16} {specs:<28} {size_text(row.whole):>10} "
                   f"{size_text(row.per_chip):>10}")
    if self.xla_flops >= 0:
      ratio = self.flops_ratio
      out.append(f"  FLOPs per chip: compiled matmuls {self.xla_flops:.4g}, trainer "
                 f"{self.model_flops:.4g}" + (f" (compiled / trainer = {ratio:.3f})"
                                              if ratio is not None else ""))
      xla = (f"XLA's cost_analysis, {self.cost_analysis_flops:.4g}, counts each loop body once"
             if self.cost_analysis_flops >= 0 else "XLA's cost_analysis gives none here")
      out.append(f"    ({xla}" + (f"; {self.opaque_calls} kernel calls are opaque to both"
                                   if self.opaque_calls else "")
                 + (f"; {self.unknown_loops} loops of data-dependent length counted once"
                    if self.unknown_loops else "") + ")")
    if self.error:
      out.append(f"per-chip verdict: {self.verdict()}")
      return out
    out += [f"  arguments   {gib(self.arguments):>12}  (parameters, optimizer state, batch)",
            f"  temporaries {gib(self.temporaries):>12}  (activations, gradients, scratch)",
            f"  outputs     {gib(self.outputs):>12}  ({gib(self.aliased)} written in place into "
            "donated arguments)",
            f"  code        {gib(self.code):>12}"]
    if self.memory:
      out.append(f"per-chip verdict: {self.verdict()}")
    out.append(f"per-device peak: {gib(self.peak)} (arguments {gib(self.arguments)}, temporaries "
               f"{gib(self.temporaries)}, outputs {gib(self.outputs - self.aliased)} beyond the "
               "donated arguments)")
    return out


def size_text(n: int) -> str:
  """Bytes as GiB from 1 GiB up, else MiB (a tiny model's table is not all zeros)."""
  return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def _out_of_memory(error: BaseException) -> bool:
  """Whether a compile failed because the program does not fit the chip (XLA:TPU's refusal)."""
  return bool(re.search(r"RESOURCE_EXHAUSTED|exceeds (the )?available|Ran out of memory|"
                        r"out of memory", str(error), re.IGNORECASE))


def cost_analysis_flops(compiled) -> float:
  """FLOPs per chip of a compiled program as XLA's cost analysis counts them, each loop body once
  (-1: none given)."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # some backends give none
    return -1.0
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return float(cost.get("flops", -1.0)) if cost else -1.0


def compile_step(cfg: TrainConfig, target: Union[str, Target, None] = None,
                 save_compiled: Optional[str] = None) -> MemoryReport:
  """Compiles ``cfg``'s train step for ``target`` (a topology name or :class:`Target`; None:
  this machine) from abstract inputs and returns its report. A step that does not fit a TPU is
  a report whose ``error`` is the compiler's refusal; any other compiler error is raised.
  ``save_compiled``: a file to write the compiled step to (:func:`save_executable`)."""
  cfg.validate()
  with compile_target(target if target is not None else "local") as t:
    mesh = train_mesh(cfg, t)
    built = abstract_step(cfg, mesh)
    rows = sharding_rows(cfg, built.params, built.opt_state, built.batch)
    flops = step_flops(cfg, built.params) / mesh.devices.size
    common = dict(devices=mesh.devices.size, platform=t.platform, chip=t.chip.name,
                  memory_order=CPU_MEMORY_FLAG in os.environ.get("XLA_FLAGS", ""),
                  target=t.name, memory=t.memory_per_chip,
                  mesh=tuple(zip(mesh.axis_names, mesh.devices.shape)), sharding=rows,
                  model_flops=flops)
    with kernel_context(cfg, mesh):
      try:
        compiled = built.step.lower(*built.args).compile()
      except Exception as e:
        if not _out_of_memory(e):
          raise
        return MemoryReport(0, 0, 0, 0, 0, error=compiler_reason(e), **common)
    if save_compiled:
      save_executable(compiled, save_compiled)
    m = compiled.memory_analysis()
    counted = hlo_flops(compiled.as_text())
    return MemoryReport(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes,
                        outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
                        code=m.generated_code_size_in_bytes, xla_flops=counted.flops,
                        cost_analysis_flops=cost_analysis_flops(compiled),
                        opaque_calls=counted.opaque_calls, unknown_loops=counted.unknown_loops,
                        **common)


def memory_report(cfg: TrainConfig, mesh=None, target: Union[str, Target, None] = None
                  ) -> MemoryReport:
  """:func:`compile_step`; ``mesh`` (this machine's devices only) overrides the config's."""
  if mesh is None:
    return compile_step(cfg, target)
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  return compile_step(dataclasses.replace(cfg, mesh_data=sizes["data"], mesh_fsdp=sizes["fsdp"],
                                          mesh_tensor=sizes["tensor"]), target)


# ----------------------------------------------------------------------------------------------
# What would fit
# ----------------------------------------------------------------------------------------------


def fit_candidates(cfg: TrainConfig, chips: int) -> list[tuple[str, TrainConfig]]:
  """Settings that trade compute or communication for memory, each as ``(--config overrides,
  config)``, cheapest first: remat per block, loss slices, fsdp over every chip, then gradient
  accumulation (2, 4, 8 micro-batches), each alone and, after them, accumulation with fsdp and
  remat. Only settings the batch allows (every micro-batch splits over the batch axes)."""
  out, seen = [], set()

  def add(**changes):
    new = dataclasses.replace(cfg, **changes)
    key = tuple(sorted(changes.items()))
    if key in seen or new == cfg:
      return
    try:
      new.validate()
      data, fsdp, _ = mesh_sizes(new, chips, "the topology")
    except ValueError:
      return
    if new.batch_size % (data * fsdp * new.grad_accum_steps):
      return
    seen.add(key)
    text = " ".join(f"--config.{k}={v}" for k, v in sorted(changes.items()))
    out.append((text, new))

  tensor = cfg.mesh_tensor if cfg.mesh_tensor != -1 else 1
  data, fsdp, _ = mesh_sizes(cfg, chips, "the topology")
  # Parameters already split over every chip (or one chip): fsdp changes nothing.
  fsdp_all = {} if fsdp * tensor == chips else dict(mesh_data=1, mesh_fsdp=-1, mesh_tensor=tensor)
  remat = {} if cfg.remat != "none" else dict(remat="block")
  slices = ({} if cfg.loss_slice_len or cfg.sequence_length <= 1024
            else dict(loss_slice_len=1024))
  if remat:
    add(**remat)
  if slices:
    add(**slices)
  if fsdp_all:
    add(**fsdp_all)
  for accum in (2, 4, 8):
    add(grad_accum_steps=cfg.grad_accum_steps * accum)
  for accum in (2, 4, 8):
    add(grad_accum_steps=cfg.grad_accum_steps * accum, **fsdp_all, **remat, **slices)
  return out


def fitting_settings(cfg: TrainConfig, target: Union[str, Target], *, limit: int = 3,
                     budget: int = 8, progress: Optional[Callable[[str], None]] = None
                     ) -> list[tuple[str, MemoryReport]]:
  """Up to ``limit`` of :func:`fit_candidates` whose step, compiled for ``target``, fits the
  chip (at most ``budget`` compiles), as ``(overrides, report)``: tried, not guessed.
  ``progress(overrides)`` before each compile."""
  chips = parse_target(target).device_count
  found = []
  for tried, (text, candidate) in enumerate(fit_candidates(cfg, chips)):
    if tried >= budget or len(found) >= limit:
      break
    if progress is not None:
      progress(text)
    report = compile_step(candidate, target)
    if report.fits:
      found.append((text, report))
  return found


# ----------------------------------------------------------------------------------------------
# A compiled step saved for the run
# ----------------------------------------------------------------------------------------------


def save_executable(compiled, path: str) -> None:
  """Writes a compiled step (``jax.stages.Compiled``) to ``path``: the executable serialized by
  ``jax.experimental.serialize_executable`` with its argument and output tree structures, which
  :func:`load_executable` reads back on the chips it was compiled for."""
  import pickle
  from jax.experimental import serialize_executable
  payload, in_tree, out_tree = serialize_executable.serialize(compiled)
  with open(path, "wb") as f:
    pickle.dump({"payload": payload, "in_tree": in_tree, "out_tree": out_tree}, f)


def load_executable(path: str, devices: Optional[Sequence] = None):
  """The compiled step :func:`save_executable` wrote, loaded onto this machine's devices
  (``devices``: its backend's, by default)."""
  import pickle
  from jax.experimental import serialize_executable
  with open(path, "rb") as f:
    saved = pickle.load(f)
  backend = devices[0].client if devices else None
  return serialize_executable.deserialize_and_load(saved["payload"], saved["in_tree"],
                                                   saved["out_tree"], backend=backend)
