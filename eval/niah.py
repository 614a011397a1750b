"""NIAH evaluation: greedy generation on RULER's single-needle tasks (the examples and the score are
:mod:`kvm_jax.tasks.niah`), per task, length and needle depth."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np

from kvm_jax.generation.engine import generate_many
from kvm_jax.generation.generate import SamplingConfig, generate_text
from kvm_jax.util.progress import ProgressReport
from kvm_jax.tasks import niah

GREEDY = SamplingConfig(temperature=0.0)


def pick_depths(count: int) -> np.ndarray:
  """``count`` of RULER's 40 evenly spaced depths, spread over the whole range."""
  if not 1 <= count <= len(niah.DEPTHS):
    raise ValueError(f"--niah-depths must be in [1, {len(niah.DEPTHS)}], got {count}.")
  return niah.DEPTHS[np.round(np.linspace(0, len(niah.DEPTHS) - 1, count)).astype(int)]


def run_niah(predict: Callable[[str, int], str], count_tokens: Callable[[str], int], *,
             tasks: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
             generation_budget: int, seed: int = 0, desc: str = "niah") -> list[dict]:
  """Scores ``predict(prompt, length) -> generated text`` on each (task, length): one row each
  with the score (0–100), the number of examples and the per-depth hits. ``predict`` may be any
  function (an oracle, a model); one with a ``many(prompts, length) -> texts`` method (a
  :class:`EnginePredictor`) gets each (task, length)'s examples at once, to run them in a batch."""
  rows = []
  jobs = [(task, length, niah.make_examples(task, length, count_tokens, seed=seed, depths=depths,
                                             generation_budget=generation_budget))
          for task in tasks for length in lengths]
  report = ProgressReport(sum(len(examples) for *_, examples in jobs), desc, min_interval=1.0)
  done = 0
  for task, length, examples in jobs:
    if hasattr(predict, "many"):
      def advance(finished, base=done, label=f"{task} {length}"):
        report.update(base + finished, label, final=base + finished == report.bar.total)
      predictions = predict.many([ex.prompt for ex in examples], length, progress=advance)
      done += len(examples)
    else:
      predictions = []
      for ex in examples:  # one generation each: progress per generation, not per (task, length)
        predictions.append(predict(ex.prompt, length))
        done += 1
        report.update(done, f"{task} {length}", final=done == report.bar.total)
    answers = [ex.answer for ex in examples]
    hits = niah.hits(predictions, answers)
    rows.append({"task": task, "length": length, "score": niah.score(predictions, answers),
                 "examples": len(examples),
                 "depths": [float(ex.depth) for ex in examples], "hits": hits})
  return rows


def greedy_predictor(model, tokenizer, generation_budget: int, bucket: int = 64):
  """``predict(prompt, length)``: greedy continuation of up to ``generation_budget`` tokens, stopped
  at EOS, with the cache sized to the example's target length (one prompt at a time; the
  evaluation runs its examples in batches through :class:`EnginePredictor`)."""

  def predict(prompt: str, length: int) -> str:
    ids = tokenizer.encode(prompt)
    return generate_text(model, tokenizer, ids, max_new_tokens=generation_budget,
                         key=jax.random.key(0), max_len=max(length, len(ids) + generation_budget),
                         prefill_bucket=bucket)

  return predict


class EnginePredictor:
  """Greedy continuations of up to ``generation_budget`` tokens, stopped at (and without) EOS,
  for many prompts at once through :func:`kvm_jax.generate_many` (``slots`` requests at a time,
  prompts fed in parallel pieces of up to ``prefill_chunk`` tokens; a model that cannot continue
  in parallel, with cross-layer KV sharing, prefills each prompt's head in multiples of
  ``prefill_bucket`` instead). Calling it on one prompt runs that prompt alone; each prompt's text
  is the same either way (greedy: what ``kj.generate`` gives it)."""

  def __init__(self, model, tokenizer, generation_budget: int, *, slots: int = 8,
               prefill_chunk: int = 256, prefill_bucket: Optional[int] = 64):
    self.model, self.tokenizer, self.budget = model, tokenizer, generation_budget
    self.slots, self.prefill_chunk, self.prefill_bucket = slots, prefill_chunk, prefill_bucket

  def many(self, prompts: Sequence[str], length: int, progress=None) -> list[str]:
    ids = [self.tokenizer.encode(p) for p in prompts]
    longest = max(len(i) for i in ids) + self.budget
    outs = generate_many(self.model, ids, max_new_tokens=self.budget, sampling=GREEDY,
                         slots=self.slots, stop_tokens=(self.tokenizer.eos_id,),
                         max_len=max(length, longest), prefill_chunk=self.prefill_chunk,
                         prefill_bucket=(None if self.model.resume_alignment()
                                         else self.prefill_bucket), progress=progress)
    eos = self.tokenizer.eos_id
    return [self.tokenizer.decode([t for t in out if t != eos]) for out in outs]

  def __call__(self, prompt: str, length: int) -> str:
    return self.many([prompt], length)[0]
