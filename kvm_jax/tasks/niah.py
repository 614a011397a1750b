"""Needle-in-a-haystack, RULER's single-needle tasks (NVIDIA/RULER ``synthetic.yaml``), offline:
the examples, the string-match score, and a training stream.

* **S1** — haystack of the repeated noise sentences, 7-digit number values;
* **S2-style** — essay-like English prose, 7-digit number values;
* **S3-style** — the same prose, UUID values.

RULER's S2/S3 download Paul Graham essays at run time; here the prose is the CPython documentation
text that ships with Python (``pydoc_data``), hence "S2/S3-style". The needle is "One of the special
magic {numbers|uuids} for {key} is: {value}." with an adjective-noun key, inserted at one of 40
evenly spaced depths; the haystack is fitted with the model's tokenizer so that prompt + the
generation budget stays within the target length. Score: case-insensitive containment × 100.
The training stream (:class:`NIAHSpec`) puts the loss on the answer only.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Callable, Sequence

import numpy as np

from kvm_jax.tasks.tokenizers import tokenizer

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
         "again.")
TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {kind} afterwards.\n{context}\nWhat are all "
            "the special magic {kind} for {key} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {kind} for {key} mentioned in the provided text are"
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = np.linspace(0, 100, 40)
_ADJECTIVES = ("abundant", "brave", "calm", "dark", "eager", "fancy", "gentle", "happy", "icy",
               "jolly", "kind", "lively", "misty", "noisy", "odd", "proud", "quiet", "rapid",
               "shiny", "tidy", "upbeat", "vast", "witty", "young", "zealous", "bitter", "clever",
               "dusty", "empty", "fierce")
_NOUNS = ("apple", "bridge", "candle", "desert", "engine", "forest", "garden", "harbor", "island",
          "jacket", "kettle", "ladder", "mirror", "needle", "orchard", "pencil", "quarry", "river",
          "saddle", "temple", "umbrella", "valley", "window", "yacht", "zebra", "anchor", "basket",
          "castle", "dragon", "feather")
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")


@dataclasses.dataclass(frozen=True)
class NIAHExample:
  prompt: str        # the full input, ending with the answer prefix
  answer: str        # the value to find
  depth: float       # needle depth in percent of the haystack
  task: str
  length: int        # target length in tokens


def _prose() -> list[str]:
  from pydoc_data import topics
  sentences = []
  for name in sorted(topics.topics):
    for line in topics.topics[name].split("\n"):
      line = " ".join(line.split())
      if len(line) > 40 and line[0].isalpha() and not line.startswith(("Note", "Changed")):
        sentences.append(line)
  return sentences


def _needle_kind(task: str) -> str:
  return "uuids" if task == "niah_single_3" else "numbers"


def make_example(task: str, length: int, depth: float, seed: int,
                 count_tokens: Callable[[str], int], generation_budget: int = 128) -> NIAHExample:
  """One example whose tokenized prompt + ``generation_budget`` fits in ``length`` tokens."""
  if task not in TASKS:
    raise ValueError(f"unknown NIAH task {task!r}; choose from {TASKS}.")
  rng = np.random.default_rng([seed, int(depth * 1000), length, TASKS.index(task)])
  key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
  kind = _needle_kind(task)
  if kind == "uuids":
    value = str(uuid.UUID(int=int(rng.integers(0, 2 ** 63)) << 64 | int(rng.integers(0, 2 ** 63))))
  else:
    value = str(int(rng.integers(1_000_000, 10_000_000)))
  needle = NEEDLE.format(kind=kind, key=key, value=value)
  units = [NOISE] if task == "niah_single_1" else _prose()

  def build(n_units: int) -> str:
    if task == "niah_single_1":
      hay = [NOISE] * n_units
    else:
      hay = [units[i % len(units)] for i in range(n_units)]
    at = int(round(len(hay) * depth / 100))
    hay = hay[:at] + [needle] + hay[at:]
    context = " ".join(hay)
    return (TEMPLATE.format(kind=kind, key=key, context=context)
            + ANSWER_PREFIX.format(kind=kind, key=key))

  budget = length - generation_budget
  if count_tokens(build(0)) > budget:
    raise ValueError(f"length={length} is too short for the NIAH template and a "
                     f"{generation_budget}-token answer.")
  lo, hi = 0, 1
  while count_tokens(build(hi)) <= budget:  # exponential then binary search on haystack size
    lo, hi = hi, hi * 2
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (mid, hi) if count_tokens(build(mid)) <= budget else (lo, mid)
  return NIAHExample(prompt=build(lo), answer=value, depth=float(depth), task=task, length=length)


def shortest_length(task: str, count_tokens: Callable[[str], int],
                    generation_budget: int = 128) -> int:
  """The smallest target length for which :func:`make_example` succeeds for every key and depth
  (the template, the longest key and value, no haystack, plus the generation budget)."""
  kind = _needle_kind(task)
  key = f"{max(_ADJECTIVES, key=len)}-{max(_NOUNS, key=len)}"
  value = "x" * (36 if kind == "uuids" else 7)
  text = (TEMPLATE.format(kind=kind, key=key, context=NEEDLE.format(kind=kind, key=key, value=value))
          + ANSWER_PREFIX.format(kind=kind, key=key))
  return count_tokens(text) + generation_budget + 8  # margin: tokenizers may merge differently


def make_examples(task: str, length: int, count_tokens: Callable[[str], int], seed: int = 0,
                  depths: Sequence[float] = DEPTHS, generation_budget: int = 128):
  return [make_example(task, length, d, seed, count_tokens, generation_budget) for d in depths]


def hits(predictions: Sequence[str], answers: Sequence[str]) -> list[bool]:
  """Per prediction: does it contain its answer (case-insensitive)?"""
  if len(predictions) != len(answers):
    raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers.")
  return [a.lower() in p.lower() for p, a in zip(predictions, answers)]


def score(predictions: Sequence[str], answers: Sequence[str]) -> float:
  """RULER's string match: percentage of predictions containing their answer (case-insensitive)."""
  found = hits(predictions, answers)
  return 100.0 * sum(found) / len(found) if found else 0.0


# ----------------------------------------------------------------------------------------------
# A training stream
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NIAHSpec:
  """Training stream of RULER-style needle-in-a-haystack examples.

  Each example is a prompt of ``min_len`` .. ``seq_len`` tokens (uniform, so the model sees many
  haystack sizes and needle depths) followed by the answer; loss only on the answer tokens.
  """

  seq_len: int = 512
  min_len: int = 0          # 0 = seq_len // 2
  task: str = "niah_single_1"
  tokenizer_file: str = ""  # "" = bytes

  def __post_init__(self):
    if self.task not in TASKS:
      raise ValueError(f"NIAHSpec.task={self.task!r}; choose from {TASKS}.")
    if not 0 <= self.min_len <= self.seq_len:
      raise ValueError(f"NIAHSpec.min_len={self.min_len} must lie in [0, seq_len={self.seq_len}].")


def niah_example(seed: int, index: int, spec: NIAHSpec, tok=None) -> dict[str, np.ndarray]:
  """Example ``index`` of the NIAH training stream ``seed``: ``inputs``/``labels`` ``[seq_len]``."""
  from kvm_jax.tasks.labels import IGNORE  # here: it imports JAX (see niah_dataset)
  tok = tok or tokenizer(spec.tokenizer_file)
  rng = np.random.default_rng([seed, index, 77])
  answer_budget = 48 if spec.task == "niah_single_3" else 16  # " <value>." + EOS, with margin
  count = lambda t: len(tok.encode(t))
  lo = max(spec.min_len or spec.seq_len // 2, shortest_length(spec.task, count, answer_budget))
  if lo > spec.seq_len:
    raise ValueError(f"NIAHSpec.seq_len={spec.seq_len} is too short for the {spec.task} template "
                     f"with this tokenizer; use seq_len >= {lo}.")
  length = int(rng.integers(lo, spec.seq_len + 1))
  ex = make_example(spec.task, length, float(rng.choice(DEPTHS)), int(rng.integers(2 ** 31)),
                    count, generation_budget=answer_budget)
  prompt = tok.encode(ex.prompt)
  answer = tok.encode(f" {ex.answer}.") + [tok.eos_id]
  ids = (prompt + answer)[:spec.seq_len + 1]
  tokens = np.full(spec.seq_len + 1, tok.eos_id, np.int64)
  tokens[:len(ids)] = ids
  labels = np.full(spec.seq_len + 1, IGNORE, np.int64)
  labels[len(prompt):len(ids)] = tokens[len(prompt):len(ids)]
  return {"inputs": tokens[:-1].astype(np.int32), "labels": labels[1:].astype(np.int32)}


def niah_dataset(seed: int, spec: NIAHSpec) -> grain.MapDataset:
  """The index-addressable NIAH training stream ``seed``."""
  import grain  # here: grain imports JAX, and kvm-eval's parser reads this module's TASKS
  tok = tokenizer(spec.tokenizer_file)
  return grain.MapDataset.range(2 ** 31 - 1).map(lambda i: niah_example(seed, int(i), spec, tok))
