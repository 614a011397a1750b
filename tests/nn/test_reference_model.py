"""The NNX model's logits against the independent float64 oracle of tests/helpers/reference_model.py.

The oracle is written from docs/kvm-spec.md alone, so these tests pin the *semantics* of every
piece (MLP activation, token shifts and their fallbacks, value residual, QK-LN, RoPE, residual
scale, KVM temperatures, novelty and routing rules, the budget schedule), which the model's
self-consistency tests (decode == forward, causality, overfitting) cannot see.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from tests.helpers import ROOT, model_logits, random_model
from tests.helpers.reference_cases import (B, REL_TOL, check_kvm_coverage, reference_config,
                                           reference_params, routing_tokens)
from tests.helpers.reference_model import lm_logits



CASES = {
    "kvm": ("kvm", {}),
    "kvm_gqa": ("kvm", dict(num_kv_heads=2)),
    "full": ("full", {}),
    "swa": ("swa", {}),
    "bswa": ("bswa", {}),
    # the paper's hybrid (SWA on even layers; each kind anchors its own value residual, so here
    # both are the identity), with the 350M models' residual scale
    "swa_kvm_hybrid": (("swa", "kvm"), dict(residual_scale=0.5)),
    # every layer anchored on layer 0, so the bswa layer's value residual reads the full layer's
    "full_bswa_shared_anchor": (("full", "bswa"), dict(
        family_options=kj.nn.GPTAlpha2Options(share_value_anchor=True))),
    # value heads wider than query/key heads (the authors' d_v_head), through every kind
    "value_head_dim_16_of_8": (("kvm", "swa", "full", "bswa"),
                               dict(num_layers=4, head_dim=8, value_head_dim=16, rope_dims=4,
                                    options={"swa": kj.nn.SWAOptions(window=12, rope_dims=8),
                                             "kvm": kj.KVMConfig(
                                                 chunk_size=8, window_chunks=2, sink_rows=1,
                                                 rope_dims=4,
                                                 budget=kj.PowerLawBudget(4.0, 0.5, 8))})),
    # the paper's OVQ/SWA hybrid (the dictionary grows 0, 4, 6, 8, 8, 9 over 45 tokens)
    "swa_ovq_hybrid": (("swa", "ovq"), {}),
    "ovq_switches": ("ovq", dict(num_layers=1, options={"ovq": kj.OVQConfig(
        chunk_size=8, max_centroids=12, min_state_size=True, count_bias=False,
        normalize_centroids=True, delta_rule=True)})),
    "rwkv7": ("rwkv7", {}),
    "rwkv7_no_token_shift": ("rwkv7", dict(
        num_layers=1, family_options=kj.nn.GPTAlpha2Options(tokenshift_attention=False))),
}


def _model(mixers, overrides, seed: int = 0) -> kj.LM:
  """The tiny preset with every parameter random (:func:`tests.conftest.random_model`)."""
  return random_model(kj.presets.tiny(mixers=mixers, **overrides), seed)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_reference(name):
  mixers, overrides = CASES[name]
  model = _model(mixers, overrides)
  tokens = routing_tokens(model.cfg.vocab_size)
  got = model_logits(model, tokens).astype(np.float64)
  log = []
  want = lm_logits(reference_params(model), reference_config(model.cfg), tokens, log)
  if "kvm" in model.cfg.layer_mixers:
    check_kvm_coverage(log, model.cfg.kvm.chunk_size)
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, rtol=0, atol=REL_TOL * scale)


def test_reference_budget_schedule():
  """The tiny preset's PowerLawBudget(4, 0.5, min 8) on 45 tokens, by hand (§6.3): after query
  chunk [16, 24) ctx 24, available 16: floor(4·√24) = 19 -> 16, append all 8; after [24, 32):
  floor(4·√32) = 22 (available 24), append 6 and merge 2; after [32, 40): floor(4·√40) = 25
  (available 32), append 3 and merge 5; none after the last chunk."""
  model = _model("kvm", dict(num_layers=1))
  log = []
  lm_logits(reference_params(model), reference_config(model.cfg),
            routing_tokens(model.cfg.vocab_size), log)
  per_group = [(r["n_append"], r["n_merge"]) for r in log[:3]]
  assert per_group == [(8, 0), (6, 2), (3, 5)]
  assert len(log) == 3 * B * model.cfg.kv_heads


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "tests" / "data" / "authors").iterdir()
                                         if p.is_dir()))
def test_reference_matches_the_authors_model(name):
  """The float64 reference itself against the authors' PyTorch model: their tiny checkpoints
  (tests/data/authors, written by their code with their float32 logits, bfloat16 casts off) run
  through the reference with their parameters. This ties the spec the reference was written from
  to the code it describes; the KVM cases grow and merge their state on these 45 tokens."""
  data = ROOT / "tests" / "data" / "authors" / name
  ref = np.load(data / "reference.npz")
  model = kj.load_pretrained(data, numerics="float32", progress=False)
  want = ref["logits_float32"]
  got = lm_logits(reference_params(model), reference_config(model.cfg), ref["tokens"])
  np.testing.assert_allclose(got, want, rtol=0, atol=REL_TOL * np.abs(want).max())
