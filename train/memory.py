"""``kvm-train --memory-report``: the compiled train step's memory per device, without running it.

The step is compiled for the configured model, batch, sequence length, mesh, remat, accumulation
and loss slicing, from abstract inputs (``jax.ShapeDtypeStruct`` with shardings): no weight is
allocated and no data is read, so a paper-sized step is measured on a laptop's CPU. XLA's buffer
assignment then says what one device holds at the step's peak:

* **arguments**: parameters, optimizer state (float32 moments and masters) and the batch;
* **temporaries**: everything the step allocates while it runs (activations kept for the
  backward pass, gradients, logits, scratch);
* **outputs**: the new parameters and optimizer state, less what is written in place into the
  donated arguments (aliased).

The peak is ``arguments + temporaries + outputs - aliased``. CPU and accelerator compilers lay
buffers out differently (fusion, layouts; XLA:CPU computes bf16 matmuls through float32 copies),
so treat a CPU figure as an estimate of a GPU/TPU one (``kvm-train --memory-report`` compiles
with XLA:CPU's parallelism-first scheduler off, :data:`CPU_MEMORY_FLAG`); on an accelerator the
report is that backend's own.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from kvm_jax.nn.model import LM
from kvm_jax.config.target import current_target
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train import sharding
from kvm_jax.train.start import make_optimizer
from kvm_jax.train.step import make_train_step

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


@dataclasses.dataclass(frozen=True)
class MemoryReport:
  """Bytes per device of one compiled train step (see the module docstring)."""

  arguments: int
  temporaries: int
  outputs: int
  aliased: int
  code: int
  devices: int
  platform: str             # "cpu", "gpu" or "tpu": the compiler that built the step
  chip: str = ""            # the target's chip ("cpu", "v5e", "h100"): the report's label
  memory_order: bool = False  # XLA:CPU compiled with CPU_MEMORY_FLAG

  @property
  def peak(self) -> int:
    return self.arguments + self.temporaries + self.outputs - self.aliased

  def lines(self, cfg: TrainConfig) -> list[str]:
    gib = lambda n: f"{n / GIB:.2f} GiB"
    shape = (f"{cfg.batch_size} x {cfg.sequence_length} tokens per step over {self.devices} "
             f"{self.chip or self.platform} device(s)")
    setup = (f"remat={cfg.remat}, grad_accum_steps={cfg.grad_accum_steps}, "
             f"loss_slice_len={cfg.loss_slice_len}, params {cfg.model.param_dtype}, compute "
             f"{cfg.model.compute_dtype}, attention {cfg.model.attention_implementation}, kvm "
             f"{cfg.model.kvm_implementation}")
    order = ("; XLA:CPU depth-first (memory-minimizing) order" if self.memory_order else
             "; XLA:CPU default (parallelism-first) order" if self.platform == "cpu" else "")
    return [f"train step: {shape}", f"  {setup}{order}",
            f"  arguments   {gib(self.arguments):>12}  (parameters, optimizer state, batch)",
            f"  temporaries {gib(self.temporaries):>12}  (activations, gradients, scratch)",
            f"  outputs     {gib(self.outputs):>12}  ({gib(self.aliased)} written in place into "
            "donated arguments)",
            f"  code        {gib(self.code):>12}",
            f"per-device peak: {gib(self.peak)} (arguments {gib(self.arguments)}, temporaries "
            f"{gib(self.temporaries)}, outputs {gib(self.outputs - self.aliased)} beyond the "
            "donated arguments)"]


def abstract_train_state(cfg: TrainConfig, mesh):
  """(graphdef, optimizer, abstract params, abstract optimizer state, shardings) with no array
  allocated: ``ShapeDtypeStruct`` leaves carrying the trainer's shardings."""
  model = nnx.eval_shape(lambda: LM(cfg.model, rngs=nnx.Rngs(cfg.seed)))
  graphdef, params = nnx.split(model)
  optimizer = make_optimizer(cfg, params)
  p_sh = sharding.param_shardings(params, mesh)
  opt_shape = jax.eval_shape(optimizer.init, params)
  o_sh = sharding.like_params_shardings(opt_shape, p_sh, mesh)
  with_sharding = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  params = jax.tree_util.tree_map(with_sharding, params, p_sh)
  opt_state = jax.tree_util.tree_map(with_sharding, opt_shape, o_sh)
  return graphdef, optimizer, params, opt_state, (p_sh, o_sh, sharding.batch_sharding(mesh))


def memory_report(cfg: TrainConfig, mesh=None) -> MemoryReport:
  """Compiles ``cfg``'s train step on the present backend from abstract inputs and returns its
  memory analysis per device."""
  cfg.validate()
  mesh = mesh or sharding.make_mesh(cfg.mesh_data, cfg.mesh_fsdp, cfg.mesh_tensor)
  sharding.check_batch(cfg.batch_size, mesh, cfg.grad_accum_steps)
  graphdef, optimizer, params, opt_state, shardings = abstract_train_state(cfg, mesh)
  tokens = jax.ShapeDtypeStruct((cfg.batch_size, cfg.sequence_length), jnp.int32,
                                sharding=shardings[2])
  halted = jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(mesh, PartitionSpec()))
  step = make_train_step(graphdef, optimizer, shardings, cfg)
  batch = {"inputs": tokens, "labels": tokens}
  if cfg.packing == "documents":  # packed rows also carry their documents' segment ids
    batch["segment_ids"] = tokens
  compiled = step.lower(params, opt_state, batch, halted).compile()
  m = compiled.memory_analysis()
  return MemoryReport(arguments=m.argument_size_in_bytes, temporaries=m.temp_size_in_bytes,
                      outputs=m.output_size_in_bytes, aliased=m.alias_size_in_bytes,
                      code=m.generated_code_size_in_bytes, devices=mesh.devices.size,
                      platform=current_target().platform, chip=current_target().chip.name,
                      memory_order=CPU_MEMORY_FLAG in os.environ.get("XLA_FLAGS", ""))
