"""The engine (kvm_jax/engine.py) and the per-row caches under it (kvm_jax/nn/cache.py).

Oracle: every request run *alone* on a one-row cache, from position 0, through the model's
prefill and decode step (no slots, no resets, no row selection, no copies), and, for a few
prompts, ``kj.generate`` itself (parallel prefill). A request served among others must give the
same greedy tokens and logits within 1e-5 (float32: the engine's rows and the alone run differ
only in the batch size of the same matmuls, measured <= 1e-6 apart on tiny models).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.engine import Engine, generate_many, sample_rows, sampling_rows
from kvm_jax.nn.cache import cache_lengths, copy_row, reset_rows
from tests.conftest import decode_step, in_ci, make_model, prefill

GREEDY = kj.SamplingConfig(temperature=0.0)
LOGIT_TOL = 1e-5

# Every mixer kind, and both kinds of cross-layer KV sharing. The three hybrids, RWKV-7 and
# shared routing run in CI (all six kinds' caches and both sharing paths); the rest nightly.
PATTERNS = {
    "kvm_swa_hybrid": dict(mixers=("swa", "kvm")),
    "full_bswa_hybrid": dict(mixers=("full", "bswa")),
    "ovq_swa_hybrid": dict(mixers=("swa", "ovq"), num_kv_heads=None),
    "rwkv7": dict(mixers="rwkv7"),
    "kvm_shared_routing": dict(mixers="kvm", kv_sharing="fusedkv",
                               kvm_kv_sharing="shared_routing"),
    "kvm": dict(mixers="kvm"),
    "kvm_window_fusion": dict(mixers="kvm", kv_sharing="fusedkv"),
    "full_fusedkv": dict(mixers="full", kv_sharing="fusedkv"),
}
CI_PATTERNS = {"kvm_swa_hybrid", "full_bswa_hybrid", "ovq_swa_hybrid", "rwkv7",
               "kvm_shared_routing"}

_models: dict = {}


def _model(name: str) -> kj.LM:
  if name not in _models:
    overrides = dict(PATTERNS[name])
    _models[name] = make_model(overrides.pop("mixers"), 0, **overrides)
  return _models[name]


def alone(model: kj.LM, prompt, max_new_tokens: int, max_len: int, stop_tokens=()):
  """Greedy tokens and the logits each was drawn from, for ``prompt`` alone on a one-row cache:
  the first token prefilled, the rest of the prompt and the generated tokens decoded (one
  compiled program per model, whatever the prompt's length)."""
  logits, caches = prefill(model, jnp.asarray([prompt[:1]], jnp.int32),
                           model.init_cache(1, max_len))
  for token in prompt[1:]:
    logits, caches = decode_step(model, jnp.asarray([[token]], jnp.int32), caches)
  tokens, drawn_from = [], []
  while True:
    row = np.asarray(logits[0, -1])
    tokens.append(int(np.argmax(row)))
    drawn_from.append(row)
    if tokens[-1] in stop_tokens or len(tokens) == max_new_tokens:
      return tokens, drawn_from
    logits, caches = decode_step(model, jnp.asarray([[tokens[-1]]], jnp.int32), caches)


def assert_logits_close(got, want, what):
  assert len(got) == len(want), what
  for i, (a, b) in enumerate(zip(got, want)):
    scale = max(1.0, float(np.max(np.abs(b))))
    err = float(np.max(np.abs(np.asarray(a) - b)))
    assert err <= LOGIT_TOL * scale, f"{what}: token {i} logits {err:.2e} from the alone run"


def random_requests(rng, count, max_len, longest_prompt=None):
  """``count`` (prompt, max_new_tokens) with prompt lengths from 1 up and outputs from 1 up,
  each fitting ``max_len``."""
  longest_prompt = longest_prompt or max_len - 1
  out = []
  for _ in range(count):
    length = int(rng.integers(1, longest_prompt + 1))
    new = int(rng.integers(1, max_len - length + 1))
    out.append((rng.integers(0, 256, length).tolist(), new))
  return out


def serve(engine, requests, rng, cancel_rate=0.0, per_step=2):
  """Submits ``requests`` a few at a time between steps (random arrival), cancels some at random
  points (waiting, prefilling or decoding); returns the request ids and the cancelled ones."""
  ids, cancelled, pending = [], set(), list(requests)
  while pending or engine.busy:
    for _ in range(int(rng.integers(0, per_step + 1))):
      if pending:
        prompt, new = pending.pop(0)
        ids.append(engine.submit(prompt, max_new_tokens=new, sampling=GREEDY))
    live = [rid for rid in ids if not engine.result(rid).done]
    if live and rng.random() < cancel_rate:
      victim = live[int(rng.integers(len(live)))]
      assert engine.cancel(victim)
      cancelled.add(victim)
    engine.step()
  return ids, cancelled


@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), CI_PATTERNS))
def test_engine_requests_equal_their_alone_runs(name):
  """Random arrival, prompt lengths from 1 to max_len - 1, slot reuse; prefill pieces of 5
  tokens cross the chunk (8) and window (16) boundaries, and so do the decodes (the KVM budget
  grows from 8 rows at 16·... tokens: a growth step is crossed mid-request)."""
  model = _model(name)
  rng = np.random.default_rng(11)
  max_len = 48
  requests = random_requests(rng, 10, max_len)
  engine = Engine(model, slots=3, max_len=max_len, prefill_chunk=5, keep_logits=True)
  ids, _ = serve(engine, requests, rng)
  for rid, (prompt, new) in zip(ids, requests):
    result = engine.result(rid)
    tokens, logits = alone(model, prompt, new, max_len)
    assert result.tokens == tokens, (name, rid, len(prompt))
    assert result.finish_reason == "length"
    assert_logits_close(result.logits, logits, f"{name} request {rid}")


def test_prefill_bucket_admission_equals_alone_runs():
  """``prefill_bucket``: a prompt's head prefilled in parallel and inserted into its slot (while
  other slots hold running requests), the rest fed in pieces: each request still equals its
  alone run."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(12)
  max_len = 48
  requests = random_requests(rng, 8, max_len)
  engine = Engine(model, slots=3, max_len=max_len, prefill_chunk=4, prefill_bucket=8,
                  keep_logits=True)
  ids, _ = serve(engine, requests, rng)
  assert any(len(p) > 9 for p, _ in requests)  # some heads were prefilled
  for rid, (prompt, new) in zip(ids, requests):
    tokens, logits = alone(model, prompt, new, max_len)
    assert engine.result(rid).tokens == tokens, rid
    assert_logits_close(engine.result(rid).logits, logits, f"request {rid}")


def test_greedy_engine_tokens_equal_generate():
  """``generate_many`` gives, per prompt, ``kj.generate``'s tokens for that prompt alone (its
  parallel prefill), stop tokens included."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (1, 9, 17, 30)]
  got = generate_many(model, prompts, max_new_tokens=12, slots=2, prefill_chunk=16)
  for prompt, tokens in zip(prompts, got):
    want, count = kj.generate(model, jnp.asarray([prompt]), max_new_tokens=12,
                              key=jax.random.PRNGKey(0), sampling=GREEDY)
    assert tokens == np.asarray(want[0, len(prompt):]).tolist()
  stop = got[1][4]  # a token the second prompt generates: it must stop there
  stopped = generate_many(model, prompts[1:2], max_new_tokens=12, stop_tokens=(stop,))
  assert stopped == [got[1][:got[1].index(stop) + 1]]


def test_sampled_engine_tokens_equal_generate_with_their_seeds():
  """Request ``i`` of ``generate_many(seed=s)`` draws what ``kj.generate`` of its prompt alone
  draws with ``PRNGKey(s + i)``, under temperature, top-k and top-p together."""
  model = _model("full_bswa_hybrid")
  rng = np.random.default_rng(4)
  prompts = [rng.integers(0, 256, n).tolist() for n in (3, 11, 20)]
  sampling = kj.SamplingConfig(temperature=1.3, top_k=40, top_p=0.9)
  got = generate_many(model, prompts, max_new_tokens=10, sampling=sampling, seed=7, slots=3)
  for i, (prompt, tokens) in enumerate(zip(prompts, got)):
    want, _ = kj.generate(model, jnp.asarray([prompt]), max_new_tokens=10,
                          key=jax.random.PRNGKey(7 + i), sampling=sampling)
    assert tokens == np.asarray(want[0, len(prompt):]).tolist(), i
  assert len({tuple(t) for t in got}) == 3


def test_slot_reuse_after_eviction_and_cancellation_leaks_nothing():
  """Hundreds of requests through three slots, a quarter of the steps cancelling one at random
  (waiting, mid-prefill, mid-decode): every request that finishes equals its alone run, so no
  slot carries anything of the request it held before."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(5)
  max_len = 40
  requests = random_requests(rng, 240, max_len, longest_prompt=24)
  requests = [(p, min(n, 6)) for p, n in requests]
  engine = Engine(model, slots=3, max_len=max_len, prefill_chunk=8, keep_logits=True)
  ids, cancelled = serve(engine, requests, rng, cancel_rate=0.2, per_step=1)
  assert 30 < len(cancelled) < 150
  references: dict = {}
  for rid, (prompt, new) in zip(ids, requests):
    result = engine.result(rid)
    if rid in cancelled:
      assert result.finish_reason == "cancelled" and len(result.tokens) < new
      continue
    key = (tuple(prompt), new)
    if key not in references:
      references[key] = alone(model, prompt, new, max_len)
    tokens, logits = references[key]
    assert result.tokens == tokens, rid
    assert_logits_close(result.logits, logits, f"request {rid}")


def test_n_samples_equal_separate_runs_with_their_seeds():
  """``submit_samples(n=3, seed=s)`` feeds the prompt once and copies its row; each sample
  equals a request of its own with seed ``s + i``."""
  model = _model("kvm_swa_hybrid")
  prompt = np.random.default_rng(6).integers(0, 256, 21).tolist()
  sampling = kj.SamplingConfig(temperature=1.0)
  engine = Engine(model, slots=4, max_len=40, prefill_chunk=8, keep_logits=True)
  other = engine.submit(prompt[:5], max_new_tokens=9, sampling=sampling, seed=1)
  samples = engine.submit_samples(prompt, 3, max_new_tokens=8, sampling=sampling, seed=20)
  engine.run()
  separate = Engine(model, slots=1, max_len=40, prefill_chunk=8, keep_logits=True)
  for i, rid in enumerate(samples):
    alone_id = separate.submit(prompt, max_new_tokens=8, sampling=sampling, seed=20 + i)
    separate.run()
    assert engine.result(rid).tokens == separate.result(alone_id).tokens, i
    assert_logits_close(engine.result(rid).logits, separate.result(alone_id).logits, f"sample {i}")
  assert len({tuple(engine.result(r).tokens) for r in samples}) == 3
  assert len(engine.result(other).tokens) == 9


@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), {"kvm_swa_hybrid", "ovq_swa_hybrid",
                                                          "full_bswa_hybrid", "rwkv7"}))
def test_prefill_in_pieces_equals_prefill_at_once(name):
  """``LM.extend`` in pieces of 1, 17, C (8) and 1000 tokens: the logits of the last prompt token
  and of the next decoded token, and the caches' lengths, equal one ``LM.prefill``."""
  model = _model(name)
  extend = nnx.jit(lambda m, t, c: m.extend(t, c))
  for piece, T in ((1, 45), (17, 45), (8, 45), (1000, 1100)):
    max_len = T + 2
    tokens = jax.random.randint(jax.random.PRNGKey(8), (1, T + 1), 0, 256)
    prompt, next_token = tokens[:, :T], tokens[:, T:]
    want, at_once = prefill(model, prompt, model.init_cache(1, max_len))
    want_next, _ = decode_step(model, next_token, at_once)
    caches = model.init_cache(1, max_len)
    for start in range(0, T, piece):
      last, caches = extend(model, prompt[:, start:start + piece], caches)
    assert int(cache_lengths(caches, 1)[0]) == T
    assert_logits_close([last[0]], [np.asarray(want[0, -1])], f"{name} pieces of {piece}")
    got_next, _ = decode_step(model, next_token, caches)
    assert_logits_close([got_next[0, 0]], [np.asarray(want_next[0, 0])], f"{name} next token")


def test_extend_fills_one_row_while_the_others_keep_theirs():
  """Ragged counts: row 0 takes 9 tokens, row 1 none, row 2 three; row 1's cache is bitwise
  unchanged and the others equal their alone runs."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(9)
  first = jnp.asarray(rng.integers(0, 256, (3, 6)), jnp.int32)
  more = jnp.asarray(rng.integers(0, 256, (3, 9)), jnp.int32)
  extend = nnx.jit(lambda m, t, c, n: m.extend(t, c, n))
  _, caches = extend(model, first, model.init_cache(3, 32), jnp.asarray([6, 6, 6]))
  last, after = extend(model, more, caches, jnp.asarray([9, 0, 3]))
  np.testing.assert_array_equal(cache_lengths(after, 3), [15, 6, 9])
  row = lambda tree, b: jax.tree_util.tree_map(lambda x: np.asarray(x[b]), tree)
  for a, b in zip(jax.tree_util.tree_leaves(row(after, 1)),
                  jax.tree_util.tree_leaves(row(caches, 1))):
    np.testing.assert_array_equal(a, b)
  assert not np.any(np.asarray(last[1]))
  for b, count in ((0, 9), (2, 3)):
    seq = np.concatenate([np.asarray(first[b]), np.asarray(more[b, :count])]).tolist()
    want, _ = prefill(model, jnp.asarray([seq]), model.init_cache(1, 32))
    assert_logits_close([last[b]], [np.asarray(want[0, -1])], f"row {b}")


def test_row_operations_reset_and_copy_rows():
  """``reset_rows`` empties exactly the chosen rows; ``copy_row`` makes rows equal to the
  source row; both leave the others bitwise alone."""
  model = _model("ovq_swa_hybrid")
  tokens = jax.random.randint(jax.random.PRNGKey(2), (3, 10), 0, 256)
  _, caches = prefill(model, tokens, model.init_cache(3, 16))
  fresh = model.init_cache(1, 16)
  reset = reset_rows(caches, jnp.asarray([False, True, False]), fresh)
  copied = copy_row(caches, 2, jnp.asarray([True, False, False]))
  for r, c, orig, f in zip(*(jax.tree_util.tree_leaves(t) for t in (reset, copied, caches,
                                                                     fresh))):
    r, c, orig = np.asarray(r), np.asarray(c), np.asarray(orig)
    np.testing.assert_array_equal(r[[0, 2]], orig[[0, 2]])
    np.testing.assert_array_equal(r[1], np.asarray(f)[0])
    np.testing.assert_array_equal(c[1:], orig[1:])
    np.testing.assert_array_equal(c[0], orig[2])


def test_stream_yields_the_tokens_as_generated_and_cancel_stops():
  model = _model("rwkv7")
  engine = Engine(model, slots=2, max_len=32)
  a = engine.submit([1, 2, 3], max_new_tokens=6)
  b = engine.submit([4, 5], max_new_tokens=20)
  streamed = list(engine.stream(a))
  assert streamed == engine.result(a).tokens and len(streamed) == 6
  assert engine.result(a).finish_reason == "length"
  running = len(engine.result(b).tokens)
  assert 0 < running < 20 and engine.cancel(b) and not engine.cancel(b)
  assert engine.result(b).finish_reason == "cancelled" and not engine.busy
  assert engine.step() == []


def test_engine_refuses_bad_requests_by_name():
  model = _model("rwkv7")
  engine = Engine(model, slots=2, max_len=16)
  with pytest.raises(ValueError, match="empty"):
    engine.submit([], max_new_tokens=2)
  with pytest.raises(ValueError, match="token id 256 is outside"):
    engine.submit([1, 256], max_new_tokens=2)
  with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, got 0"):
    engine.submit([1], max_new_tokens=0)
  with pytest.raises(ValueError, match="= 17 exceeds the engine's max_len=16"):
    engine.submit(list(range(10)), max_new_tokens=7)
  with pytest.raises(ValueError, match="slots must be a positive int, got 0"):
    Engine(model, slots=0, max_len=16)
  with pytest.raises(KeyError, match="no request 99"):
    engine.result(99)
  assert not engine.busy  # nothing bad was queued


def test_sample_rows_is_sample_logits_row_by_row():
  """Per-row settings give, row by row, ``sample_logits`` of that row alone with its key."""
  logits = jax.random.normal(jax.random.PRNGKey(0), (5, 50)) * 3
  settings = [GREEDY, kj.SamplingConfig(1.0), kj.SamplingConfig(0.7, top_k=5),
              kj.SamplingConfig(1.0, top_p=0.6), kj.SamplingConfig(2.0, top_k=9, top_p=0.8)]
  keys = jax.random.split(jax.random.PRNGKey(1), 5)
  rows = np.asarray([sampling_rows(s) for s in settings], np.float32)
  for trial in range(20):
    trial_keys = jax.vmap(lambda k: jax.random.fold_in(k, trial))(keys)
    got = sample_rows(logits, trial_keys, jnp.asarray(rows[:, 0]),
                      jnp.asarray(rows[:, 1], jnp.int32), jnp.asarray(rows[:, 2]))
    for b, s in enumerate(settings):
      want = kj.sample_logits(logits[b:b + 1], trial_keys[b], s)
      assert int(got[b]) == int(want[0]), (trial, b)


def test_register_mixer_refuses_a_cache_off_the_protocol():
  """A kind whose cache keeps one scalar length cannot serve slots: registration names it."""
  from kvm_jax.nn import register_mixer
  from kvm_jax.nn.rwkv7 import RWKV7TimeMix

  class ScalarLength(RWKV7TimeMix):
    def init_cache(self, batch, max_len):
      cache = super().init_cache(batch, max_len)
      return dataclasses.replace(cache, length=jnp.zeros((), jnp.int32))

  with pytest.raises(TypeError, match="length of shape \\(\\) for batch 2"):
    register_mixer("scalar_length_rwkv7", ScalarLength)
