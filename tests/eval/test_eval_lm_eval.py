"""The lm-eval adapter: its scores against a different code path (prefill + decode steps, or a
plain forward pass), lm-eval's own evaluator on the offline example tasks, sampling, and its CLI on
a trained run directory."""

from __future__ import annotations

import json
import math
import os
import re
import string
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the example tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import lm_eval  # a test dependency (pyproject's `test` extra): missing, the suite must fail
import numpy as np
import pytest
from flax import nnx
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

import kvm_jax as kj
from kvm_jax.eval.lm_eval_adapter import KVMEvalLM, local_task_manager
from kvm_jax.runs import logits_fn
from kvm_jax.tasks.tokenizers import ByteTokenizer
from tests.helpers import make_model

from tests.helpers import ROOT  # noqa: E402
TOK = ByteTokenizer()
TASKS = ["kvm_local_choice", "kvm_local_generate", "kvm_local_perplexity"]


@pytest.fixture(scope="module")
def model():
  return make_model("kvm", seed=3, vocab_size=TOK.vocab_size)


def _request(kind: str, *args) -> Instance:
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


# Every decode-path reference below runs in caches of this length, so that its two jitted steps
# compile once for the whole module (eagerly, each request took seconds).
_DECODE_MAX_LEN = 64


@nnx.jit
def _prefill_one(model, token, caches):
  logits, caches = model.prefill(token, caches)
  return jax.nn.log_softmax(logits[0, -1]), caches


@nnx.jit
def _decode_one(model, token, caches):
  logits, caches = model.decode_step(token, caches)
  return jax.nn.log_softmax(logits[0, -1]), caches


def _decode_path_logprob(model, context: list[int], continuation: list[int]) -> float:
  """sum log p(continuation | context) from a one-token prefill and then one decode step per
  token: a different code path from the adapter's batched, padded forward."""
  tokens = context + continuation
  assert len(tokens) <= _DECODE_MAX_LEN
  caches = model.init_cache(1, _DECODE_MAX_LEN)
  logp, caches = _prefill_one(model, jnp.asarray([tokens[:1]], jnp.int32), caches)
  total = 0.0
  for position, token in enumerate(tokens[1:], start=1):
    if position >= len(context):
      total += float(logp[token])
    if position < len(tokens) - 1:
      logp, caches = _decode_one(model, jnp.asarray([[token]], jnp.int32), caches)
  return total


def test_loglikelihood_matches_the_decode_path(model):
  lm = KVMEvalLM(model, TOK, batch_size=2, pad_multiple=16, max_length=256)
  pairs = [("The sky is", " blue"), ("A list is a mutable sequence of", " items, in order."),
           ("", "hello"), ("x" * 40, " y")]
  got = lm.loglikelihood([_request("loglikelihood", c, x) for c, x in pairs])
  for (context, continuation), (logprob, _) in zip(pairs, got):
    context_ids = TOK.encode(context) or [TOK.eos_id]  # empty context: conditioned on EOS
    want = _decode_path_logprob(model, context_ids, TOK.encode(continuation))
    # float32 logits; sums of up to 17 log-probs from two differently fused programs
    np.testing.assert_allclose(logprob, want, rtol=1e-4, atol=1e-4)
  assert lm.truncated == 0


def test_loglikelihood_of_rwkv7_matches_its_decode_path():
  """The adapter's batched, padded forward against one-token decoding for a model whose layers
  have none of the attention front end (RWKV-7: its own shift history and state in the cache;
  OVQ's decode equals its forward in tests/nn/test_model.py)."""
  other = make_model("rwkv7", seed=4, vocab_size=TOK.vocab_size)
  lm = KVMEvalLM(other, TOK, batch_size=2, pad_multiple=16, max_length=256)
  pairs = [("A list is a mutable sequence of", " items, in order."), ("x" * 40, " y")]
  got = lm.loglikelihood([_request("loglikelihood", c, x) for c, x in pairs])
  for (context, continuation), (logprob, _) in zip(pairs, got):
    want = _decode_path_logprob(other, TOK.encode(context), TOK.encode(continuation))
    np.testing.assert_allclose(logprob, want, rtol=1e-4, atol=1e-4)


def test_is_greedy_and_left_truncation(model):
  lm = KVMEvalLM(model, TOK, batch_size=4, pad_multiple=8, max_length=32)
  context = "Here we go. "
  ids = TOK.encode(context)
  out, _ = kj.generate(model, jnp.asarray([ids]), max_new_tokens=4, key=jax.random.key(0),
                       sampling=kj.SamplingConfig(temperature=0.0))
  greedy = np.asarray(out[0, len(ids):]).tolist()
  other = greedy[:-1] + [(greedy[-1] + 1) % 256]
  (_, is_greedy), (_, not_greedy) = lm._score([(ids, greedy), (ids, other)])
  assert is_greedy and not not_greedy
  # A context longer than max_length keeps its last max_length + 1 - len(continuation) tokens.
  long_context = TOK.encode("The grass is green. The sky is blue. The sun is yellow.")
  cont = TOK.encode(" Yes")
  (logprob, _), = lm._score([(long_context, cont)])
  kept = (long_context + cont)[-33:]
  want = _decode_path_logprob(model, kept[:-len(cont)], cont)
  np.testing.assert_allclose(logprob, want, rtol=1e-4, atol=1e-4)
  assert lm.truncated == 1


def test_rolling_loglikelihood_is_the_whole_text_given_eos(model):
  lm = KVMEvalLM(model, TOK, batch_size=2, pad_multiple=16, max_length=256)
  text = "Functions are defined with def."
  (rolling,) = lm.loglikelihood_rolling([_request("loglikelihood_rolling", text)])
  want = _decode_path_logprob(model, [TOK.eos_id], TOK.encode(text))
  np.testing.assert_allclose(rolling, want, rtol=1e-4, atol=1e-4)
  # Shorter windows still score every token exactly once (more, shorter contexts).
  short = KVMEvalLM(model, TOK, batch_size=2, pad_multiple=8, max_length=8)
  (chunked,) = short.loglikelihood_rolling([_request("loglikelihood_rolling", text)])
  assert np.isfinite(chunked) and chunked != pytest.approx(rolling, rel=1e-6)


def test_generate_until_stops_at_the_stop_string(model):
  lm = KVMEvalLM(model, TOK, pad_multiple=16)
  prompt = "Repeat: apple\nAnswer:"
  ids = TOK.encode(prompt)
  out, _ = kj.generate(model, jnp.asarray([ids]), max_new_tokens=12, key=jax.random.key(0),
                       sampling=kj.SamplingConfig(temperature=0.0))
  full = TOK.decode([t for t in np.asarray(out[0, len(ids):]).tolist() if t != TOK.eos_id])
  (free,) = lm.generate_until([_request("generate_until", prompt, {"max_gen_toks": 12})])
  assert free == full
  stop = full[3:5]
  (cut,) = lm.generate_until([_request("generate_until", prompt,
                                       {"until": [stop], "max_gen_toks": 12})])
  assert cut == full[:full.index(stop)]


def test_generate_until_batches_ragged_requests_as_if_alone(model):
  """One call with contexts of several lengths and budgets, through two slots, gives every
  request the text a call of its own gives it (greedy and sampled alike: request i of a call
  samples with seed i, so the sampled one is asked alone at the same index)."""
  lm = KVMEvalLM(model, TOK, pad_multiple=64, batch_size=2)  # one cache size for all calls
  hot = {"do_sample": True, "temperature": 2.0}
  asks = [("A longer context, to be continued:", {"max_gen_toks": 9}),
          ("x", {"max_gen_toks": 3, **hot}), ("Repeat: apple\nAnswer:", {"max_gen_toks": 7})]
  together = lm.generate_until([_request("generate_until", c, kw) for c, kw in asks])
  for i, (context, kw) in enumerate(asks):
    pad = [_request("generate_until", "p", {"max_gen_toks": 1})] * i  # moves it to index i
    alone = lm.generate_until(pad + [_request("generate_until", context, kw)])[-1]
    assert together[i] == alone, (i, context)


def test_generate_until_samples_when_asked(model):
  """do_sample, temperature, top_k and top_p reach the sampler. Greedy decoding is the reference
  (the test above checks it against kj.generate): a vanishing temperature, top_k=1 or a tiny top_p
  reproduce it; a hot temperature does not, and two identical requests of one call are sampled
  with different keys. At T=5 this model's next-token distribution is near-uniform over 320 ids,
  so two 12-token samples agree by chance with probability ~300**-12."""
  lm = KVMEvalLM(model, TOK, pad_multiple=16)  # as above: the greedy compilations are shared

  def generate(*kwargs):
    requests = [_request("generate_until", "Repeat: apple\nAnswer:", {"max_gen_toks": 12, **kw})
                for kw in kwargs]
    return lm.generate_until(requests)

  (greedy,) = generate({})
  hot = {"do_sample": True, "temperature": 5.0}
  first, second = generate(hot, hot)
  assert first != greedy and second != greedy and first != second
  assert generate(hot) == [first]  # keys are fixed: a rerun of the evaluation repeats it
  assert generate({"temperature": 5.0}) == [first]  # lm-eval's default: sample when T > 0
  assert generate({"temperature": 5.0, "do_sample": False}) == [greedy]
  # T=1e-6 scales the gaps between the best two logits (>= 0.02 at each of these 12 steps) to
  # >= 2e4, far past the spread of the draw's float32 Gumbel noise (-5 < g < 17).
  assert generate({"do_sample": True, "temperature": 1e-6}) == [greedy]
  assert generate({**hot, "top_k": 1}) == [greedy]
  assert generate({**hot, "top_p": 1e-3}) == [greedy]  # the top token is always kept


# -- lm-eval's evaluator on the offline tasks ------------------------------------------------------

TASK_DATA = ROOT / "eval/lm_eval_tasks/kvm_local"


def _local_tasks():
  # Only the offline tasks: indexing lm-eval's own thousands of tasks would take most of the
  # time of each evaluation here (the CLI test below still goes through that index).
  return local_task_manager(include_defaults=False)


def _docs(name: str) -> list[dict]:
  return [json.loads(line) for line in (TASK_DATA / f"{name}.jsonl").read_text().splitlines()]


def _by_doc(samples: list[dict]) -> list[dict]:
  return sorted(samples, key=lambda sample: sample["doc_id"])


def _first_word(text: str) -> str:
  """The generate task's filter and metric by hand: the first run of non-space characters
  (regex "(\\S+)", take_first; "[invalid]" when there is none), then exact_match's
  ignore_case and ignore_punctuation."""
  words = re.findall(r"\S+", text)
  word = words[0] if words else "[invalid]"
  return word.lower().translate(str.maketrans("", "", string.punctuation))


def _count_words(text: str) -> int:
  return len(re.split(r"\s+", text))  # lm-eval's word count for word_perplexity


class _KnownAnswers(LM):
  """An LM that answers the offline tasks from their own data files, right on every document but
  the last of each task: what lm-eval then reports shows how it reads the labels, targets and
  filters of our task files, independently of any model."""

  def __init__(self):
    super().__init__()
    self.choice, self.generate = _docs("choice"), _docs("generate")

  def loglikelihood(self, requests):
    out = []
    for request in requests:
      context, continuation = request.args
      i = next(i for i, d in enumerate(self.choice) if d["question"] == context)
      gold = self.choice[i]["label"]
      best = (gold + 1) % 3 if i == len(self.choice) - 1 else gold
      out.append((0.0 if self.choice[i]["choices"][best] == continuation else -1.0, False))
    return out

  def generate_until(self, requests):
    out = []
    for request in requests:
      i = next(i for i, d in enumerate(self.generate) if d["prompt"] == request.args[0])
      answer = self.generate[i]["answer"] if i < len(self.generate) - 1 else "pear"
      out.append(f" {answer.upper()}!")  # case and punctuation are ignored
    return out

  def loglikelihood_rolling(self, requests):
    return [-float(len(request.args[0].encode())) for request in requests]  # 1 nat per byte


def test_offline_tasks_score_known_answers():
  out = lm_eval.simple_evaluate(model=_KnownAnswers(), tasks=TASKS, task_manager=_local_tasks(),
                                bootstrap_iters=0)
  results = out["results"]
  # Varied gold labels (not all 0): a model that scores every choice alike cannot reach 7/8.
  assert len({d["label"] for d in _docs("choice")}) == 3
  assert results["kvm_local_choice"]["acc,none"] == 7 / 8
  assert results["kvm_local_generate"]["exact_match,strip"] == 3 / 4
  texts = [d["text"] for d in _docs("documents")]
  nats, words = sum(len(t.encode()) for t in texts), sum(map(_count_words, texts))
  perplexity = results["kvm_local_perplexity"]
  assert perplexity["word_perplexity,none"] == pytest.approx(math.exp(nats / words), rel=1e-12)
  assert perplexity["byte_perplexity,none"] == pytest.approx(math.e, rel=1e-12)
  assert perplexity["bits_per_byte,none"] == pytest.approx(1 / math.log(2), rel=1e-12)


# One padded shape for every reference forward pass, so that it compiles once: the 24
# question + choice sequences, the 3 documents and the 4 generation prompts all fit.
_REF_ROWS, _REF_WIDTH = 32, 128


def _reference_logprobs(model, sequences: list[list[int]]) -> list[np.ndarray]:
  """Per sequence, ``[len, V]`` log-softmax of the model's logits from one plain forward pass,
  normalized in float64 here: no adapter, cache or decode code involved. Right padding never
  reaches earlier positions of a causal model (tests/nn/test_model.py::test_causality)."""
  assert len(sequences) <= _REF_ROWS and max(map(len, sequences)) <= _REF_WIDTH
  tokens = np.full((_REF_ROWS, _REF_WIDTH), TOK.eos_id, np.int32)
  for i, seq in enumerate(sequences):
    tokens[i, :len(seq)] = seq
  logits = np.asarray(logits_fn(model)(jnp.asarray(tokens)), np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  return [logp[i, :len(seq)] for i, seq in enumerate(sequences)]


def _reference_scores(model, pairs: list[tuple[list[int], list[int]]]) -> np.ndarray:
  """sum log p(continuation | context) of ``(context ids, continuation ids)`` pairs."""
  scores = []
  for (context, continuation), logp in zip(
      pairs, _reference_logprobs(model, [c + x for c, x in pairs])):
    predicted_at = np.arange(len(context) - 1, len(context) + len(continuation) - 1)
    scores.append(logp[predicted_at, continuation].sum())
  return np.asarray(scores)


def _reference_greedy(model, prompts: list[list[int]], max_new: int) -> list[str]:
  """Greedy continuations by repeated forward passes (argmax at the last position), each stopped
  at (and without) EOS, decoded."""
  seqs, new = [list(p) for p in prompts], [[] for _ in prompts]
  done = [False] * len(prompts)
  for _ in range(max_new):
    for i, logp in enumerate(_reference_logprobs(model, seqs)):
      if done[i]:
        continue
      second, first = np.sort(logp[-1])[-2:]
      # The adapter decodes through the cache (float32, a different program): its argmax can only
      # be compared where the best token wins by far more than the ~1e-5 the two paths differ by.
      assert first - second > 1e-3, "a near-tie: pick another prompt"
      token = int(np.argmax(logp[-1]))
      done[i] = token == TOK.eos_id
      if not done[i]:
        seqs[i].append(token)
        new[i].append(token)
  return [TOK.decode(ids) for ids in new]


def test_simple_evaluate_on_the_offline_tasks(model):
  """lm-eval's metrics equal those computed here from the model's forward pass alone: per-choice
  loglikelihoods -> acc, greedy continuations -> exact_match, document loglikelihoods -> word
  perplexity. No expected value goes through the adapter."""
  lm = KVMEvalLM(model, TOK, batch_size=4, pad_multiple=32, max_length=256)
  out = lm_eval.simple_evaluate(model=lm, tasks=TASKS, task_manager=_local_tasks(),
                                bootstrap_iters=0, log_samples=True)
  results, samples = out["results"], out["samples"]
  choice, documents = _docs("choice"), [d["text"] for d in _docs("documents")]
  pairs = [(TOK.encode(d["question"]), TOK.encode(c)) for d in choice for c in d["choices"]]
  pairs += [([TOK.eos_id], TOK.encode(text)) for text in documents]  # rolling: given EOS
  want = _reference_scores(model, pairs)
  # Float32 logits from two differently batched programs: the sums (-22 to -580 nats) agree to
  # ~2e-6; 1e-4 leaves room and is still far below the margin between the best two choices.
  tolerance = dict(rtol=1e-6, atol=1e-4)

  want_choice = want[:-len(documents)].reshape(len(choice), -1)
  got_choice = [[ll for ll, _ in s["filtered_resps"]] for s in _by_doc(samples["kvm_local_choice"])]
  np.testing.assert_allclose(got_choice, want_choice, **tolerance)
  top2 = np.sort(want_choice, axis=1)[:, -2:]
  assert np.all(top2[:, 1] - top2[:, 0] > 1e-2)  # each argmax is far outside the tolerance
  labels = np.array([d["label"] for d in choice])
  accuracy = np.mean(np.argmax(want_choice, axis=1) == labels)
  assert results["kvm_local_choice"]["acc,none"] == pytest.approx(accuracy, abs=1e-12)

  generate = _docs("generate")  # the task: until "\n", at most 8 new tokens
  continuations = _reference_greedy(model, [TOK.encode(d["prompt"]) for d in generate], 8)
  want_text = [text.split("\n")[0] for text in continuations]
  assert [s["resps"][0][0] for s in _by_doc(samples["kvm_local_generate"])] == want_text
  exact = np.mean([_first_word(t) == d["answer"].lower() for t, d in zip(want_text, generate)])
  assert results["kvm_local_generate"]["exact_match,strip"] == pytest.approx(exact, abs=1e-12)

  want_docs = want[-len(documents):]
  got_docs = [s["resps"][0][0] for s in _by_doc(samples["kvm_local_perplexity"])]
  np.testing.assert_allclose(got_docs, want_docs, **tolerance)
  words = sum(map(_count_words, documents))
  perplexity = results["kvm_local_perplexity"]["word_perplexity,none"]
  # The sums' tolerance (< 2e-3 nats in all) over 53 words moves the exponent by < 4e-5.
  assert perplexity == pytest.approx(math.exp(-want_docs.sum() / words), rel=1e-4)


def test_bad_adapter_arguments(model):
  with pytest.raises(ValueError, match="tokenizer has 320 ids but the model only 256"):
    KVMEvalLM(make_model("full"), TOK)
  with pytest.raises(ValueError, match="needs a model and a tokenizer"):
    KVMEvalLM()
  with pytest.raises(ValueError, match="max_length must be >= 1"):
    KVMEvalLM(model, TOK, max_length=0)
  with pytest.raises(ValueError, match="unknown arguments"):
    KVMEvalLM(model, TOK, pretrained="gpt2")


@pytest.mark.slow  # trains in a subprocess and indexes every lm-eval task; the adapter is in CI
def test_lm_eval_cli_on_a_run_directory(tmp_path):
  """lm-eval's own CLI with the registered `kvm_jax` model loading a kvm-train run directory."""
  run = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1",
             HF_HUB_OFFLINE="1")
  subprocess.run([sys.executable, "-m", "kvm_jax.train.main", "--config=train/configs/tiny_mqar.py",
                  f"--workdir={run}", "--config.steps=2", "--config.batch_size=4",
                  "--config.model.vocab_size=320", "--config.mqar.seq_len=32",
                  "--config.mqar.num_pairs=2", "--config.warmup_steps=1"],
                 cwd=ROOT, env=env, check=True, capture_output=True)
  proc = subprocess.run(
      [sys.executable, "-m", "kvm_jax.eval.lm_eval_adapter", "run", "--model", "kvm_jax",
       "--model_args", f"checkpoint={run},max_length=128", "--tasks", "kvm_local_choice",
       "--include_path", str(ROOT / "eval/lm_eval_tasks"), "--limit", "3",
       ], cwd=ROOT, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "kvm_local_choice" in proc.stdout and "acc" in proc.stdout
