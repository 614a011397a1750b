"""The GPTAlpha-2 LM: parameter counts, decode == forward for every mixer, causality, generation,
and a tiny KVM model that overfits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import kvm_jax as kj
from tests.helpers import decode_all, forward, in_ci, make_model, prefill

PATTERNS = {
    "kvm": "kvm", "full": "full", "swa": "swa", "bswa": "bswa",
    "kvm_swa_hybrid": ("swa", "kvm"), "full_bswa_hybrid": ("full", "bswa"),
    "ovq_swa_hybrid": ("swa", "ovq"), "rwkv7": "rwkv7",
}


def _model(mixers, seed=0, **kw) -> kj.LM:
  return make_model(mixers, seed, **kw)


@pytest.fixture(scope="module")
def models():
  return {name: _model(mixers) for name, mixers in PATTERNS.items()}


def test_paper_parameter_counts():
  c = kj.count_params(kj.presets.kvm256_120m())
  assert round(c["total"] / 1e6, 2) == 162.94 and round(c["non_embedding"] / 1e6, 2) == 85.68
  assert round(c["without_lm_head"] / 1e6, 2) == 124.31
  c = kj.count_params(kj.presets.kvm_sqrt16_350m())
  assert round(c["total"] / 1e6, 2) == 407.03 and round(c["non_embedding"] / 1e6, 2) == 304.00
  assert round(c["without_lm_head"] / 1e6, 2) == 355.51
  # KVM-specific parameters (LN_s, W_g, two temperature vectors): docs/kvm-spec.md §3.
  kvm_extra = c["total"] - kj.count_params(kj.presets.gpta2_350m())["total"]
  assert kvm_extra == 203136
  assert kj.count_params(kj.presets.kvm256_120m())["total"] - kj.count_params(
      kj.presets.gpta2_120m())["total"] == 58512


@pytest.mark.parametrize("overrides", [
    dict(mixers=("swa", "kvm", "swa", "kvm"), num_layers=4), dict(mixers="rwkv7"),
    dict(mixers="full", kv_sharing="fusedkv"),
    dict(mixers="kvm", kv_sharing="fusedkv", kvm_kv_sharing="shared_routing"),
    dict(mixers=("swa", "ovq"), num_kv_heads=None)], ids=lambda o: str(o["mixers"]))
def test_count_params_adds_up_the_whole_model(overrides):
  """count_params traces block by block (one whole-model trace is quadratic in the parameter
  count): it must equal the whole model's abstract parameters, reconstruction layers and fusion
  weights of cross-layer sharing included."""
  from kvm_jax.nn.model import abstract_param_count
  cfg = kj.presets.tiny(**overrides)
  assert kj.count_params(cfg)["total"] == abstract_param_count(lambda: kj.LM(cfg, rngs=nnx.Rngs(0)))


def test_baseline_parameter_counts_are_the_authors():
  """OVQ/SWA and RWKV-7 at the paper's sizes, as the authors' code counts them (their
  ``configs/prolong/{120M,350M}/{ovq_swa_ts_c256_s1024_wd,rwkv_wd}.yaml``)."""
  counts = {name: kj.count_params(getattr(kj.presets, name)()) for name in
            ("ovq_swa_120m", "ovq_swa_350m", "rwkv7_120m", "rwkv7_350m")}
  assert {name: (c["total"], c["non_embedding"]) for name, c in counts.items()} == {
      "ovq_swa_120m": (162_880_548, 85_613_604), "ovq_swa_350m": (406_816_864, 303_794_272),
      "rwkv7_120m": (167_688_192, 90_421_248), "rwkv7_350m": (421_212_160, 318_189_568)}


def test_presets_are_the_paper_models():
  hybrid = kj.presets.kvm_swa_sat1024_120m()
  assert hybrid.layer_mixers[:4] == ("swa", "kvm", "swa", "kvm")
  assert hybrid.rope_dims_of(0) == 128 and hybrid.rope_dims_of(1) == 64
  assert hybrid.value_anchor(4) == 0 and hybrid.value_anchor(5) == 1
  assert kj.presets.swa_nope_350m().rope_dims_of(1) == 0
  assert kj.presets.kvm256_350m().scale == 0.5
  assert kj.presets.bswa_120m().options_of("bswa").window_chunks == 3
  ovq = kj.presets.ovq_swa_350m()
  assert ovq.layer_mixers[:4] == ("swa", "ovq", "swa", "ovq") and ovq.num_layers == 24
  assert ovq.rope_dims_of(0) == 128 and ovq.rope_dims_of(1) == 0
  assert (ovq.options_of("ovq").chunk_size, ovq.options_of("ovq").max_centroids) == (256, 1024)
  assert ovq.value_anchor(5) == 1 and ovq.options_of("swa").window == 256
  assert kj.presets.rwkv7_350m().layer_mixers == ("rwkv7",) * 24


# The three hybrids and RWKV-7 hold all six mixer kinds; the other single-mixer models run nightly.
@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), {"kvm_swa_hybrid", "full_bswa_hybrid",
                                                          "ovq_swa_hybrid", "rwkv7"}))
def test_decode_matches_forward(models, name):
  model = models[name]
  T = 37
  tokens = jax.random.randint(jax.random.PRNGKey(3), (2, T), 0, model.cfg.vocab_size)
  full = forward(model, tokens)
  assert full.dtype == jnp.float32 and full.shape == (2, T, model.cfg.vocab_size)
  for prefix in (1, 5, 13, 21):  # < chunk, ragged, > window, past the first KVM update
    decoded, _ = decode_all(model, tokens, prefix)
    err = float(jnp.max(jnp.abs(decoded - full)))
    assert err < 2e-5 * float(jnp.max(jnp.abs(full))), (prefix, err)


@pytest.mark.parametrize("name", ["kvm", "kvm_swa_hybrid", "bswa"])
def test_causality(models, name):
  model = models[name]
  T = 40
  tokens = jax.random.randint(jax.random.PRNGKey(4), (1, T), 0, model.cfg.vocab_size)
  base = np.asarray(forward(model, tokens))
  rng = np.random.default_rng(0)
  for t in rng.choice(T, size=3, replace=False):
    changed = tokens.at[0, t].set((tokens[0, t] + 1) % model.cfg.vocab_size)
    out = np.asarray(forward(model, changed))
    np.testing.assert_array_equal(out[:, :t], base[:, :t])
    assert np.abs(out[:, t] - base[:, t]).max() > 0


def test_generation_greedy_is_argmax_of_forward(models):
  model = models["kvm_swa_hybrid"]
  prompt = jax.random.randint(jax.random.PRNGKey(5), (2, 7), 0, model.cfg.vocab_size)
  out, lengths = kj.generate(model, prompt, max_new_tokens=20, key=jax.random.PRNGKey(0),
                             sampling=kj.SamplingConfig(temperature=0.0))
  assert out.shape == (2, 27) and np.all(np.asarray(lengths) == 20)
  logits = forward(model, out)
  np.testing.assert_array_equal(np.asarray(out[:, 7:]), np.asarray(jnp.argmax(logits[:, 6:-1], -1)))
  # Sampled generation (temperature, top-k, top-p, keys): tests/generation/test_sampling.py.


@pytest.mark.parametrize("name", in_ci(["kvm", "full_bswa_hybrid"], {"kvm"}))
def test_bucketed_prefill_generates_the_same(models, name):
  """prefill_bucket prefills a bucket-aligned prefix and decodes the prompt's tail token by
  token: greedy output must equal a whole-prompt prefill (decode == prefill)."""
  model = models[name]
  prompt = jax.random.randint(jax.random.PRNGKey(8), (2, 21), 0, model.cfg.vocab_size)
  greedy = kj.SamplingConfig(temperature=0.0)
  whole, _ = kj.generate(model, prompt, max_new_tokens=6, key=jax.random.PRNGKey(0),
                         sampling=greedy)
  for bucket in (8, 64):  # a 16-token prefill + 5 decoded; a 1-token prefill + 20 decoded
    bucketed, _ = kj.generate(model, prompt, max_new_tokens=6, key=jax.random.PRNGKey(0),
                              sampling=greedy, prefill_bucket=bucket, max_len=40)
    np.testing.assert_array_equal(np.asarray(bucketed), np.asarray(whole))
  with pytest.raises(ValueError, match="prefill_bucket"):
    kj.generate(model, prompt, max_new_tokens=2, key=jax.random.PRNGKey(0), prefill_bucket=0)


def test_generation_stop_tokens(models):
  model = models["kvm"]
  prompt = jax.random.randint(jax.random.PRNGKey(6), (2, 5), 0, model.cfg.vocab_size)
  greedy = kj.SamplingConfig(temperature=0.0)
  free, _ = kj.generate(model, prompt, max_new_tokens=12, key=jax.random.PRNGKey(0), sampling=greedy)
  stop = int(free[0, 5 + 3])  # the 4th generated token of sequence 0
  out, lengths = kj.generate(model, prompt, max_new_tokens=12, key=jax.random.PRNGKey(0),
                             sampling=greedy, stop_tokens=[stop], pad_token=255)
  first = int(np.argmax(np.asarray(free[0, 5:]) == stop))
  assert int(lengths[0]) == first + 1
  assert np.all(np.asarray(out[0, 5 + first + 1:]) == 255)
  np.testing.assert_array_equal(np.asarray(out[0, :5 + first + 1]), np.asarray(free[0, :5 + first + 1]))


def test_bad_model_input():
  with pytest.raises(ValueError, match="unknown mixer 'mamba'"):
    kj.presets.tiny(mixers=("kvm", "mamba"))
  with pytest.raises(ValueError, match="3 entries but num_layers=2"):
    kj.presets.tiny(mixers=("kvm", "kvm", "kvm"))
  with pytest.raises(ValueError, match="must divide num_heads"):
    kj.presets.tiny(num_kv_heads=3)
  with pytest.raises(ValueError, match="rope_dims=7"):
    kj.presets.tiny(mixers="full", rope_dims=7)
  with pytest.raises(ValueError, match="not divisible by num_heads"):
    kj.presets.tiny(hidden_size=66)
  model = kj.LM(kj.presets.tiny(), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="token id 300 is outside the vocabulary"):
    model(jnp.array([[1, 300]]))
  with pytest.raises(ValueError, match="exceeds the cache max_len=4"):
    model.prefill(jnp.zeros((1, 6), jnp.int32), model.init_cache(1, 4))
  with pytest.raises(ValueError, match="exceeds max_len=8"):
    kj.generate(model, jnp.zeros((1, 6), jnp.int32), max_new_tokens=5, key=jax.random.PRNGKey(0),
                max_len=8)


@pytest.mark.slow  # GQA decode is also checked at the op level in CI (tests/ops/kvm/test_kvm_decode.py)
def test_gqa_model_decode_matches_forward():
  model = _model("kvm", seed=3, num_kv_heads=2)
  tokens = jax.random.randint(jax.random.PRNGKey(8), (1, 29), 0, 256)
  decoded, _ = decode_all(model, tokens, 11)
  assert float(jnp.max(jnp.abs(decoded - forward(model, tokens)))) < 1e-4


@pytest.mark.slow  # trains; the model's semantics are pinned by tests/nn/test_reference_model.py
def test_tiny_kvm_model_overfits():
  cfg = kj.presets.tiny(mixers="kvm")
  model = kj.LM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 33), 0, cfg.vocab_size)
  inputs, labels = tokens[:, :-1], tokens[:, 1:]
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer):
    def loss_fn(model):
      logits = model(inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer)) for _ in range(250)]
  assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


@pytest.mark.slow  # CI's training tests run the split model under jit and grad
def test_split_model_runs_under_plain_jit_and_grad(models):
  model = models["kvm_swa_hybrid"]
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.PRNGKey(10), (2, 42), 0, model.cfg.vocab_size)  # > L + C

  def loss(state, tokens):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  value, grads = jax.jit(jax.value_and_grad(loss))(state, tokens)
  np.testing.assert_allclose(float(value), float(loss(state, tokens)), rtol=1e-5)
  leaves = jax.tree_util.tree_leaves(grads)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
  kvm_block = grads["blocks"][1]["attn"]
  for name in ("state_temperature", "window_temperature"):  # KVM-only parameters get gradient
    assert np.any(np.asarray(kvm_block[name][...]))
  assert np.any(np.asarray(kvm_block["key_weighting"]["kernel"][...]))


def test_bf16_compute_keeps_float32_logits_and_state():
  cfg32 = kj.presets.tiny(mixers=("swa", "kvm"))
  cfg16 = kj.presets.tiny(mixers=("swa", "kvm"), compute_dtype="bfloat16")
  m32, m16 = kj.LM(cfg32, rngs=nnx.Rngs(0)), kj.LM(cfg16, rngs=nnx.Rngs(0))
  nnx.update(m16, nnx.state(_model(("swa", "kvm"), seed=4), nnx.Param))
  nnx.update(m32, nnx.state(_model(("swa", "kvm"), seed=4), nnx.Param))
  tokens = jax.random.randint(jax.random.PRNGKey(11), (1, 30), 0, 256)
  l32, l16 = forward(m32, tokens), forward(m16, tokens)
  assert l16.dtype == jnp.float32
  # bf16 activations: ~3 significant digits through 2 layers; a loose relative bound.
  rel = float(jnp.sqrt(jnp.mean((l16 - l32) ** 2) / jnp.mean(l32 ** 2)))
  assert rel < 5e-2, rel
  caches = m16.init_cache(1, 30)
  _, caches = prefill(m16, tokens, caches)
  assert caches[1].mixer.state.keys.dtype == jnp.float32
