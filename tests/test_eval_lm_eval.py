"""The lm-eval adapter: its scores against a different code path (prefill + decode steps), lm-eval's
own evaluator on the offline example tasks, and its CLI on a trained run directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the example tasks never download
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

import kvm_jax as kj  # noqa: E402
from kvm_jax.eval.lm_eval_adapter import KVMEvalLM, local_task_manager  # noqa: E402
from kvm_jax.tasks.tokenizers import ByteTokenizer  # noqa: E402
from tests.conftest import make_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
  return make_model("kvm", seed=3, vocab_size=TOK.vocab_size)


def _request(kind: str, *args) -> Instance:
  return Instance(request_type=kind, doc={}, arguments=args, idx=0)


def _decode_path_logprob(model, context: list[int], continuation: list[int]) -> float:
  """sum log p(continuation | context) from a prefill of the context and one decode step per
  continuation token: a different code path from the adapter's batched, padded forward."""
  caches = model.init_cache(1, len(context) + len(continuation))
  logits, caches = model.prefill(jnp.asarray([context], jnp.int32), caches)
  step_logits = logits[0, -1]
  total = 0.0
  for token in continuation:
    total += float(jax.nn.log_softmax(step_logits)[token])
    logits, caches = model.decode_step(jnp.asarray([[token]], jnp.int32), caches)
    step_logits = logits[0, 0]
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


def test_simple_evaluate_on_the_offline_tasks(model):
  lm = KVMEvalLM(model, TOK, batch_size=4, pad_multiple=32, max_length=256)
  out = lm_eval.simple_evaluate(
      model=lm, tasks=["kvm_local_choice", "kvm_local_generate", "kvm_local_perplexity"],
      task_manager=local_task_manager(), bootstrap_iters=0, log_samples=False)
  results = out["results"]
  # lm-eval's accuracy equals the argmax over our own loglikelihoods of the choices.
  docs = [__import__("json").loads(l) for l in
          (ROOT / "eval/lm_eval_tasks/kvm_local/choice.jsonl").read_text().splitlines()]
  correct = 0
  for d in docs:
    scores = lm.loglikelihood([_request("loglikelihood", d["question"], c) for c in d["choices"]])
    correct += int(np.argmax([s for s, _ in scores]) == d["label"])
  assert results["kvm_local_choice"]["acc,none"] == pytest.approx(correct / len(docs))
  assert 0.0 <= results["kvm_local_generate"]["exact_match,strip"] <= 1.0
  assert results["kvm_local_perplexity"]["word_perplexity,none"] > 1.0


def test_bad_adapter_arguments(model):
  with pytest.raises(ValueError, match="tokenizer has 320 ids but the model only 256"):
    KVMEvalLM(make_model("full"), TOK)
  with pytest.raises(ValueError, match="needs a model and a tokenizer"):
    KVMEvalLM()
  with pytest.raises(ValueError, match="max_length must be >= 1"):
    KVMEvalLM(model, TOK, max_length=0)
  with pytest.raises(ValueError, match="unknown arguments"):
    KVMEvalLM(model, TOK, pretrained="gpt2")


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
