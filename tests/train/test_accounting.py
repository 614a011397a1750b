"""What the library counts for every mixer kind, against counts made by hand: the keys one query
attends to (the attention term of the training FLOPs, hence MFU), the training FLOPs per token,
and the bytes of a decode cache. The numbers below are worked out in the comments from the
definitions (docs/kvm-spec.md, docs/ovq-rwkv7.md), not read from the code under test."""

from __future__ import annotations

import dataclasses

import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.nn import registry
from kvm_jax.nn.mixers.swa import SWAOptions
from kvm_jax.runs.train_config import TrainConfig
from kvm_jax.train.accounting import flops_per_token, visible_keys

# OVQ with chunks of 4 and at most 6 centroids: after t tokens the plateau schedule holds
# floor(6t / (t + 6)) rows: 2 after 4 tokens, 3 after 8, 4 after 12 and every later multiple of
# 4 up to 28 (168 // 34 = 4); min(t, 6) with min_state_size: 4, 6, 6, ...
OVQ = kj.OVQConfig(chunk_size=4, max_centroids=6)
OPTIONS = {"ovq": OVQ, "swa": SWAOptions(window=5, rope_dims=8), "rwkv7": kj.RWKV7Options(4)}


def _model(mixers, options=None, **overrides) -> kj.ModelConfig:
  """The tiny preset (width 64, 4 heads of 16, vocab 256; KVM C = 8, L = 16, 4·√N rows, at
  least 8) with the options above."""
  return kj.presets.tiny(mixers=mixers, options={**OPTIONS, **(options or {})}, **overrides)


# (mixers, overrides, T, keys per query of each layer), each a hand count:
KEYS = {
    # OVQ, T = 14: a query sees the rows before its chunk plus its chunk's tokens up to itself.
    # Chunks [0,4) [4,8) [8,12) [12,14): (1+2+3+4) + (4·2 + 10) + (4·3 + 10) + (2·4 + 1+2) = 61.
    "ovq": ("ovq", {}, 14, [61 / 14] * 2),
    # min(t, 6) rows: 10 + (4·4 + 10) + (4·6 + 10) + (2·6 + 3) = 85.
    "ovq_min_state_size": ("ovq", dict(options={"ovq": dataclasses.replace(
        OVQ, min_state_size=True)}), 14, [85 / 14] * 2),
    # RWKV-7: 9·Dk·Dv FLOPs per token and head (S·diag(w) 1, (S·a) 2, (S·a)·bᵀ 2, v·kᵀ 2,
    # readout S·r 2, times Dk·Dv), what attention spends on 9·Dk·Dv / (4·Dk) = 9·16/4 = 36 keys
    # (QKᵀ and PV: 4·Dk FLOPs a key), at every length.
    "rwkv7_T1": ("rwkv7", {}, 1, [36.0, 36.0]),
    "rwkv7_T1000": ("rwkv7", {}, 1000, [36.0, 36.0]),
    "rwkv7_wide_heads": ("rwkv7", dict(num_heads=2), 14, [72.0, 72.0]),  # heads of 32
    # The paper's hybrids. SWA of 5, T = 14: 1+2+3+4 + 5·10 = 60.
    "swa_ovq": (("swa", "ovq"), {}, 14, [60 / 14, 61 / 14]),
    "rwkv7_swa": (("rwkv7", "swa"), {}, 14, [36.0, 60 / 14]),
    # KVM at T = 30: positions 0..15 are the exact window, 1..16 keys (136). Chunk [16,24): the
    # window from 8 (9..16 keys, 100) plus the 8-row initial state (64). The update after it
    # (ctx 24: floor(4·√24) = 19 rows wanted, one chunk of 8 may append) leaves 16 rows, so chunk
    # [24,30) sees the window from 16 (9..14, 69) plus 16 rows each (96): 465 / 30 = 15.5.
    # OVQ at T = 30: 10 + 18 + 22 + 4·(4·4 + 10) + (2·4 + 3) = 165 over chunks of 4.
    "kvm_ovq": (("kvm", "ovq"), {}, 30, [15.5, 5.5]),
    "rwkv7_kvm": (("rwkv7", "kvm"), {}, 30, [36.0, 15.5]),
}


@pytest.mark.parametrize("name", list(KEYS))
def test_keys_per_query_by_hand(name):
  mixers, overrides, T, want = KEYS[name]
  cfg = _model(mixers, **overrides)
  assert registry.keys_per_query(cfg, T) == pytest.approx(want, rel=1e-12)


# KVM's routing scores per sequence, forward only (2·C·Hkv·D FLOPs per row scored): at T = 30
# one fold fires (after chunk [16,24)), appending 8 rows to the 8 there; its 8 tokens are scored
# against the 8 rows before it (novelty) and the 15 non-sink rows after it (merge targets):
# 2·8·4·16·(8 + 15) = 23552.
ROUTING = {"kvm_ovq": 23552.0, "rwkv7_kvm": 23552.0}


@pytest.mark.parametrize("name", ["ovq", "rwkv7_T1000", "kvm_ovq", "rwkv7_kvm"])
def test_training_flops_per_token_by_hand(name):
  """6 FLOPs per matmul parameter and token (forward and backward) for every parameter but the
  embedding table (a lookup), plus 12·D·H FLOPs per visible key and layer (QKᵀ and PV at 2
  FLOPs a multiply-add, forward and twice in the backward pass), plus KVM's routing scores."""
  mixers, overrides, T, keys = KEYS[name]
  cfg = TrainConfig(model=_model(mixers, **overrides), task="text", seq_len=T)
  params = nnx.state(nnx.eval_shape(lambda: kj.LM(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  m = cfg.model
  assert visible_keys(cfg) == pytest.approx(sum(keys), rel=1e-12)
  matmul_params = kj.count_params(m)["total"] - m.vocab_size * m.hidden_size
  want = 6 * matmul_params + 12 * 16 * 4 * sum(keys) + ROUTING.get(name, 0.0) / T  # D 16, H 4
  assert flops_per_token(cfg, params) == pytest.approx(want, rel=1e-12)


def test_a_tied_head_counts_as_a_matmul():
  """A tied head (Llama's option, Gemma's rule) multiplies by the embedding table: every
  parameter is a matmul parameter then, the table included."""
  from kvm_jax.nn.families.llama import LlamaOptions
  cfg = TrainConfig(model=_model("full", family="llama", family_options=LlamaOptions(
      tie_embeddings=True), rope_dims=16, options={}), task="text", seq_len=16)
  params = nnx.state(nnx.eval_shape(lambda: kj.LM(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  want = 6 * kj.count_params(cfg.model)["total"] + 12 * 16 * 4 * visible_keys(cfg)
  assert kj.count_params(cfg.model)["lm_head"] == 0
  assert flops_per_token(cfg, params) == pytest.approx(want, rel=1e-12)


# (mixers, overrides, batch, max_len, cache bytes of each layer), by hand. Every cache counts the
# tokens of each row (an int32 length per row: rows are sequences of their own lengths).
CACHES = {
    # OVQ, B = 2, 14 tokens: a dictionary of floor(6·14/20) = 4 rows per (batch, head) with keys,
    # values (16 + 16) and a count, float32; the current chunk's keys and values (4 x 32 float32);
    # the int32 lengths: 2·4·(4·33 + 4·32)·4 + 2·4.
    "ovq": ("ovq", {}, 2, 14, [2 * 4 * (4 * 33 + 4 * 32) * 4 + 2 * 4] * 2),
    # min(14, 6) = 6 rows.
    "ovq_min_state_size": ("ovq", dict(options={"ovq": dataclasses.replace(
        OVQ, min_state_size=True)}), 2, 14, [2 * 4 * (6 * 33 + 4 * 32) * 4 + 2 * 4] * 2),
    # RWKV-7: a 16 x 16 float32 state per (batch, head), the last input of width 64 in the compute
    # dtype and the int32 lengths, whatever the length.
    "rwkv7": ("rwkv7", {}, 2, 14, [2 * 4 * 16 * 16 * 4 + 2 * 64 * 4 + 2 * 4] * 2),
    "rwkv7_long": ("rwkv7", {}, 2, 4096, [2 * 4 * 16 * 16 * 4 + 2 * 64 * 4 + 2 * 4] * 2),
    "rwkv7_bf16": ("rwkv7", dict(compute_dtype="bfloat16"), 3, 14,
                   [3 * 4 * 16 * 16 * 4 + 3 * 64 * 2 + 3 * 4] * 2),
    # SWA of 5 keeps a ring of 5 keys and values (4 heads of 16, float32) and the int32 lengths.
    "swa_ovq": (("swa", "ovq"), {}, 2, 14,
                [2 * 5 * 4 * 32 * 4 + 2 * 4, 2 * 4 * (4 * 33 + 4 * 32) * 4 + 2 * 4]),
}


@pytest.mark.parametrize("name", list(CACHES))
def test_cache_bytes_by_hand(name):
  mixers, overrides, batch, max_len, want = CACHES[name]
  cfg = _model(mixers, **overrides)
  assert list(registry.cache_bytes(cfg, batch, max_len)) == want
