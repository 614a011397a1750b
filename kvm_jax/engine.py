"""A generation engine: ragged prompts, continuous batching over cache slots, chunked prefill.

The engine owns one decode cache of ``slots`` rows (:mod:`kvm_jax.nn.cache`: every row an
independent sequence at a length of its own). Requests wait in a queue; a free slot admits one
(its row reset to an empty cache), feeds its prompt in pieces of at most ``prefill_chunk`` tokens,
then decodes one token per step until a stop token, ``max_new_tokens`` or a cancel frees the slot
for the next request. Every :meth:`Engine.step` is one jitted call over all slots: each slot
takes its piece (a prompt piece, its last sampled token, or nothing), the emitting slots sample
their next token on the device, and the host reads the sampled tokens once.

A request's tokens depend only on its prompt, sampling settings and seed, never on what else is
running: its slot starts from an empty row, rows never mix, and its random keys are its own. A
request with seed ``s`` draws exactly what ``kj.generate`` draws for that prompt alone with
``key=jax.random.PRNGKey(s)`` (the same key splits, the same sampling), so greedy and sampled
tokens alike equal the alone run, up to float32 rounding of the logits (the engine feeds a prompt
through the decode step; ``generate`` prefills it in parallel).

``generate_many(model, prompts, ...)`` is the common case: a list of prompts of any lengths in, one
list of generated tokens per prompt out.

On a pod (parameters that span processes), every process builds the same engine and makes the
same calls in the same order, like any SPMD program: the scheduling is deterministic, the step's
inputs are replicated onto the parameters' mesh, and every process reads the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Callable, Iterator, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvm_jax.generate import SamplingConfig, pod_mesh, replicate_on
from kvm_jax.nn.cache import reset_rows

Array = jax.Array


# ----------------------------------------------------------------------------------------------
# Sampling with settings of its own per row
# ----------------------------------------------------------------------------------------------


def sample_rows(logits: Array, keys: Array, temperature: Array, top_k: Array,
                top_p: Array) -> Array:
  """Draws one token per row from ``logits [S, V]``, each row with its own raw PRNG key
  (``keys [S, 2]`` uint32) and settings: ``temperature [S]`` (0 = greedy), ``top_k [S]`` (0 =
  all tokens), ``top_p [S]`` (a value > 1 = no nucleus cut). Row by row the same arithmetic and
  the same random draws as :func:`kvm_jax.generate.sample_logits` on that row alone."""
  return jax.vmap(_sample_one)(logits.astype(jnp.float32), keys, temperature, top_k, top_p)


def _sample_one(logits: Array, key: Array, temperature: Array, top_k: Array,
                top_p: Array) -> Array:
  """:func:`sample_rows` for one row ``logits [V]``."""
  greedy = jnp.argmax(logits).astype(jnp.int32)
  scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
  V = logits.shape[-1]
  kth = jnp.sort(scaled)[::-1][jnp.clip(top_k, 1, V) - 1]
  scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
  order = jnp.argsort(-scaled)
  probs = jax.nn.softmax(scaled[order])
  keep_sorted = (jnp.cumsum(probs) - probs) < top_p  # the top token is always kept
  keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
  scaled = jnp.where((top_p <= 1.0) & ~keep, -jnp.inf, scaled)
  drawn = jax.random.categorical(key, scaled[None], axis=-1)[0].astype(jnp.int32)
  return jnp.where(temperature > 0, drawn, greedy)


def sampling_rows(sampling: SamplingConfig) -> tuple[float, int, float]:
  """``(temperature, top_k, top_p)`` of :func:`sample_rows` for one request's settings."""
  return (float(sampling.temperature), int(sampling.top_k or 0),
          2.0 if sampling.top_p is None else float(sampling.top_p))


# ----------------------------------------------------------------------------------------------
# The device step
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What one engine step does to each of the ``S`` slots (host-built arrays).

  Attributes:
    tokens: ``[S, n]`` int32, each slot's piece (prompt tokens, or its last sampled token).
    counts: ``[S]`` int32, the tokens of the piece to feed (0: the slot is left as it is).
    reset: ``[S]`` bool, slots whose row starts a new sequence (emptied before feeding).
    copy_from: ``[S]`` int32, for a sample of an n-sample request the slot its prompt was fed
      in (the row is copied after feeding, before sampling), else -1.
    emit: ``[S]`` bool, slots that draw a token this step.
    new_keys: ``[S, 2]`` uint32, the first key of a request admitted this step.
    set_key: ``[S]`` bool, slots whose key is replaced by ``new_keys``.
    temperature / top_k / top_p: ``[S]``, each slot's sampling settings (:func:`sample_rows`).
    piece: ``[1, P]`` int32, a prompt piece one slot takes in parallel (``P`` a multiple of the
      model's ``resume_alignment``; ``P = 0``: none this step).
    piece_slot: int32, the slot taking ``piece``.
    piece_starts: bool, whether ``piece`` begins its prompt (prefilled on an empty row; else the
      row continues, ``LM.resume``).
  """

  tokens: np.ndarray
  counts: np.ndarray
  reset: np.ndarray
  copy_from: np.ndarray
  emit: np.ndarray
  new_keys: np.ndarray
  set_key: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  piece: np.ndarray
  piece_slot: np.ndarray
  piece_starts: np.ndarray


jax.tree_util.register_dataclass(
    StepPlan, data_fields=[f.name for f in dataclasses.fields(StepPlan)], meta_fields=[])


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnums=(3,))
def prefill_into_slot(graphdef, state, tokens: Array, caches, fresh, slot: Array):
  """A prompt head ``tokens [1, H]`` prefilled in parallel on an empty one-row cache and
  inserted as row ``slot`` of ``caches`` (donated): the engine's ``prefill_bucket`` admission."""
  _, row = nnx.merge(graphdef, state).prefill(tokens, fresh)
  return _put_row(caches, row, slot)


def _put_row(caches, row, slot: Array):
  """``caches`` with the one-row cache ``row`` written as row ``slot``."""
  put = lambda whole, one: jax.lax.dynamic_update_slice_in_dim(whole, one.astype(whole.dtype),
                                                               slot, axis=0)
  return jax.tree_util.tree_map(put, caches, row)


def _feed_piece(model, caches, fresh, plan: StepPlan):
  """The parallel prompt piece of one slot: that row taken out of the caches, prefilled (a new
  prompt) or resumed, put back. Returns the caches and the logits of the piece's last token."""
  take = lambda x: jax.lax.dynamic_index_in_dim(x, plan.piece_slot, axis=0, keepdims=True)
  row = jax.tree_util.tree_map(take, caches)
  logits, row = jax.lax.cond(plan.piece_starts, lambda r: model.prefill(plan.piece, fresh),
                             lambda r: model.resume(plan.piece, r), row)
  return _put_row(caches, row, plan.piece_slot), logits[0, -1]


def _copy_rows(tree, copy_from: Array):
  """Row ``copy_from[s]`` into row ``s`` wherever ``copy_from[s] >= 0`` (a gather over rows)."""
  rows = jnp.where(copy_from >= 0, copy_from, jnp.arange(copy_from.shape[0]))
  return jax.tree_util.tree_map(lambda x: jnp.take(x, rows, axis=0), tree)


@functools.partial(jax.jit, static_argnames=("graphdef", "keep_logits"), donate_argnums=(2, 3))
def engine_step(graphdef, state, caches, keys: Array, fresh, plan: StepPlan,
                keep_logits: bool = False):
  """One step over every slot: reset, feed, copy, sample. Returns ``(caches, keys, tokens [S],
  logits [S, V] or None)``; tokens of slots that do not emit are meaningless. ``caches`` and
  ``keys`` are donated."""
  model = nnx.merge(graphdef, state)
  caches = reset_rows(caches, plan.reset, fresh)
  S = plan.counts.shape[0]
  if plan.tokens.shape[1]:
    logits, caches = model.extend(plan.tokens, caches, plan.counts)
  else:
    logits = jnp.zeros((S, model.cfg.vocab_size), jnp.float32)
  if plan.piece.shape[1]:
    caches, piece_logits = _feed_piece(model, caches, fresh, plan)
    logits = jax.lax.dynamic_update_slice_in_dim(logits, piece_logits[None], plan.piece_slot, 0)
  copies = jnp.any(plan.copy_from >= 0)
  caches, logits = jax.lax.cond(copies, _copy_rows, lambda tree, _: tree, (caches, logits),
                                plan.copy_from)
  keys = jnp.where(plan.set_key[:, None], plan.new_keys, keys)
  pairs = jax.vmap(jax.random.split)(keys)                      # [S, 2, 2]: (next key, this draw)
  tokens = sample_rows(logits, pairs[:, 1], plan.temperature, plan.top_k, plan.top_p)
  keys = jnp.where(plan.emit[:, None], pairs[:, 0], keys)
  return caches, keys, tokens, (logits if keep_logits else None)


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


class Engine:
  """Continuous batching over ``slots`` cache rows of up to ``max_len`` tokens each.

  ``prefill_chunk``: the most prompt tokens a slot feeds in one step (a long prompt takes several
  steps, while the other slots keep decoding between them). Pieces go through the decode step one
  token at a time inside the step (exact for every mixer kind).

  ``prefill_bucket``: admit a request by prefilling its first ``H`` prompt tokens in parallel
  (``H`` the largest multiple of ``prefill_bucket`` below the prompt's length) in a call of its
  own, and inserting that row into the slot; the rest of the prompt goes in pieces. Prefill is
  far faster per token than feeding, at the price of one compiled program per multiple (as
  ``kj.generate``'s ``prefill_bucket``) and of stalling the other slots while it runs: what
  batch evaluations of long prompts want (NIAH), not a server's latency. None: off.

  ``keep_logits``: keep the logits of every generated token (tests and analyses; one more
  transfer per step).

  Usage::

      engine = kj.Engine(model, slots=8, max_len=1024)
      rid = engine.submit(prompt_ids, max_new_tokens=64, seed=0)
      for token in engine.stream(rid):   # steps the engine; other requests progress too
        ...
      engine.run()                       # steps until every request is done
      engine.result(rid).tokens
  """

  def __init__(self, model, *, slots: int, max_len: int, prefill_chunk: int = 64,
               prefill_bucket: Optional[int] = None, keep_logits: bool = False):
    for name, value in (("slots", slots), ("max_len", max_len), ("prefill_chunk", prefill_chunk),
                        ("prefill_bucket", 1 if prefill_bucket is None else prefill_bucket)):
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Engine: {name} must be a positive int, got {value!r}.")
    self.model, self.slots, self.max_len = model, slots, max_len
    self.prefill_chunk, self.keep_logits = prefill_chunk, keep_logits
    self.prefill_bucket = prefill_bucket
    # Prompts continue in parallel pieces when every layer can (LM.resume) and the pieces can be
    # whole multiples of the alignment; else they go through the decode step.
    alignment = model.resume_alignment()
    self._alignment = alignment if alignment and prefill_chunk >= alignment else None
    # Rests shorter than the alignment go through the decode step; without a lane, all of it.
    self._serial_width = (prefill_chunk if self._alignment is None
                          else min(prefill_chunk, max(self._alignment - 1, 1)))
    self._graphdef, self._state = nnx.split(model)
    self._mesh = pod_mesh(self._state)
    self._caches = replicate_on(self._mesh, model.init_cache(slots, max_len))
    self._fresh = replicate_on(self._mesh, model.init_cache(1, max_len))
    self._keys = replicate_on(self._mesh, jnp.zeros((slots, 2), jnp.uint32))
    self._requests: dict[int, Request] = {}
    self._waiting: collections.deque = collections.deque()
    self._running: list[Optional[Request]] = [None] * slots
    self._ids = itertools.count()
    self._events: dict[int, list] = collections.defaultdict(list)

  # -- submitting and following requests ----------------------------------------------------
  def submit(self, prompt_ids: Sequence[int], *, max_new_tokens: int,
             sampling: SamplingConfig = SamplingConfig(temperature=0.0), seed: int = 0,
             stop_tokens: Sequence[int] = ()) -> int:
    """Queues a prompt; returns its request id. ``seed``: the request draws what
    ``kj.generate`` of this prompt alone draws with ``key=jax.random.PRNGKey(seed)``."""
    prompt = self._checked_prompt(prompt_ids, max_new_tokens)
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
    request.finish_reason = "cancelled"
    self._events[request.id].append(TokenEvent(request.id, -1, "cancelled"))
    return True

  def request(self, request_id: int) -> Request:
    if request_id not in self._requests:
      raise KeyError(f"no request {request_id!r} in this engine.")
    return self._requests[request_id]

  def requests(self) -> list[Request]:
    """Every request submitted so far, in submission order."""
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
        progress(sum(r.done for r in self._requests.values()))

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

  def _parallel_width(self, request: Request) -> int:
    """Prompt tokens ``request`` may feed as a parallel piece now (0: none): a full piece (the
    most alignment units ``prefill_chunk`` holds) while its prompt's rest allows, else one unit.
    Two widths, so that the step compiles for few shapes."""
    if self._alignment is None or request.source is not None or request.fed % self._alignment:
      return 0
    rest = len(request.prompt) - request.fed
    full = self.prefill_chunk // self._alignment * self._alignment
    return full if rest >= full else (self._alignment if rest >= self._alignment else 0)

  def _plan(self, reset: np.ndarray) -> Optional[tuple[StepPlan, np.ndarray]]:
    """The step's plan, and the prompt tokens each slot feeds in it; None when nothing runs."""
    S = self.slots
    counts, fed = np.zeros(S, np.int32), np.zeros(S, np.int32)
    pieces: list = [()] * S
    emit = np.zeros(S, bool)
    copy_from = np.full(S, -1, np.int32)
    new_keys, set_key = np.zeros((S, 2), np.uint32), np.zeros(S, bool)
    temperature, top_p = np.zeros(S, np.float32), np.ones(S, np.float32)
    top_k = np.zeros(S, np.int32)
    piece, piece_slot, piece_starts = np.zeros((1, 0), np.int32), 0, False
    # One slot's prompt continues in parallel (the earliest admitted that can); the others with
    # a parallel piece to come wait for the lane, and prompt rests shorter than the alignment go
    # through the decode step beside the decoding slots.
    lane = [(r.id, slot) for slot, r in enumerate(self._running)
            if r is not None and self._parallel_width(r)]
    lane_slot = min(lane)[1] if lane else None
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
        width = self._parallel_width(request)
        if width and slot != lane_slot:
          continue
        if width:
          piece = np.asarray([request.prompt[request.fed:request.fed + width]], np.int32)
          piece_slot, piece_starts, fed[slot] = slot, request.fed == 0, width
        else:
          pieces[slot] = request.prompt[request.fed:request.fed + self.prefill_chunk]
          fed[slot] = len(pieces[slot])
        emit[slot] = request.fed + fed[slot] == len(request.prompt)
      else:
        pieces[slot] = (request.tokens[-1],)
        emit[slot] = True
      counts[slot] = len(pieces[slot])
    for slot, request in enumerate(self._running):  # samples copy a prompt fed in full now
      source = None if request is None else request.source
      if source is not None and source.slot is not None and emit[source.slot] \
          and source.fed < len(source.prompt):
        copy_from[slot], emit[slot] = source.slot, True
    if not counts.any() and not emit.any() and not piece.shape[1]:
      return None
    # Two widths of the serial part, so that a step compiles for few shapes: one token (decoding
    # slots alone) or the widest rest a slot may feed (the others wait masked in the scan).
    width = 1 if counts.max() <= 1 else self._serial_width
    tokens = np.zeros((S, width), np.int32)
    for slot, row in enumerate(pieces):
      tokens[slot, :len(row)] = row
    plan = StepPlan(tokens=tokens, counts=counts, reset=reset, copy_from=copy_from, emit=emit,
                    new_keys=new_keys, set_key=set_key, temperature=temperature, top_k=top_k,
                    top_p=top_p, piece=piece, piece_slot=np.int32(piece_slot),
                    piece_starts=np.bool_(piece_starts))
    return plan, fed

  def step(self) -> list[TokenEvent]:
    """One jitted step over every slot (admitting waiting requests first). Returns the tokens
    generated in it, one event per emitting request."""
    reset = self._admit()
    planned = self._plan(reset)
    if planned is None:
      return []
    plan, fed = planned
    self._caches, self._keys, tokens, logits = engine_step(
        self._graphdef, self._state, self._caches, self._keys, self._fresh,
        replicate_on(self._mesh, plan), keep_logits=self.keep_logits)
    # The step's one read of device results, all slots at once (replicated first: on a pod every
    # process reads them whatever the parameters' split).
    tokens, logits = replicate_on(self._mesh, (tokens, logits))
    tokens = np.asarray(tokens)
    logits = None if logits is None else np.asarray(logits)
    events = []
    for slot, request in enumerate(self._running):
      if request is None:
        continue
      if request.source is None:
        request.fed += int(fed[slot])
      if plan.emit[slot]:
        if request.source is not None:
          request.fed, request.source = len(request.prompt), None
        events.append(self._emit(request, int(tokens[slot]),
                                 None if logits is None else logits[slot]))
    return events

  def _emit(self, request: Request, token: int, logits) -> TokenEvent:
    request.tokens.append(token)
    if logits is not None:
      request.logits.append(logits)
    if token in request.stop_tokens:
      request.finish_reason = "stop"
    elif len(request.tokens) >= request.max_new_tokens:
      request.finish_reason = "length"
    if request.done:
      self._running[request.slot] = None
      request.slot = None
    event = TokenEvent(request.id, token, request.finish_reason)
    self._events[request.id].append(event)
    return event


def generate_many(model, prompts: Sequence[Sequence[int]], *,
                  max_new_tokens: Union[int, Sequence[int]],
                  sampling: SamplingConfig = SamplingConfig(temperature=0.0), seed: int = 0,
                  slots: int = 8, stop_tokens: Sequence[int] = (), max_len: Optional[int] = None,
                  prefill_chunk: int = 64, prefill_bucket: Optional[int] = None,
                  progress: Optional[Callable[[int], None]] = None) -> list[list[int]]:
  """Continues every prompt (token-id lists of any lengths) through one :class:`Engine`;
  returns the generated tokens of each, in order, without the prompt (a stop token included as
  the last one). Prompt ``i`` is sampled with seed ``seed + i``: it draws what ``kj.generate``
  of it alone draws with ``key=jax.random.PRNGKey(seed + i)``. ``max_new_tokens``: one for all,
  or one per prompt; ``max_len``: the slots' length, by default the longest request's;
  ``prefill_chunk`` / ``prefill_bucket``: as in :class:`Engine`."""
  prompts = [list(p) for p in prompts]
  budgets = ([max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int)
             else list(max_new_tokens))
  if len(budgets) != len(prompts):
    raise ValueError(f"max_new_tokens lists {len(budgets)} budgets for {len(prompts)} prompts.")
  if not prompts:
    return []
  if max_len is None:
    max_len = max(len(p) + n for p, n in zip(prompts, budgets))
  engine = Engine(model, slots=min(slots, len(prompts)), max_len=max_len,
                  prefill_chunk=prefill_chunk, prefill_bucket=prefill_bucket)
  ids = [engine.submit(p, max_new_tokens=n, sampling=sampling, seed=seed + i,
                       stop_tokens=stop_tokens)
         for i, (p, n) in enumerate(zip(prompts, budgets))]
  engine.run(progress)
  return [list(engine.result(i).tokens) for i in ids]
