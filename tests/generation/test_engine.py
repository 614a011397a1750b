"""The engine (kvm_jax/generation/engine.py) and the per-row caches under it (kvm_jax/nn/cache.py).

Oracle: every request run *alone* on a one-row cache, from position 0, through the model's
prefill and decode step (no slots, no resets, no row selection, no copies), and, for a few
prompts, ``kj.generate`` itself (parallel prefill). A request served among others must give the
same greedy tokens and logits within 1e-5 (float32: the engine's rows and the alone run differ
only in the batch size of the same matmuls, measured <= 1e-6 apart on tiny models).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax.generation.engine import Engine, generate_many, sample_rows, sampling_rows
from kvm_jax.nn.cache import cache_lengths, copy_row, put_rows, reset_rows, select_rows
from kvm_jax.nn.families.gemma import GemmaOptions
from kvm_jax.nn.families.llama import LlamaOptions
from tests.helpers import decode_step, forward, in_ci, make_model, prefill

GREEDY = kj.SamplingConfig(temperature=0.0)
LOGIT_TOL = 1e-5
# One engine shape for the tests that compare requests (its step programs compile once per model
# and worker): prompts through the lanes (every slot's, pieces of 8 = the tiny models' chunk, a
# prompt's partial last chunk in a lane of its own count), bursts of up to 4 tokens per slot and
# step.
MAX_LEN = 48
ENGINE = dict(slots=3, max_len=MAX_LEN, prefill_chunk=8, tokens_per_step=4, keep_logits=True)

# Every mixer kind, both kinds of cross-layer KV sharing, and the Llama and Gemma families (the
# paper's GPTAlpha-2 is the others'). The three hybrids run in CI (five kinds' caches); shared
# routing's engine runs are checked in CI by the prefill_bucket test, and RWKV-7's cache (a state
# and a length) by the resume and stream tests; the rest nightly. The last four put the kinds whose
# own alignment is 1 (rings, RWKV-7) beside KVM's chunk, so that their pieces end partway too.
_KVM16 = dataclasses.replace(kj.presets.TINY_OPTIONS["kvm"], rope_dims=16)
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
    "full_bswa_kvm_hybrid": dict(mixers=("full", "bswa", "kvm"), num_layers=3),
    "rwkv7_kvm_hybrid": dict(mixers=("rwkv7", "kvm")),
    "llama_swa_kvm": dict(mixers=("swa", "kvm"), family="llama", rope_dims=16,
                          family_options=LlamaOptions(intermediate_size=96, qkv_bias=True,
                                                      qk_norm=True),
                          options={"kvm": _KVM16}),
    "gemma_swa_kvm": dict(mixers=("swa", "kvm"), family="gemma", rope_dims=16,
                          family_options=GemmaOptions(intermediate_size=96, local_layers=(0,),
                                                      qk_norm=True, attention_softcap=50.0,
                                                      final_logit_softcap=30.0),
                          options={"kvm": _KVM16}),
}
CI_PATTERNS = {"kvm_swa_hybrid", "full_bswa_hybrid", "ovq_swa_hybrid"}

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
  points (waiting, prefilling or decoding); returns the request ids, the cancelled ones and the
  most tokens one request drew in one step (the engine's bursts)."""
  ids, cancelled, pending, burst = [], set(), list(requests), 0
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
    drawn = collections.Counter(event.request_id for event in engine.step())
    burst = max([burst, *drawn.values()])
  return ids, cancelled, burst


@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), CI_PATTERNS))
def test_engine_requests_equal_their_alone_runs(name):
  """Random arrival, prompt lengths from 1 to max_len - 1, slot reuse; prompts continue in
  parallel pieces of a chunk (8), several in one step, starting and continuing rows together,
  and their rests through the decode step (all of them for the kinds without an alignment),
  crossing chunk (8) and window (16) boundaries, and so do the decodes, some in bursts of
  several tokens per step; the KVM budget (4·√N rows, at least 8) grows mid-request."""
  model = _model(name)
  rng = np.random.default_rng(11)
  max_len = MAX_LEN
  # Folds at tokens 24, 32 and 40 grow the KVM state (8 -> 16 -> 22 -> 25 rows): the first
  # request's prompt ends before them and its decoding crosses all three.
  requests = [(rng.integers(0, 256, 20).tolist(), 24)] + random_requests(rng, 9, max_len)
  engine = Engine(model, **ENGINE)
  ids, _, burst = serve(engine, requests, rng)
  # some steps drew several tokens per slot (bursts, or rounds beside a prompt's serial rest)
  assert burst >= ENGINE["tokens_per_step"]
  for rid, (prompt, new) in zip(ids, requests):
    result = engine.result(rid)
    tokens, logits = alone(model, prompt, new, max_len)
    assert result.tokens == tokens, (name, rid, len(prompt))
    assert result.finish_reason == "length"
    assert_logits_close(result.logits, logits, f"{name} request {rid}")


# The tiny models' chunk (KVM's and OVQ's C; the lanes' alignment where a model has one) and the
# prompt lengths whose last chunk is partial: shorter than a chunk (a rest of 1 and of C - 1), a
# rest of 1 and of C - 1 after whole chunks, and rests whose lane folds first (from 24 = L + C,
# from 32).
C = 8
PARTIAL_PROMPTS = (1, C - 1, C + 1, 2 * C - 1, 3 * C + 4, 4 * C + 1)


def partial_prompts(seed: int) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, 256, n).tolist() for n in PARTIAL_PROMPTS]


@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), {"kvm_swa_hybrid", "ovq_swa_hybrid",
                                                          "full_bswa_kvm_hybrid"}))
def test_partial_last_chunks_equal_their_alone_runs(name):
  """Prompts whose last chunk is partial, all submitted at once to three slots (a lane's partial
  piece beside whole ones and beside decoding slots): greedy tokens equal the alone run's, and
  the logits each was drawn from within 1e-5 (float32, see the module docstring), for every
  kind; the decodes after each partial lane cross chunk and window boundaries."""
  model = _model(name)
  prompts = partial_prompts(21)
  engine = Engine(model, **ENGINE)
  ids = [engine.submit(p, max_new_tokens=10) for p in prompts]
  engine.run()
  for rid, prompt in zip(ids, prompts):
    tokens, logits = alone(model, prompt, 10, MAX_LEN)
    assert engine.result(rid).tokens == tokens, (name, len(prompt))
    assert_logits_close(engine.result(rid).logits, logits, f"{name}, {len(prompt)}-token prompt")


@pytest.mark.parametrize("name", in_ci(["kvm_swa_hybrid", "llama_swa_kvm", "gemma_swa_kvm"],
                                       {"kvm_swa_hybrid"}))
def test_partial_last_chunks_sample_what_generate_draws(name):
  """Sampled under temperature, top-k and top-p, prompt ``i`` with seed ``s + i``: each request
  of a partial last chunk draws exactly ``kj.generate``'s tokens for that prompt alone with
  ``PRNGKey(s + i)`` (its parallel prefill of the whole prompt); three draws differ, so the
  sampling is not greedy in disguise."""
  model = _model(name)
  prompts = partial_prompts(22)[:4]
  sampling = kj.SamplingConfig(temperature=1.3, top_k=40, top_p=0.9)
  engine = Engine(model, **ENGINE)
  ids = [engine.submit(p, max_new_tokens=6, sampling=sampling, seed=30 + i)
         for i, p in enumerate(prompts)]
  engine.run()
  for i, (rid, prompt) in enumerate(zip(ids, prompts)):
    want, _ = kj.generate(model, jnp.asarray([prompt]), max_new_tokens=6, sampling=sampling,
                          key=jax.random.PRNGKey(30 + i), max_len=MAX_LEN)
    assert engine.result(rid).tokens == np.asarray(want[0, len(prompt):]).tolist(), (name, i)
  assert len({tuple(engine.result(r).tokens) for r in ids}) > 1


def test_a_prompts_partial_last_chunk_takes_no_decode_round():
  """A prompt's rest after its whole chunks (or a prompt shorter than one) is fed in one lane
  of the step that draws its first token: the steps to that token are the prompt's chunks,
  rounded up, and the step runs no decode round (the engine counts the rounds its device loop
  ran). ``rest_prefill="decode"`` feeds the rest a round per token, as the engine did before
  the lanes took rests (that count is the measure's own check), and draws the same token."""
  model = _model("kvm_swa_hybrid")
  for length in PARTIAL_PROMPTS:
    prompt = list(range(1, length + 1))
    first = {}
    for how, rounds in (("lane", 0), ("decode", length % C)):
      engine = Engine(model, **ENGINE, rest_prefill=how)
      rid = engine.submit(prompt, max_new_tokens=1)
      steps = 0
      while engine.busy:
        engine.step()
        steps += 1
      assert engine.decode_rounds == rounds, (how, length)
      assert steps == (-(-length // C) if how == "lane" else length // C + 1), (how, length)
      first[how] = engine.result(rid).tokens
    assert first["lane"] == first["decode"], length
  with pytest.raises(ValueError, match=r"rest_prefill='chunks' is unknown; choose from"):
    Engine(model, **ENGINE, rest_prefill="chunks")


def test_prefill_bucket_admission_equals_alone_runs():
  """``prefill_bucket`` (for models that cannot continue in parallel: cross-layer KV sharing): a
  prompt's head prefilled on its own and inserted into its slot while other slots hold running
  requests, the rest fed through the decode step: each request still equals its alone run."""
  model = _model("kvm_shared_routing")
  assert model.resume_alignment() is None
  rng = np.random.default_rng(12)
  requests = random_requests(rng, 8, MAX_LEN)
  engine = Engine(model, **ENGINE, prefill_bucket=16)
  ids, _, _ = serve(engine, requests, rng)
  assert any(len(p) > 17 for p, _ in requests)  # some heads were prefilled
  for rid, (prompt, new) in zip(ids, requests):
    tokens, logits = alone(model, prompt, new, MAX_LEN)
    assert engine.result(rid).tokens == tokens, rid
    assert_logits_close(engine.result(rid).logits, logits, f"request {rid}")


# Nightly: in CI, tests/generation/test_serve.py compares the engine's greedy and seeded sampled completions
# with kj.generate alone, and test_sample_rows_is_sample_logits_row_by_row the sampler itself.
@pytest.mark.slow
def test_engine_tokens_equal_generate_greedy_and_sampled():
  """``generate_many`` gives, per prompt, ``kj.generate``'s tokens for that prompt alone (its
  parallel prefill): greedy, then sampled under temperature, top-k and top-p together, prompt
  ``i`` with ``PRNGKey(seed + i)``; with a stop token, each output ends at its first one."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(3)
  prompts = [rng.integers(0, 256, n).tolist() for n in (1, 17, 30)]
  sampling = kj.SamplingConfig(temperature=1.3, top_k=40, top_p=0.9)
  shape = dict(slots=3, max_len=MAX_LEN, prefill_chunk=8)  # one engine shape for every call
  outputs = {}
  for how, seed in ((GREEDY, 0), (sampling, 7)):
    outputs[how] = generate_many(model, prompts, max_new_tokens=10, sampling=how, seed=seed,
                                 **shape)
    for i, (prompt, tokens) in enumerate(zip(prompts, outputs[how])):
      want, _ = kj.generate(model, jnp.asarray([prompt]), max_new_tokens=10,
                            key=jax.random.PRNGKey(seed + i), sampling=how)
      assert tokens == np.asarray(want[0, len(prompt):]).tolist(), (how, i)
  assert len({tuple(t) for t in outputs[sampling]}) == 3
  greedy = outputs[GREEDY]
  stop = greedy[1][4]  # a token the second prompt generates: it must stop there
  stopped = generate_many(model, prompts, max_new_tokens=10, stop_tokens=(stop,), **shape)
  for full, cut in zip(greedy, stopped):
    assert cut == (full[:full.index(stop) + 1] if stop in full else full)
  assert len(stopped[1]) == greedy[1].index(stop) + 1 <= 5


def test_slot_reuse_after_eviction_and_cancellation_leaks_nothing():
  """Two hundred requests through three slots, a fifth of the steps cancelling one at random
  (waiting, mid-prefill, mid-decode): every request that finishes equals its run alone (here a
  whole-sequence forward of its prompt and tokens), so no slot carries anything of the request
  it held before."""
  model = _model("kvm_swa_hybrid")
  rng = np.random.default_rng(5)
  max_len = 32
  requests = random_requests(rng, 200, max_len, longest_prompt=20)
  requests = [(p, min(n, 5)) for p, n in requests]
  engine = Engine(model, **ENGINE)
  ids, cancelled, _ = serve(engine, requests, rng, cancel_rate=0.2, per_step=1)
  assert 30 < len(cancelled) < 150
  # The oracle, batched: each finished request's prompt and tokens as one row of a whole-sequence
  # forward (right-padded; a causal row never sees its padding, and rows never mix), whose logits
  # at the prompt's last position and after are what each generated token was drawn from.
  finished = [(engine.result(rid), prompt) for rid, (prompt, _) in zip(ids, requests)
              if rid not in cancelled]
  rows = np.zeros((len(finished), max_len), np.int32)
  for row, (result, prompt) in zip(rows, finished):
    row[:len(prompt) + len(result.tokens)] = prompt + result.tokens
  whole = np.asarray(forward(model, jnp.asarray(rows)))
  for i, (result, prompt) in enumerate(finished):
    assert result.finish_reason == "length"
    drawn_from = whole[i, len(prompt) - 1:len(prompt) - 1 + len(result.tokens)]
    assert result.tokens == drawn_from.argmax(-1).tolist(), result.id
    assert_logits_close(result.logits, drawn_from, f"request {result.id}")
  for rid in cancelled:
    result = engine.result(rid)
    assert result.finish_reason == "cancelled" and len(result.tokens) < result.max_new_tokens


def test_n_samples_equal_separate_runs_with_their_seeds():
  """``submit_samples(n=3, seed=s)`` feeds the prompt once and copies its row; each sample
  equals a request of its own with seed ``s + i``: a prompt that ends in a rest through the
  decode step (21 tokens: the copy inside the step's rounds) and one that ends with a lane's
  piece (16: the copy after the lanes)."""
  model = _model("kvm_swa_hybrid")
  sampling = kj.SamplingConfig(temperature=1.0)
  for length in (21, 16):
    prompt = np.random.default_rng(6).integers(0, 256, length).tolist()
    engine = Engine(model, **ENGINE)
    other = engine.submit(prompt[:5], max_new_tokens=9, sampling=sampling, seed=1)
    samples = engine.submit_samples(prompt, 3, max_new_tokens=8, sampling=sampling, seed=20)
    engine.run()
    separate = Engine(model, **ENGINE)
    for i, rid in enumerate(samples):
      alone_id = separate.submit(prompt, max_new_tokens=8, sampling=sampling, seed=20 + i)
      separate.run()
      assert engine.result(rid).tokens == separate.result(alone_id).tokens, (length, i)
      assert_logits_close(engine.result(rid).logits, separate.result(alone_id).logits,
                          f"{length}-token prompt, sample {i}")
    assert len({tuple(engine.result(r).tokens) for r in samples}) == 3
    assert len(engine.result(other).tokens) == 9


# Nightly: in CI, LM.extend is checked against prefill by
# test_extend_fills_one_row_while_the_others_keep_theirs, and prompts fed in pieces (lanes, and
# rests through the decode step) against alone runs by the engine tests.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(PATTERNS))
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


# The rings' and OVQ's resume run in CI through the engine tests of their hybrids (their prompts
# go through the lanes); RWKV-7's, which no CI engine test runs, and KVM's run here.
@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), {"kvm_swa_hybrid", "rwkv7"}))
def test_resume_in_pieces_equals_prefill_at_once(name):
  """``LM.resume`` in pieces of one and of three alignment units, one row starting from an
  empty cache in the same calls as a row continuing a prefill three units ahead: every
  position's logits and the next decoded token's equal one ``LM.prefill`` of each row's whole
  sequence (KVM's initial state from a piece, folds from the ring and from the piece, the budget
  grows, OVQ's dictionary and RWKV-7's state continue, bswa sinks are in the ring)."""
  model = _model(name)
  A = model.resume_alignment()
  if A is None:
    with pytest.raises(ValueError, match="cannot continue a piece in parallel"):
      model.resume(jnp.zeros((1, 8), jnp.int32), model.init_cache(1, 16))
    return
  tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 8 * A + 1), 0, 256)
  resume = nnx.jit(lambda m, t, c: m.resume(t, c))
  extend = nnx.jit(lambda m, t, c, n: m.extend(t, c, n))
  want, _ = prefill(model, tokens, model.init_cache(2, 9 * A))
  want = np.asarray(want)
  _, caches = prefill(model, tokens[:, :2 * A], model.init_cache(2, 9 * A))
  _, caches = extend(model, tokens[:, 2 * A:3 * A], caches, jnp.asarray([0, A]))
  caches = reset_rows(caches, jnp.asarray([True, False]), model.init_cache(1, 9 * A))
  offsets = [0, 3 * A]  # row 0 starts from nothing, row 1 continues
  for width in (A, 3 * A, A):
    piece = jnp.stack([tokens[b, offsets[b]:offsets[b] + width] for b in range(2)])
    logits, caches = resume(model, piece, caches)
    for b in range(2):
      assert_logits_close(list(np.asarray(logits[b])),
                          list(want[b, offsets[b]:offsets[b] + width]),
                          f"{name} row {b} from {offsets[b]}")
      offsets[b] += width
  np.testing.assert_array_equal(cache_lengths(caches, 2), offsets)
  last = jnp.stack([tokens[b, offsets[b]:offsets[b] + 1] for b in range(2)])
  next_got, _ = decode_step(model, last, caches)
  assert_logits_close([next_got[0, 0], next_got[1, 0]],
                      [want[0, offsets[0]], want[1, offsets[1]]], f"{name} next token")
  if A == 1:
    return
  _, off_unit = prefill(model, tokens[:, :1], model.init_cache(2, 9 * A))
  with pytest.raises(ValueError, match=r"row lengths \[1, 1\] must be multiples"):
    model.resume(tokens[:, :A], off_unit)


def _decoded_rows(model, tokens, caches, starts, counts):
  """Row ``b`` of ``caches`` continued by decode steps over ``tokens[b, starts[b]:starts[b] +
  counts[b]]`` (the other rows held meanwhile): the logits of each fed token ``[B, n, V]`` and
  the caches."""
  logits = []
  for i in range(max(counts)):
    column = jnp.asarray([[tokens[b, min(starts[b] + i, tokens.shape[1] - 1)]]
                          for b in range(len(starts))], jnp.int32)
    step_logits, stepped = decode_step(model, column, caches)
    caches = select_rows(jnp.asarray([i < n for n in counts]), stepped, caches)
    logits.append(np.asarray(step_logits[:, 0]))
  return np.stack(logits, axis=1), caches


# KVM's and OVQ's counts in CI (beside the swa ring); RWKV-7's and the block window's (sinks)
# nightly, where the engine tests of their hybrids run too.
@pytest.mark.parametrize("name", in_ci(
    ["kvm_swa_hybrid", "ovq_swa_hybrid", "rwkv7_kvm_hybrid", "full_bswa_kvm_hybrid"],
    {"kvm_swa_hybrid", "ovq_swa_hybrid"}))
def test_resume_with_counts_ends_as_the_decode_steps_do(name):
  """``LM.resume(tokens, caches, counts)`` over a piece of two alignment units whose rows end
  early: a row starting its sequence with one token, a row at 2C with C - 1 (the padded second
  chunk would fold at 24 = L + C: it must not), and a row at 3C with C + 3 (folds at 24 and 32,
  a partial chunk after a whole one). The real tokens' logits equal decode steps' within 1e-5,
  and so does every array of the caches (float32 rounding of the same sums: measured <= 1.1e-6;
  the lengths and state row counts exactly): the padding is written nowhere, folds and starts
  nothing, and the token-shift history is the last real token's."""
  model = _model(name)
  A = model.resume_alignment()
  assert A == C
  starts, counts = [0, 2 * C, 3 * C], [1, C - 1, C + 3]
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(5), (3, 6 * C), 0, 256))
  _, caches = _decoded_rows(model, tokens, model.init_cache(3, 6 * C), [0, 0, 0], starts)
  np.testing.assert_array_equal(cache_lengths(caches, 3), starts)
  piece = np.zeros((3, 2 * C), np.int32)
  for b in range(3):
    piece[b, :counts[b]] = tokens[b, starts[b]:starts[b] + counts[b]]
  resume = nnx.jit(lambda m, t, c, n: m.resume(t, c, n))
  got_logits, got = resume(model, jnp.asarray(piece), caches, jnp.asarray(counts))
  want_logits, want = _decoded_rows(model, tokens, caches, starts, counts)
  for b in range(3):
    assert_logits_close(list(np.asarray(got_logits[b, :counts[b]])),
                        list(want_logits[b, :counts[b]]), f"{name} row {b}")
  np.testing.assert_array_equal(cache_lengths(got, 3), np.add(starts, counts))
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree_util.tree_leaves(want)):
    where = f"{name} {jax.tree_util.keystr(path)}"
    if np.issubdtype(np.asarray(a).dtype, np.integer):
      np.testing.assert_array_equal(a, b, err_msg=where)
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5,
                                 err_msg=where)
  with pytest.raises(ValueError, match=r"counts \[0, 7, 11\] must lie in \[1, 16\]"):
    model.resume(jnp.asarray(piece), caches, jnp.asarray([0, 7, 11]))


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


def test_put_rows_writes_the_chosen_rows_as_reset_and_copy_do():
  """``put_rows`` (the engine's in-place row writes): rows from a fresh one-row cache equal
  ``reset_rows``, rows copied from the caches themselves equal ``copy_row``, bitwise; the other
  rows are untouched; and it writes nothing when no row is chosen."""
  model = _model("ovq_swa_hybrid")
  tokens = jax.random.randint(jax.random.PRNGKey(2), (4, 10), 0, 256)
  _, caches = prefill(model, tokens, model.init_cache(4, 16))
  fresh = model.init_cache(1, 16)
  rows = jnp.asarray([False, True, False, True])
  same = lambda a, b: all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in
                          zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
  put = jax.jit(put_rows)
  assert same(put(caches, rows, fresh, jnp.zeros(4, jnp.int32)), reset_rows(caches, rows, fresh))
  copied = put(caches, rows, caches, jnp.asarray([0, 2, 2, 2]))
  assert same(copied, copy_row(caches, 2, rows))
  assert same(put(caches, jnp.zeros(4, bool), fresh, jnp.zeros(4, jnp.int32)), caches)


@pytest.mark.parametrize("name", in_ci(sorted(PATTERNS), CI_PATTERNS | {"rwkv7"}))
def test_a_decode_step_leaves_the_rows_it_does_not_feed_bitwise_alone(name):
  """``decode_step(token, caches, active)`` for every kind: the rows not active come out with
  every cache array bitwise as they went in (what lets the engine's rounds update the caches in
  place instead of selecting rows back), and the active rows as a step of every row leaves them
  (to float32 rounding, 1e-6: two programs, fused apart). Rows at lengths where a step changes
  a state (the tiny models' chunk of 8 and window of 16): at 7, KVM's state still grows and
  OVQ commits its chunk; at 24, KVM folds; at 15, OVQ commits; each case on a skipped row and
  on a fed one."""
  model = _model(name)
  lengths = [24, 7, 15, 24]
  tokens = jax.random.randint(jax.random.PRNGKey(4), (4, 24), 0, 256)
  caches = model.init_cache(4, 32)
  extend = nnx.jit(lambda m, t, c, n: m.extend(t, c, n))
  _, caches = extend(model, tokens, caches, jnp.asarray(lengths))
  step = nnx.jit(lambda m, t, c, a: m.decode_step(t, c, a))
  token = tokens[:, :1]
  _, everyone = decode_step(model, token, caches)
  active = jnp.asarray([True, False, True, False])
  _, some = step(model, token, caches, active)
  row = lambda tree, b: [np.asarray(x[b]) for x in jax.tree_util.tree_leaves(tree)]
  for b in range(4):
    for got, stepped, kept in zip(row(some, b), row(everyone, b), row(caches, b)):
      if bool(active[b]):
        np.testing.assert_allclose(got, stepped, rtol=1e-6, atol=1e-6, err_msg=f"{name}: {b}")
      else:
        np.testing.assert_array_equal(got, kept, err_msg=f"{name}: row {b}")


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
  # Seeds: jax.random.PRNGKey keeps 32 bits (2**32 would draw what 0 draws, 2**80 does not
  # convert at all), and sample i of n draws with seed + i.
  for seed in (2**80, 2**32, -1, 1.5, True):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 4294967295\]"):
      engine.submit([1], max_new_tokens=1, seed=seed)
  with pytest.raises(ValueError, match=r"and seed \+ 1 for the last of 2 samples"):
    engine.submit_samples([1], 2, max_new_tokens=1, seed=2**32 - 1)
  with pytest.raises(ValueError, match="temperature must be 0 .greedy. or a number"):
    kj.SamplingConfig(temperature=float("nan"))
  with pytest.raises(ValueError, match="top_p must be in"):
    kj.SamplingConfig(top_p=1e-300)  # 0 in float32: no token would be kept
  assert not engine.busy  # nothing bad was queued
  last = engine.submit([1], max_new_tokens=1, seed=2**32 - 1)  # the range's edges are served
  first = engine.submit_samples([1], 2, max_new_tokens=1, seed=2**32 - 2)
  engine.run()
  assert engine.result(last).done and all(engine.result(i).done for i in first)


def test_finished_requests_are_kept_only_within_their_bound():
  """``keep_finished`` bounds the records of finished requests (the oldest go first),
  ``release`` drops one at once, and waiting or running requests are never dropped."""
  model = _model("rwkv7")
  engine = Engine(model, slots=2, max_len=16, keep_finished=3)
  ids = [engine.submit([1 + i], max_new_tokens=2) for i in range(7)]
  assert [r.id for r in engine.requests()] == ids  # none finished yet: all kept
  engine.run()
  assert [r.id for r in engine.requests()] == ids[-3:]
  with pytest.raises(KeyError, match="keep_finished=3"):
    engine.result(ids[0])
  running = engine.submit([9], max_new_tokens=5)
  with pytest.raises(ValueError, match="still running"):
    engine.release(running)
  engine.release(ids[-1])
  assert [r.id for r in engine.requests()] == [ids[-3], ids[-2], running]
  progress = []
  engine.run(progress.append)
  assert progress[-1] == 8  # every request finished so far, kept or not


def test_recover_ends_the_held_requests_and_serves_exactly_after():
  """After a step that raised, ``recover`` ends every waiting and running request with "error"
  (one event each), empties the slots, and the next request is its alone run."""
  model = _model("kvm_swa_hybrid")
  engine = Engine(model, **ENGINE)
  held = [engine.submit(list(range(1, 12)), max_new_tokens=9) for _ in range(4)]
  engine.step()
  events = engine.recover()
  assert sorted(e.request_id for e in events) == held
  assert {(e.token, e.finish_reason) for e in events} == {(-1, "error")}
  assert not engine.busy and all(engine.result(i).finish_reason == "error" for i in held)
  after = engine.submit([3, 1, 4, 1, 5], max_new_tokens=6)
  engine.run()
  want, _ = alone(model, [3, 1, 4, 1, 5], 6, MAX_LEN)
  assert engine.result(after).tokens == want


def test_warm_up_compiles_every_step_program_a_request_can_need():
  """After ``warm_up`` no request compiles a step program: prompts of every length (lanes of
  both widths, rests through the decode step), samples and bursts run on what it compiled."""
  # Parameters committed to the device, as a loaded checkpoint's are (then the step's outputs
  # are committed too, and fresh slots must be as well).
  graphdef, state = nnx.split(_model("kvm_swa_hybrid"))
  model = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
  # A burst width no other test uses: this engine's step program is its own (not yet compiled).
  engine = Engine(model, **{**ENGINE, "keep_logits": False, "tokens_per_step": 11})
  assert engine._step._cache_size() == 0
  reported = []
  engine.warm_up(lambda what, seconds: reported.append(what))
  assert len(reported) == len(engine.lane_widths()) == 2  # no lane, and 8-token pieces
  assert engine.requests() == [] and not engine.busy
  compiled = engine._step._cache_size()
  assert compiled == 2
  engine.submit(list(range(1, 10)), max_new_tokens=2)  # a lane's piece first, on fresh slots
  engine.run()
  assert engine._step._cache_size() == compiled
  for length in (1, 7, 8, 9, 17, 30):
    engine.submit(list(range(1, length + 1)), max_new_tokens=5)
  engine.submit_samples([5, 6, 7], 2, max_new_tokens=4, sampling=kj.SamplingConfig(0.8),
                        seed=1)
  engine.run()
  assert engine._step._cache_size() == compiled


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
  from kvm_jax.nn.mixers.rwkv7 import RWKV7TimeMix

  class ScalarLength(RWKV7TimeMix):
    def init_cache(self, batch, max_len):
      cache = super().init_cache(batch, max_len)
      return dataclasses.replace(cache, length=jnp.zeros((), jnp.int32))

  with pytest.raises(TypeError, match="length of shape \\(\\) for batch 2"):
    register_mixer("scalar_length_rwkv7", ScalarLength)
