"""``kvm-serve RUN_DIR``: an OpenAI-compatible server over one :class:`kvm_jax.Engine`.

Endpoints: ``POST /v1/completions`` (``prompt`` as text or token ids, or a list of either;
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stream`` as
server-sent events with ``stream_options.include_usage``, ``n``), ``POST /v1/chat/completions``
(``messages`` rendered with the run's chat template: ``chat_template.jinja`` in the run
directory or beside its tokenizer, or the ``chat_template`` of the tokenizer's
``tokenizer_config.json``), ``GET /v1/models`` and ``GET /health``.

Concurrent requests share the engine's slots: one worker thread owns the engine, steps it while
anything runs, and hands each token to the request's handler. A request's completion is what
``kj.generate`` gives its prompt alone (sample ``i`` of ``n`` with seed ``seed + i``).

No request can stop the server. Every field is checked before the engine sees it (a 4xx in
OpenAI's error shape names the bad value); a client that disconnects cancels its request,
freeing its slot; a finished request's record is dropped once its response is delivered. Should
the engine's step raise anyway, the requests it held end with a JSON 500 naming the error, the
engine restarts on empty slots and ``/health`` counts the restart; an engine whose empty slots
fail a request of its own three restarts in a row ends the process with a non-zero exit instead
of hanging.

Before it reports ready (``/health`` says ``warming`` with status 503 until then), the server
compiles the engine's step programs, printing each and its time; JAX's persistent compilation
cache (``--compilation-cache``) lets the next start load them instead.

Needs the ``serve`` extra (``pip install -e ".[serve]"``: starlette, uvicorn, jinja2).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import queue
import secrets
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from kvm_jax.util import compilation_cache

INSTALL_HINT = ('kvm-serve needs the serve extra: pip install -e ".[serve]" (starlette, uvicorn, '
                'jinja2).')
# OpenAI fields this server accepts only at their neutral value (what they would change is not
# implemented): a request that sets them otherwise is refused rather than silently served.
NEUTRAL_FIELDS = {"echo": (False, None), "logprobs": (None, False), "best_of": (None, 1),
                  "suffix": (None,), "presence_penalty": (0, 0.0, None),
                  "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {})}
CHAT_NEUTRAL_FIELDS = {"logprobs": (None, False), "top_logprobs": (None, 0),
                       "presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None),
                       "logit_bias": (None, {}), "response_format": (None, {"type": "text"}),
                       "tools": (None, []), "tool_choice": (None, "none"),
                       "parallel_tool_calls": (None, True, False)}
SHARED_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                 "stream_options", "n", "user"}
FIELDS = SHARED_FIELDS | {"prompt"} | set(NEUTRAL_FIELDS)
CHAT_FIELDS = SHARED_FIELDS | {"messages", "max_completion_tokens"} | set(CHAT_NEUTRAL_FIELDS)
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 1024
# Prompts one request may hold (each with n samples): more would let one client fill the queue.
MAX_PROMPTS = 64
MAX_MESSAGES = 1024
# A request body larger than this is refused (413) before it is read whole.
MAX_BODY_BYTES = 16 * 2**20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# How long /health waits for the engine's thread before it answers with what it knows.
HEALTH_TIMEOUT_S = 2.0
# How often a request that is not streamed looks whether its client is still there.
DISCONNECT_CHECK_S = 0.25
# How long a stopping server waits for open responses (a stalled client must not keep a server
# whose engine stopped alive).
SHUTDOWN_GRACE_S = 10


class RequestError(ValueError):
  """A request the server refuses: its HTTP status, message and the offending field."""

  def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
               code: Optional[str] = None):
    super().__init__(message)
    self.param, self.status, self.code = param, status, code


def error_body(message: str, status: int, param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
  """An error in OpenAI's shape (what the ``openai`` client reads into its exceptions): a
  request's fault is an ``invalid_request_error``, the server's a ``server_error``."""
  kind = "server_error" if status >= 500 else "invalid_request_error"
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class Completion:
  """One validated prompt of a request: its token ids and generation settings."""

  prompt: tuple
  max_tokens: int
  sampling: Any  # kvm_jax.SamplingConfig
  seed: int
  n: int
  stop: tuple


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the server checks a request against: the served model and the engine's limits."""

  vocab_size: int
  max_len: int
  slots: int
  model_name: str
  # Why text prompts are refused (a run without a tokenizer whose vocabulary holds no bytes).
  text_refusal: Optional[str] = None


# ----------------------------------------------------------------------------------------------
# Validating a request (pure functions)
# ----------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def shown_value(value, limit: int = 80) -> str:
  """``value`` as JSON for a message, cut to ``limit`` characters (a request may be huge)."""
  try:
    text = json.dumps(value, allow_nan=True)
  except (TypeError, ValueError, RecursionError):
    try:
      text = repr(value)
    except RecursionError:  # nested nearly as deep as the JSON parser goes
      text = f"a {type(value).__name__} nested too deeply to show"
  return text if len(text) <= limit else text[:limit] + "..."


def _encode(tokenizer, text: str, param: str, **kwargs) -> list[int]:
  try:
    return list(tokenizer.encode(text, **kwargs))
  except (UnicodeError, ValueError, TypeError) as e:  # e.g. a lone surrogate "\ud800"
    raise RequestError(f"{param} cannot be encoded by the tokenizer: {e}.", param) from e


def _prompts(value, tokenizer, text_refusal: Optional[str] = None) -> list[list[int]]:
  """The prompts of ``value`` (text, token ids, or a list of those) as token-id lists."""
  if isinstance(value, str):
    if text_refusal:
      raise RequestError(text_refusal, "prompt")
    return [_encode(tokenizer, value, "prompt")]
  if isinstance(value, list) and value and all(_is_int(t) for t in value):
    return [list(value)]
  if isinstance(value, list) and value and all(
      isinstance(p, str) or (isinstance(p, list) and p and all(_is_int(t) for t in p))
      for p in value):
    if len(value) > MAX_PROMPTS:
      raise RequestError(f"a request holds at most {MAX_PROMPTS} prompts, got {len(value)}.",
                         "prompt")
    return [one for p in value for one in _prompts(p, tokenizer, text_refusal)]
  raise RequestError(f"prompt must be a string, a list of token ids, or a list of those; got "
                     f"{shown_value(value)}.", "prompt")


def _same(value, neutral) -> bool:
  """``value == neutral`` without Python's ``0 == False`` (JSON tells a number from a bool)."""
  return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _check_neutral(body: dict, neutral_fields: dict) -> None:
  for name, neutral in neutral_fields.items():
    if name in body and not any(_same(body[name], n) for n in neutral):
      raise RequestError(f"{name}={shown_value(body[name])} is not supported (only "
                         f"{shown_value(neutral[0])}).", name)


def _int_field(body: dict, name: str, default, low: int, high: int, why: str = ""):
  """``body[name]`` checked to be an int in ``[low, high]``; ``default`` when absent or null."""
  value = body.get(name)
  value = default if value is None else value
  if value is None:
    return None
  if not _is_int(value) or not low <= value <= high:
    raise RequestError(f"{name} must be an integer in [{low}, {high}]{why}, got {shown_value(value)}.",
                       name)
  return value


def _sampling(body: dict, vocab_size: int):
  """The request's :class:`kvm_jax.SamplingConfig` (temperature, top_p, top_k: each finite and
  in the range float32 logits can be divided or cut by)."""
  from kvm_jax.generation.generate import FLOAT32_MAX, FLOAT32_TINY, MIN_TEMPERATURE, SamplingConfig
  temperature = body.get("temperature")
  temperature = 1.0 if temperature is None else temperature
  if not _is_number(temperature) or not (
      temperature == 0 or MIN_TEMPERATURE <= temperature <= FLOAT32_MAX):
    raise RequestError(f"temperature must be 0 (greedy) or a finite number in "
                       f"[{MIN_TEMPERATURE:g}, {FLOAT32_MAX:.3g}], got {shown_value(temperature)}.",
                       "temperature")
  top_p = body.get("top_p")
  top_p = 1.0 if top_p is None else top_p
  if not _is_number(top_p) or not FLOAT32_TINY <= top_p <= 1:
    raise RequestError(f"top_p must be a number in (0, 1] (at least {FLOAT32_TINY:.3g}), got "
                       f"{shown_value(top_p)}.", "top_p")
  from kvm_jax.generation.engine import INT32_MAX
  top_k = _int_field(body, "top_k", None, 1, INT32_MAX,
                     f" (any value >= the vocabulary's {vocab_size} keeps every token)")
  return SamplingConfig(temperature=float(temperature), top_k=top_k,
                        top_p=None if top_p == 1 else float(top_p))


def _stop(body: dict) -> tuple:
  stop = body.get("stop")
  stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
  if (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
      or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
    raise RequestError(f"stop must be a non-empty string of at most {MAX_STOP_CHARS} characters "
                       f"or a list of at most {MAX_STOP_STRINGS} such, got "
                       f"{shown_value(body.get('stop'))}.", "stop")
  return tuple(stop)


def _stream(body: dict) -> tuple[bool, bool]:
  """(whether the response streams, whether its last chunk carries the usage)."""
  stream = body.get("stream")
  stream = False if stream is None else stream
  if not isinstance(stream, bool):
    raise RequestError(f"stream must be true or false, got {shown_value(stream)}.", "stream")
  options = body.get("stream_options")
  if options is None:
    return stream, False
  if not stream:
    raise RequestError("stream_options is only allowed with stream=true.", "stream_options")
  if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
      options.get("include_usage", False), bool):
    raise RequestError(f"stream_options must be {{\"include_usage\": true|false}}, got "
                       f"{shown_value(options)}.", "stream_options")
  return stream, options.get("include_usage", False)


def _common(body: Any, fields: set, neutral: dict, settings: Settings) -> dict:
  """The fields completions and chat share, checked: ``max_tokens`` (or None when absent),
  ``sampling``, ``seed``, ``n``, ``stop``, ``stream``, ``include_usage``."""
  if not isinstance(body, dict):
    raise RequestError(f"the request body must be a JSON object, got {shown_value(body)}.")
  unknown = sorted(set(body) - fields)
  if unknown:
    raise RequestError(f"unknown field(s) {shown_value(unknown)}; this endpoint takes "
                       f"{sorted(fields)}.", str(unknown[0])[:80])
  _check_neutral(body, neutral)
  model = body.get("model")
  if model is not None and not isinstance(model, str):
    raise RequestError(f"model must be a string, got {shown_value(model)}.", "model")
  if model is not None and model != settings.model_name:
    raise RequestError(f"model {shown_value(model)} is not served here; this server serves "
                       f"{settings.model_name!r}.", "model", status=404, code="model_not_found")
  if body.get("user") is not None and not isinstance(body["user"], str):
    raise RequestError(f"user must be a string, got {shown_value(body['user'])}.", "user")
  from kvm_jax.generation.engine import SEED_MAX, SEED_MIN
  n = _int_field(body, "n", 1, 1, settings.slots, " (the server's slots)")
  seed = _int_field(body, "seed", None, SEED_MIN, SEED_MAX - (n - 1),
                    " (the sampler's 32-bit seeds; sample i of n uses seed + i)")
  stream, include_usage = _stream(body)
  return dict(sampling=_sampling(body, settings.vocab_size), seed=seed, n=n, stop=_stop(body),
              stream=stream, include_usage=include_usage)


def _completions(prompts: list[list[int]], max_tokens, common: dict, settings: Settings,
                 param: str, default_max_tokens: Optional[int] = 16) -> list[Completion]:
  """One :class:`Completion` per prompt, each checked against the vocabulary and ``max_len``.
  ``max_tokens`` None: ``default_max_tokens``, or (None) what the slot holds after the prompt."""
  if max_tokens is not None or default_max_tokens is not None:
    max_tokens = default_max_tokens if max_tokens is None else max_tokens
    if not _is_int(max_tokens) or not 1 <= max_tokens <= settings.max_len - 1:
      raise RequestError(f"max_tokens must be an integer in [1, {settings.max_len - 1}] (the "
                         f"server's max_len={settings.max_len} holds the prompt too), got "
                         f"{shown_value(max_tokens)}.", "max_tokens")
  completions = []
  for prompt in prompts:
    if not prompt:
      raise RequestError(f"the {param} is empty: give at least one token.", param)
    bad = [t for t in prompt if not 0 <= t < settings.vocab_size]
    if bad:
      raise RequestError(f"token id {shown_value(bad[0])} is outside the vocabulary [0, "
                         f"{settings.vocab_size}).", param)
    if max_tokens is None:  # a chat without max_tokens: until the end of text or of the slot
      max_tokens = max(settings.max_len - len(prompt), 1)
    if len(prompt) + max_tokens > settings.max_len:
      raise RequestError(f"the {param} ({len(prompt)} tokens) + max_tokens ({max_tokens}) = "
                         f"{len(prompt) + max_tokens} exceeds the server's max_len="
                         f"{settings.max_len}.",
                         param if len(prompt) >= settings.max_len else "max_tokens")
    seed = secrets.randbits(31) if common["seed"] is None else common["seed"]
    completions.append(Completion(prompt=tuple(prompt), max_tokens=max_tokens,
                                  sampling=common["sampling"], seed=seed, n=common["n"],
                                  stop=common["stop"]))
  return completions


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A checked request: its completions and how the response goes out."""

  completions: list
  stream: bool
  include_usage: bool


def parse_completion_request(body: Any, tokenizer, settings: Settings) -> Parsed:
  """A ``/v1/completions`` body, checked (a :class:`RequestError` naming the bad value)."""
  common = _common(body, FIELDS, NEUTRAL_FIELDS, settings)
  if "prompt" not in body:
    raise RequestError("prompt is required.", "prompt")
  completions = _completions(_prompts(body["prompt"], tokenizer, settings.text_refusal),
                             body.get("max_tokens"),
                             common, settings, "prompt")
  return Parsed(completions, common["stream"], common["include_usage"])


def _message_text(message: Any, i: int) -> dict:
  """A chat message as the template sees it: ``role`` and ``content`` as text."""
  where = f"messages[{i}]"
  if not isinstance(message, dict) or "role" not in message:
    raise RequestError(f"{where} must be an object with a role and content, got "
                       f"{shown_value(message)}.", "messages")
  role, content = message["role"], message.get("content")
  if role not in CHAT_ROLES:
    raise RequestError(f"{where}.role must be one of {list(CHAT_ROLES)}, got {shown_value(role)}.",
                       "messages")
  if isinstance(content, list):  # content parts: only text can be rendered here
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
      raise RequestError(f"{where}.content parts must all be {{\"type\": \"text\", \"text\": "
                         f"...}} (this server reads text only), got {shown_value(content)}.",
                         "messages")
    content = "".join(p["text"] for p in content)
  if not isinstance(content, str):
    raise RequestError(f"{where}.content must be a string or a list of text parts, got "
                       f"{shown_value(content)}.", "messages")
  # A client sends earlier assistant turns back as it got them (refusal, tool_calls: null).
  unknown = sorted(k for k in set(message) - {"role", "content", "name"} if message[k] is not None)
  if unknown:
    raise RequestError(f"{where} has unknown field(s) {shown_value(unknown)} (tool calls are not "
                       "supported).", "messages")
  return {"role": role, "content": content}


def parse_chat_request(body: Any, tokenizer, template: Optional["ChatTemplate"],
                       settings: Settings) -> Parsed:
  """A ``/v1/chat/completions`` body, checked and its messages rendered with ``template``."""
  common = _common(body, CHAT_FIELDS, CHAT_NEUTRAL_FIELDS, settings)
  if template is None:
    raise RequestError("this run has no chat template (no chat_template.jinja in the run "
                       "directory or beside its tokenizer, no chat_template in the tokenizer's "
                       "tokenizer_config.json): send the text yourself to /v1/completions.",
                       "messages")
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
    raise RequestError(f"messages must be a non-empty list of at most {MAX_MESSAGES} messages, "
                       f"got {shown_value(messages)}.", "messages")
  if settings.text_refusal:
    raise RequestError(settings.text_refusal, "messages")
  messages = [_message_text(m, i) for i, m in enumerate(messages)]
  max_tokens = body.get("max_completion_tokens")
  max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
  try:
    text = template.render(messages)
  except Exception as e:  # a template may raise_exception() on messages it does not take
    raise RequestError(f"the chat template refused these messages: {e}", "messages") from e
  prompt = _encode(tokenizer, text, "messages", **template.encode_kwargs)
  completions = _completions([prompt], max_tokens, common, settings, "messages",
                             default_max_tokens=None)
  return Parsed(completions, common["stream"], common["include_usage"])


# ----------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A Jinja chat template (transformers' convention: ``messages``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token``), rendered in a sandbox, and where it came from."""

  source: str
  where: str
  bos_token: str = ""
  eos_token: str = ""

  @property
  def encode_kwargs(self) -> dict:
    # The rendered text carries the template's own special tokens; the tokenizer must not add
    # its BOS again (transformers' apply_chat_template encodes the same way).
    return {"add_special_tokens": False}

  @functools.cached_property
  def compiled(self):
    """The template compiled (once; a template that does not compile fails here, at start)."""
    try:
      from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
      raise ImportError(INSTALL_HINT) from e

    def raise_exception(message):
      raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    try:
      return env.from_string(self.source)
    except Exception as e:  # jinja2's TemplateSyntaxError and kin
      raise ValueError(f"the chat template of {self.where} does not compile: {e}") from e

  def render(self, messages: list[dict]) -> str:
    return self.compiled.render(messages=messages, add_generation_prompt=True,
                                bos_token=self.bos_token, eos_token=self.eos_token)


def find_chat_template(folders: Sequence[Path]) -> Optional[ChatTemplate]:
  """The first chat template in ``folders``: a ``chat_template.jinja`` file, else the
  ``chat_template`` of a ``tokenizer_config.json`` (a string, or transformers' list of named
  templates, whose ``default`` is taken). None when no folder has one."""
  from kvm_jax.hf.special_tokens import token_name
  for folder in folders:
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    tokens = dict(bos_token=token_name(config.get("bos_token")) or "",
                  eos_token=token_name(config.get("eos_token")) or "")
    jinja = folder / "chat_template.jinja"
    found = None
    if jinja.is_file():
      found = ChatTemplate(jinja.read_text(), str(jinja), **tokens)
    source = config.get("chat_template")
    if isinstance(source, list):
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if found is None and isinstance(source, str) and source:
      found = ChatTemplate(source, f"{config_file} (chat_template)", **tokens)
    if found is not None:
      found.compiled  # a broken template stops the start, not every chat request
      return found
  return None


def template_folders(run: Path) -> list[Path]:
  """Where a run's chat template may be: the run directory, then its tokenizer's folder."""
  folders = [run]
  try:
    from kvm_jax.hf.load import checkpoint_kind
    from kvm_jax.runs.directory import load_config
    if checkpoint_kind(run) == "run":
      cfg = load_config(run)
      name = cfg.niah.tokenizer_file if cfg.task == "niah" else cfg.tokenizer_file
      if name:
        folders.append(Path(name).parent)
  except (ValueError, OSError):
    pass
  return folders


# ----------------------------------------------------------------------------------------------
# The engine's thread
# ----------------------------------------------------------------------------------------------


class EngineFailed(RuntimeError):
  """The engine's thread stopped for good: nothing can be served any more."""


class EngineWorker:
  """Owns an :class:`~kvm_jax.generation.engine.Engine` on a thread of its own: compiles its programs
  first (``warm``), then runs submitted calls on it between steps, steps it while requests run,
  and passes each request's tokens to its listener.

  A step that raises ends the requests the engine held (an event with finish reason "error" to
  each listener), the engine restarts on empty slots and runs a request of its own through
  them: when that works the fault was the requests', and the loop goes on. When it fails too,
  the engine restarts again, up to ``max_failures`` times in a row; then the thread ends:
  ``state`` becomes "failed", every waiting call and listener is told, and ``on_fatal(error)``
  is called (the server exits non-zero)."""

  def __init__(self, engine, *, warm: bool = False, on_fatal: Optional[Callable] = None,
               max_failures: int = 3, log: Callable[[str], None] = print):
    self.engine, self.on_fatal, self.max_failures, self.log = engine, on_fatal, max_failures, log
    self.state = "warming" if warm else "ok"
    self.restarts, self.last_error = 0, None
    self._warm = warm
    self._inbox: queue.Queue = queue.Queue()
    # Held while a call is queued and while the thread fails for good, so that no call is queued
    # after the failed thread emptied the inbox (its future would never resolve).
    self._failing = threading.Lock()
    self._listeners: dict[int, Callable] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="kvm-engine", daemon=True)
    self._thread.start()

  def call(self, fn: Callable) -> concurrent.futures.Future:
    """Runs ``fn(engine)`` on the engine's thread; its result (or exception) in the future."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._failing:
      if self.state == "failed":
        future.set_exception(EngineFailed(f"the engine stopped: {self.last_error}"))
      else:
        self._inbox.put((fn, future))
    return future

  def listen(self, request_ids: Sequence[int], listener: Callable) -> None:
    """Sends the tokens of ``request_ids`` to ``listener`` (called on the engine's thread; call
    from the engine's thread, inside :meth:`call`, so that no token comes before)."""
    for rid in request_ids:
      self._listeners[rid] = listener

  def finish(self, request_ids: Sequence[int]) -> concurrent.futures.Future:
    """Cancels the requests that still run and drops every one's record and listener (on the
    engine's thread): what a response that was delivered, or a client that left, leaves."""
    def finish_all(engine):
      for rid in request_ids:
        self._listeners.pop(rid, None)
        with contextlib.suppress(KeyError):  # already dropped (the engine keeps a bounded few)
          engine.cancel(rid)
          engine.release(rid)
    return self.call(finish_all)

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

  def _deliver(self, events) -> None:
    for event in events:
      listener = self._listeners.get(event.request_id)
      if listener is not None:
        try:
          listener(event)
        except Exception:  # a handler whose event loop is gone: nobody waits for it
          pass
      if event.finish_reason is not None:
        self._listeners.pop(event.request_id, None)

  def _warm_up(self) -> None:
    self.log("kvm-serve: warming up: compiling the engine's step programs "
             f"(prompt piece widths {list(self.engine.lane_widths())}) ...")
    seconds = self.engine.warm_up(lambda what, s: self.log(f"kvm-serve:   {what}: {s:.1f} s"))
    self.log(f"kvm-serve: warm in {seconds:.1f} s")

  def _step(self) -> None:
    """One engine step, its events delivered; after a step that raised, the recovery."""
    try:
      events = self.engine.step()
    except Exception as e:
      self._recover(e)
      return
    self._deliver(events)

  def _recover(self, error: Exception) -> None:
    """Ends the held requests, restarts the engine on empty slots and checks them with a
    request of its own (the warm-up's); raises once ``max_failures`` restarts in a row failed
    that check (the engine cannot serve: the thread ends)."""
    for attempt in range(1, self.max_failures + 1):
      self.last_error = f"{type(error).__name__}: {error}"
      self.log(f"kvm-serve: the engine's step failed ({self.last_error}); the requests it held "
               f"end with an error and the engine restarts on empty slots.\n"
               f"{''.join(traceback.format_exception(error))}")
      self._deliver(self.engine.recover())
      self.restarts += 1
      try:
        self.engine.warm_up()
        return
      except Exception as again:  # the fault is the engine's, not the requests'
        error = again
    raise RuntimeError(f"the engine failed {self.max_failures} restarts in a row: "
                       f"{self.last_error}") from error

  def _run(self) -> None:
    try:
      if self._warm:
        self._warm_up()
      self.state = "ok"
      while not self._stop.is_set():
        self._run_calls(block=not self.engine.busy)
        if self.engine.busy:
          self._step()
    except BaseException as e:  # nothing more can run: say so to everyone, then stop
      with self._failing:
        self.state, self.last_error = "failed", f"{type(e).__name__}: {e}"
      self.log(f"kvm-serve: the engine stopped for good: {self.last_error}\n"
               f"{traceback.format_exc()}")
      self._fail_everything()
      if self.on_fatal is not None:
        self.on_fatal(e)

  def _fail_everything(self) -> None:
    from kvm_jax.generation.engine import TokenEvent
    self._deliver([TokenEvent(rid, -1, "error") for rid in list(self._listeners)])
    while True:
      try:
        _, future = self._inbox.get_nowait()
      except queue.Empty:
        return
      if future.set_running_or_notify_cancel():
        future.set_exception(EngineFailed(f"the engine stopped: {self.last_error}"))


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
  started: bool = False  # a chat stream's first chunk (the assistant's role) went out


def usage(completions: Sequence[Completion], choices: Sequence[_Choice]) -> dict:
  """OpenAI's ``usage`` of a request: each prompt counted once however many samples it has, the
  completion tokens of every sample added up (a stop token that ended one is not among them:
  it is neither in its ``token_ids`` nor in its text)."""
  prompt = sum(len(c.prompt) for c in completions)
  generated = sum(len(c.tokens) for c in choices)
  return {"prompt_tokens": prompt, "completion_tokens": generated,
          "total_tokens": prompt + generated}


class _Running:
  """One request on the engine: a choice per sample (by engine request id), the queue their
  token events arrive on, and the fields every response to it carries."""

  def __init__(self, server: "_Server", parsed: Parsed, ids: list[int], events: asyncio.Queue,
               chat: bool):
    self.server, self.parsed, self.events, self.chat = server, parsed, events, chat
    self.completions = parsed.completions
    stops = [c.stop for c in self.completions for _ in range(c.n)]  # the engine's id order
    self.choices = {rid: _Choice(index=i, stops=stops[i]) for i, rid in enumerate(ids)}
    prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
    self.header = {"id": f"{prefix}-{secrets.token_hex(12)}", "object": kind,
                   "created": int(time.time()), "model": server.settings.model_name}

  def unfinished(self) -> list[int]:
    """The engine ids of the samples still running: what a client that leaves must cancel."""
    return [rid for rid, c in self.choices.items() if c.finish_reason is None]

  def failed(self) -> bool:
    return any(c.finish_reason == "error" for c in self.choices.values())

  def error_message(self) -> str:
    return (f"the engine failed while generating this request ({self.server.worker.last_error}); "
            "it restarted on empty slots and the server goes on: send the request again.")

  async def next_event(self, timeout=None):
    """``(choice, new text, new token ids)`` of the next token event (text None: the choice
    had already ended, or the engine failed it)."""
    event = await asyncio.wait_for(self.events.get(), timeout)
    choice = self.choices[event.request_id]
    if choice.finish_reason is not None:
      return choice, None, []
    if event.finish_reason == "error":
      choice.finish_reason = "error"
      return choice, None, []
    delta = self.server.advance(choice, event)
    if choice.finish_reason is not None and event.finish_reason is None:
      self.server.worker.finish([event.request_id])  # a stop string ended it early: free the slot
    return choice, delta, ([] if event.token == self.server.eos else [event.token])

  def _choice_json(self, choice: _Choice, text: str, token_ids: list, streamed: bool) -> dict:
    if not self.chat:
      return {"index": choice.index, "text": text, "logprobs": None,
              "finish_reason": choice.finish_reason, "token_ids": token_ids}
    if streamed:  # the first chunk of a choice names the role, as OpenAI's do
      delta = {"content": text} if text else {}
      if not choice.started:
        delta, choice.started = {"role": "assistant", "content": text}, True
      return {"index": choice.index, "delta": delta, "logprobs": None,
              "finish_reason": choice.finish_reason, "token_ids": token_ids}
    return {"index": choice.index, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": choice.finish_reason, "token_ids": token_ids}

  def _chunk(self, **fields) -> str:
    kind = "chat.completion.chunk" if self.chat else "text_completion"
    return f"data: {json.dumps({**self.header, 'object': kind, **fields})}\n\n"

  async def chunks(self):
    """The server-sent events of a streamed response, one chunk per token that shows; the
    usage in a last chunk of its own when asked (``stream_options.include_usage``)."""
    extra = {"usage": None} if self.parsed.include_usage else {}
    try:
      while self.unfinished():
        choice, delta, new_ids = await self.next_event()
        if delta is None:
          continue
        if delta or new_ids or choice.finish_reason:
          yield self._chunk(choices=[self._choice_json(choice, delta, new_ids, True)], **extra)
      if self.failed():
        yield f"data: {json.dumps(error_body(self.error_message(), 500))}\n\n"
      elif self.parsed.include_usage:
        yield self._chunk(choices=[], usage=usage(self.completions, self.choices.values()))
      yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): nothing may keep a slot or a record
      self.server.worker.finish(list(self.choices))

  async def wait(self, request) -> bool:
    """Takes token events until every sample ends; False (its samples cancelled) if the client
    disconnected first. The engine never tells of a disconnect, so the wait looks every
    :data:`DISCONNECT_CHECK_S`, whether tokens arrive meanwhile or not."""
    loop = asyncio.get_running_loop()
    try:
      look_at = loop.time() + DISCONNECT_CHECK_S
      while self.unfinished():
        with contextlib.suppress(asyncio.TimeoutError):
          await self.next_event(timeout=max(look_at - loop.time(), 0.0))
        if loop.time() >= look_at:
          if await request.is_disconnected():
            return False
          look_at = loop.time() + DISCONNECT_CHECK_S
      return True
    finally:  # delivered, failed, or abandoned: its slots and records go
      self.server.worker.finish(list(self.choices))

  def result(self) -> dict:
    """The whole (non-streamed) response, once every sample ended."""
    ordered = sorted(self.choices.values(), key=lambda c: c.index)
    return {**self.header,
            "choices": [self._choice_json(c, c.sent, list(c.tokens), False) for c in ordered],
            "usage": usage(self.completions, self.choices.values())}


class _Server:
  """The endpoints of :func:`build_app` and what they share: the engine's worker, the tokenizer,
  the served settings. Starlette's response classes come in from :func:`build_app`, the one
  place that imports starlette (so a missing extra fails there, with :data:`INSTALL_HINT`)."""

  def __init__(self, worker: EngineWorker, tokenizer, settings: Settings, *, json_response,
               streaming_response, chat_template: Optional[ChatTemplate] = None):
    self.worker, self.tokenizer, self.eos = worker, tokenizer, tokenizer.eos_id
    self.settings, self.chat_template = settings, chat_template
    self.created = int(time.time())
    self._json_response, self._streaming_response = json_response, streaming_response

  def error(self, e: RequestError):
    return self._json_response(error_body(str(e), e.status, e.param, e.code),
                               status_code=e.status)

  def _start(self, engine, completions: list[Completion], listener: Callable) -> list[int]:
    """Submits every sample (on the engine's thread, so no token comes before ``listener``);
    the engine's own checks refuse what the server's missed (nothing is half submitted)."""
    ids = []
    try:
      for c in completions:
        stops = () if self.eos is None else (self.eos,)
        if c.n == 1:
          ids.append(engine.submit(c.prompt, max_new_tokens=c.max_tokens, sampling=c.sampling,
                                   seed=c.seed, stop_tokens=stops))
        else:
          ids += engine.submit_samples(c.prompt, c.n, max_new_tokens=c.max_tokens,
                                       sampling=c.sampling, seed=c.seed, stop_tokens=stops)
    except ValueError as e:
      for rid in ids:
        engine.cancel(rid)
        engine.release(rid)
      raise RequestError(str(e)) from e
    self.worker.listen(ids, listener)
    return ids

  async def submit(self, parsed: Parsed, chat: bool) -> _Running:
    """Submits every sample; the request, its token events queued on this event loop."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    deliver = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    started = self.worker.call(lambda engine: self._start(engine, parsed.completions, deliver))
    try:
      ids = await asyncio.wrap_future(started)
    except asyncio.CancelledError:  # the handler went away: whatever it submitted must go too
      started.add_done_callback(self._finish_orphans)
      raise
    return _Running(self, parsed, ids, events, chat)

  def _finish_orphans(self, started: concurrent.futures.Future) -> None:
    if not started.cancelled() and started.exception() is None:
      self.worker.finish(started.result())

  def advance(self, choice: _Choice, event) -> str:
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

  async def _body(self, request) -> bytes:
    """The request's body (a :class:`RequestError` for one too large)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
      raise RequestError(f"the request body ({declared} bytes) is larger than "
                         f"{MAX_BODY_BYTES} bytes.", status=413)
    raw = bytearray()
    async for piece in request.stream():
      raw += piece
      if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"the request body is larger than {MAX_BODY_BYTES} bytes.",
                           status=413)
    return bytes(raw)

  async def _serve(self, request, parse: Callable[[Any], Parsed], chat: bool):
    try:
      raw = await self._body(request)
      # Decoding, checking and tokenizing a large body take a while: off the event loop, so
      # that other streams and /health go on meanwhile.
      parsed = await asyncio.to_thread(lambda: parse(read_json(raw)))
      if self.worker.state == "failed":
        raise RequestError(f"the engine stopped ({self.worker.last_error}); the server is "
                           "shutting down.", status=503)
      running = await self.submit(parsed, chat)
    except RequestError as e:
      return self.error(e)
    except EngineFailed as e:
      return self.error(RequestError(str(e), status=503))
    if parsed.stream:
      return self._streaming_response(running.chunks(), media_type="text/event-stream",
                                      on_close=lambda: self.worker.finish(list(running.choices)))
    if not await running.wait(request):
      return self._json_response(error_body("the client closed the request.", 499),
                                 status_code=499)
    if running.failed():
      return self.error(RequestError(running.error_message(), status=500))
    return self._json_response(running.result())

  async def completions(self, request):
    """``POST /v1/completions``: a 4xx before the engine sees a bad request; else the whole
    response, or its server-sent events as they come."""
    return await self._serve(
        request, lambda body: parse_completion_request(body, self.tokenizer, self.settings),
        chat=False)

  async def chat_completions(self, request):
    """``POST /v1/chat/completions``: the messages rendered with the run's chat template."""
    return await self._serve(
        request, lambda body: parse_chat_request(body, self.tokenizer, self.chat_template,
                                                 self.settings), chat=True)

  async def models(self, request):
    return self._json_response({"object": "list", "data": [
        {"id": self.settings.model_name, "object": "model", "created": self.created,
         "owned_by": "kvm_jax", "max_len": self.settings.max_len, "slots": self.settings.slots}]})

  async def health(self, request):
    """``GET /health``: 200 with ``status: ok`` once warm and serving; 503 while ``warming`` or
    once ``failed``. ``engine_restarts`` counts the engine's recoveries, ``last_error`` names
    the latest failure."""
    body = {"status": self.worker.state, "slots": self.settings.slots, "running": None,
            "waiting": None,
            "engine_restarts": self.worker.restarts, "last_error": self.worker.last_error}
    if self.worker.state == "ok":
      with contextlib.suppress(asyncio.TimeoutError, EngineFailed):
        running, waiting = await asyncio.wait_for(asyncio.wrap_future(
            self.worker.call(lambda engine: engine.occupancy)), HEALTH_TIMEOUT_S)
        body.update(running=running, waiting=waiting)
    return self._json_response(body, status_code=200 if body["status"] == "ok" else 503)

  async def http_error(self, request, exc):
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    status = getattr(exc, "status_code", 500)
    detail = getattr(exc, "detail", None) or "error"
    message = (f"{request.method} {request.url.path}: {detail}" if status != 404 else
               f"no endpoint {request.url.path}; this server has /v1/completions, "
               "/v1/chat/completions, /v1/models and /health.")
    return self._json_response(error_body(message, status), status_code=status)

  async def server_error(self, request, exc):
    """Anything a handler did not expect: a JSON 500 naming it (the server goes on)."""
    return self._json_response(error_body(f"internal error: {type(exc).__name__}: {exc}", 500),
                               status_code=500)

  @contextlib.asynccontextmanager
  async def lifespan(self, app):
    yield
    self.worker.close()


def read_json(raw: bytes) -> Any:
  """A request body's JSON (a :class:`RequestError` for one that is not JSON, or is nested
  deeper than the parser goes)."""
  try:
    return json.loads(raw)
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, an int of 5000 digits
    raise RequestError(f"the request body is not JSON: {e}.") from e
  except RecursionError as e:
    raise RequestError("the request body is nested too deeply to read.") from e


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


def build_app(model, tokenizer, *, slots: int = 8, max_len: int = 2048, prefill_chunk: int = 64,
              prefill_lanes: int = 4, tokens_per_step: int = 4, model_name: str = "kvm_jax",
              chat_template: Optional[ChatTemplate] = None, warm: bool = False,
              on_fatal: Optional[Callable] = None, keep_finished: int = 64,
              log: Callable[[str], None] = print):
  """The starlette application serving ``model`` (its ``engine_worker`` in ``app.state``).

  ``warm``: compile the engine's programs on its thread before serving (``/health`` says
  "warming" meanwhile); ``on_fatal(error)``: called when the engine stops for good;
  ``keep_finished``: finished requests the engine keeps (responses drop theirs when delivered:
  this bounds only records nobody collected)."""
  from kvm_jax.generation.engine import Engine
  engine = Engine(model, slots=slots, max_len=max_len, prefill_chunk=prefill_chunk,
                  prefill_lanes=prefill_lanes, tokens_per_step=tokens_per_step,
                  keep_finished=keep_finished)
  settings = Settings(model.cfg.vocab_size, max_len, slots, model_name,
                      text_refusal=text_refusal(tokenizer, model.cfg.vocab_size))
  worker = EngineWorker(engine, warm=warm, on_fatal=on_fatal, log=log)
  return app_for(worker, tokenizer, settings, chat_template)


def app_for(worker: EngineWorker, tokenizer, settings: Settings,
            chat_template: Optional[ChatTemplate] = None):
  """The starlette application of the endpoints over ``worker``'s engine."""
  try:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
  except ImportError as e:
    raise ImportError(INSTALL_HINT) from e
  class AsciiJSONResponse(JSONResponse):
    """JSON as ASCII: a message that quotes a request's lone surrogate ("\\ud800") still
    encodes (starlette's own writes UTF-8, which cannot hold one)."""

    def render(self, content) -> bytes:
      return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")

  class ClosingStreamingResponse(StreamingResponse):
    """A stream that runs ``on_close`` however it ends: sent, failed, or its client gone before
    or while it was read (its generator is then not always run to its ``finally``)."""

    def __init__(self, content, *, on_close: Callable[[], Any], **kwargs):
      super().__init__(content, **kwargs)
      self.on_close = on_close

    async def __call__(self, scope, receive, send):
      try:
        await super().__call__(scope, receive, send)
      finally:
        self.on_close()

  server = _Server(worker, tokenizer, settings, json_response=AsciiJSONResponse,
                   streaming_response=ClosingStreamingResponse, chat_template=chat_template)
  app = Starlette(routes=[Route("/v1/completions", server.completions, methods=["POST"]),
                          Route("/v1/chat/completions", server.chat_completions,
                                methods=["POST"]),
                          Route("/v1/models", server.models, methods=["GET"]),
                          Route("/health", server.health, methods=["GET"])],
                  exception_handlers={HTTPException: server.http_error,
                                      Exception: server.server_error},
                  lifespan=server.lifespan)
  app.state.engine_worker = worker
  return app


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="kvm-serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", metavar="RUN_DIR",
                 help="a kvm_jax run directory (kvm-train, kvm-demo, kvm-import) or an authors' "
                      "checkpoint directory; its tokenizer reads text prompts (a run without "
                      "one reads text as UTF-8 bytes: the startup line says which)")
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
  p.add_argument("--no-warm-up", action="store_true",
                 help="serve at once and compile the step programs on the first requests "
                      "(default: compile them before /health says ok)")
  compilation_cache.add_flag(p)
  return p


def text_refusal(tokenizer, vocab_size: int) -> Optional[str]:
  """Why text prompts cannot be served (None when they can): a run without a tokenizer reads
  text as UTF-8 bytes, which a vocabulary of fewer than 256 ids cannot hold."""
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  if isinstance(tokenizer, ByteTokenizer) and vocab_size < 256:
    return (f"this run has no tokenizer and its {vocab_size}-token vocabulary cannot hold "
            "UTF-8 bytes: send the prompt as a list of token ids.")
  return None


def tokenizer_line(tokenizer, vocab_size: int, template: Optional[ChatTemplate]) -> str:
  """The startup line saying how text prompts are read (and whether chat is served)."""
  from kvm_jax.tasks.tokenizers import ByteTokenizer
  chat = (f"/v1/chat/completions uses the chat template of {template.where}" if template else
          "no chat template: /v1/chat/completions answers 400, use /v1/completions")
  if isinstance(tokenizer, ByteTokenizer):
    if text_refusal(tokenizer, vocab_size):
      return (f"no tokenizer: this model's {vocab_size}-token vocabulary cannot hold UTF-8 "
              "bytes, so send prompts as token ids (text prompts are refused); " + chat)
    return ("no tokenizer recorded: text prompts are read as UTF-8 bytes (ids 0-255, end of "
            f"text {tokenizer.eos_id}); send token ids if the model was trained on others; "
            + chat)
  return (f"tokenizer with {tokenizer.vocab_size} ids (end of text {tokenizer.eos_id}) reads "
          "text prompts; " + chat)


def main(argv: Optional[Sequence[str]] = None) -> None:
  parser = build_parser()
  args = parser.parse_args(argv)
  for name in ("slots", "prefill_chunk", "prefill_lanes", "tokens_per_step", "port"):
    if getattr(args, name) < 1:
      parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}.")
  if args.max_len is not None and args.max_len < 2:
    parser.error(f"--max-len must be >= 2, got {args.max_len}.")
  run = Path(args.run_dir)
  if not run.is_dir():
    parser.error(f"RUN_DIR {run} is not a directory.")
  try:
    import uvicorn
  except ImportError:
    raise SystemExit(INSTALL_HINT)
  cache = compilation_cache.enable(args.compilation_cache)

  import kvm_jax as kj
  from kvm_jax.hf.load import checkpoint_kind
  from kvm_jax.runs.directory import load_config
  model = kj.load_pretrained(run, args.dtype)
  tokenizer = kj.tokenizer_of(run)
  template = find_chat_template(template_folders(run))
  max_len = args.max_len
  if max_len is None:
    max_len = load_config(run).sequence_length if checkpoint_kind(run) == "run" else 2048
  name = args.name or run.name
  config = uvicorn.Config(None, host=args.host, port=args.port, log_level="info",
                          timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
  server = uvicorn.Server(config)
  failures = []

  def on_fatal(error):
    failures.append(error)
    server.should_exit = True

  config.app = build_app(model, tokenizer, slots=args.slots, max_len=max_len,
                         prefill_chunk=args.prefill_chunk, prefill_lanes=args.prefill_lanes,
                         tokens_per_step=args.tokens_per_step, model_name=name,
                         chat_template=template, warm=not args.no_warm_up, on_fatal=on_fatal,
                         log=lambda line: print(line, flush=True))
  print(f"kvm-serve: {name} on http://{args.host}:{args.port} ({args.slots} slots of {max_len} "
        f"tokens); {tokenizer_line(tokenizer, model.cfg.vocab_size, template)}; compilation "
        f"cache: {cache or 'off'}", flush=True)
  server.run()
  if failures:
    print(f"kvm-serve: exiting: the engine could not recover ({failures[0]!r}).", file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
  main()
