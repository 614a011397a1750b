"""EleutherAI lm-evaluation-harness adapter: any kvm_jax model + tokenizer as an ``lm_eval`` LM.

Python::

    from kvm_jax.eval.lm_eval_adapter import KVMEvalLM, local_task_manager
    import lm_eval
    lm = KVMEvalLM(checkpoint="runs/text")                 # or KVMEvalLM(model, tokenizer)
    out = lm_eval.simple_evaluate(model=lm, tasks=["kvm_local_choice"],
                                  task_manager=local_task_manager())

Command line (registers the model as ``kvm_jax`` and then runs lm-eval's own CLI)::

    python -m kvm_jax.eval.lm_eval_adapter run --model kvm_jax --model_args checkpoint=runs/text \\
        --tasks kvm_local_choice --include_path eval/lm_eval_tasks

Scoring follows lm-eval's conventions: ``loglikelihood`` sums log p(continuation | context) and
reports whether the continuation is the greedy one; contexts longer than ``max_length`` are cut
from the left (a warning counts them); ``loglikelihood_rolling`` scores a whole document in
disjoint windows of ``max_length`` tokens after an EOS prefix; ``generate_until`` decodes greedily
(or samples when ``do_sample``/``temperature`` ask for it) and cuts at the first stop string.
Scoring runs ragged contexts ``batch_size`` at a time in one forward pass, right-padded to a
multiple of ``pad_multiple`` tokens so that the jitted forward compiles once per bucket, not once
per request length (causal models: right padding never changes the scored positions).
``generate_until`` runs all of a call's requests through one :class:`kvm_jax.Engine`,
``batch_size`` slots decoding together, each request with its own settings.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  from lm_eval.api.model import LM as _HarnessLM
  from lm_eval.api.registry import register_model
  from lm_eval import utils as _harness_utils
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError("the lm-eval adapter needs lm-evaluation-harness: pip install 'kvm-jax[eval]' "
                    "(or pip install lm_eval)") from e

from kvm_jax.generation.engine import Engine
from kvm_jax.generation.generate import SamplingConfig
from kvm_jax.runs.directory import load_trained
from kvm_jax.tasks.tokenizers import tokenizer as run_tokenizer

log = logging.getLogger(__name__)
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


def local_task_manager(*extra_dirs: str | Path, include_defaults: bool = True):
  """An lm-eval ``TaskManager`` that also knows the offline example tasks shipped with the package
  (``kvm_jax/eval/lm_eval_tasks``; ``eval/lm_eval_tasks`` in the repository).

  ``include_defaults=False`` leaves out lm-eval's own tasks: indexing their thousands of task
  files is most of the time a small offline evaluation takes."""
  from lm_eval.tasks import TaskManager
  return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra_dirs)],
                     include_defaults=include_defaults)


@functools.partial(jax.jit, static_argnums=0)
def _token_scores(graphdef, params, inputs, targets):
  """Per-position ``log p(target)`` and ``target == argmax``: ``[B, T]`` each."""
  logits = nnx.merge(graphdef, params)(inputs)
  logp = jax.nn.log_softmax(logits, axis=-1)
  picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return picked, jnp.argmax(logits, axis=-1) == targets


@register_model("kvm_jax")
class KVMEvalLM(_HarnessLM):
  """A kvm_jax model as an lm-eval LM.

  Args:
    model: an ``kvm_jax.LM`` (``nnx`` module with parameters) — or pass ``checkpoint``.
    tokenizer: anything with ``encode(str) -> list[int]``, ``decode(ids) -> str`` and ``eos_id``
      (``kvm_jax.tasks.ByteTokenizer``, ``kvm_jax.tasks.HFTokenizer``).
    checkpoint: a run directory (``kvm-train``/``kvm-demo`` workdir with ``config.json``); the model
      and tokenizer are loaded from it.
    max_length: the longest token sequence scored in one forward pass.
    batch_size: requests per forward pass.
    max_gen_toks: default generation budget when a request names none.
    pad_multiple: forward passes are padded to a multiple of this many tokens.
  """

  def __init__(self, model=None, tokenizer=None, *, checkpoint: Optional[str] = None,
               max_length: int = 2048, batch_size: int | str = 8, max_gen_toks: int = 256,
               pad_multiple: int = 64, **harness_kwargs):
    super().__init__()
    unused = {k: v for k, v in harness_kwargs.items()
              if k not in ("device", "max_batch_size") and v is not None}
    if unused:
      raise ValueError(f"KVMEvalLM: unknown arguments {sorted(unused)}.")
    if checkpoint is not None:
      if model is not None:
        raise ValueError("pass either a model or checkpoint=, not both.")
      cfg, model, _ = load_trained(checkpoint)
      tokenizer = tokenizer or run_tokenizer(cfg.tokenizer_file)
    if model is None or tokenizer is None:
      raise ValueError("KVMEvalLM needs a model and a tokenizer (or checkpoint=RUN_DIR).")
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is not None and vocab > model.cfg.vocab_size:
      raise ValueError(f"the tokenizer has {vocab} ids but the model only {model.cfg.vocab_size}; "
                       "this model was not trained on this tokenizer's text.")
    if str(batch_size).startswith("auto"):
      batch_size = 8  # no memory probing on JAX; a fixed default
    self.model, self.tokenizer = model, tokenizer
    self.graphdef, self.params = nnx.split(model)
    self.max_length, self.batch_size = int(max_length), int(batch_size)
    self.max_gen_toks, self.pad_multiple = int(max_gen_toks), int(pad_multiple)
    for name in ("max_length", "batch_size", "max_gen_toks", "pad_multiple"):
      if getattr(self, name) < 1:
        raise ValueError(f"KVMEvalLM: {name} must be >= 1, got {getattr(self, name)}.")
    self.truncated = 0  # requests whose context was cut from the left

  @property
  def eot_token_id(self) -> int:
    return self.tokenizer.eos_id

  @property
  def tokenizer_name(self) -> str:
    return type(self.tokenizer).__name__

  # -- scoring --------------------------------------------------------------------------------

  def _score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """``(sum log p(cont), greedy)`` for ``(context ids, continuation ids)``; context non-empty."""
    rows = []
    for context, continuation in pairs:
      if not continuation:
        rows.append(None)
        continue
      whole = (context + continuation)[-(self.max_length + 1):]
      if len(context) + len(continuation) > self.max_length + 1:
        self.truncated += 1
      rows.append((whole[:-1], whole[1:], len(continuation)))
    results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
    order = sorted((i for i, r in enumerate(rows) if r is not None), key=lambda i: -len(rows[i][0]))
    for start in range(0, len(order), self.batch_size):
      idx = order[start:start + self.batch_size]
      width = -(-len(rows[idx[0]][0]) // self.pad_multiple) * self.pad_multiple
      inputs = np.full((self.batch_size, width), self.eot_token_id, np.int32)
      targets = np.zeros_like(inputs)
      for b, i in enumerate(idx):
        x, y, _ = rows[i]
        inputs[b, :len(x)], targets[b, :len(y)] = x, y
      logp, greedy = _token_scores(self.graphdef, self.params, jnp.asarray(inputs),
                                   jnp.asarray(targets))
      logp, greedy = np.asarray(logp, np.float64), np.asarray(greedy)
      for b, i in enumerate(idx):
        x, _, n = rows[i]
        span = slice(len(x) - n, len(x))
        results[i] = (float(logp[b, span].sum()), bool(greedy[b, span].all()))
    if self.truncated:
      log.warning("%d requests were longer than max_length=%d tokens and were cut from the left.",
                  self.truncated, self.max_length)
    return results

  def loglikelihood(self, requests) -> list[tuple[float, bool]]:
    pairs = []
    for request in requests:
      context, continuation = request.args
      context_ids = self.tokenizer.encode(context) if context else [self.eot_token_id]
      pairs.append((context_ids, self.tokenizer.encode(continuation)))
    return self._score(pairs)

  def loglikelihood_rolling(self, requests) -> list[float]:
    out = []
    for request in requests:
      (text,) = request.args
      windows = [_harness_utils.make_disjoint_window(w) for w in
                 _harness_utils.get_rolling_token_windows(
                     token_list=self.tokenizer.encode(text), prefix_token=self.eot_token_id,
                     max_seq_len=self.max_length, context_len=1)]
      out.append(sum(logp for logp, _ in self._score(windows)))
    return out

  # -- generation -----------------------------------------------------------------------------

  def generate_until(self, requests) -> list[str]:
    """Every request of the call through one :class:`kvm_jax.Engine` (``batch_size`` at a time,
    each with its own sampling settings; request ``i`` of a call samples with seed ``i``: a
    rerun repeats its samples, while identical requests of one call, the repeats of a sampled
    task, are drawn independently). Each text is what generating its request alone gives."""
    jobs = []
    for request in requests:
      context, kwargs = request.args
      kwargs = dict(kwargs or {})
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
      temperature = float(kwargs.pop("temperature", 0.0))
      if not kwargs.pop("do_sample", temperature > 0):
        temperature = 0.0
      sampling = SamplingConfig(temperature=temperature, top_k=kwargs.pop("top_k", None),
                                top_p=kwargs.pop("top_p", None))
      if kwargs:
        log.warning("generate_until ignores unsupported arguments %s", sorted(kwargs))
      ids = self.tokenizer.encode(context) or [self.eot_token_id]
      keep = max(self.max_length - max_new, 1)
      if len(ids) > keep:
        ids, self.truncated = ids[-keep:], self.truncated + 1
      jobs.append((ids, max_new, sampling, until))
    if not jobs:
      return []
    longest = max(len(ids) + max_new for ids, max_new, _, _ in jobs)
    # batch_size slots whatever the call's size, and a length rounded up to pad_multiple: calls
    # share their compiled steps. Prompts continue in parallel pieces, every slot's at once
    # (throughput, not latency); a model that cannot (cross-layer KV sharing) prefills their
    # heads in multiples of pad_multiple instead.
    engine = Engine(self.model, slots=self.batch_size,
                    max_len=-(-longest // self.pad_multiple) * self.pad_multiple,
                    prefill_chunk=256, prefill_lanes=self.batch_size, tokens_per_step=16,
                    prefill_bucket=None if self.model.resume_alignment() else self.pad_multiple)
    eos = self.tokenizer.eos_id
    ids = [engine.submit(ids, max_new_tokens=max_new, sampling=sampling, seed=i,
                         stop_tokens=(eos,))
           for i, (ids, max_new, sampling, _) in enumerate(jobs)]
    engine.run()
    out = []
    for rid, (*_, until) in zip(ids, jobs):
      text = self.tokenizer.decode([t for t in engine.result(rid).tokens if t != eos])
      for stop in until:
        if stop and stop in text:
          text = text[:text.index(stop)]
      out.append(text)
    return out


def main(argv: Optional[Sequence[str]] = None) -> None:
  """``python -m kvm_jax.eval.lm_eval_adapter run --model kvm_jax --model_args checkpoint=DIR ...``:
  lm-eval's own CLI with the ``kvm_jax`` model registered."""
  import sys
  from lm_eval.__main__ import cli_evaluate
  if argv is not None:
    sys.argv = [sys.argv[0], *argv]
  cli_evaluate()


if __name__ == "__main__":
  main()
