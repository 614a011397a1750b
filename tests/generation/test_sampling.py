"""Sampling (``kj.sample_logits``, ``kj.SamplingConfig``, sampled ``kj.generate``) against exact
distributions worked out by hand on hand-made logits.

``sample_logits`` does not expose its filtered logits, so every check compares the frequencies of
many draws (one jitted, vmapped call) with the exact probabilities. Bounds are 5 binomial standard
deviations per token: the tests are deterministic for their fixed keys, a correct sampler would
exceed the bound with probability < 1e-6 per token for another key, and every mistake these
tests guard against (temperature multiplied, k +- 1, a dropped top token, ``<=`` at the nucleus
boundary, filters in another order) moves some probability by more than 50 deviations, or draws a
token that must never be drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from tests.helpers import make_model

DRAWS = 20_000


def _frequencies(logits, sampling: kj.SamplingConfig, seed: int = 0) -> np.ndarray:
  """How often each token is drawn from ``logits [B, V]``, ``[B, V]``, over ``DRAWS`` keys."""
  keys = jax.random.split(jax.random.key(seed), DRAWS)
  draws = jax.jit(jax.vmap(lambda k: kj.sample_logits(logits, k, sampling)))(keys)  # [DRAWS, B]
  draws = np.asarray(draws)
  vocab = logits.shape[-1]
  return np.stack([np.bincount(row, minlength=vocab) for row in draws.T]) / DRAWS


def _assert_draws_follow(probs, sampling: kj.SamplingConfig, want, seed: int = 0):
  """Draws from ``log(probs)`` [B, V] (or [V]) follow ``want``, the exact distribution.

  Each frequency is a binomial proportion: standard deviation sqrt(p (1 - p) / DRAWS) <= 0.0036.
  A token with probability 0 has deviation 0: it must never be drawn."""
  probs, want = np.atleast_2d(probs), np.atleast_2d(np.asarray(want, np.float64))
  np.testing.assert_allclose(want.sum(-1), 1.0, atol=1e-12)  # the hand computation itself
  got = _frequencies(jnp.log(jnp.asarray(probs, jnp.float32)), sampling, seed)
  bound = 5 * np.sqrt(want * (1 - want) / DRAWS)
  assert np.all(np.abs(got - want) <= bound), (
      f"{sampling}: drawn frequencies\n{got.round(4)}\nexact probabilities\n{want.round(4)}")


def _sharpened(p, temperature: float) -> np.ndarray:
  """softmax(log(p) / T): p ** (1 / T), renormalized."""
  q = np.asarray(p, np.float64) ** (1 / temperature)
  return q / q.sum(-1, keepdims=True)


def _renormalized(p, keep) -> np.ndarray:
  """``p`` restricted to the token ids ``keep`` and renormalized."""
  q = np.zeros(len(p))
  q[list(keep)] = np.asarray(p)[list(keep)]
  return q / q.sum()


P3 = [0.5, 0.3, 0.2]
# Deliberately unsorted, so that no check can pass by keeping a prefix of the ids.
P5 = [0.1, 0.4, 0.05, 0.3, 0.15]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
  # T=0.5: [0.658, 0.237, 0.105]; multiplying instead gives p**0.5: [0.415, 0.322, 0.263].
  # T=2: the other way round. Either mistake moves >= 0.24 of mass: > 60 deviations.
  _assert_draws_follow(P3, kj.SamplingConfig(temperature=temperature),
                       _sharpened(P3, temperature))


def test_temperature_one_draws_the_softmax():
  _assert_draws_follow(P5, kj.SamplingConfig(temperature=1.0), P5)


def test_temperature_zero_is_the_argmax_of_each_row():
  logits = jnp.asarray([[0.1, 2.0, -1.0, 1.9], [3.0, 0.0, 0.0, 2.5], [-5.0, -4.0, -3.0, -3.5]])
  greedy = kj.SamplingConfig(temperature=0.0)
  for seed in range(3):  # the key plays no part
    got = kj.sample_logits(logits, jax.random.key(seed), greedy)
    np.testing.assert_array_equal(np.asarray(got), [1, 0, 2])
    assert got.dtype == jnp.int32


@pytest.mark.parametrize("top_k, keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 4]),
                                         (5, range(5)), (9, range(5))])
def test_top_k_keeps_the_k_most_likely(top_k, keep):
  # k - 1 or k + 1 tokens: a kept token never drawn or a dropped one drawn (probability 0: exact).
  _assert_draws_follow(P5, kj.SamplingConfig(top_k=top_k), _renormalized(P5, keep))


def test_top_k_after_the_temperature():
  # The k most likely tokens do not depend on T; their probabilities do: (p ** 2) over the three.
  want = _sharpened(_renormalized(P5, [1, 3, 4]), 0.5)
  _assert_draws_follow(P5, kj.SamplingConfig(temperature=0.5, top_k=3), want)


@pytest.mark.parametrize("top_p, keep", [
    # Sorted, P5 is 0.4 (id 1), 0.3 (id 3), 0.15 (id 4), 0.1 (id 0), 0.05 (id 2); running sums
    # 0.4, 0.7, 0.85, 0.95, 1.
    (0.2, [1]),            # below the top token's own mass: the top token is always kept
    (0.65, [1, 3]),        # 0.4 < 0.65 <= 0.7
    (0.75, [1, 3, 4]),     # 0.7 < 0.75 <= 0.85
    (0.9, [1, 3, 4, 0]),   # 0.85 < 0.9 <= 0.95
    (1.0, range(5)),
])
def test_top_p_keeps_the_smallest_prefix_that_reaches_p(top_p, keep):
  _assert_draws_follow(P5, kj.SamplingConfig(top_p=top_p), _renormalized(P5, keep))


def test_top_p_boundary_is_exact():
  """A nucleus whose mass equals p exactly is complete; p just above it takes one more token.

  Four equal logits have probabilities of exactly 0.25 in float32 (exp(0) / 4), and their running
  sums 0.25, 0.5, 0.75 are exact too, so the boundary is tested without rounding. Which of the tied
  tokens are kept is the sort's business: only the sorted frequencies are compared."""
  uniform = jnp.zeros((1, 4), jnp.float32)
  for top_p, kept in [(0.25, 1), (0.5 - 1e-3, 2), (0.5, 2), (0.5 + 1e-3, 3), (0.75, 3),
                      (0.75 + 1e-3, 4)]:
    got = np.sort(_frequencies(uniform, kj.SamplingConfig(top_p=top_p))[0])[::-1]
    want = np.array([1 / kept] * kept + [0.0] * (4 - kept))
    bound = 5 * np.sqrt(want * (1 - want) / DRAWS)  # as in _assert_draws_follow
    assert np.all(np.abs(got - want) <= bound), f"top_p={top_p}: {got.round(4)}, want {want}"


def test_top_k_then_top_p_on_the_renormalized_top_k():
  # top_k=3 leaves 0.4, 0.3, 0.15 -> 0.47, 0.353, 0.176: 0.47 + 0.353 = 0.82 reaches 0.8, so
  # the nucleus is two tokens. top-p on the unfiltered softmax would need 0.4 + 0.3 + 0.15.
  _assert_draws_follow(P5, kj.SamplingConfig(top_k=3, top_p=0.8), _renormalized(P5, [1, 3]))


def test_top_p_after_the_temperature():
  # T=0.5 turns [0.5, 0.3, 0.2] into [0.658, 0.237, 0.105]: 0.658 + 0.237 = 0.895 reaches 0.85,
  # a nucleus of two. Before the temperature 0.5 + 0.3 = 0.8 would not: three tokens.
  want = _renormalized(_sharpened(P3, 0.5), [0, 1])
  _assert_draws_follow(P3, kj.SamplingConfig(temperature=0.5, top_p=0.85), want)


@pytest.mark.parametrize("sampling", [kj.SamplingConfig(top_k=2), kj.SamplingConfig(top_p=0.75)])
def test_each_row_is_filtered_by_its_own_logits(sampling):
  # Mirror-image rows: both filters keep tokens {0, 1} of the first row and {2, 3} of the second.
  rows = np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]])
  want = [_renormalized(rows[0], [0, 1]), _renormalized(rows[1], [2, 3])]
  _assert_draws_follow(rows, sampling, want)


def test_bad_sampling_config():
  # float32 logits are divided by the temperature: NaN, infinity or a value that float32 rounds
  # to 0 or infinity would draw from NaN logits rather than fail.
  for temperature in (-0.1, float("nan"), float("inf"), 1e39, 1e-46):
    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or a number in"):
      kj.SamplingConfig(temperature=temperature)
  with pytest.raises(ValueError, match="top_k must be >= 1"):
    kj.SamplingConfig(top_k=0)
  for top_p in (0.0, 1.5, float("nan"), 1e-46):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
      kj.SamplingConfig(top_p=top_p)


# -- generate --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
  # A 64-token vocabulary: enough draws per id for a per-id bound (see below).
  return make_model("kvm", seed=0, vocab_size=64)


def _pooled(x, rare) -> np.ndarray:
  """The columns of ``x [B, V]`` with the ``rare`` ones summed into one last column."""
  return np.concatenate([x[:, ~rare], x[:, rare].sum(-1, keepdims=True)], -1)


def test_generate_draws_from_the_tempered_forward_logits(model):
  """1024 copies of one prompt, two sampled tokens each: per token id, the count of draws must
  match the sum over rows of softmax(forward logits / T), computed from the model's own forward
  pass over the generated sequences (not from generate's prefill and decode step).

  Given the prefix, each row's draw is an independent Bernoulli per token id, so the count minus
  its expectation has standard deviation sqrt(sum p (1 - p)); the bound is 5 of them. Ids expected
  fewer than 20 times are pooled into one bin, where that normal approximation would not hold.
  With this key the largest deviation is 2.4; drawing at T=1 instead of 0.5 (the temperature
  ignored) gives 13, at T=2 (multiplied) 23, greedily 90."""
  batch, temperature = 1024, 0.5
  prompt = jnp.tile(jnp.asarray([[5, 17, 42, 8]], jnp.int32), (batch, 1))
  out, lengths = kj.generate(model, prompt, max_new_tokens=2, key=jax.random.key(0),
                             sampling=kj.SamplingConfig(temperature=temperature))
  assert np.all(np.asarray(lengths) == 2)
  logits = np.asarray(nnx.jit(lambda m, tokens: m(tokens))(model, out), np.float64)
  out = np.asarray(out)
  for position in (prompt.shape[1], prompt.shape[1] + 1):
    p = np.exp(logits[:, position - 1] / temperature)
    p /= p.sum(-1, keepdims=True)
    drawn = np.eye(p.shape[-1])[out[:, position]]
    rare = p.sum(0) < 20
    p, drawn = _pooled(p, rare), _pooled(drawn, rare)
    z = np.abs(drawn.sum(0) - p.sum(0)) / np.sqrt((p * (1 - p)).sum(0))
    assert z.max() <= 5, f"token {position}: largest deviation {z.max():.1f} sd"


@pytest.mark.slow  # CI: the lm-eval adapter's top_k=1 and fixed-key samples go through generate
def test_generate_top_k_1_is_greedy_and_a_key_fixes_the_sample(model):
  prompt = jax.random.randint(jax.random.key(5), (2, 7), 0, model.cfg.vocab_size)

  def run(sampling, seed):
    return np.asarray(kj.generate(model, prompt, max_new_tokens=8, key=jax.random.key(seed),
                                  sampling=sampling)[0])

  greedy = run(kj.SamplingConfig(temperature=0.0), 0)
  np.testing.assert_array_equal(run(kj.SamplingConfig(temperature=1.0, top_k=1), 9), greedy)
  hot = kj.SamplingConfig(temperature=1.3, top_p=0.9)
  np.testing.assert_array_equal(run(hot, 1), run(hot, 1))
  # Another key, another sample: 16 near-uniform draws over 64 tokens all equal by chance: ~0.
  assert np.any(run(hot, 2) != run(hot, 1))
