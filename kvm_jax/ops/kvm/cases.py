"""The one case matrix of the KVM checks, with its input builders, error metric and tolerances.

Every comparison of KVM implementations draws from :data:`CASES`: the tests of the scan against
the oracle (outputs, final state, gradients), of prefill + decode against the whole sequence, of
the Pallas kernels against the XLA scan, and ``kvm-check``. A case is tagged with the checks that
run it (``tags``), so a new case is added in one place and every check it belongs to picks it up.

Tags:
  ``oracle``        scan vs oracle: outputs and final state (small, many edge cases);
  ``grad``          scan vs oracle: gradients of every input (run at a shorter length);
  ``oracle-large``  scan vs oracle at longer sequences and wider heads;
  ``decode``        prefill + one-token decode vs the whole-sequence scan;
  ``kernels``       Pallas kernels (interpreted on CPU) vs the XLA scan, routing compared exactly;
  ``check-small`` / ``check-paper``  the ``kvm-check`` command (``--size small`` / ``paper``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvm_jax.config.budget import FixedBudget, PowerLawBudget, SaturatingBudget
from kvm_jax.config.kvm import KVMConfig
from kvm_jax.ops.kvm.state import KVMParams, KVMState

# Relative RMS tolerances (fla style). float32: the paths sum the same terms in different orders
# (joint softmax without concatenation, scatter vs matmul accumulation, online softmax in the
# kernels), a few ulps per operation: observed <= 1e-6 for outputs and states; gradients pass
# through softmax and LayerNorm backward, which amplify rounding. bfloat16: activations,
# probabilities and outputs are rounded to bf16 (2^-9 relative) at the same points on every path,
# but differently ordered sums move individual roundings (observed ~3e-3). Routing is discrete:
# one different decision moves a whole row, an O(1) state error, far outside these tolerances.
TOLERANCE = {"float32": {"output": 2e-5, "grad": 1e-4},
             "bfloat16": {"output": 2e-2, "grad": 5e-2}}


@dataclasses.dataclass(frozen=True)
class Case:
  """One configuration and shape. ``inputs(seed)`` builds its random q, k, v, gates, parameters."""

  name: str
  cfg: KVMConfig
  seq_len: int
  batch: int = 2
  heads: int = 2
  kv_heads: int = 2
  head_dim: int = 8
  value_dim: int = 6
  dtype: str = "float32"
  tags: frozenset = frozenset()
  slow: bool = False  # too slow for the default test run (scripts/nightly.sh runs it)

  def inputs(self, seed: int = 0):
    """``(q, k, v, merge_gate, params)`` for this case (see :func:`random_inputs`)."""
    q, k, v, g = random_inputs(seed, self.batch, self.seq_len, self.heads, self.kv_heads,
                               self.head_dim, self.value_dim, jnp.dtype(self.dtype))
    return q, k, v, g, random_params(seed, self.head_dim, self.heads)

  @property
  def tolerance(self) -> dict[str, float]:
    return TOLERANCE[self.dtype]


def random_inputs(seed: int, B: int, T: int, H: int, Hkv: int, D: int, Dv: int,
                  dtype: Any = jnp.float32):
  """q ``[B,T,H,D]``, k ``[B,T,Hkv,D]``, v ``[B,T,Hkv,Dv]`` (standard normal, cast to ``dtype``)
  and merge gates g = 1 + ELU(normal) ``[B,T,Hkv]`` (float32, > 0, as a layer makes them)."""
  kq, kk, kv, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (B, T, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, T, Hkv, Dv), jnp.float32).astype(dtype)
  g = 1.0 + jax.nn.elu(jax.random.normal(kg, (B, T, Hkv), jnp.float32))
  return q, k, v, g


def random_params(seed: int, D: int, H: int) -> KVMParams:
  """KVM parameters away from their init (LN_s scale/bias, both temperatures), so that every one
  of them matters in a comparison."""
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(1000 + seed), 4)
  return KVMParams(ln_scale=1.0 + 0.2 * jax.random.normal(k1, (D,)),
                   ln_bias=0.2 * jax.random.normal(k2, (D,)),
                   window_temperature=1.0 + 0.3 * jax.random.uniform(k3, (H,), minval=-1, maxval=1),
                   state_temperature=1.0 + 0.3 * jax.random.uniform(k4, (H,), minval=-1, maxval=1))


def rel_rms(actual, expected) -> float:
  """Relative error RMS(actual - expected) / RMS(expected), in float64. NaN anywhere gives NaN,
  which fails every ``<`` comparison."""
  a = np.asarray(actual, np.float64)
  e = np.asarray(expected, np.float64)
  return float(np.sqrt(np.mean((a - e) ** 2)) / max(np.sqrt(np.mean(e * e)), 1e-30))


def row_count(state: KVMState) -> int:
  """The state's valid rows: one count for the batch, or a cache's count per row, which must
  then agree (a ValueError otherwise: rows of different lengths cannot be compared as one)."""
  counts = np.unique(np.asarray(state.num_rows))
  if counts.size != 1:
    raise ValueError(f"the batch rows hold different row counts {counts.tolist()}.")
  return int(counts[0])


def valid_rows(state: KVMState):
  """(keys, values, radius) of the valid rows of a state, float64 numpy."""
  n = row_count(state)
  return tuple(np.asarray(x[:, :, :n], np.float64) for x in (state.keys, state.values,
                                                            state.radius))


def state_rel_error(state: KVMState, ref: KVMState) -> float:
  """Largest :func:`rel_rms` of the valid keys, values and radii (NaN if any of them is NaN: a
  plain ``max`` could drop it); inf if the row counts differ (another schedule: the rows cannot
  be compared)."""
  if row_count(state) != row_count(ref):
    return float("inf")
  return float(np.max([rel_rms(a, b) for a, b in zip(valid_rows(state), valid_rows(ref))]))


# ----------------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------------


def _tiny(**kw) -> KVMConfig:
  """C=4, L=8, one sink, 2 rotary channels: every schedule event within a few dozen tokens."""
  return KVMConfig(**{"chunk_size": 4, "window_chunks": 2, "sink_rows": 1, "rope_dims": 2,
                      "budget": FixedBudget(4), **kw})


def _grow(**kw) -> KVMConfig:
  return _tiny(**{"budget": PowerLawBudget(3.0, 0.5, min_rows=4), **kw})


def _kernel(**kw) -> KVMConfig:
  """C=8, L=16: chunk and head sizes the kernels' lowering accepts."""
  return KVMConfig(**{"chunk_size": 8, "window_chunks": 2, "rope_dims": 8, **kw})


def _paper(**kw) -> KVMConfig:
  return KVMConfig(**{"chunk_size": 256, "window_chunks": 2, "sink_rows": 1, **kw})


ORACLE, GRAD = frozenset({"oracle"}), frozenset({"oracle", "grad"})
LARGE = frozenset({"oracle-large"})
_FIXED_SMALL, _SQRT_SMALL = FixedBudget(12), PowerLawBudget(4.0, 0.5, min_rows=8)
_FIXED_PAPER, _SQRT_PAPER = FixedBudget(256), PowerLawBudget(16.0, 0.5, min_rows=256)

CASES: tuple[Case, ...] = (
    # Scan vs oracle: budgets, sinks, GQA/MQA, ragged lengths, every schedule edge, every option.
    Case("fixed_C_no_append_ragged", _tiny(), 29, tags=GRAD),
    Case("fixed_above_C_appends_gqa_sink0", _tiny(sink_rows=0, budget=FixedBudget(7)), 30,
         heads=4, tags=GRAD),
    Case("powerlaw_gqa", _grow(), 37, heads=4, kv_heads=1, tags=GRAD),
    Case("saturating", _tiny(budget=SaturatingBudget(limit=12, min_rows=1)), 40, tags=ORACLE),
    Case("callable_budget_cap", _tiny(budget=lambda n: n // 2, max_state_rows=11), 41,
         tags=ORACLE),
    Case("T_below_C", _tiny(), 3, tags=ORACLE),
    Case("T_below_L", _tiny(), 6, tags=GRAD),
    Case("T_equals_L", _tiny(), 8, tags=ORACLE),
    Case("T_L_plus_1", _grow(), 9, tags=ORACLE),
    Case("first_update", _grow(), 13, tags=ORACLE),
    Case("no_gates_no_temps", _grow(gate_keys=False, gate_values=False, head_temperatures=False),
         27, tags=GRAD),
    Case("keys_gated_only", _grow(gate_values=False), 27, tags=ORACLE),
    Case("gate_appends_and_initial", _grow(gate_appends=True, gate_initial_state=True), 33,
         tags=GRAD),
    Case("value_norm_none", _grow(value_norm="none"), 30, tags=GRAD),
    Case("bf16_readout_cast", _grow(readout_value_dtype="bfloat16"), 30, tags=GRAD),
    Case("bf16_readout_cast_gqa", _grow(readout_value_dtype="bfloat16"), 30, heads=4,
         kv_heads=1, tags=GRAD),
    Case("one_window_chunk", _grow(window_chunks=1), 23, tags=ORACLE),
    Case("three_window_chunks", _tiny(window_chunks=3, sink_rows=2,
                                      budget=SaturatingBudget(limit=14)), 35, tags=ORACLE),
    Case("no_rope_channels", _tiny(rope_dims=0, budget=FixedBudget(6)), 26, tags=ORACLE),
    Case("all_rope_channels", _tiny(rope_dims=8, budget=FixedBudget(6)), 26, tags=ORACLE),
    Case("state_keeps_slow_rope_pairs", _grow(rope_dims=8, state_rope_dims=4), 30, tags=ORACLE),
    # Gemma 2's soft-capped scores (cap 2 against O(1) scores: most of them bent).
    Case("softcapped_scores_gqa", _grow(logit_softcap=2.0), 30, heads=4, tags=GRAD),
    # Scan vs oracle at longer sequences: more rows, more chances of near-ties.
    Case("C32_T700_growth", KVMConfig(chunk_size=32, window_chunks=2, sink_rows=1, rope_dims=16,
                                      budget=PowerLawBudget(8.0, 0.5, min_rows=32)), 700,
         heads=4, head_dim=32, value_dim=32, tags=LARGE),
    Case("paper_geometry_sqrt16_T2500", _paper(rope_dims=32, budget=_SQRT_PAPER), 2500, batch=1,
         heads=4, kv_heads=4, head_dim=64, value_dim=64, tags=LARGE),
    Case("paper_heads_sat1024_T8200", _paper(rope_dims=64, budget=SaturatingBudget(1024, 1)), 8200,
         batch=1, heads=4, head_dim=128, value_dim=128, tags=LARGE, slow=True),
    # Prefill + decode vs the whole sequence.
    Case("decode_powerlaw_gqa", _grow(), 31, heads=4, tags=frozenset({"decode"})),
    Case("decode_fixed_C", _grow(budget=FixedBudget(4)), 31, tags=frozenset({"decode"})),
    Case("decode_saturating_nb3_gated_init",
         _grow(window_chunks=3, budget=SaturatingBudget(16), gate_initial_state=True,
               gate_appends=True), 31, kv_heads=1, tags=frozenset({"decode"})),
    Case("decode_softcapped_gqa", _grow(logit_softcap=2.0), 31, heads=4,
         tags=frozenset({"decode"})),
    # Pallas kernels (interpreted) vs the XLA scan.
    Case("fixed_sink1_gqa", _kernel(budget=_FIXED_SMALL, sink_rows=1), 61, heads=4,
         head_dim=16, value_dim=16, tags=frozenset({"kernels"})),
    Case("sqrt_sink0", _kernel(budget=_SQRT_SMALL, sink_rows=0), 53, head_dim=16, value_dim=16,
         tags=frozenset({"kernels"})),
    Case("saturating_ragged_mqa", _kernel(budget=SaturatingBudget(40, min_rows=8), sink_rows=1),
         45, heads=4, kv_heads=1, head_dim=16, value_dim=16, tags=frozenset({"kernels"})),
    Case("sqrt_bf16", _kernel(budget=_SQRT_SMALL, sink_rows=1), 40, heads=4, head_dim=16,
         value_dim=16, dtype="bfloat16", tags=frozenset({"kernels"})),
    Case("three_window_chunks_kernels", _kernel(budget=_SQRT_SMALL, sink_rows=1, window_chunks=3),
         70, head_dim=16, value_dim=16, tags=frozenset({"kernels"})),
    # a group of 3 query heads per KV head (not a power of two)
    Case("gqa3_kernels", _kernel(budget=_SQRT_SMALL, sink_rows=1), 47, heads=6, kv_heads=2,
         head_dim=16, value_dim=16, tags=frozenset({"kernels"})),
    # kvm-check, small (any machine, seconds) and at the paper's operator geometry (GPU/TPU).
    Case("fixed, sink 1", _kernel(budget=_FIXED_SMALL, sink_rows=1), 75, heads=4, kv_heads=4,
         head_dim=16, value_dim=16, tags=frozenset({"check-small"})),
    Case("sqrt16, GQA 4:2", _kernel(budget=_SQRT_SMALL, sink_rows=1), 75, heads=4, kv_heads=2,
         head_dim=16, value_dim=16, tags=frozenset({"check-small"})),
    Case("sqrt16, no sink, MQA", _kernel(budget=_SQRT_SMALL, sink_rows=0), 75, heads=4,
         kv_heads=1, head_dim=16, value_dim=16, tags=frozenset({"check-small"})),
    Case("fixed, GQA, bf16", _kernel(budget=_FIXED_SMALL, sink_rows=1), 75, heads=4, kv_heads=2,
         head_dim=16, value_dim=16, dtype="bfloat16", tags=frozenset({"check-small"})),
    Case("paper: fixed, sink 1", _paper(rope_dims=64, budget=_FIXED_PAPER), 2048, batch=1,
         heads=4, kv_heads=4, head_dim=128, value_dim=128, tags=frozenset({"check-paper"})),
    Case("paper: sqrt16, GQA 4:2", _paper(rope_dims=64, budget=_SQRT_PAPER), 2048, batch=1,
         heads=4, kv_heads=2, head_dim=128, value_dim=128, tags=frozenset({"check-paper"})),
    Case("paper: sqrt16, no sink, MQA", _paper(rope_dims=64, sink_rows=0, budget=_SQRT_PAPER),
         2048, batch=1, heads=4, kv_heads=1, head_dim=128, value_dim=128,
         tags=frozenset({"check-paper"})),
    Case("paper: fixed, GQA, bf16", _paper(rope_dims=64, budget=_FIXED_PAPER), 2048, batch=1,
         heads=4, kv_heads=2, head_dim=128, value_dim=128, dtype="bfloat16",
         tags=frozenset({"check-paper"})),
)


def select(tag: str) -> list[Case]:
  """The cases tagged ``tag``, in matrix order."""
  chosen = [c for c in CASES if tag in c.tags]
  if not chosen:
    tags = sorted(set().union(*(c.tags for c in CASES)))
    raise ValueError(f"no case is tagged {tag!r}; tags: {tags}.")
  return chosen


def get(name: str) -> Case:
  """The case called ``name``."""
  for c in CASES:
    if c.name == name:
      return c
  raise ValueError(f"no case named {name!r}; names: {[c.name for c in CASES]}.")


def _check_unique_names() -> None:
  names = [c.name for c in CASES]
  dupes = sorted({n for n in names if names.count(n) > 1})
  if dupes:  # a module-load invariant of this file, not user input
    raise AssertionError(f"case names must be unique: {dupes}")


_check_unique_names()
