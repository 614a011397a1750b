"""``kvm-serve RUN_DIR``: an OpenAI-compatible completions server over one :class:`kvm_jax.Engine`.

Endpoints: ``POST /v1/completions`` (``prompt`` as text or token ids, or a list of either;
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream`` as
server-sent events, ``n``), ``GET /v1/models`` and ``GET /health``. Concurrent requests share the
engine's slots: one worker thread owns the engine, steps it while anything runs, and hands each
token to the request's handler. A request's completion is what ``kj.generate`` gives its prompt
alone (sample ``i`` of ``n`` with seed ``seed + i``); a bad request gets a 4xx naming the bad
value before it reaches the engine, so it never disturbs the running ones; a client that
disconnects cancels its request, freeing its slot.

Needs the ``serve`` extra (``pip install -e ".[serve]"``: starlette and uvicorn).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import queue
import secrets
import threading
import time
from typing import Any, Callable, Optional, Sequence

from kvm_jax.engine import Engine, TokenEvent
from kvm_jax.generate import SamplingConfig


INSTALL_HINT = 'kvm-serve needs the serve extra: pip install -e ".[serve]" (starlette, uvicorn).'
# OpenAI fields this server accepts only at their neutral value (what they would change is not
# implemented): a request that sets them otherwise is refused rather than silently served.
NEUTRAL_FIELDS = {"echo": (False, None), "logprobs": (None,), "best_of": (None, 1),
                  "suffix": (None,), "presence_penalty": (0, 0.0, None),
                  "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
                  "stream_options": (None,)}
FIELDS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
          "stream", "n", "user"} | set(NEUTRAL_FIELDS)
MAX_STOP_STRINGS = 4


class RequestError(ValueError):
  """A request the server refuses: its HTTP status, message and the offending field."""

  def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
    super().__init__(message)
    self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Completion:
  """One validated prompt of a request: its token ids and generation settings."""

  prompt: tuple
  max_tokens: int
  sampling: SamplingConfig
  seed: int
  n: int
  stop: tuple


# ----------------------------------------------------------------------------------------------
# Validating a request (pure functions)
# ----------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _prompts(value, tokenizer) -> list[list[int]]:
  """The prompts of ``value`` (text, token ids, or a list of either) as token-id lists."""
  if isinstance(value, str):
    return [tokenizer.encode(value)]
  if isinstance(value, list) and value and all(_is_int(t) for t in value):
    return [list(value)]
  if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
    return [one for p in value for one in _prompts(p, tokenizer)]
  raise RequestError(f"prompt must be a string, a list of token ids, or a list of those; got "
                     f"{json.dumps(value)[:80]}.", "prompt")


def parse_completion(body: Any, *, tokenizer, vocab_size: int, max_len: int, slots: int,
                     model_name: str) -> tuple[list[Completion], bool]:
  """The completions a ``/v1/completions`` body asks for, and whether it streams; a
  :class:`RequestError` naming the bad value otherwise."""
  if not isinstance(body, dict):
    raise RequestError("the request body must be a JSON object.")
  unknown = sorted(set(body) - FIELDS)
  if unknown:
    raise RequestError(f"unknown field(s) {unknown}; this server takes {sorted(FIELDS)}.",
                       unknown[0])
  for name, neutral in NEUTRAL_FIELDS.items():
    if name in body and body[name] not in neutral:
      raise RequestError(f"{name}={json.dumps(body[name])} is not supported (only "
                         f"{json.dumps(neutral[0])}).", name)
  model = body.get("model")
  if model is not None and model != model_name:
    raise RequestError(f"model {model!r} is not served here; this server serves {model_name!r}.",
                       "model", status=404)
  if "prompt" not in body:
    raise RequestError("prompt is required.", "prompt")
  max_tokens = body.get("max_tokens", 16)
  if not _is_int(max_tokens) or max_tokens < 1:
    raise RequestError(f"max_tokens must be an integer >= 1, got {json.dumps(max_tokens)}.",
                       "max_tokens")
  temperature = body.get("temperature", 1.0)
  if not _is_number(temperature) or temperature < 0:
    raise RequestError(f"temperature must be a number >= 0, got {json.dumps(temperature)}.",
                       "temperature")
  top_p = body.get("top_p", 1.0)
  if not _is_number(top_p) or not 0 < top_p <= 1:
    raise RequestError(f"top_p must be a number in (0, 1], got {json.dumps(top_p)}.", "top_p")
  top_k = body.get("top_k")
  if top_k is not None and (not _is_int(top_k) or top_k < 1):
    raise RequestError(f"top_k must be an integer >= 1, got {json.dumps(top_k)}.", "top_k")
  seed = body.get("seed")
  if seed is not None and not _is_int(seed):
    raise RequestError(f"seed must be an integer, got {json.dumps(seed)}.", "seed")
  n = body.get("n", 1)
  if not _is_int(n) or not 1 <= n <= slots:
    raise RequestError(f"n must be an integer in [1, {slots}] (the server's slots), got "
                       f"{json.dumps(n)}.", "n")
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise RequestError(f"stream must be true or false, got {json.dumps(stream)}.", "stream")
  stop = body.get("stop")
  stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
      or not all(isinstance(s, str) and s for s in stop)):
    raise RequestError(f"stop must be a non-empty string or a list of at most "
                       f"{MAX_STOP_STRINGS}, got {json.dumps(body.get('stop'))}.", "stop")
  sampling = SamplingConfig(temperature=float(temperature), top_k=top_k,
                            top_p=None if top_p == 1 else float(top_p))
  completions = []
  for prompt in _prompts(body["prompt"], tokenizer):
    if not prompt:
      raise RequestError("the prompt is empty: give at least one token.", "prompt")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
      raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}).",
                         "prompt")
    if len(prompt) + max_tokens > max_len:
      raise RequestError(f"the prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                         f"{len(prompt) + max_tokens} exceeds the server's max_len={max_len}.",
                         "prompt" if len(prompt) >= max_len else "max_tokens")
    completions.append(Completion(prompt=tuple(prompt), max_tokens=max_tokens,
                                  sampling=sampling,
                                  seed=secrets.randbits(31) if seed is None else seed, n=n,
                                  stop=tuple(stop)))
  return completions, stream


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
  """``text`` up to the first of ``stops`` (and whether one occurred)."""
  cuts = [text.index(s) for s in stops if s in text]
  return (text[:min(cuts)], True) if cuts else (text, False)


def safe_prefix(text: str, stops: Sequence[str]) -> str:
  """The part of a growing ``text`` that can be streamed already: without an incomplete UTF-8
  character at the end, and without a tail that might still become a stop string."""
  text = text.rstrip("\ufffd")
  hold = 0
  for stop in stops:
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
      if text.endswith(stop[:k]):
        hold = max(hold, k)
        break
  return text[:len(text) - hold]


# ----------------------------------------------------------------------------------------------
# The engine's thread
# ----------------------------------------------------------------------------------------------


class EngineWorker:
  """Owns an :class:`Engine` on a thread of its own: runs submitted calls on it between steps,
  steps it while requests run, and passes each request's tokens to its listener."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self._inbox: queue.Queue = queue.Queue()
    self._listeners: dict[int, Callable[[TokenEvent], None]] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="kvm-engine", daemon=True)
    self._thread.start()

  def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
    """Runs ``fn(engine)`` on the engine's thread; its result (or exception) in the future."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._inbox.put((fn, future))
    return future

  def listen(self, request_ids: Sequence[int], listener: Callable[[TokenEvent], None]) -> None:
    """Sends the tokens of ``request_ids`` to ``listener`` (called on the engine's thread; call
    from the engine's thread, inside :meth:`call`, so that no token comes before)."""
    for rid in request_ids:
      self._listeners[rid] = listener

  def cancel(self, request_ids: Sequence[int]) -> concurrent.futures.Future:
    """Cancels requests (on the engine's thread) and forgets their listeners."""
    def cancel_all(engine: Engine):
      for rid in request_ids:
        engine.cancel(rid)
        self._listeners.pop(rid, None)
    return self.call(cancel_all)

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)

  def _run_calls(self, block: bool) -> None:
    try:
      fn, future = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
    except queue.Empty:
      return
    while True:
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(self.engine))
        except Exception as e:  # the caller sees it; the engine and other requests go on
          future.set_exception(e)
      try:
        fn, future = self._inbox.get_nowait()
      except queue.Empty:
        return

  def _loop(self) -> None:
    while not self._stop.is_set():
      self._run_calls(block=not self.engine.busy)
      if not self.engine.busy:
        continue
      for event in self.engine.step():
        listener = self._listeners.get(event.request_id)
        if listener is not None:
          listener(event)
        if event.finish_reason is not None:
          self._listeners.pop(event.request_id, None)


# ----------------------------------------------------------------------------------------------
# The HTTP application
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Choice:
  """One sample of one prompt as it streams: its tokens, the text sent so far, its end."""

  index: int
  stops: tuple
  tokens: list = dataclasses.field(default_factory=list)
  sent: str = ""
  finish_reason: Optional[str] = None


def _usage(completions: Sequence[Completion], choices: dict[int, _Choice]) -> dict:
  """The OpenAI ``usage`` of a finished request: every sample counts its prompt once."""
  prompt = sum(len(c.prompt) * c.n for c in completions)
  generated = sum(len(c.tokens) for c in choices.values())
  return {"prompt_tokens": prompt, "completion_tokens": generated,
          "total_tokens": prompt + generated}


def _choice_json(choice: _Choice, text: str) -> dict:
  """A choice as the response shows it, with ``text`` (the whole text, or a streamed piece)."""
  return {"index": choice.index, "text": text, "logprobs": None,
          "finish_reason": choice.finish_reason, "token_ids": list(choice.tokens)}


class _Running:
  """One ``/v1/completions`` request on the engine: a choice per sample (by engine request id),
  the queue their token events arrive on, and the fields every response to it carries."""

  def __init__(self, server: _Server, completions: list[Completion], ids: list[int],
               events: asyncio.Queue):
    self.server, self.completions, self.events = server, completions, events
    stops = [c.stop for c in completions for _ in range(c.n)]  # the engine's ids run in this order
    self.choices = {rid: _Choice(index=i, stops=stops[i]) for i, rid in enumerate(ids)}
    self.header = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion",
                   "created": int(time.time()), "model": server.model_name}

  def unfinished(self) -> list[int]:
    """The engine ids of the samples still running: what a client that leaves must cancel."""
    return [rid for rid, c in self.choices.items() if c.finish_reason is None]

  async def next_event(self, timeout=None):
    """``(choice, new text, new token ids)`` of the next token event (text None: the choice
    had already ended at a stop string)."""
    event = await asyncio.wait_for(self.events.get(), timeout)
    choice = self.choices[event.request_id]
    if choice.finish_reason is not None:
      return choice, None, []
    delta = self.server.advance(choice, event)
    if choice.finish_reason is not None and event.finish_reason is None:
      self.server.worker.cancel([event.request_id])  # a stop string ended it early: free the slot
    return choice, delta, ([] if event.token == self.server.eos else [event.token])

  async def chunks(self):
    """The server-sent events of a streamed response, one chunk per token that shows."""
    try:
      while self.unfinished():
        choice, delta, new_ids = await self.next_event()
        if delta is None:
          continue
        if delta or new_ids or choice.finish_reason:
          chunk = {**self.header, "choices": [{**_choice_json(choice, delta),
                                               "token_ids": new_ids}]}
          yield f"data: {json.dumps(chunk)}\n\n"
      yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): nothing may keep a slot
      if self.unfinished():
        self.server.worker.cancel(self.unfinished())

  async def wait(self, request) -> bool:
    """Takes token events until every sample ends; False (its samples cancelled) if the client
    disconnected first. The engine never tells of a disconnect, so the wait looks now and then."""
    try:
      while self.unfinished():
        try:
          await self.next_event(timeout=0.25)
        except asyncio.TimeoutError:
          if await request.is_disconnected():
            self.server.worker.cancel(self.unfinished())
            return False
    except asyncio.CancelledError:  # the server drops the handler: its slots go with it
      self.server.worker.cancel(self.unfinished())
      raise
    return True

  def result(self) -> dict:
    """The whole (non-streamed) response, once every sample ended."""
    ordered = sorted(self.choices.values(), key=lambda c: c.index)
    return {**self.header, "choices": [_choice_json(c, c.sent) for c in ordered],
            "usage": _usage(self.completions, self.choices)}


class _Server:
  """The endpoints of :func:`build_app` and what they share: the engine's worker, the tokenizer,
  the served settings. Starlette's response classes come in from :func:`build_app`, the one
  place that imports starlette (so a missing extra fails there, with :data:`INSTALL_HINT`)."""

  def __init__(self, worker: EngineWorker, tokenizer, *, vocab_size: int, slots: int,
               max_len: int, model_name: str, json_response, streaming_response):
    self.worker, self.tokenizer, self.eos = worker, tokenizer, tokenizer.eos_id
    self.vocab_size, self.slots, self.max_len = vocab_size, slots, max_len
    self.model_name, self.created = model_name, int(time.time())
    self._json_response, self._streaming_response = json_response, streaming_response

  def error(self, e: RequestError):
    kind = "invalid_request_error" if e.status == 400 else "not_found_error"
    return self._json_response({"error": {"message": str(e), "type": kind, "param": e.param}},
                               status_code=e.status)

  def _start(self, engine: Engine, completions: list[Completion],
             listener: Callable[[TokenEvent], None]) -> list[int]:
    """Submits every sample (on the engine's thread, so no token comes before ``listener``)."""
    ids = []
    for c in completions:
      stops = (self.eos,)
      if c.n == 1:
        ids.append(engine.submit(c.prompt, max_new_tokens=c.max_tokens, sampling=c.sampling,
                                 seed=c.seed, stop_tokens=stops))
      else:
        ids += engine.submit_samples(c.prompt, c.n, max_new_tokens=c.max_tokens,
                                     sampling=c.sampling, seed=c.seed, stop_tokens=stops)
    self.worker.listen(ids, listener)
    return ids

  async def submit(self, completions: list[Completion]) -> _Running:
    """Submits every sample; the request, its token events queued on this event loop."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    deliver = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    ids = await asyncio.wrap_future(
        self.worker.call(lambda engine: self._start(engine, completions, deliver)))
    return _Running(self, completions, ids, events)

  def advance(self, choice: _Choice, event: TokenEvent) -> str:
    """Takes one token event; returns the new text to send."""
    if event.token != self.eos:
      choice.tokens.append(event.token)
    text, stopped = cut_at_stop(self.tokenizer.decode(choice.tokens), choice.stops)
    if stopped:
      choice.finish_reason = "stop"
    elif event.finish_reason is not None:
      choice.finish_reason = "stop" if event.finish_reason == "stop" else "length"
    ready = text if choice.finish_reason else safe_prefix(text, choice.stops)
    delta, choice.sent = ready[len(choice.sent):], ready
    return delta

  async def completions(self, request):
    """``POST /v1/completions``: a 4xx before the engine sees a bad request; else the whole
    response, or its server-sent events as they come."""
    try:
      body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      return self.error(RequestError(f"the request body is not JSON: {e}."))
    try:
      completions, stream = parse_completion(body, tokenizer=self.tokenizer,
                                             vocab_size=self.vocab_size, max_len=self.max_len,
                                             slots=self.slots, model_name=self.model_name)
    except RequestError as e:
      return self.error(e)
    running = await self.submit(completions)
    if stream:
      return self._streaming_response(running.chunks(), media_type="text/event-stream")
    if not await running.wait(request):
      return self._json_response({}, status_code=499)
    return self._json_response(running.result())

  async def models(self, request):
    return self._json_response({"object": "list", "data": [
        {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kvm_jax",
         "max_len": self.max_len, "slots": self.slots}]})

  async def health(self, request):
    def count(engine: Engine):
      running, waiting = engine.occupancy
      return {"status": "ok", "slots": self.slots, "running": running, "waiting": waiting}
    return self._json_response(await asyncio.wrap_future(self.worker.call(count)))

  @contextlib.asynccontextmanager
  async def lifespan(self, app):
    yield
    self.worker.close()


def build_app(model, tokenizer, *, slots: int = 8, max_len: int = 2048, prefill_chunk: int = 64,
              prefill_lanes: int = 4, tokens_per_step: int = 4, model_name: str = "kvm_jax"):
  """The starlette application serving ``model`` (and its ``engine_worker``, to close)."""
  try:
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
  except ImportError as e:
    raise ImportError(INSTALL_HINT) from e
  engine = Engine(model, slots=slots, max_len=max_len, prefill_chunk=prefill_chunk,
                  prefill_lanes=prefill_lanes, tokens_per_step=tokens_per_step)
  server = _Server(EngineWorker(engine), tokenizer, vocab_size=model.cfg.vocab_size, slots=slots,
                   max_len=max_len, model_name=model_name, json_response=JSONResponse,
                   streaming_response=StreamingResponse)
  app = Starlette(routes=[Route("/v1/completions", server.completions, methods=["POST"]),
                          Route("/v1/models", server.models, methods=["GET"]),
                          Route("/health", server.health, methods=["GET"])],
                  lifespan=server.lifespan)
  app.state.engine_worker = server.worker
  return app


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", metavar="RUN_DIR",
                 help="a kvm_jax run directory (kvm-train, kvm-demo, kvm-import) or an authors' "
                      "checkpoint directory; its tokenizer reads text prompts")
  p.add_argument("--slots", type=int, default=8,
                 help="requests decoded together: the rows of the engine's cache (default: 8)")
  p.add_argument("--max-len", type=int, default=None,
                 help="the longest prompt + completion a slot holds, in tokens (default: the "
                      "run's training sequence length, or 2048)")
  p.add_argument("--prefill-chunk", type=int, default=64,
                 help="prompt tokens a slot feeds per engine step (default: 64): smaller keeps "
                      "other slots' tokens flowing while long prompts arrive")
  p.add_argument("--prefill-lanes", type=int, default=4,
                 help="prompts that feed a piece in parallel in one step (default: 4; models "
                      "with cross-layer KV sharing feed prompts through the decode step)")
  p.add_argument("--tokens-per-step", type=int, default=4,
                 help="the most tokens a decoding slot draws per engine step, one host round "
                      "trip for all (default: 4): more raises throughput, fewer streams sooner")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
  p.add_argument("--name", default=None,
                 help="the model name /v1/models reports (default: the run directory's name)")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="parameter and activation dtype (default: float32)")
  return p


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  for name in ("slots", "prefill_chunk", "prefill_lanes", "tokens_per_step", "port"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.max_len is not None and args.max_len < 2:
    parser.error(f"--max-len must be >= 2, got {args.max_len}.")
  try:
    import uvicorn
  except ImportError:
    raise SystemExit(INSTALL_HINT)
  from pathlib import Path

  import kvm_jax as kj
  from kvm_jax.hf.load import checkpoint_kind
  from kvm_jax.runs.directory import load_config
  run = Path(args.run_dir)
  if not run.is_dir():
    parser.error(f"RUN_DIR {run} is not a directory.")
  model = kj.load_pretrained(run, args.dtype)
  tokenizer = kj.tokenizer_of(run)
  max_len = args.max_len
  if max_len is None:
    max_len = load_config(run).sequence_length if checkpoint_kind(run) == "run" else 2048
  app = build_app(model, tokenizer, slots=args.slots, max_len=max_len,
                  prefill_chunk=args.prefill_chunk, prefill_lanes=args.prefill_lanes,
                  tokens_per_step=args.tokens_per_step, model_name=args.name or run.name)
  print(f"kvm-serve: {args.name or run.name} on http://{args.host}:{args.port} "
        f"({args.slots} slots of {max_len} tokens)", flush=True)
  uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
  main()
