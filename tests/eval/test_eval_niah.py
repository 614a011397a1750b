"""NIAH generator invariants and RULER-style scoring."""

from __future__ import annotations

import pytest

from kvm_jax.tasks import niah
from kvm_jax.tasks.tokenizers import ByteTokenizer

TOK = ByteTokenizer()
COUNT = lambda s: len(TOK.encode(s))


@pytest.mark.parametrize("task", niah.TASKS)
def test_needle_once_with_value_and_length_fits(task):
  for depth in (0.0, niah.DEPTHS[13], 100.0):
    ex = niah.make_example(task, 4096, depth, seed=1, count_tokens=COUNT)
    needle_start = "One of the special magic"
    assert ex.prompt.count(needle_start) == 1
    assert ex.prompt.count(ex.answer) == 1
    assert COUNT(ex.prompt) + 128 <= 4096
    assert COUNT(ex.prompt) + 128 > 4096 - 300   # the haystack fills the budget
    assert ex.prompt.endswith("mentioned in the provided text are")
  ex = niah.make_example(task, 4096, 50.0, seed=1, count_tokens=COUNT)
  assert len(ex.answer) == (36 if task == "niah_single_3" else 7)


def test_depth_places_the_needle_and_generation_is_deterministic():
  early = niah.make_example("niah_single_1", 8192, 0.0, 3, COUNT)
  late = niah.make_example("niah_single_1", 8192, 100.0, 3, COUNT)
  assert early.prompt.index("One of the special") < 300 < late.prompt.index("One of the special")
  again = niah.make_example("niah_single_1", 8192, 0.0, 3, COUNT)
  assert again == early
  assert len(niah.DEPTHS) == 40 and niah.DEPTHS[0] == 0 and niah.DEPTHS[-1] == 100


def test_scoring_oracle_and_empty_models():
  examples = niah.make_examples("niah_single_2", 2048, COUNT, depths=niah.DEPTHS[:5])
  answers = [e.answer for e in examples]
  assert niah.score([f" {a}." for a in answers], answers) == 100.0   # a model copying the needle
  assert niah.score(["" for _ in answers], answers) == 0.0           # a model that says nothing
  assert niah.score(["The VALUE is " + answers[0].upper()], answers[:1]) == 100.0
  assert niah.score([answers[1]] + [""] * 4, answers) == 0.0
  with pytest.raises(ValueError, match="too short"):
    niah.make_example("niah_single_1", 150, 0.0, 0, COUNT)


def test_engine_predictor_generates_what_one_by_one_generation_does():
  """The NIAH suite's batches through the engine give every example the text that generating it
  alone gives, slots reused, prompts of several lengths; ``run_niah`` scores the batch as it
  scores those texts."""
  import kvm_jax.eval.niah as niah_eval
  from tests.helpers import make_model

  model = make_model(("swa", "kvm"), 3)  # a seed whose continuations differ between prompts
  budget = 12
  kw = dict(tasks=["niah_single_1"], lengths=[400], depths=niah.DEPTHS[:2],
            generation_budget=budget)
  examples = niah.make_examples("niah_single_1", 400, COUNT, depths=niah.DEPTHS[:2],
                                generation_budget=budget)
  one = niah_eval.greedy_predictor(model, TOK, budget)
  batched = niah_eval.EnginePredictor(model, TOK, budget, slots=2, prefill_chunk=64)
  prompts = [ex.prompt for ex in examples]
  alone = {p: one(p, 400) for p in prompts}
  assert batched.many(prompts, 400) == [alone[p] for p in prompts]
  assert len(set(alone.values())) > 1  # the prompts differ, so do the continuations
  assert (niah_eval.run_niah(batched, COUNT, **kw)
          == niah_eval.run_niah(lambda prompt, length: alone[prompt], COUNT, **kw))
