"""What a step costs: FLOPs per token, the devices' peak, honest step time, and MFU from them."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import numpy as np

from kvm_jax.nn import registry
from kvm_jax.nn.families.family import family_of
from kvm_jax.nn.layers import path_names
from kvm_jax.nn.roles import parameter_role
from kvm_jax.runs.train_config import TrainConfig

# Dense bf16 peak per device, for the MFU estimate (matched against device_kind).
_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "TPU v5p": 459.0, "TPU v5 lite": 197.0,
                "TPU v4": 275.0, "TPU v6": 918.0}


def peak_flops(cfg: TrainConfig) -> float:
  """Peak FLOP/s of all devices (0 when unknown, e.g. on CPU)."""
  per = cfg.peak_tflops_per_device
  if not per:
    kind = jax.devices()[0].device_kind
    per = next((v for k, v in _PEAK_TFLOPS.items() if k.lower() in kind.lower()), 0.0)
  return per * 1e12 * jax.device_count()


def visible_keys(cfg: TrainConfig) -> float:
  """Keys per query, averaged over the positions of a training sequence and summed over layers:
  each layer's kind says how many its queries see (``keys_per_query`` of its class; e.g. causal
  full attention (T + 1) / 2, KVM its window plus the state rows of its schedule at each
  chunk)."""
  return float(sum(registry.keys_per_query(cfg.model, cfg.sequence_length)))


def flops_per_token(cfg: TrainConfig, params) -> float:
  """Training FLOPs per token, the model FLOPs MFU is measured by: 6·N (matmul parameters,
  forward + backward) plus each layer's mixing work (:func:`kvm_jax.nn.registry.mixer_flops`'s
  ``model``): for attention 12·keys·D·H with ``keys`` the :func:`visible_keys` of the layer (QKᵀ
  and PV, 2 FLOPs per multiply-add each, tripled for the backward pass); for KVM that plus its
  routing scores. Work an implementation adds (masked keys it scores anyway, one-hot
  accumulation, recomputation) is not the model's: :func:`recomputed_flops_per_token` counts
  it for :func:`step_flops`."""
  m = cfg.model
  n = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  if not family_of(m).tied_head(m):
    n -= m.vocab_size * m.hidden_size  # the embedding lookup is not a matmul (a tied head is)
  return 6.0 * n + sum(f.model for f in registry.mixer_flops(m, cfg.sequence_length))


@dataclasses.dataclass
class StepClock:
  """Honest throughput: wall time per step between host syncs, after ``block_until_ready``.

  The clock starts only once the first step of a (resumed) run has finished, so warm-up is never
  counted, and it restarts after every evaluation and checkpoint, which are not training time.
  ``data_wait`` is the host time spent producing batches (reading rows, placing them)."""

  start: Optional[float] = None
  steps: int = 0
  data_wait: float = 0.0

  def restart(self) -> None:
    self.start, self.steps, self.data_wait = time.perf_counter(), 0, 0.0

  def tick(self, data_wait: float) -> None:
    if self.start is not None:
      self.steps += 1
      self.data_wait += data_wait

  def report(self) -> dict[str, float]:
    """``step_time_s`` and ``data_wait_s`` per step of the interval (empty before any step)."""
    if self.start is None or self.steps == 0:
      return {}
    elapsed = time.perf_counter() - self.start
    return {"step_time_s": elapsed / self.steps, "data_wait_s": self.data_wait / self.steps}


def throughput(timing: dict[str, float], tokens_per_step: int, flops_per_token: float,
               peak: float) -> dict[str, float]:
  """``timing`` (:meth:`StepClock.report`) plus ``tokens_per_s`` and, when the devices' ``peak``
  FLOP/s is known (non-zero), ``mfu``: achieved model FLOP/s over that peak. Empty before any
  timed step."""
  if not timing:
    return {}
  out = dict(timing, tokens_per_s=tokens_per_step / timing["step_time_s"])
  if peak:
    out["mfu"] = out["tokens_per_s"] * flops_per_token / peak
  return out



def recomputed_flops_per_token(cfg: TrainConfig, params) -> float:
  """FLOPs per token the step runs beyond the model's (:func:`flops_per_token`): what each
  layer's implementation runs beyond its model count (``forward + backward - model`` of
  :func:`kvm_jax.nn.registry.mixer_flops`: for KVM's XLA scan the masked window and capacity
  rows, the one-hot accumulation off CPU and the rerun of each block in its backward pass);
  with ``remat="block"`` every block's forward again (2 FLOPs per block matmul parameter plus
  the layer's ``forward``); ``"block_dots"`` keeps the matmuls' outputs, so nothing; with
  ``loss_slice_len`` the LM head of each slice (2 FLOPs per head parameter), which the sliced
  loss recomputes rather than keeping every slice's logits."""
  m = cfg.model
  layers = registry.mixer_flops(m, cfg.sequence_length)
  extra = sum(f.forward + f.backward - f.model for f in layers)
  if cfg.remat == "block":
    block_params = sum(int(np.prod(p.shape)) for path, p in
                       jax.tree_util.tree_leaves_with_path(params)
                       if parameter_role(path_names(path)).layer is not None)
    extra += 2.0 * block_params + sum(f.forward for f in layers)
  if cfg.loss_slice_len and cfg.loss_slice_len < cfg.sequence_length:
    extra += 2.0 * m.vocab_size * m.hidden_size
  return extra


def step_flops(cfg: TrainConfig, params) -> float:
  """FLOPs one train step runs (all devices): the model's (:func:`flops_per_token`, what MFU
  counts) plus what remat and loss slicing recompute (:func:`recomputed_flops_per_token`), times
  the step's tokens. The compiled program's matmul count (``kvm-train --memory-report``) checks
  it."""
  per_token = flops_per_token(cfg, params) + recomputed_flops_per_token(cfg, params)
  return per_token * cfg.batch_size * cfg.sequence_length
