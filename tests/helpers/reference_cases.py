"""The independent reference model's side of the tests: its configuration and parameters
from a kvm_jax model, routing-heavy tokens, tolerances and the coverage check (shared by the
reference, conversion and distillation tests)."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

import kvm_jax as kj

B, T = 2, 45   # ragged: tiny preset C = 8, L = 16, so query chunks at 16, 24, 32, 40 (5 tokens)



# Worst |model - reference| allowed, relative to max |reference logit|. The model runs in float32:
# each matmul, LayerNorm and softmax rounds at ~6e-8 relative, and the errors of a few layers of
# short dot products (width 64, MLP 256) add up to ~4e-7 of the largest logit on CPU. 1e-5 leaves
# a 25x margin for other XLA versions and backends, and is still far below what a semantic slip
# does: of 24 bugs planted in the model, the subtlest (merge gate exp(x) instead of
# 1 + ELU(x)) moved the worst logit by 3e-3 of max |logit|, ~300x this tolerance.
REL_TOL = 1e-5


# Routing decisions (append ranking, merge argmax) are discrete: float32 and float64 agree only if
# no decision is within rounding of a tie. Score gaps below this would make the comparison fragile
# (scores are O(head dim); float32 error on them is ~1e-5).
MIN_DECISION_GAP = 1e-3


def routing_tokens(vocab: int) -> np.ndarray:
  """Random ids, except that tokens 19 and 20 repeat token 0: in the first layer token 20's key
  then equals the sink's (same input, and its token shift reads an identical previous key; the
  rotary channels are zeroed in the state), so when chunk [16, 24) is merged (after query chunk
  [24, 32)) the sink is its best row and routing must skip it."""
  tokens = np.random.default_rng(7).integers(0, vocab, (B, T))
  tokens[:, 19] = tokens[:, 20] = tokens[:, 0]
  return tokens


def reference_params(model: kj.LM) -> dict:
  """The model's parameters as nested float64 numpy dicts, ``blocks`` as a list."""
  tree = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64),
                                nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  tree["blocks"] = [tree["blocks"][i] for i in sorted(tree["blocks"])]
  return tree


def _budget(budget) -> dict:
  if isinstance(budget, kj.FixedBudget):
    return dict(mode="fixed", rows=budget.rows)
  if isinstance(budget, kj.PowerLawBudget):
    return dict(mode="power_law", factor=budget.factor, exponent=budget.exponent,
                min_rows=budget.min_rows, round_down=budget.round_down)
  if isinstance(budget, kj.SaturatingBudget):
    return dict(mode="saturation", limit=budget.limit, min_rows=budget.min_rows,
                round_down=budget.round_down)
  raise ValueError(f"budget {budget!r}: the reference model knows FixedBudget, PowerLawBudget and "
                   "SaturatingBudget only.")


def reference_config(cfg: kj.ModelConfig) -> dict:
  """The plain config dict of :func:`tests.reference_model.lm_logits`."""
  kvm, swa, bswa = cfg.options_of("kvm"), cfg.options_of("swa"), cfg.options_of("bswa")
  ovq = cfg.options_of("ovq")
  return dict(
      mixers=cfg.layer_mixers, num_heads=cfg.num_heads, num_kv_heads=cfg.kv_heads,
      head_dim=cfg.qk_head_dim, value_head_dim=cfg.v_head_dim, residual_scale=cfg.scale,
      rope_dims=cfg.rope_dims, swa_rope_dims=swa.rope_dims if swa.rope_dims is not None
      else cfg.rope_dims, rope_theta=cfg.rope_theta, swa_window=swa.window,
      bswa_chunk_size=bswa.chunk_size, bswa_window_chunks=bswa.window_chunks,
      bswa_sink_rows=bswa.sink_rows,
      tokenshift_attention=cfg.tokenshift_attention, tokenshift_mlp=cfg.tokenshift_mlp,
      value_residual=cfg.value_residual, share_value_anchor=cfg.share_value_anchor,
      kvm=dict(chunk_size=kvm.chunk_size, window_chunks=kvm.window_chunks,
               sink_rows=kvm.sink_rows, rope_dims=kvm.rope_dims, budget=_budget(kvm.budget),
               max_state_rows=kvm.max_state_rows, gate_keys=kvm.gate_keys,
               gate_values=kvm.gate_values, gate_appends=kvm.gate_appends,
               gate_initial_state=kvm.gate_initial_state,
               head_temperatures=kvm.head_temperatures, value_norm=kvm.value_norm,
               readout_value_dtype=kvm.readout_value_dtype),
      ovq=dict(chunk_size=ovq.chunk_size, max_centroids=ovq.max_centroids,
               min_state_size=ovq.min_state_size, count_bias=ovq.count_bias,
               normalize_centroids=ovq.normalize_centroids, delta_rule=ovq.delta_rule))


def check_kvm_coverage(log: list, chunk: int) -> None:
  """The case exercises every branch of the state update, far from any routing tie."""
  assert any(r["n_append"] == chunk for r in log), "no update appends a whole chunk"
  assert any(0 < r["n_append"] < chunk for r in log), "no update both appends and merges"
  assert sum(r.get("sink_would_win", 0) for r in log) > 0, "routing never has to skip the sink"
  gaps = [r[k] for r in log for k in ("append_gap", "route_gap") if k in r]
  assert min(gaps) > MIN_DECISION_GAP, f"a routing decision is within {min(gaps):.2e} of a tie"
