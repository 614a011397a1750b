"""A generation engine: ragged prompts, continuous batching over cache slots, chunked prefill.

The engine owns one decode cache of ``slots`` rows (:mod:`kvm_jax.nn.cache`: every row an
independent sequence at a length of its own). Requests wait in a queue; a free slot admits one
(its row reset to an empty cache), feeds its prompt in pieces of at most ``prefill_chunk`` tokens,
then decodes until a stop token, ``max_new_tokens`` or a cancel frees the slot for the next
request. Every :meth:`Engine.step` is one jitted call over all slots: the prompts' pieces (up to
``prefill_lanes`` of them in parallel, each ``LM.resume`` of whole chunks or, for a prompt's last
piece, of a chunk-wide lane filled up to its count of real tokens), then rounds of decode steps
in one loop that feed every decoding slot's tokens and draw on the device (up to
``tokens_per_step`` per slot once no prompt is left to feed); the host reads the drawn tokens
once. A prompt's partial last chunk thus costs one parallel program rather than a decode round
per token (up to 255 at the paper's chunk of 256), and the lane widths, not the rests' lengths,
decide the compiled programs (:meth:`Engine.lane_widths`). Models that cannot continue a piece in
parallel (cross-layer KV sharing) feed their prompts through the decode rounds.

A request's tokens depend only on its prompt, sampling settings and seed, never on what else is
running: its slot starts from an empty row, rows never mix, and its random keys are its own. A
request with seed ``s`` draws exactly what ``kj.generate`` draws for that prompt alone with
``key=jax.random.PRNGKey(s)`` (the same key splits, the same sampling), so greedy and sampled
tokens alike equal the alone run, up to float32 rounding of the logits (the engine feeds a prompt
in pieces; ``generate`` prefills it at once).

``generate_many(model, prompts, ...)`` is the common case: a list of prompts of any lengths in, one
list of generated tokens per prompt out.

On a pod (parameters that span processes), every process builds the same engine and makes the
same calls in the same order, like any SPMD program: the scheduling is deterministic, the step's
inputs are replicated onto the parameters' mesh, and every process reads the same tokens.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import time
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.generation.generate import SamplingConfig, pod_mesh, replicate_on
from kvm_jax.nn.cache import put_rows

Array = jax.Array
INT32_MAX = 2**31 - 1
# The seeds a request may name: jax.random.PRNGKey keeps 32 bits of a seed (without x64), so
# 2**32 would draw what 0 draws; a larger Python int does not convert at all.
SEED_MIN, SEED_MAX = 0, 2**32 - 1
# Finished requests an engine keeps for Engine.result by default (the oldest go first): a
# long-lived engine serves without end, and its memory must not grow with what it served.
KEEP_FINISHED = 1024
# How an engine feeds a prompt's rest shorter than the model's alignment (Engine's rest_prefill).
REST_PREFILLS = ("lane", "decode")


# ----------------------------------------------------------------------------------------------
# Sampling with settings of its own per row
# ----------------------------------------------------------------------------------------------


def sample_rows(logits: Array, keys: Array, temperature: Array, top_k: Array,
                top_p: Array) -> Array:
  """Draws one token per row from ``logits [S, V]``, each row with its own raw PRNG key
  (``keys [S, 2]`` uint32) and settings: ``temperature [S]`` (0 = greedy), ``top_k [S]`` (0 =
  all tokens), ``top_p [S]`` (a value > 1 = no nucleus cut). Row by row the same arithmetic and
  the same random draws as :func:`kvm_jax.generation.generate.sample_logits` on that row alone. The sorts
  of the top-k and nucleus cuts run only in calls where some row asks for them, and the draw
  only where some row samples (a greedy batch is one argmax)."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  sampled = temperature > 0

  def draw(logits):
    scaled = logits / jnp.where(sampled, temperature, 1.0)[:, None]
    scaled = jax.lax.cond(jnp.any(sampled & (top_k > 0)), _cut_top_k, lambda x, _: x, scaled,
                          top_k)
    scaled = jax.lax.cond(jnp.any(sampled & (top_p <= 1.0)), _cut_top_p, lambda x, _: x,
                          scaled, top_p)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row[None], axis=-1)[0])(
        keys, scaled)
    return jnp.where(sampled, drawn.astype(jnp.int32), greedy)

  return jax.lax.cond(jnp.any(sampled), draw, lambda _: greedy, logits)


def _cut_top_k(scaled: Array, top_k: Array) -> Array:
  """``scaled [S, V]`` with each row's tokens below its ``top_k``-th largest set to -inf (rows
  with ``top_k`` 0 untouched)."""
  V = scaled.shape[-1]
  descending = -jnp.sort(-scaled, axis=-1)
  kth = jnp.take_along_axis(descending, (jnp.clip(top_k, 1, V) - 1)[:, None], axis=-1)
  return jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)


def _cut_top_p(scaled: Array, top_p: Array) -> Array:
  """``scaled [S, V]`` with each row's tokens outside its nucleus ``top_p`` set to -inf (the
  most likely token always kept; rows with ``top_p`` > 1 untouched)."""
  order = jnp.argsort(-scaled, axis=-1)
  probs = jax.nn.softmax(jnp.take_along_axis(scaled, order, axis=-1), axis=-1)
  keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
  keep = jax.vmap(lambda o, k: jnp.zeros_like(k).at[o].set(k))(order, keep_sorted)
  return jnp.where((top_p[:, None] <= 1.0) & ~keep, -jnp.inf, scaled)


def sampling_rows(sampling: SamplingConfig) -> tuple[float, int, float]:
  """``(temperature, top_k, top_p)`` of :func:`sample_rows` for one request's settings. A
  ``top_k`` beyond int32 keeps every token, as any ``top_k`` of at least the vocabulary does."""
  return (float(sampling.temperature), min(int(sampling.top_k or 0), INT32_MAX),
          2.0 if sampling.top_p is None else float(sampling.top_p))


# ----------------------------------------------------------------------------------------------
# The device step
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What one engine step does to each of the ``S`` slots (host-built arrays).

  A step feeds the lanes' prompt pieces in parallel, then runs one loop of decode steps over
  every slot: round ``i`` feeds each slot its serial piece's token ``i`` while it has one, then
  the token it drew last; a slot draws after feeding the last token of its piece, and after each
  token it feeds back, ``draws`` times in all.

  Attributes:
    tokens: ``[S, n]`` int32, each slot's serial piece (a prompt rest, or its last sampled
      token), fed through the decode step.
    counts: ``[S]`` int32, the tokens of the serial piece (0: none).
    draws: ``[S]`` int32, the tokens the slot draws this step (0: none).
    lane_tokens: ``[N, P]`` int32, the prompt pieces the ``N`` lanes feed in parallel
      (``LM.resume``; ``P`` a multiple of the model's ``resume_alignment``; ``P = 0``: no lane
      this step). A lane slot has no serial piece; it draws its first token from the piece.
    lane_counts: ``[N]`` int32, the real tokens at the front of each lane's piece (1 to ``P``;
      fewer than ``P`` for a prompt's last, partial piece, the rest padding).
    lane_slots: ``[N]`` int32, the slot each lane feeds (``S``: an unused lane).
    reset: ``[S]`` bool, slots whose row starts a new sequence (emptied before feeding).
    copy_from: ``[S]`` int32, for a sample of an n-sample request the slot its prompt was fed
      in (its row and logits are copied when that prompt's last token is fed, before the
      sample's first draw), else -1.
    copy_at: ``[S]`` int32, the round of that copy (-1: after the lanes, before the loop).
    new_keys: ``[S, 2]`` uint32, the first key of a request admitted this step.
    set_key: ``[S]`` bool, slots whose key is replaced by ``new_keys``.
    temperature / top_k / top_p: ``[S]``, each slot's sampling settings (:func:`sample_rows`).
  """

  tokens: np.ndarray
  counts: np.ndarray
  draws: np.ndarray
  lane_tokens: np.ndarray
  lane_counts: np.ndarray
  lane_slots: np.ndarray
  reset: np.ndarray
  copy_from: np.ndarray
  copy_at: np.ndarray
  new_keys: np.ndarray
  set_key: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray


jax.tree_util.register_dataclass(
    StepPlan, data_fields=[f.name for f in dataclasses.fields(StepPlan)], meta_fields=[])


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def prefill_into_slot(graphdef, state, tokens: Array, caches, fresh, slot: Array):
  """A prompt head ``tokens [1, H]`` prefilled in parallel on an empty one-row cache and
  inserted as row ``slot`` of ``caches`` (donated): the engine's ``prefill_bucket`` admission."""
  _, row = nnx.merge(graphdef, state).prefill(tokens, fresh)
  put = lambda whole, one: jax.lax.dynamic_update_slice_in_dim(whole, one.astype(whole.dtype),
                                                               slot, axis=0)
  return jax.tree_util.tree_map(put, caches, row)


def _feed_lanes(model, caches, plan: StepPlan):
  """The lanes' prompt pieces in parallel: their rows gathered, continued by ``LM.resume`` by
  each lane's count of real tokens (from length 0 for a prompt's first piece), scattered back;
  an unused lane (slot ``S``) is dropped. Returns the caches and ``logits [S, V]``: each lane
  slot's logits of its piece's last real token."""
  S = plan.counts.shape[0]
  gather = jnp.minimum(plan.lane_slots, S - 1)
  rows = jax.tree_util.tree_map(lambda x: jnp.take(x, gather, axis=0), caches)
  lane_logits, rows = model.resume(plan.lane_tokens, rows, plan.lane_counts)
  put = lambda whole, part: whole.at[plan.lane_slots].set(part.astype(whole.dtype), mode="drop")
  caches = jax.tree_util.tree_map(put, caches, rows)
  last = jnp.take_along_axis(lane_logits, (plan.lane_counts - 1)[:, None, None], axis=1)[:, 0]
  logits = jnp.zeros((S, lane_logits.shape[-1]), jnp.float32)
  return caches, logits.at[plan.lane_slots].set(last, mode="drop")


def _copy_where(caches, logits: Array, copy_from: Array, now: Array):
  """Row ``copy_from[s]`` of the caches and of ``logits [S, V]`` into row ``s`` wherever ``now
  [S]`` holds: the caches in place, one row per copy (a copy's source is never a target)."""
  source = jnp.where(now, copy_from, jnp.arange(copy_from.shape[0]))
  return (put_rows(caches, now, caches, source),
          jnp.where(now[:, None], jnp.take(logits, source, axis=0), logits))


class _Drawn(NamedTuple):
  """The tokens a step drew (``[S, W]``), the logits each came from (``[S, W, V]``, or ``[S, 0,
  V]`` when not kept) and every slot's last drawn token ``[S]``."""
  tokens: Array
  logits: Array
  last: Array


def _record(drawn: _Drawn, index: Array, drawing: Array, tokens: Array, logits: Array,
            keep_logits: bool) -> _Drawn:
  """``drawn`` with each drawing slot's token (and logits) written at its draw ``index [S]``."""
  at = drawing[:, None] & (jnp.arange(drawn.tokens.shape[1])[None, :] == index[:, None])
  kept = drawn.logits
  if keep_logits:
    kept = jnp.where(at[..., None], logits.astype(jnp.float32)[:, None], kept)
  return _Drawn(jnp.where(at, tokens[:, None], drawn.tokens), kept,
                jnp.where(drawing, tokens, drawn.last))


def _draw(logits: Array, keys: Array, plan: StepPlan, drawing: Array):
  """One token per slot from ``logits [S, V]``, and the keys after it: a drawing slot splits its
  key into (next key, this draw) as ``kj.generate`` does per token; the others keep theirs."""
  pairs = jax.vmap(jax.random.split)(keys)                      # [S, 2, 2]: (next key, this draw)
  tokens = sample_rows(logits, pairs[:, 1], plan.temperature, plan.top_k, plan.top_p)
  return tokens, jnp.where(drawing[:, None], pairs[:, 0], keys)


def _engine_step(graphdef, state, caches, keys: Array, fresh, plan: StepPlan, *, width: int,
                 keep_logits: bool):
  """One step over every slot: reset, the lanes, then the rounds of decode steps (serial
  pieces, draws, tokens fed back). Returns ``(caches, keys, tokens [S, width], logits [S,
  width, V] or None, rounds)``: slot ``s``'s draws are its first ``plan.draws[s]`` tokens;
  ``rounds`` (int32) is how many decode steps the loop ran."""
  model = nnx.merge(graphdef, state)
  S, V = plan.counts.shape[0], model.cfg.vocab_size
  caches = put_rows(caches, plan.reset, fresh, jnp.zeros((S,), jnp.int32))
  keys = jnp.where(plan.set_key[:, None], plan.new_keys, keys)
  drawn = _Drawn(jnp.zeros((S, width), jnp.int32),
                 jnp.zeros((S, width if keep_logits else 0, V), jnp.float32),
                 jnp.zeros((S,), jnp.int32))
  if plan.lane_tokens.shape[1]:
    caches, logits = _feed_lanes(model, caches, plan)
    caches, logits = _copy_where(caches, logits, plan.copy_from,
                                 (plan.copy_from >= 0) & (plan.copy_at < 0))
    first = (plan.counts == 0) & (plan.draws > 0)   # lane slots (and copies of them) draw now
    tokens, keys = _draw(logits, keys, plan, first)
    drawn = _record(drawn, jnp.zeros((S,), jnp.int32), first, tokens, logits, keep_logits)

  # Round i feeds a slot while i < fed_until: its piece, then each token it drew but the last.
  fed_until = plan.counts + jnp.maximum(plan.draws - 1, 0)
  n = plan.tokens.shape[1]

  def round_(carry):
    i, caches, keys, drawn = carry
    piece = jax.lax.dynamic_index_in_dim(plan.tokens, jnp.minimum(i, n - 1), axis=1,
                                         keepdims=False)
    # A row keeps its cache through the rounds it does not feed: the decode step writes only
    # the rows it feeds, in place (a select of stepped against kept caches would hold both).
    feeding = i < fed_until
    logits, caches = nnx.merge(graphdef, state).decode_step(
        jnp.where(i < plan.counts, piece, drawn.last)[:, None], caches, feeding)
    caches, logits = _copy_where(caches, logits[:, 0], plan.copy_from, plan.copy_at == i)
    index = i - plan.counts + 1                  # the draw this round gives a slot
    drawing = (index >= 0) & (index < plan.draws)
    tokens, keys = _draw(logits, keys, plan, drawing)
    return i + 1, caches, keys, _record(drawn, index, drawing, tokens, logits, keep_logits)

  rounds, caches, keys, drawn = jax.lax.while_loop(
      lambda carry: carry[0] < jnp.max(fed_until), round_, (jnp.int32(0), caches, keys, drawn))
  return caches, keys, drawn.tokens, (drawn.logits if keep_logits else None), rounds


def step_widths(alignment: Optional[int], prefill_chunk: int, tokens_per_step: int
                ) -> tuple[Optional[int], int, int]:
  """``(alignment, serial width, draw width)`` of an engine: the lanes' alignment (None: no
  lanes, when the model cannot resume in parallel or ``prefill_chunk`` is shorter than one
  aligned piece), the most tokens a slot feeds through the decode step in one step, and the most
  it draws in one step."""
  alignment = alignment if alignment and prefill_chunk >= alignment else None
  # The decode step feeds what no lane takes: rests shorter than the alignment with
  # rest_prefill="decode", a rest that starts off the alignment (after a prefill_bucket head),
  # and, without lanes, every prompt.
  serial = prefill_chunk if alignment is None else min(prefill_chunk, max(alignment - 1, 1))
  # A slot draws at most this many tokens in a step: a burst, or the rounds a serial rest runs
  # (the decoding slots ride along).
  return alignment, serial, max(tokens_per_step, serial + 1)


def step_arguments(model, *, slots: int, max_len: int, prefill_chunk: int = 64,
                   prefill_lanes: int = 4, tokens_per_step: int = 8, keep_logits: bool = False):
  """``(step, arguments)``: the jitted step of an :class:`Engine` of these settings and
  ``ShapeDtypeStruct`` arguments of its largest form, whose lanes feed the widest prompt piece
  (``model`` may be abstract: ``nnx.eval_shape``). Nothing is allocated; ``kvm-bench --slots``
  compiles it for a chip to find how many slots fit."""
  alignment, serial, width = step_widths(model.resume_alignment(), prefill_chunk,
                                         tokens_per_step)
  graphdef, state = nnx.split(model)
  lanes = min(prefill_lanes, slots)
  piece = prefill_chunk // alignment * alignment if alignment else 0
  spec = jax.ShapeDtypeStruct
  S, i32 = slots, jnp.int32
  plan = StepPlan(tokens=spec((S, serial), i32), counts=spec((S,), i32), draws=spec((S,), i32),
                  lane_tokens=spec((lanes, piece), i32),
                  lane_counts=spec((lanes,), i32), lane_slots=spec((lanes,), i32),
                  reset=spec((S,), jnp.bool_), copy_from=spec((S,), i32),
                  copy_at=spec((S,), i32), new_keys=spec((S, 2), jnp.uint32),
                  set_key=spec((S,), jnp.bool_), temperature=spec((S,), jnp.float32),
                  top_k=spec((S,), i32), top_p=spec((S,), jnp.float32))
  caches = jax.eval_shape(lambda: model.init_cache(slots, max_len))
  fresh = jax.eval_shape(lambda: model.init_cache(1, max_len))
  as_spec = lambda x: spec(x.shape, x.dtype)  # noqa: E731
  state = jax.tree_util.tree_map(as_spec, state)
  arguments = (state, caches, spec((S, 2), jnp.uint32), fresh, plan)
  return step_program(graphdef, width, keep_logits), arguments


@functools.lru_cache(maxsize=32)
def step_program(graphdef, width: int, keep_logits: bool):
  """The jitted engine step for one model structure (``caches`` and ``keys`` donated), drawing
  at most ``width`` tokens per slot. The structure is bound here, once per engine, rather than
  hashed as a static argument on every step (a model's graphdef costs about a millisecond to
  hash); engines of one structure share the program and its compilations."""
  return jax.jit(functools.partial(_engine_step, graphdef, width=width, keep_logits=keep_logits),
                 donate_argnums=(1, 2))


# ----------------------------------------------------------------------------------------------
# Requests and the host-side scheduler
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Request:
  """One submitted prompt and what became of it.

  Attributes:
    id: the request id :meth:`Engine.submit` returned.
    prompt: the prompt's token ids.
    max_new_tokens / sampling / seed / stop_tokens: as submitted.
    tokens: the tokens generated so far (a stop token included, as the last one).
    finish_reason: None while running; "stop" (a stop token), "length" (``max_new_tokens``) or
      "cancelled".
    logits: with ``Engine(keep_logits=True)``, the float32 logits each token was drawn from.
  """

  id: int
  prompt: tuple
  max_new_tokens: int
  sampling: SamplingConfig
  seed: int
  stop_tokens: frozenset
  tokens: list = dataclasses.field(default_factory=list)
  finish_reason: Optional[str] = None
  logits: list = dataclasses.field(default_factory=list)
  fed: int = 0                        # prompt tokens fed so far
  slot: Optional[int] = None
  source: Optional["Request"] = None  # a sample of an n-sample request: the request fed
  needs_key: bool = False             # admitted: its slot's key starts from its seed

  @property
  def done(self) -> bool:
    return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token, as :meth:`Engine.step` reports it (``finish_reason`` set on a
  request's last token)."""

  request_id: int
  token: int
  finish_reason: Optional[str] = None


def _check_seeds(seed, n: int) -> None:
  """A ValueError unless seeds ``seed .. seed + n - 1`` are ints :func:`jax.random.PRNGKey` keeps
  whole (:data:`SEED_MIN` .. :data:`SEED_MAX`)."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
      not SEED_MIN <= seed <= SEED_MAX - (n - 1):
    last = "" if n == 1 else f" (and seed + {n - 1} for the last of {n} samples)"
    raise ValueError(f"seed must be an int in [{SEED_MIN}, {SEED_MAX}]{last}, got {seed!r}.")


class Engine:
  """Continuous batching over ``slots`` cache rows of up to ``max_len`` tokens each.

  ``prefill_chunk``: the most prompt tokens a slot feeds in one step (a long prompt takes several
  steps, while the other slots keep decoding between them). When every layer can continue a
  piece in parallel (``LM.resume_alignment``), up to ``prefill_lanes`` prompts each feed a
  piece in parallel per step (the *lanes*: one ``LM.resume`` over their rows, a prompt's first
  piece from an empty row). A lane is one or several alignment units wide; a prompt's last
  piece may fill it only partly (its rest after the whole units, or a prompt shorter than one
  unit), the lane's count of real tokens telling ``LM.resume`` where the padding starts, so the
  same program serves every rest length. Every prompt of a model without an alignment
  (cross-layer KV sharing) goes through the decode step, a token per round.

  ``rest_prefill``: how a prompt's rest shorter than the alignment is fed. "lane" (default): in
  a lane, as above. "decode": through the decode step, one token per round of the step's loop
  (up to alignment - 1 rounds: 255 at the paper's chunk of 256), the engine's earlier way, kept
  to measure what the lanes buy (``kvm-bench --engine``).

  ``tokens_per_step``: the most tokens a decoding slot draws in one step once no prompt is left
  to feed, each fed back through the decode step inside the same jitted call (one host read per
  step whatever it holds; beside a prompt's rest, a slot draws once per round the rest runs).
  More amortizes the step's fixed cost (the host round trip, the scheduling); fewer streams
  sooner and lets a waiting request in sooner. While requests wait for a slot, no slot draws
  past the round where the first one reaches its ``max_new_tokens``, so that slot is taken at
  once.

  ``prefill_bucket``: admit a request by prefilling its first ``H`` prompt tokens in parallel
  (``H`` the largest multiple of ``prefill_bucket`` below the prompt's length) in a call of its
  own, and inserting that row into the slot; the rest of the prompt goes in pieces. For models
  without lanes; one compiled program per multiple (as ``kj.generate``'s ``prefill_bucket``),
  and the other slots stall while it runs. None: off.

  ``keep_logits``: keep the logits of every generated token (tests and analyses; one more
  transfer per step).

  ``keep_finished``: how many finished requests :meth:`result` can still show (the oldest are
  dropped first; :meth:`release` drops one at once); None keeps every one (a batch that reads its
  results at the end, as :func:`generate_many`). Waiting and running requests are always kept.

  Usage::

      engine = kj.Engine(model, slots=8, max_len=1024)
      rid = engine.submit(prompt_ids, max_new_tokens=64, seed=0)
      for token in engine.stream(rid):   # steps the engine; other requests progress too
        ...
      engine.run()                       # steps until every request is done
      engine.result(rid).tokens
  """

  def __init__(self, model, *, slots: int, max_len: int, prefill_chunk: int = 64,
               prefill_lanes: int = 4, tokens_per_step: int = 8,
               prefill_bucket: Optional[int] = None, keep_logits: bool = False,
               keep_finished: Optional[int] = KEEP_FINISHED, rest_prefill: str = "lane"):
    for name, value in (("slots", slots), ("max_len", max_len), ("prefill_chunk", prefill_chunk),
                        ("prefill_lanes", prefill_lanes), ("tokens_per_step", tokens_per_step),
                        ("prefill_bucket", 1 if prefill_bucket is None else prefill_bucket),
                        ("keep_finished", 1 if keep_finished is None else keep_finished)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Engine: {name} must be a positive int, got {value!r}.")
    if rest_prefill not in REST_PREFILLS:
      raise ValueError(f"Engine: rest_prefill={rest_prefill!r} is unknown; choose from "
                       f"{REST_PREFILLS} ('lane' feeds a prompt's partial last chunk in one "
                       "parallel piece, 'decode' token by token).")
    self.rest_prefill = rest_prefill
    self.model, self.slots, self.max_len = model, slots, max_len
    self.prefill_chunk, self.keep_logits = prefill_chunk, keep_logits
    self.prefill_bucket, self.tokens_per_step = prefill_bucket, tokens_per_step
    self.prefill_lanes = min(prefill_lanes, slots)
    self.keep_finished = keep_finished
    # Prompts continue in parallel pieces when every layer can (LM.resume) and the pieces can be
    # whole multiples of the alignment; else they go through the decode step.
    self._alignment, self._serial_width, self._width = step_widths(
        model.resume_alignment(), prefill_chunk, tokens_per_step)
    self._graphdef, self._state = nnx.split(model)
    self._step = step_program(self._graphdef, self._width, keep_logits)
    self._mesh = pod_mesh(self._state)
    self._fresh = replicate_on(self._mesh, model.init_cache(1, max_len))
    self._requests: dict[int, Request] = {}
    self._finished: collections.deque = collections.deque()  # ids of finished requests kept
    self._finished_total = 0
    self._ids = itertools.count()
    # Decode-step rounds the steps have run, all slots at once (read from the device): what the
    # lanes save a prompt's rest, and the tests' measure of it.
    self.decode_rounds = 0
    self._clear_slots()

  def _clear_slots(self) -> None:
    """Empty slots: new device caches and keys, no request waiting or running."""
    # The old caches go first: after a step that ran out of memory, both would not fit.
    self._caches = self._keys = None
    caches = self.model.init_cache(self.slots, self.max_len)
    keys = jnp.zeros((self.slots, 2), jnp.uint32)
    # Committed to a device like the step's outputs that replace them: jit compiles separately
    # for uncommitted arguments, so fresh slots would cost a compile of each program again.
    if self._mesh is None:
      caches, keys = jax.device_put((caches, keys), jax.devices()[0])
    self._caches, self._keys = replicate_on(self._mesh, (caches, keys))
    self._waiting: collections.deque = collections.deque()
    self._running: list[Optional[Request]] = [None] * self.slots

  # -- submitting and following requests ----------------------------------------------------
  def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(temperature=0.0), seed: int = 0,
             stop_tokens: Sequence[int] = ()) -> int:
    """Queues a prompt; returns its request id. ``seed``: the request draws what
    ``kj.generate`` of this prompt alone draws with ``key=jax.random.PRNGKey(seed)``."""
    prompt = self._checked_prompt(prompt_ids, max_new_tokens)
    _check_seeds(seed, 1)
    request = Request(id=next(self._ids), prompt=prompt, max_new_tokens=max_new_tokens,
                      sampling=sampling, seed=int(seed), stop_tokens=frozenset(stop_tokens))
    self._requests[request.id] = request
    self._waiting.append([request])
    return request.id

  def submit_samples(self, prompt_ids: Sequence[int], n: int, *, max_new_tokens: int,
                     sampling: SamplingConfig = SamplingConfig(), seed: int = 0,
                     stop_tokens: Sequence[int] = ()) -> list[int]:
    """``n`` continuations of one prompt, sample ``i`` with seed ``seed + i``: the prompt is fed
    once and its cache row copied into the other samples' slots. Each sample equals
    :meth:`submit` of the prompt with its seed. Waits until ``n`` slots are free together."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= self.slots:
      raise ValueError(f"n must be an int in [1, slots={self.slots}], got {n!r}.")
    prompt = self._checked_prompt(prompt_ids, max_new_tokens)
    _check_seeds(seed, n)
    group = [Request(id=next(self._ids), prompt=prompt, max_new_tokens=max_new_tokens,
                     sampling=sampling, seed=int(seed) + i, stop_tokens=frozenset(stop_tokens))
             for i in range(n)]
    for request in group:
      request.source = group[0] if request is not group[0] else None
      self._requests[request.id] = request
    self._waiting.append(group)
    return [request.id for request in group]

  def _checked_prompt(self, prompt_ids, max_new_tokens) -> tuple:
    prompt = tuple(int(t) for t in prompt_ids)
    if not prompt:
      raise ValueError("the prompt is empty: a request needs at least one token.")
    vocab = self.model.cfg.vocab_size
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab}).")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
        max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}.")
    if len(prompt) + max_new_tokens > self.max_len:
      raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
                       f"{len(prompt) + max_new_tokens} exceeds the engine's max_len="
                       f"{self.max_len}; shorten the request or raise max_len.")
    return prompt

  def cancel(self, request_id: int) -> bool:
    """Stops a waiting or running request (its slot is free for the next one); False when it
    had already finished."""
    request = self.request(request_id)
    if request.done:
      return False
    for group in list(self._waiting):
      if request in group:
        group.remove(request)
        if not group:
          self._waiting.remove(group)
        elif request.source is None:  # the fed one left: the next sample feeds the prompt
          for other in group[1:]:
            other.source = group[0]
          group[0].source = None
    if request.slot is not None:
      for other in self._running:  # samples waiting to copy this row feed the prompt themselves
        if other is not None and other.source is request:  # (their rows are still empty)
          other.source, other.fed = None, 0
      self._running[request.slot] = None
      request.slot = None
    self._finish(request, "cancelled")
    return True

  def _finish(self, request: Request, reason: str) -> None:
    """Ends ``request`` (its slot freed) and keeps its record among the last ``keep_finished``."""
    request.finish_reason = reason
    if request.slot is not None:
      self._running[request.slot] = None
      request.slot = None
    self._finished_total += 1
    if self.keep_finished is None:
      return
    self._finished.append(request.id)
    while len(self._finished) > self.keep_finished:
      self._requests.pop(self._finished.popleft(), None)

  def release(self, request_id: int) -> None:
    """Drops a finished request's record now (a server does once it delivered the response);
    a ValueError for a request still waiting or running (cancel it first)."""
    if not self.request(request_id).done:
      raise ValueError(f"request {request_id} is still running: cancel it before releasing it.")
    del self._requests[request_id]
    with contextlib.suppress(ValueError):  # its place among the kept ones is free again
      self._finished.remove(request_id)

  def recover(self) -> list[TokenEvent]:
    """After a step that raised: every waiting and running request ends with finish reason
    "error" (their events returned), and the slots start empty (new caches and keys: a failed
    step may have consumed its donated ones). Finished requests stay as they were."""
    held = [r for group in self._waiting for r in group] + [r for r in self._running if r]
    for request in held:
      request.slot = None
      self._finish(request, "error")
    self._clear_slots()
    return [TokenEvent(r.id, -1, "error") for r in held]

  def request(self, request_id: int) -> Request:
    if request_id not in self._requests:
      raise KeyError(f"no request {request_id!r} in this engine (never submitted, released, or "
                     f"finished before the last keep_finished={self.keep_finished}).")
    return self._requests[request_id]

  def requests(self) -> list[Request]:
    """Every request the engine holds (waiting, running, and the finished ones it keeps), in
    submission order."""
    return list(self._requests.values())

  def result(self, request_id: int) -> Request:
    """The request (its ``tokens`` and ``finish_reason``), finished or not."""
    return self.request(request_id)

  @property
  def occupancy(self) -> tuple[int, int]:
    """``(running, waiting)``: requests holding a slot, and requests queued for one."""
    return (sum(r is not None for r in self._running),
            sum(len(group) for group in self._waiting))

  @property
  def busy(self) -> bool:
    """Whether some request is waiting or running."""
    return bool(self._waiting) or any(r is not None for r in self._running)

  def run(self, progress: Optional[Callable[[int], None]] = None) -> None:
    """Steps until every submitted request is done (``progress(finished so far)`` after each
    step, if given)."""
    while self.busy:
      self.step()
      if progress is not None:
        progress(self._finished_total)

  def stream(self, request_id: int) -> Iterator[int]:
    """The request's tokens as they are generated (stepping the engine, which advances every
    running request); ends when the request is done."""
    request = self.request(request_id)
    sent = 0
    while True:
      while sent < len(request.tokens):
        sent += 1
        yield request.tokens[sent - 1]
      if request.done:
        return
      self.step()

  def lane_widths(self) -> tuple[int, ...]:
    """The prompt-piece widths a step can run with (0: no lane): one compiled step program
    each."""
    if self._alignment is None:
      return (0,)
    full = self.prefill_chunk // self._alignment * self._alignment
    return tuple(sorted({0, self._alignment, full}))

  def warm_up(self, report: Optional[Callable[[str, float], None]] = None) -> float:
    """Compiles every step program a request can need (one per :meth:`lane_widths`) before any
    request arrives, by running one synthetic greedy request per width to its first token (the
    one for no lane to a second token, which only the decode step draws);
    ``report(what, seconds)`` after each. The engine must be idle; it is idle and empty after
    (the synthetic requests released, the slots cleared). Returns the seconds it took. Without
    ``prefill_bucket`` only: its admission program compiles once per prompt length bucket."""
    if self.busy:
      raise ValueError("warm_up needs an idle engine: it runs before the first request.")
    start = time.perf_counter()
    if self.max_len < 2:  # no request fits a slot (a prompt token and a new one): none to serve
      return 0.0
    # A prompt of a lane's width feeds that width's piece (with rest_prefill="decode", one more
    # token goes through the decode step). A one-token prompt that draws a second token in a
    # step of its own runs the step without a lane (its decode loop serves rests and draws
    # alike); tokens_per_step, which the compiled programs do not depend on, is 1 meanwhile so
    # that the second token is not drawn in the first step's burst.
    serial = 1 if self.rest_prefill == "decode" else 0
    tokens_per_step, self.tokens_per_step = self.tokens_per_step, 1
    try:
      for width in self.lane_widths():
        length = min(width + serial, self.max_len - 1) if width else 1
        began = time.perf_counter()
        rid = self.submit([0] * length, max_new_tokens=1 if width else min(2, self.max_len - 1))
        self.run()
        self.release(rid)
        what = (f"the step with {width}-token prompt pieces" if width
                else "the step that feeds tokens one at a time and draws")
        if report is not None:
          report(what, time.perf_counter() - began)
    finally:
      self.tokens_per_step = tokens_per_step
    self._clear_slots()
    return time.perf_counter() - start

  # -- the step -------------------------------------------------------------------------------
  def _admit(self) -> np.ndarray:
    """Moves waiting groups into free slots, in arrival order; returns the slots to reset."""
    reset = np.zeros(self.slots, bool)
    while self._waiting:
      free = [s for s, r in enumerate(self._running) if r is None]
      group = self._waiting[0]
      if len(free) < len(group):
        break
      self._waiting.popleft()
      for request, slot in zip(group, free):
        request.slot, self._running[slot] = slot, request
        reset[slot], request.needs_key = True, True
        if request.source is None and self._prefill_head(request):
          reset[slot] = False  # the inserted row replaced the whole row
    return reset

  def _prefill_head(self, request: Request) -> bool:
    """With ``prefill_bucket``, prefills the request's prompt head in parallel into its slot
    (at least one prompt token is left for the step, which draws the first token); whether it
    did."""
    if self.prefill_bucket is None:
      return False
    head = (len(request.prompt) - 1) // self.prefill_bucket * self.prefill_bucket
    if head < 1:
      return False
    tokens = replicate_on(self._mesh, jnp.asarray([request.prompt[:head]], jnp.int32))
    self._caches = prefill_into_slot(self._graphdef, self._state, tokens, self._caches,
                                     self._fresh, replicate_on(self._mesh,
                                                               jnp.int32(request.slot)))
    request.fed = head
    return True

  def _lane_rest(self, request: Request) -> int:
    """Prompt tokens ``request`` still has for the lanes: all it has left when its row stands
    at a multiple of the alignment (with ``rest_prefill="decode"``, the whole alignment units of
    it; the decode step feeds the rest). 0: none, or no lane (no alignment, a sample waiting for
    its prompt's row, a row off the alignment after a ``prefill_bucket`` head)."""
    if self._alignment is None or request.source is not None or request.fed % self._alignment:
      return 0
    rest = len(request.prompt) - request.fed
    return rest if self.rest_prefill == "lane" else rest // self._alignment * self._alignment

  def _lanes(self) -> tuple[int, list[tuple[Request, int]]]:
    """The step's lane width and its lanes' requests with the tokens each feeds, earliest
    admitted first: a full piece (the most alignment units ``prefill_chunk`` holds) when some
    prompt has more than one unit left, else one unit; each prompt feeds as much of its rest as
    the width holds (its last piece partly filled, padded behind its count). Two widths, so
    that a step compiles for few shapes."""
    waiting = sorted((r for r in self._running if r is not None and self._lane_rest(r)),
                     key=lambda r: r.id)
    if not waiting:
      return 0, []
    full = self.prefill_chunk // self._alignment * self._alignment
    width = (full if any(self._lane_rest(r) > self._alignment for r in waiting)
             else self._alignment)
    return width, [(r, min(self._lane_rest(r), width)) for r in waiting[:self.prefill_lanes]]

  def _plan(self, reset: np.ndarray) -> Optional[tuple[StepPlan, np.ndarray]]:
    """The step's plan, and the prompt tokens each slot feeds in it; None when nothing runs."""
    S, N, n = self.slots, self.prefill_lanes, self._serial_width
    tokens, counts = np.zeros((S, n), np.int32), np.zeros(S, np.int32)
    fed, draws = np.zeros(S, np.int32), np.zeros(S, np.int32)
    emit = np.zeros(S, bool)
    copy_from, copy_at = np.full(S, -1, np.int32), np.full(S, -1, np.int32)
    new_keys, set_key = np.zeros((S, 2), np.uint32), np.zeros(S, bool)
    temperature, top_p = np.zeros(S, np.float32), np.ones(S, np.float32)
    top_k = np.zeros(S, np.int32)
    width, in_lanes = self._lanes()
    lane_tokens = np.zeros((N, width), np.int32)
    lane_counts = np.full(N, max(width, 1), np.int32)
    lane_slots = np.full(N, S, np.int32)
    for lane, (request, count) in enumerate(in_lanes):
      lane_tokens[lane, :count] = request.prompt[request.fed:request.fed + count]
      lane_counts[lane], lane_slots[lane], fed[request.slot] = count, request.slot, count
    for slot, request in enumerate(self._running):
      if request is None:
        continue
      temperature[slot], top_k[slot], top_p[slot] = sampling_rows(request.sampling)
      if request.needs_key:
        new_keys[slot] = np.asarray(jax.random.PRNGKey(request.seed), np.uint32)
        set_key[slot], request.needs_key = True, False
      if request.source is not None:
        continue
      if request.fed < len(request.prompt):
        if not fed[slot] and not self._lane_rest(request):  # a rest through the decode step
          piece = request.prompt[request.fed:request.fed + n]
          tokens[slot, :len(piece)], counts[slot] = piece, len(piece)
          fed[slot] = len(piece)
        emit[slot] = request.fed + fed[slot] == len(request.prompt)
      else:
        tokens[slot, 0], counts[slot], emit[slot] = request.tokens[-1], 1, True
    for slot, request in enumerate(self._running):  # samples copy a prompt fed in full now
      source = None if request is None else request.source
      if source is not None and source.slot is not None and emit[source.slot] \
          and source.fed < len(source.prompt):
        # The sample feeds its source's piece on its own (empty) row until the copy replaces it.
        copy_from[slot], emit[slot] = source.slot, True
        tokens[slot], counts[slot] = tokens[source.slot], counts[source.slot]
        copy_at[slot] = counts[slot] - 1
    if not counts.any() and not emit.any() and not width:
      return None
    self._plan_draws(emit, counts, fed, draws)
    plan = StepPlan(tokens=tokens, counts=counts, draws=draws,
                    lane_tokens=lane_tokens, lane_counts=lane_counts, lane_slots=lane_slots,
                    reset=reset,
                    copy_from=copy_from, copy_at=copy_at, new_keys=new_keys, set_key=set_key,
                    temperature=temperature, top_k=top_k, top_p=top_p)
    return plan, fed

  def _plan_draws(self, emit: np.ndarray, counts: np.ndarray, fed: np.ndarray,
                  draws: np.ndarray) -> None:
    """Fills ``draws``: the tokens each emitting slot draws this step (at least one; never past
    its ``max_new_tokens``).

    The step runs as many rounds as its longest serial piece needs anyway; decoding slots ride
    along, drawing a token per round. Bursts beyond that (up to ``tokens_per_step``) only once
    no prompt is left to feed: a burst would hold every prompt's next piece back while the
    prefilling rows idle through it. While requests wait for a slot, no slot draws past the
    round where the first slot finishes, so that slot is free for the next step."""
    rounds = int(counts.max())
    prefilling = any(r is not None and r.source is None and r.fed + fed[slot] < len(r.prompt)
                     for slot, r in enumerate(self._running))
    left = {slot: self._running[slot].max_new_tokens - len(self._running[slot].tokens)
            for slot in np.flatnonzero(emit)}
    for slot, remaining in left.items():
      free = rounds - counts[slot] + 1  # a draw after its piece's last token and each round on
      draws[slot] = min(remaining, self._width,
                        max(free, 1) if prefilling else max(free, self.tokens_per_step))
    finishing = [counts[s] + draws[s] - 1 for s, remaining in left.items()
                 if draws[s] == remaining]
    if self._waiting and finishing:
      last_round = max(min(finishing), rounds)
      for slot in left:
        draws[slot] = max(1, min(draws[slot], last_round - counts[slot] + 1))

  def step(self) -> list[TokenEvent]:
    """One jitted step over every slot (admitting waiting requests first). Returns the tokens
    generated in it, in order per request."""
    reset = self._admit()
    planned = self._plan(reset)
    if planned is None:
      return []
    plan, fed = planned
    self._caches, self._keys, tokens, logits, rounds = self._step(
        self._state, self._caches, self._keys, self._fresh, replicate_on(self._mesh, plan))
    # The step's one read of device results, all slots at once (replicated first: on a pod every
    # process reads them whatever the parameters' split).
    tokens, logits, rounds = replicate_on(self._mesh, (tokens, logits, rounds))
    self.decode_rounds += int(rounds)
    tokens = np.asarray(tokens)
    logits = None if logits is None else np.asarray(logits)
    events = []
    for slot, request in enumerate(self._running):
      if request is None:
        continue
      if request.source is None:
        request.fed += int(fed[slot])
      if plan.draws[slot]:
        if request.source is not None:
          request.fed, request.source = len(request.prompt), None
        for i in range(int(plan.draws[slot])):
          events.append(self._emit(request, int(tokens[slot, i]),
                                   None if logits is None else logits[slot, i]))
          if request.done:
            break
    return events

  def _emit(self, request: Request, token: int, logits) -> TokenEvent:
    request.tokens.append(token)
    if logits is not None:
      request.logits.append(logits)
    if token in request.stop_tokens:
      self._finish(request, "stop")
    elif len(request.tokens) >= request.max_new_tokens:
      self._finish(request, "length")
    return TokenEvent(request.id, token, request.finish_reason)


def generate_many(model, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: Union[int, Sequence[int]],
                  sampling: SamplingConfig = SamplingConfig(temperature=0.0), seed: int = 0,
                  slots: int = 8, stop_tokens: Sequence[int] = (), max_len: Optional[int] = None,
                  prefill_chunk: int = 64, prefill_lanes: Optional[int] = None,
                  tokens_per_step: int = 16, prefill_bucket: Optional[int] = None,
                  progress: Optional[Callable[[int], None]] = None) -> list[list[int]]:
  """Continues every prompt (token-id lists of any lengths) through one :class:`Engine`;
  returns the generated tokens of each, in order, without the prompt (a stop token included as
  the last one). Prompt ``i`` is sampled with seed ``seed + i``: it draws what ``kj.generate``
  of it alone draws with ``key=jax.random.PRNGKey(seed + i)``. ``max_new_tokens``: one for all,
  or one per prompt; ``max_len``: the slots' length, by default the longest request's;
  ``prefill_chunk`` / ``prefill_lanes`` (default: every slot) / ``tokens_per_step`` /
  ``prefill_bucket``: as in :class:`Engine`, here tuned for throughput rather than latency."""
  prompts = [list(p) for p in prompts]
  budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
             else list(max_new_tokens))
  if len(budgets) != len(prompts):
    raise ValueError(f"max_new_tokens lists {len(budgets)} budgets for {len(prompts)} prompts.")
  if not prompts:
    return []
  if max_len is None:
    max_len = max(len(p) + n for p, n in zip(prompts, budgets))
  slots = min(slots, len(prompts))
  engine = Engine(model, slots=slots, max_len=max_len, prefill_chunk=prefill_chunk,
                  prefill_lanes=slots if prefill_lanes is None else prefill_lanes,
                  tokens_per_step=tokens_per_step, prefill_bucket=prefill_bucket,
                  keep_finished=None)
  ids = [engine.submit(p, max_new_tokens=n, sampling=sampling, seed=seed + i,
                       stop_tokens=stop_tokens)
         for i, (p, n) in enumerate(zip(prompts, budgets))]
  engine.run(progress)
  return [list(engine.result(i).tokens) for i in ids]
