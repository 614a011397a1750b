"""Cross-layer KV sharing (FusedKV, FusedKV-Lite, YOCO, CLA; window-only fusion for KVM layers):
init equivalence, folded == materialized, the relative-position property of tied rotary pairs,
decode == forward, cache bytes, gradients and bad configs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.nn.model import LM
from kvm_jax.ops.attention import dense as attn_ops
from kvm_jax.ops import kv_fusion
from kvm_jax.ops.kvm.cases import random_inputs, random_params
from kvm_jax.ops.kvm.scan import kvm_attention_scan
from kvm_jax.ops.kvm.shared_routing import SourceTrack, kvm_attention_shared_state
from kvm_jax.ops.rope import apply_rope, rope_tables
from tests.helpers import decode_all, forward, in_ci, make_model

MODES = ("fusedkv", "fusedkv_lite", "yoco", "cla")


def _random_weights(key, S, Hkv, D, r):
  k1, k2 = jax.random.split(key)
  return kv_fusion.expand_key_weights(jax.random.normal(k1, (S, Hkv, r // 2)),
                                      jax.random.normal(k2, (S, Hkv, D - r)))


@pytest.mark.parametrize("kind", ["full", "swa", "bswa"])
def test_folded_attention_equals_materialized(kind):
  """(q⊙a_1)·K_1 + (q⊙a_n)·K_n over the stacked head dim == q·(a_1⊙K_1 + a_n⊙K_n)."""
  B, T, H, Hkv, D = 2, 29, 4, 2, 16
  ks = jax.random.split(jax.random.PRNGKey(0), 8)
  q = jax.random.normal(ks[0], (B, T, H, D))
  keys = [jax.random.normal(ks[i], (B, T, Hkv, D)) for i in (1, 2)]
  values = [jax.random.normal(ks[i], (B, T, Hkv, D)) for i in (3, 4)]
  key_w = _random_weights(ks[5], 2, Hkv, D, 8)
  value_w = jax.random.normal(ks[6], (2, Hkv, D))
  ops = {"full": attn_ops.full_attention,
         "swa": lambda q, k, v, scale=None: attn_ops.sliding_window_attention(q, k, v, 5, scale),
         "bswa": lambda q, k, v, scale=None: attn_ops.block_sliding_window_attention(
             q, k, v, 8, 2, 1, scale=scale)}
  op = ops[kind]
  folded = kv_fusion.unfold_output(
      op(kv_fusion.fold_queries(q, key_w), kv_fusion.stack_sources(keys),
         kv_fusion.stack_sources(values), scale=1 / np.sqrt(D)), value_w)
  materialized = op(q, kv_fusion.materialize(keys, key_w), kv_fusion.materialize(values, value_w))
  # float32; the folded logits sum 2D products in another order
  np.testing.assert_allclose(folded, materialized, rtol=2e-5, atol=2e-5)


def test_tied_rotary_pairs_keep_logits_relative():
  """Shifting every position leaves fused logits unchanged iff the two weights of each rotary pair
  are tied (interleaved RoPE pairs channels (2j, 2j+1)); untied weights break it."""
  Hkv, D, r, T = 2, 16, 12, 6
  ks = jax.random.split(jax.random.PRNGKey(1), 6)
  q = jax.random.normal(ks[0], (1, T, Hkv, D))
  k1, kn = (jax.random.normal(k, (1, T, Hkv, D)) for k in ks[1:3])
  tied = _random_weights(ks[3], 2, Hkv, D, r)
  untied = jax.random.normal(ks[4], (2, Hkv, D))

  def logits(weights, offset):
    cos, sin = rope_tables(jnp.arange(T)[None] + offset, D, r, 10000.0, jnp.float32)
    rot = lambda x: apply_rope(x, cos, sin)
    fused = kv_fusion.materialize([rot(k1), rot(kn)], weights)
    return jnp.einsum("bqhd,bkhd->bhqk", rot(q), fused)

  np.testing.assert_allclose(logits(tied, 0), logits(tied, 1000), rtol=1e-4, atol=1e-4)
  assert float(jnp.max(jnp.abs(logits(untied, 0) - logits(untied, 1000)))) > 1e-2


def _copy_common_params(src: LM, dst: LM) -> None:
  """Gives ``dst`` every parameter it shares (by path) with ``src``."""
  nnx.update(dst, nnx.state(src, nnx.Param))


@pytest.mark.parametrize("mixer", ["full", "kvm"])
def test_fusedkv_at_init_equals_lite(mixer):
  lite = make_model(mixer, seed=2, num_layers=4, kv_sharing="fusedkv_lite")
  fused = kj.LM(kj.presets.tiny(mixers=mixer, num_layers=4, kv_sharing="fusedkv"),
                rngs=nnx.Rngs(0))
  _copy_common_params(lite, fused)
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 30), 0, 256)
  # Identical in exact arithmetic (weights 0 and 1); float32 sums over the stacked head dim.
  np.testing.assert_allclose(forward(fused, tokens), forward(lite, tokens), rtol=0, atol=2e-6)
  mean = kj.LM(kj.presets.tiny(mixers=mixer, num_layers=4, kv_sharing="fusedkv",
                               fusedkv_init="mean"), rngs=nnx.Rngs(0))
  _copy_common_params(lite, mean)
  assert float(jnp.max(jnp.abs(forward(mean, tokens) - forward(lite, tokens)))) > 1e-3


class _SharedModels(dict):
  """The models of the decode tests, built when first asked for (most run only nightly)."""

  def __missing__(self, key):
    mixer, mode = key
    if mixer == "kvm-shared" and mode == "none":
      model = self["kvm", "none"]
    else:
      extra = {"kvm_kv_sharing": "shared_routing"} if mixer == "kvm-shared" else {}
      model = make_model("kvm" if mixer == "kvm-shared" else mixer, seed=4, num_layers=4,
                         num_kv_heads=2, kv_sharing=mode, fusedkv_init="mean", **extra)
    self[key] = model
    return model


@pytest.fixture(scope="module")
def shared_models():
  return _SharedModels()


# In CI: full attention's folded FusedKV, KVM's window fusion (Lite), KVM's shared routing and a
# CLA pair of BSWA layers; the whole matrix (YOCO, SWA, every mode per kind) nightly.
DECODE_IN_CI = {"full-fusedkv", "kvm-fusedkv_lite", "kvm-shared-fusedkv", "bswa-cla"}


@pytest.mark.parametrize("mixer,mode", in_ci(
    [("full", m) for m in MODES] + [("kvm", m) for m in MODES] + [("kvm-shared", m) for m in MODES]
    + [("swa", "fusedkv"), ("bswa", "fusedkv"), ("bswa", "cla")], DECODE_IN_CI,
    ids=lambda p: "-".join(p)))
def test_decode_matches_forward_and_cache_bytes(shared_models, mixer, mode):
  model, vanilla = shared_models[mixer, mode], shared_models[mixer, "none"]
  # 45 tokens with C=8, L=16: the decode crosses several state updates (folds at 32 and 40).
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 45), 0, 256)
  decoded, caches = decode_all(model, tokens, prompt=19)
  np.testing.assert_allclose(decoded, forward(model, tokens), rtol=1e-5, atol=2e-5)
  vanilla_caches = vanilla.init_cache(2, tokens.shape[1])  # bytes do not depend on contents
  per_layer, vanilla_per_layer = LM.cache_bytes(caches), LM.cache_bytes(vanilla_caches)
  storage = [i for i in range(4) if model.cfg.kv_sources(i) is None]
  assert storage == ([0, 2] if mode == "cla" else [0, 1])
  if mixer != "kvm":  # reconstruction layers store nothing: n/L (FusedKV/Lite/YOCO), 1/2 (CLA)
    # (kvm-shared: shared routing, the upper layers read their sources' states and windows)
    assert sum(per_layer) * 2 == sum(vanilla_per_layer)
    assert all(per_layer[i] == 0 for i in range(4) if i not in storage)
  else:  # window-only fusion: an upper KVM layer keeps its state, not its window K/V
    cache = caches[3].mixer
    assert cache.window_keys is None and cache.window_values is None
    window_kv = (vanilla_caches[3].mixer.window_keys.nbytes
                 + vanilla_caches[3].mixer.window_values.nbytes)
    assert per_layer[3] == vanilla_per_layer[3] - window_kv


@pytest.mark.parametrize("mixer", in_ci(["full", "kvm", "kvm-shared"], {"kvm", "kvm-shared"}))
def test_gradients_reach_the_fusion_weights(mixer):
  extra = {"kvm_kv_sharing": "shared_routing"} if mixer == "kvm-shared" else {}
  model = make_model(mixer.split("-")[0], seed=6, num_layers=4, kv_sharing="fusedkv", **extra)
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 24), 0, 256)

  def loss(p):
    logits = nnx.merge(graphdef, p)(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  grads = jax.jit(jax.grad(loss))(params)
  for layer in (2, 3):
    attn = grads["blocks"][layer]["attn"]
    for name in ("fuse_k_rotary", "fuse_k_free", "fuse_v"):
      assert float(jnp.max(jnp.abs(attn[name][...]))) > 0, (layer, name)
    assert "c_k" not in attn and "c_v" not in attn  # reconstruction layers project no K/V


def test_reconstruction_layers_have_no_kv_projections():
  vanilla = kj.count_params(kj.presets.tiny(mixers="full", num_layers=4))["total"]
  lite = kj.count_params(kj.presets.tiny(mixers="full", num_layers=4,
                                         kv_sharing="fusedkv_lite"))["total"]
  fused = kj.count_params(kj.presets.tiny(mixers="full", num_layers=4,
                                          kv_sharing="fusedkv"))["total"]
  cfg = kj.presets.tiny(mixers="full", num_layers=4)
  C, H, D = cfg.hidden_size, cfg.kv_heads, cfg.qk_head_dim
  per_layer_kv = (2 * C * H * D                  # c_k, c_v (no biases)
                  + 2 * D                        # ln_k
                  + 2 * H * D                    # token-shift x_k, x_v
                  + H * D                        # value-residual v_gate0
                  + C * cfg.value_lora_width     # v_gate1
                  + cfg.value_lora_width * H * D)  # v_gate2
  assert vanilla - lite == 2 * per_layer_kv
  r = cfg.rope_dims
  assert fused - lite == 2 * 2 * H * (r // 2 + (D - r) + D)  # 2 layers x 2 sources


def test_bad_sharing_configs():
  with pytest.raises(ValueError, match="even num_layers"):
    kj.presets.tiny(mixers="full", num_layers=3, kv_sharing="fusedkv")
  with pytest.raises(ValueError, match="adjacent pairs"):
    kj.presets.tiny(mixers="full", num_layers=5, kv_sharing="cla")
  with pytest.raises(ValueError, match="layer 2 \\(swa\\) would reuse the K/V of layer 1 \\(full\\)"):
    kj.presets.tiny(mixers=("full", "full", "swa", "swa"), num_layers=4, kv_sharing="yoco")
  with pytest.raises(ValueError, match="kv_sharing='mla'"):
    kj.presets.tiny(kv_sharing="mla")
  with pytest.raises(ValueError, match="fusedkv_init"):
    kj.presets.tiny(num_layers=4, kv_sharing="fusedkv", fusedkv_init="zeros")
  with pytest.raises(ValueError, match="kvm_kv_sharing='rows'"):
    kj.presets.tiny(num_layers=4, kv_sharing="fusedkv", kvm_kv_sharing="rows")
  bf16_readout = kj.KVMConfig(chunk_size=8, window_chunks=2, rope_dims=8,
                              budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8),
                              readout_value_dtype="bfloat16")
  with pytest.raises(ValueError, match="does not support kvm.readout_value_dtype"):
    kj.presets.tiny(num_layers=4, kv_sharing="fusedkv", kvm_kv_sharing="shared_routing",
                    options={"kvm": bf16_readout})
  # GQA composes: the sources and the reconstruction layers share one KV-head layout.
  cfg = kj.presets.tiny(mixers="full", num_layers=4, num_kv_heads=2, kv_sharing="fusedkv")
  assert cfg.kv_layout(0) == cfg.kv_layout(3)
  assert dataclasses.replace(cfg, kv_sharing="none").kv_sources(3) is None


# -- shared routing: the decisions are applied exactly, and replaying a state reproduces it ------


def _op_inputs(seed, T=53, H=4, Hkv=2, D=16):
  q, k, v, g = random_inputs(seed, 2, T, H, Hkv, D, D)
  return q, k, v, g, random_params(seed, D, H)


OP_CFG = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                      budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))


def test_the_public_ops_return_named_results_of_one_shape_per_request():
  """``kvm_attention`` returns a ``KVMOutput`` (y, state), ``kvm_prefill`` and
  ``kvm_decode_step`` a ``KVMStepOutput`` (y, cache); with ``return_routing`` their ``Routed``
  forms, whose ``routing`` fed back reproduces the run (the applied decisions, not a copy of
  another field)."""
  q, k, v, g, params = _op_inputs(0)
  plain = kj.kvm_attention(q, k, v, g, params, OP_CFG)
  routed = kj.kvm_attention(q, k, v, g, params, OP_CFG, return_routing=True)
  assert type(plain) is kj.KVMOutput and type(routed) is kj.RoutedKVMOutput
  assert plain._fields == ("y", "state") and routed._fields == ("y", "state", "routing")
  np.testing.assert_array_equal(routed.y, plain.y)
  replayed = kj.kvm_attention(q, k, v, g, params, OP_CFG, routing=routed.routing)
  np.testing.assert_array_equal(replayed.state.keys, plain.state.keys)
  cache = kj.kvm_init_cache(OP_CFG, batch=2, kv_heads=2, head_dim=16, value_dim=16, max_len=40)
  pre = kj.kvm_prefill(q[:, :31], k[:, :31], v[:, :31], g[:, :31], params, OP_CFG, cache,
                       return_routing=True)
  step = kj.kvm_decode_step(q[:, 31:32], k[:, 31:32], v[:, 31:32], g[:, 31:32], params, OP_CFG,
                            pre.cache)
  assert type(pre) is kj.RoutedKVMStepOutput and type(step) is kj.KVMStepOutput
  assert pre._fields == ("y", "cache", "routing") and step._fields == ("y", "cache")
  assert isinstance(step.cache, kj.KVMCache) and step.y.shape == (2, 1, 4, 16)


def test_given_routing_is_applied_exactly():
  q, k, v, g, params = _op_inputs(0)
  y, state, routing = kvm_attention_scan(q, k, v, g, params, cfg=OP_CFG, return_routing=True)
  # (a) Feeding a run's own decisions back changes nothing.
  y2, state2 = kvm_attention_scan(q, k, v, g, params, cfg=OP_CFG, routing=routing)
  np.testing.assert_array_equal(y2, y)
  np.testing.assert_array_equal(state2.keys, state.keys)
  # (b) Other tokens under these decisions: each row's value sum, rebuilt in numpy from the
  # decisions alone, matches (initial rows = the first chunk's tokens; appends ungated; merges
  # gated, docs/kvm-spec.md §6.7).
  _, k_b, v_b, g_b, _ = _op_inputs(1)
  _, state_b = kvm_attention_scan(q, k_b, v_b, g_b, params, cfg=OP_CFG, routing=routing)
  sched = kj.kvm_schedule(OP_CFG, q.shape[1])
  C, R = OP_CFG.chunk_size, sched.final_rows
  vb, gb = np.asarray(v_b, np.float64), np.asarray(g_b, np.float64)
  dest, target = (np.asarray(x) for x in routing)
  want = np.zeros((2, 2, R + 1, 16))
  want[:, :, :C] = np.transpose(vb[:, :C], (0, 2, 1, 3))
  for c, fired in enumerate(sched.update_after):
    if not fired:
      continue
    start = (c - OP_CFG.window_chunks + 1) * C  # the chunk leaving the window
    for b in range(2):
      for h in range(2):
        for i in range(C):
          tok = start + i
          if dest[c, b, h, i] < R:
            want[b, h, dest[c, b, h, i]] += vb[b, tok, h]
          if target[c, b, h, i] < R:
            want[b, h, target[c, b, h, i]] += gb[b, tok, h] * vb[b, tok, h]
  np.testing.assert_allclose(np.asarray(state_b.values), want[:, :, :R], rtol=1e-5, atol=1e-5)
  assert int(state_b.num_rows) == int(state.num_rows)


def test_replayed_state_reproduces_the_layer():
  """A fused-state layer with one source and weight 1 replays that source's state from its tokens
  and routing; with the source's own queries it must reproduce the source layer's output."""
  q, k, v, g, params = _op_inputs(2)
  y, _, routing = kvm_attention_scan(q, k, v, g, params, cfg=OP_CFG, return_routing=True)
  replayed = kvm_attention_shared_state(q, k, v, (SourceTrack(k, v, g, params),), None, None,
                                        params, routing, cfg=OP_CFG, key_tracks=(0,),
                                        value_tracks=(0,))
  np.testing.assert_allclose(replayed, y, rtol=1e-5, atol=1e-5)
