"""Configuration of the KVM layer: a frozen, hashable dataclass validated at construction.

Each docstring names the authors' field (docs/kvm-spec.md §2) so that a config of their code can be
translated field by field.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from kvm_jax.config.budget import (BUDGET_SPEC_HELP, BudgetLike, CallableBudget, FixedBudget,
                                   SaturatingBudget, as_budget)

#: What ``implementation=`` of ``resolve_kvm_backend`` (and ``ModelConfig.kvm_implementation``)
#: accepts; the resolver that gives each name its meaning is ``kvm_jax.ops.kvm.api``.
KVM_IMPLEMENTATIONS = ("xla", "pallas", "auto")
_VALUE_NORMS = ("radius", "none")
_READOUT_DTYPES = (None, "bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class KVMConfig:
  """Hyper-parameters of one KVM layer (docs/kvm-spec.md §2 and its list of decisions).

  Attributes:
    chunk_size: C, tokens per chunk (authors: ``chunk_len``, paper 256). Queries are processed and
      the state is updated one chunk at a time.
    window_chunks: nb, chunks in the exact block-sliding window (``n_bswa_chunks``, paper 2); the
      window spans L = nb·C tokens and the first L tokens use plain causal attention.
    sink_rows: S, protected state rows holding the first S tokens; never merged into
      (``sink_len``, paper 1).
    rope_dims: r, leading rotary channels of q/k (``rope_partial_dim``, paper 64). They are zeroed
      in state keys before LN_s (unless ``state_rope_dims`` says fewer). Must be even; 0 means no
      rotary channels.
    state_rope_dims: how many of the leading rotary channels are zeroed in state keys; None:
      all ``rope_dims`` (the paper). The op takes rotary channels in pairs, fastest first
      (GPTAlpha-2's interleaved layout; a family rotating halves presents its channels in that
      order, :meth:`kvm_jax.nn.families.family.Family.state_channel_order`), so fewer keeps the slowest
      pairs, nearly position-free over the context, in the state keys. A family that rotates
      every channel (Llama, Qwen, Mistral, Gemma) needs it: with all channels zeroed, every
      state key is LN_s's bias and the state cannot be addressed. Even, at most ``rope_dims``.
    budget: target state rows as a function of tokens processed: ``FixedBudget(rows)``,
      ``PowerLawBudget(factor, exponent, min_rows)``, ``SaturatingBudget(limit, min_rows)`` or any
      callable ``ctx_len -> rows`` (``state_budget_mode`` & co., docs/kvm-spec.md §6.3).
    max_state_rows: hard cap on state rows (authors: ``chunk_len * n_max_d_chunks``); ``None`` means
      only the budget limits growth. The static state capacity is sized from the budget at the
      sequence length, never from this cap alone.
    gate_keys / gate_values: multiply merged keys / values by the merge gate g
      (``kvm_use_merge_gate_keys`` / ``_values``).
    gate_appends: also gate appended rows (``kvm_apply_merge_gate_to_appends``, default off).
    gate_initial_state: gate the initial chunk's rows (``kvm_apply_merge_gate_to_initial_state``).
      Unlike the authors' eager decode, our decode path gates them too, so prefill == decode.
    head_temperatures: use the per-query-head key temperatures of ``KVMParams``
      (``kvm_use_head_temps``); when False they are treated as 1.
    value_norm: "radius" (state values read out as normalize(sum)·‖v of the creating token‖, the
      paper) or "none" (raw sums; an honest replacement of the authors' buggy ``kvm_use_vlens=0``).
    readout_value_dtype: None keeps the state-value readout in float32; "bfloat16" reproduces the
      authors' hard-coded ``.bfloat16()`` cast of normalize(S_V)·radius (docs/kvm-spec.md
      §11.6), forward and gradient.
    ln_eps: epsilon of LN_s (1e-5 like every LayerNorm of the authors).
    logit_softcap: None, or every scaled score of the readout (state rows and window alike)
      becomes ``cap · tanh(score / cap)`` before the softmax: a KVM layer in a family that
      soft-caps attention (Gemma 2) takes the family's cap here, so that it equals the
      attention it replaces inside the window. Plain XLA only (the kernels do not cap).
  """

  chunk_size: int = 256
  window_chunks: int = 2
  sink_rows: int = 1
  rope_dims: int = 64
  budget: BudgetLike = FixedBudget(rows=256)
  max_state_rows: Optional[int] = None
  gate_keys: bool = True
  gate_values: bool = True
  gate_appends: bool = False
  gate_initial_state: bool = False
  head_temperatures: bool = True
  value_norm: str = "radius"
  readout_value_dtype: Optional[str] = None
  ln_eps: float = 1e-5
  logit_softcap: Optional[float] = None
  state_rope_dims: Optional[int] = None

  def __post_init__(self):
    def positive_int(name, minimum):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"KVMConfig.{name} must be an int >= {minimum}, got {value!r}.")

    positive_int("chunk_size", 1)
    positive_int("window_chunks", 1)
    positive_int("sink_rows", 0)
    positive_int("rope_dims", 0)
    if self.rope_dims % 2:
      raise ValueError(
          f"KVMConfig.rope_dims must be even (rotary channels come in interleaved pairs), got "
          f"{self.rope_dims}; use {self.rope_dims - 1} or {self.rope_dims + 1}.")
    if self.state_rope_dims is not None:
      positive_int("state_rope_dims", 0)
      if self.state_rope_dims % 2 or self.state_rope_dims > self.rope_dims:
        raise ValueError(f"KVMConfig.state_rope_dims={self.state_rope_dims} must be even and at "
                         f"most rope_dims={self.rope_dims} (the rotary channels zeroed in state "
                         "keys, in pairs).")
    if self.sink_rows >= self.chunk_size:
      raise ValueError(
          f"KVMConfig.sink_rows={self.sink_rows} must be < chunk_size={self.chunk_size}: the state "
          f"capacity is at least one chunk and needs a non-sink row to merge into.")
    if self.max_state_rows is not None:
      positive_int("max_state_rows", 1)
      if self.max_state_rows <= self.sink_rows:
        raise ValueError(
            f"KVMConfig.max_state_rows={self.max_state_rows} must exceed sink_rows={self.sink_rows}.")
    try:
      budget = as_budget(self.budget)
    except ValueError as e:
      raise ValueError(f"KVMConfig.budget: {e}") from None
    object.__setattr__(self, "budget", budget)
    if isinstance(budget, FixedBudget) and budget.rows <= self.sink_rows:
      raise ValueError(
          f"KVMConfig.budget=FixedBudget(rows={budget.rows}) is not above sink_rows="
          f"{self.sink_rows}: no row could ever receive merges. Use rows > {self.sink_rows}.")
    if isinstance(budget, SaturatingBudget) and budget.limit <= self.sink_rows:
      raise ValueError(
          f"KVMConfig.budget=SaturatingBudget(limit={budget.limit}) is not above sink_rows="
          f"{self.sink_rows}. Use limit > {self.sink_rows}.")
    if self.value_norm not in _VALUE_NORMS:
      raise ValueError(f"KVMConfig.value_norm must be one of {_VALUE_NORMS}, got {self.value_norm!r}.")
    if self.readout_value_dtype not in _READOUT_DTYPES:
      raise ValueError(
          f"KVMConfig.readout_value_dtype must be one of {_READOUT_DTYPES}, got "
          f"{self.readout_value_dtype!r}.")
    if self.logit_softcap is not None and (
        isinstance(self.logit_softcap, bool) or not isinstance(self.logit_softcap, (int, float))
        or not self.logit_softcap > 0):
      raise ValueError(f"KVMConfig.logit_softcap must be a positive number or None, got "
                       f"{self.logit_softcap!r}.")
    if not (isinstance(self.ln_eps, float) and self.ln_eps > 0):
      raise ValueError(f"KVMConfig.ln_eps must be a positive float, got {self.ln_eps!r}.")
    for name in ("gate_keys", "gate_values", "gate_appends", "gate_initial_state",
                 "head_temperatures"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"KVMConfig.{name} must be a bool, got {getattr(self, name)!r}.")

  @property
  def window_len(self) -> int:
    """L = window_chunks · chunk_size, tokens of exact attention."""
    return self.window_chunks * self.chunk_size

  @property
  def state_zeroed_dims(self) -> int:
    """Leading channels zeroed in state keys: ``state_rope_dims``, or every rotary one."""
    return self.rope_dims if self.state_rope_dims is None else self.state_rope_dims

  @property
  def uses_gate(self) -> bool:
    """Whether the merge gate affects anything (authors skip W_g when both flags are off)."""
    return self.gate_keys or self.gate_values

  def validate_head_dim(self, head_dim: int) -> None:
    """Trace-time check of ``rope_dims`` against the actual q/k head dim."""
    if self.rope_dims > head_dim:
      raise ValueError(
          f"KVMConfig.rope_dims={self.rope_dims} exceeds the q/k head dim {head_dim}; use "
          f"rope_dims <= {head_dim}.")

  # As the options of a mixer kind (kvm_jax.config.mixers): what ModelConfig asks of them.
  def rotary_dims(self, model) -> int:
    return self.rope_dims

  def check(self, model) -> None:
    """The state zeroes exactly the rotary channels, so they must be the model's."""
    if self.rope_dims != model.rope_dims:
      raise ValueError(f"KVMConfig.rope_dims={self.rope_dims} must equal the model's "
                       f"rope_dims={model.rope_dims} (the state zeroes exactly the rotary "
                       "channels).")


# Here, beside the fields it documents, so that a command's parser (kvm-eval, kvm-convert) builds
# without importing the model; kvm_jax.nn.convert.kvm_flags reads the values.
def add_kvm_flag(parser, what: str) -> None:
  """Documents ``--kvm.FIELD=VALUE`` (read by ``kvm_jax.nn.convert.kvm_flags``) on an argparse parser or group;
  ``what`` says which layers the fields set."""
  parser.add_argument("--kvm.FIELD", dest="kvm_help", metavar="VALUE", default=None,
                      help=f"--kvm.FIELD=VALUE sets a field of {what} KVMConfig (repeatable): "
                           f"budget (a spec: {BUDGET_SPEC_HELP}), max_state_rows (an int or "
                           "none), chunk_size, window_chunks, sink_rows, ...")


__all__ = ["KVMConfig", "CallableBudget", "KVM_IMPLEMENTATIONS"]
