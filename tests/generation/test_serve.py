"""kvm-serve (kvm_jax/generation/serve.py): the OpenAI-compatible server, over real HTTP on localhost.

Oracle: ``kj.generate`` of each prompt alone with the seed's key, stopped at the tokenizer's EOS
(greedy prompts with their first token prefilled and the rest through the decode step, so that
one program serves every length; sampled ones prefilled whole, as ``generate`` draws no key
for a prompt it prefills). Every response of the running server, whatever else runs beside it, must
hold exactly those token ids and their text.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import subprocess
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.runs.launch import free_local_port
from kvm_jax.generation.serve import build_app, cut_at_stop, safe_prefix
from kvm_jax.tasks.tokenizers import ByteTokenizer
from tests.helpers import make_model, write_run

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

TOK = ByteTokenizer()
MAX_LEN, SLOTS = 256, 3


def alone(model, prompt, max_tokens, seed=0, temperature=0.0, top_p=None):
  """Token ids ``kj.generate`` gives ``prompt`` alone, up to and without EOS, and whether EOS
  ended it."""
  tokens, _ = kj.generate(model, jnp.asarray([prompt], jnp.int32), max_new_tokens=max_tokens,
                          key=jax.random.PRNGKey(seed),
                          sampling=kj.SamplingConfig(temperature=temperature, top_p=top_p),
                          stop_tokens=(TOK.eos_id,), pad_token=TOK.eos_id,
                          prefill_bucket=MAX_LEN + 1 if temperature == 0 else None,
                          max_len=MAX_LEN)
  new = np.asarray(tokens[0, len(prompt):]).tolist()
  if TOK.eos_id in new:
    return new[:new.index(TOK.eos_id)], True
  return new, False


def start_server(app):
  port = free_local_port()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 30
  while not server.started:
    assert time.time() < deadline, "the server did not start"
    time.sleep(0.05)
  return server, thread, f"http://127.0.0.1:{port}"


def wait_until_ready(client, timeout=120):
  """Polls /health until the server is warm (status ok); returns the statuses it saw."""
  seen, deadline = [], time.time() + timeout
  while True:
    response = client.get("/health")
    seen.append((response.status_code, response.json()["status"]))
    if seen[-1] == (200, "ok"):
      return seen
    assert time.time() < deadline, f"the server did not get warm: {seen[-3:]}"
    time.sleep(0.05)


@contextlib.contextmanager
def serving(model, tokenizer=TOK, **options):
  """A live server of ``model`` (warm), its worker and an HTTP client to it."""
  app = build_app(model, tokenizer, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=8,
                  model_name="tiny", log=lambda line: None, **options)
  server, thread, url = start_server(app)
  client = httpx.Client(base_url=url, timeout=120)
  try:
    wait_until_ready(client)
    yield types.SimpleNamespace(model=model, url=url, engine=app.state.engine_worker,
                                client=client)
  finally:
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def served():
  model = make_model(("swa", "kvm"), 3, vocab_size=TOK.vocab_size)
  with serving(model, warm=True) as served:
    yield served


def complete(client, **body):
  response = client.post("/v1/completions", json=body)
  assert response.status_code == 200, response.text
  return response.json()


def test_health_and_models(served):
  health = served.client.get("/health").json()
  assert health == {"status": "ok", "slots": SLOTS, "running": 0, "waiting": 0,
                    "engine_restarts": 0, "last_error": None}
  (listed,) = served.client.get("/v1/models").json()["data"]
  assert listed["id"] == "tiny" and listed["max_len"] == MAX_LEN


def test_concurrent_completions_equal_generate_alone(served):
  """Five requests at once through three slots: text and token-id prompts, greedy and sampled
  (seeded), different lengths; each response is its prompt's ``kj.generate`` alone."""
  rng = np.random.default_rng(0)
  asks = [dict(prompt="The capital of", max_tokens=9, temperature=0),
          dict(prompt=rng.integers(0, 256, 30).tolist(), max_tokens=12, temperature=0),
          dict(prompt=[5], max_tokens=20, temperature=0),
          dict(prompt="Sampled:", max_tokens=10, temperature=1.0, seed=11),
          dict(prompt=rng.integers(0, 256, 17).tolist(), max_tokens=8, temperature=0.8,
               top_p=0.9, seed=3),
          ]
  with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
    responses = list(pool.map(lambda body: complete(served.client, model="tiny", **body), asks))
  for body, response in zip(asks, responses):
    prompt = TOK.encode(body["prompt"]) if isinstance(body["prompt"], str) else body["prompt"]
    want, stopped = alone(served.model, prompt, body["max_tokens"], body.get("seed", 0),
                          body["temperature"], body.get("top_p"))
    (choice,) = response["choices"]
    assert choice["token_ids"] == want, body
    assert choice["text"] == TOK.decode(want)
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    assert response["usage"]["prompt_tokens"] == len(prompt)
    assert response["object"] == "text_completion" and response["model"] == "tiny"


def sse(client, path="/v1/completions", **body) -> list:
  """The events of a streamed completion (the JSON chunks, then "[DONE]")."""
  events = []
  with client.stream("POST", path, json={**body, "stream": True}) as response:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    for line in response.iter_lines():
      if line.startswith("data: "):
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
  return events


def test_streaming_sends_the_same_completion_token_by_token(served):
  body = dict(prompt="Stream this:", max_tokens=14, temperature=0)
  whole = complete(served.client, **body)["choices"][0]
  events = sse(served.client, **body)
  assert events[-1] == "[DONE]"
  chunks = [e["choices"][0] for e in events[:-1]]
  assert "".join(c["text"] for c in chunks) == whole["text"]
  assert sum((c["token_ids"] for c in chunks), []) == whole["token_ids"]
  assert len(chunks) >= 5  # sent as generated, not at the end
  assert [c["finish_reason"] for c in chunks][-1] == whole["finish_reason"]
  assert all(c["finish_reason"] is None for c in chunks[:-1])


def test_n_samples_equal_separate_requests_with_their_seeds(served):
  body = dict(prompt="Pick one:", max_tokens=8, temperature=1.0)
  together = complete(served.client, n=3, seed=40, **body)["choices"]
  assert [c["index"] for c in together] == [0, 1, 2]
  for i, choice in enumerate(together):
    single = complete(served.client, seed=40 + i, **body)["choices"][0]
    assert choice["token_ids"] == single["token_ids"], i
  assert len({tuple(c["token_ids"]) for c in together}) > 1


def test_stop_strings_cut_the_text_streamed_or_not(served):
  body = dict(prompt="Stop somewhere:", max_tokens=16, temperature=0)
  full = complete(served.client, **body)["choices"][0]["text"]
  stop = full[5:7]
  assert stop and full.index(stop) == 5
  cut = complete(served.client, stop=[stop, "never there"], **body)["choices"][0]
  assert cut["text"] == full[:5] and cut["finish_reason"] == "stop"
  events = sse(served.client, stop=stop, **body)
  assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full[:5]
  assert cut_at_stop("abcXYd", ["XY"]) == ("abc", True)
  assert safe_prefix("abcX", ["XY"]) == "abc" and safe_prefix("ab\ufffd", []) == "ab"


BAD_REQUESTS = [
    (dict(prompt="x" * 250, max_tokens=10), 400, "= 260 exceeds the server's max_len=256"),
    (dict(prompt="", max_tokens=4), 400, "the prompt is empty"),
    (dict(prompt=[], max_tokens=4), 400, "prompt must be a string"),
    (dict(prompt=[1, 999], max_tokens=4), 400, "token id 999 is outside the vocabulary"),
    (dict(prompt="hi", max_tokens=0), 400, "max_tokens must be an integer in [1, 255]"),
    (dict(prompt="hi", max_token=4), 400, 'unknown field(s) ["max_token"]'),
    (dict(prompt="hi", temperature=-1), 400, "temperature must be 0 (greedy) or a finite"),
    (dict(prompt="hi", top_p=1.5), 400, "top_p must be a number in (0, 1]"),
    (dict(prompt="hi", n=9), 400, "n must be an integer in [1, 3]"),
    (dict(prompt="hi", logprobs=5), 400, "logprobs=5 is not supported"),
    (dict(prompt="hi", stop=[""]), 400, "stop must be a non-empty string"),
    (dict(prompt="hi", model="gpt-4"), 404, 'model "gpt-4" is not served here'),
    (dict(max_tokens=3), 400, "prompt is required"),
]


def test_bad_requests_get_4xx_naming_the_value_and_disturb_nothing(served):
  """While a long request runs, every bad request is refused with its status and a message
  naming the bad value; the long request's completion is still its alone run."""
  long_body = dict(prompt="A long one:", max_tokens=40, temperature=0)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    running = pool.submit(complete, served.client, **long_body)
    time.sleep(0.2)
    for body, status, message in BAD_REQUESTS:
      response = served.client.post("/v1/completions", json=body)
      assert response.status_code == status, (body, response.text)
      assert message in response.json()["error"]["message"], (body, response.text)
    not_json = served.client.post("/v1/completions", content=b"{nope",
                                  headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not JSON" in not_json.text
    result = running.result()["choices"][0]
  want, _ = alone(served.model, TOK.encode(long_body["prompt"]), 40)
  assert result["token_ids"] == want


def test_a_client_that_disconnects_frees_its_slot(served):
  """A streamed request whose client goes away after a few tokens is cancelled (the server shows
  nothing running, the engine calls it cancelled), and the slot serves the next request
  exactly."""
  body = dict(prompt="Interrupted:", max_tokens=240, temperature=0, stream=True)
  ended = []  # the requests the engine ends (their records are dropped once delivered)

  def watch(engine):
    finish = type(engine)._finish
    engine._finish = lambda request, reason: (finish(engine, request, reason),
                                              ended.append(request))
  served.engine.call(watch).result()
  try:
    disconnect_and_wait(served, body)
  finally:
    served.engine.call(lambda engine: vars(engine).pop("_finish")).result()
  (last,) = ended
  assert last.prompt == tuple(TOK.encode("Interrupted:"))
  assert last.finish_reason == "cancelled" and len(last.tokens) < 240
  after = complete(served.client, prompt="Next:", max_tokens=6, temperature=0)["choices"][0]
  assert after["token_ids"] == alone(served.model, TOK.encode("Next:"), 6)[0]


def disconnect_and_wait(served, body):
  """Reads a few events of a streamed ``body``, leaves, and waits until nothing runs."""
  with served.client.stream("POST", "/v1/completions", json=body) as response:
    lines = response.iter_lines()
    seen = [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
    assert seen
  wait_until_idle(served)


def wait_until_idle(served):
  deadline = time.time() + 20
  while served.client.get("/health").json()["running"]:
    assert time.time() < deadline, "the disconnected request still holds its slot"
    time.sleep(0.05)


def test_a_client_that_leaves_a_request_not_streamed_frees_its_slot(served):
  """A client that stops waiting for a whole (non-streamed) response is noticed while tokens
  still arrive (steps slowed here so that generation outlasts the client's patience): its request
  is cancelled long before its max_tokens."""
  ended = []

  def slow_and_watched(engine):
    finish, step = type(engine)._finish, type(engine).step
    engine._finish = lambda request, reason: (finish(engine, request, reason),
                                              ended.append(request))
    engine.step = lambda: (time.sleep(0.05), step(engine))[1]
  served.engine.call(slow_and_watched).result()
  try:
    with pytest.raises(httpx.ReadTimeout):
      served.client.post("/v1/completions", timeout=1.0,
                         json=dict(prompt="Impatient:", max_tokens=200, temperature=0))
    wait_until_idle(served)
  finally:
    served.engine.call(lambda engine: (vars(engine).pop("_finish"),
                                       vars(engine).pop("step"))).result()
  (last,) = ended
  assert last.finish_reason == "cancelled" and len(last.tokens) < 200


def test_kvm_serve_serves_a_run_directory(tmp_path, subprocess_environ):
  """``kvm-serve RUN_DIR`` (a subprocess, as a user starts it) answers with the run's model."""
  from kvm_jax.runs.train_config import TrainConfig
  cfg = TrainConfig(model=kj.presets.tiny(mixers=("swa", "kvm"), vocab_size=TOK.vocab_size),
                    task="text", seq_len=48)
  model = make_model(("swa", "kvm"), 5, vocab_size=TOK.vocab_size)
  run = write_run(tmp_path / "tiny-run", cfg, model)
  port = free_local_port()
  log = open(tmp_path / "serve.log", "w+")  # a file, not a pipe: nobody reads while it runs
  server = subprocess.Popen([sys.executable, "-m", "kvm_jax.generation.serve", str(run), "--port", str(port),
                             "--slots", "2"], env=subprocess_environ(), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
  try:
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    deadline = time.time() + 120
    while True:
      try:
        health = client.get("/health").json()
        break
      except httpx.TransportError:
        assert server.poll() is None, (tmp_path / "serve.log").read_text()
        assert time.time() < deadline, "kvm-serve did not start"
        time.sleep(0.2)
    assert health["slots"] == 2
    wait_until_ready(client)
    assert client.get("/v1/models").json()["data"][0]["max_len"] == 48  # the run's seq_len
    got = complete(client, prompt="Hello", max_tokens=5, temperature=0, model="tiny-run")
    assert got["choices"][0]["token_ids"] == alone(model, TOK.encode("Hello"), 5)[0]
  finally:
    server.terminate()
    server.wait(timeout=30)
    log.close()
  output = (tmp_path / "serve.log").read_text()
  # It says how it reads text (this run has no tokenizer) and what it compiled before ready.
  assert "no tokenizer recorded: text prompts are read as UTF-8 bytes" in output, output
  assert "compiling the engine's step programs" in output and "kvm-serve: warm in" in output
  assert output.index("kvm-serve: warm in") < output.index("POST /v1/completions")


# ----------------------------------------------------------------------------------------------
# No request stops the server
# ----------------------------------------------------------------------------------------------

# Bodies as raw JSON text: Python's json reads NaN and Infinity, which a client may send.
HOSTILE = [
    ('{"prompt": "x", "max_tokens": 5, "seed": 1208925819614629174706176}', "seed", "seed"),
    ('{"prompt": "x", "max_tokens": 5, "seed": 4294967296}', "seed", "[0, 4294967295]"),
    ('{"prompt": "x", "max_tokens": 5, "seed": -1}', "seed", "[0, 4294967295]"),
    ('{"prompt": "x", "n": 2, "seed": 4294967295}', "seed", "seed + i"),
    ('{"prompt": "x", "temperature": NaN}', "temperature", "got NaN"),
    ('{"prompt": "x", "temperature": Infinity}', "temperature", "got Infinity"),
    ('{"prompt": "x", "temperature": 1e39}', "temperature", "finite number"),
    ('{"prompt": "x", "top_p": NaN}', "top_p", "got NaN"),
    ('{"prompt": "x", "top_p": 1e-300}', "top_p", "(0, 1]"),
    ('{"prompt": "x", "top_k": 1e3}', "top_k", "integer"),
    ('{"prompt": "x", "top_k": 2147483648}', "top_k", "[1, 2147483647]"),
    ('{"prompt": "x", "max_tokens": 1208925819614629174706176}', "max_tokens", "[1, 255]"),
    ('{"prompt": "x", "max_tokens": -3}', "max_tokens", "[1, 255]"),
    ('{"prompt": "x", "n": 1e100}', "n", "n must be an integer"),
    ('{"prompt": [1208925819614629174706176]}', "prompt", "outside the vocabulary"),
    ('{"prompt": [-1]}', "prompt", "outside the vocabulary"),
    ('{"prompt": [[[1]]]}', "prompt", "prompt must be a string"),
    ('{"prompt": [1.0, 2]}', "prompt", "prompt must be a string"),
    ('{"prompt": "\\ud800"}', "prompt", "cannot be encoded"),
    ('{"prompt": {"a": 1}}', "prompt", "prompt must be a string"),
    ('{"prompt": ' + json.dumps(["a"] * 65) + '}', "prompt", "at most 64 prompts"),
    ('{"prompt": "x", "stop": ' + json.dumps("s" * 2000) + '}', "stop", "at most 1024"),
    ('{"prompt": "x", "stop": [1]}', "stop", "stop must be"),
    ('{"prompt": "x", "stream": "yes"}', "stream", "true or false"),
    ('{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options",
     "only allowed with stream=true"),
    ('{"prompt": "x", "stream": true, "stream_options": {"x": 1}}', "stream_options",
     "include_usage"),
    ('{"prompt": "x", "user": 5}', "user", "user must be a string"),
    ('{"prompt": "x", "echo": 0}', "echo", "not supported"),
    ('{"prompt": "x", "model": ["tiny"]}', "model", "model must be a string"),
    ('{"prompt": "x", ' + json.dumps("k" * 5000) + ': 1}', "k" * 80, "unknown field"),
    ("[" * 100_000 + "]" * 100_000, None, "nested too deeply"),
    ('{"prompt": "x", "max_tokens": ' + "9" * 5000 + '}', None, "not JSON"),
    ('"just a string"', None, "must be a JSON object"),
    ('{"prompt": "x", "\\ud800": 1}', "\ud800", "unknown field"),  # the reply must still encode
    ('{"prompt": "x", "temperature": 1e-9}', "temperature", "[1e-06, "),
]


def post_raw(client, body: str, path="/v1/completions"):
  return client.post(path, content=body.encode("utf-8", "surrogatepass"),
                     headers={"content-type": "application/json"})


def assert_openai_error(response, status, param=None, message=""):
  """A JSON error in OpenAI's shape with ``status`` (and the field and words expected)."""
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert set(error) == {"message", "type", "param", "code"}, error
  assert isinstance(error["message"], str) and message in error["message"], error
  assert error["param"] == param, error
  return error


def test_hostile_requests_get_json_4xx_and_the_server_goes_on(served):
  """Values past every range the engine takes (the 2**80 seed that once killed the engine's
  thread, NaN temperatures, ids past int64, lone surrogates, deep nesting, huge numbers...) are
  refused with a JSON 400 naming the field; the server still serves exactly after them."""
  before = complete(served.client, prompt="Still here?", max_tokens=6, temperature=0)
  for body, param, message in HOSTILE:
    assert_openai_error(post_raw(served.client, body), 400, param, message)
  # Nested about as deep as the JSON parser goes: refused by the parser or by the field's check
  # (whose message must still show the value), never a 500.
  for depth in range(880, 1000, 8):
    nested = '{"prompt": "x", "logit_bias": ' + "[" * depth + "]" * depth + '}'
    response = post_raw(served.client, nested)
    assert response.status_code == 400, (depth, response.text)
    assert response.json()["error"]["param"] in ("logit_bias", None), depth
  health = served.client.get("/health").json()
  assert health["status"] == "ok" and health["engine_restarts"] == 0
  after = complete(served.client, prompt="Still here?", max_tokens=6, temperature=0)
  assert after["choices"] == before["choices"]
  # The largest top_k keeps every token, as top_k >= the vocabulary does: the same draw.
  huge_k = complete(served.client, prompt="k", max_tokens=5, temperature=1.0, seed=3,
                    top_k=2**31 - 1)["choices"][0]["token_ids"]
  assert huge_k == complete(served.client, prompt="k", max_tokens=5, temperature=1.0, seed=3,
                            top_k=TOK.vocab_size)["choices"][0]["token_ids"]


def test_a_body_too_large_is_refused_before_it_is_read(served, monkeypatch):
  monkeypatch.setattr("kvm_jax.generation.serve.MAX_BODY_BYTES", 1000)
  response = post_raw(served.client, json.dumps({"prompt": "x" * 2000}))
  assert_openai_error(response, 413, None, "larger than 1000 bytes")


def test_every_error_is_json_in_openai_shape(served):
  """Starlette's own answers (no such path, a wrong method) come in OpenAI's shape too."""
  assert_openai_error(served.client.post("/v1/nothing", json={}), 404, None, "no endpoint")
  assert_openai_error(served.client.get("/v1/completions"), 405, None, "Method Not Allowed")
  assert_openai_error(served.client.post("/v1/chat/completions", json={
      "messages": [{"role": "user", "content": "hi"}]}), 400, "messages", "/v1/completions")


def random_value(rng: np.random.Generator, depth: int = 0):
  """A JSON value of a random type and magnitude: what a careless or hostile client sends."""
  kind = rng.integers(0, 12 if depth < 3 else 9)
  if kind == 0:
    return None
  if kind == 1:
    return bool(rng.integers(0, 2))
  if kind == 2:
    return int(rng.integers(-5, 40))
  if kind == 3:
    return int(rng.choice([-2**80, -2**63, -1, 0, 2**31, 2**32, 2**63, 2**80, 10**30]))
  if kind == 4:
    return float(rng.choice([0.0, -0.0, 0.5, 1.0, 1e-300, 1e308, -1e308, np.nan, np.inf,
                             -np.inf, 2.5]))
  if kind == 5:
    return "".join(rng.choice(list("ab \n\u00e9\u4e2d\U0001f600"), int(rng.integers(0, 12))))
  if kind == 6:
    return "x" * int(rng.choice([300, 5000]))
  if kind == 7:
    return [int(rng.integers(0, TOK.vocab_size)) for _ in range(int(rng.integers(1, 6)))]
  if kind == 8:
    return [int(rng.integers(-2**40, 2**40))]
  if kind in (9, 10):
    return [random_value(rng, depth + 1) for _ in range(int(rng.integers(0, 4)))]
  return {str(random_value(rng, 3)): random_value(rng, depth + 1)
          for _ in range(int(rng.integers(0, 3)))}


FUZZED_FIELDS = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                 "stream", "stream_options", "echo", "logprobs", "user", "model", "best_of"]


def fuzz_body(rng: np.random.Generator) -> str:
  """A request: a valid small one with a few fields replaced by random values (or left out),
  sometimes an unknown field, sometimes not an object at all."""
  body = {"prompt": "fuzz", "max_tokens": int(rng.integers(1, 4)), "temperature": 0.0}
  for name in rng.choice(FUZZED_FIELDS, int(rng.integers(0, 4)), replace=False):
    if rng.random() < 0.2:
      body.pop(name, None)
    else:
      body[name] = random_value(rng)
  if rng.random() < 0.05:
    body["surprise"] = random_value(rng)
  if rng.random() < 0.03:
    return json.dumps(random_value(rng))
  return json.dumps(body)  # NaN and Infinity go out as such


def test_fuzzed_requests_never_stop_the_server_nor_change_its_answers(served):
  """Three hundred random and hostile requests (random JSON types and magnitudes for every
  field, NaN and Infinity, huge and negative numbers, nesting, long strings, unknown fields),
  sent 8 at a time, with streams whose clients leave after their first event: every answer is
  200 or a JSON 4xx, never a 500; afterwards the server answers a normal request with the tokens
  it gave before, has restarted nothing, and holds no record of any of them."""
  probe = dict(prompt="The same tokens", max_tokens=8, temperature=0.7, seed=5)
  before = complete(served.client, **probe)["choices"]
  rng = np.random.default_rng(0)
  bodies = [fuzz_body(rng) for _ in range(300)]

  def send(i):
    body = bodies[i]
    if i % 25 == 0:  # a stream whose client leaves at once: a concurrent cancel
      with served.client.stream("POST", "/v1/completions", content=body.encode(),
                                headers={"content-type": "application/json"}) as response:
        next(response.iter_lines(), None)
        return response.status_code, None
    response = post_raw(served.client, body)
    return response.status_code, response.json()

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    answers = list(pool.map(send, range(len(bodies))))
  statuses = collections.Counter(status for status, _ in answers)
  assert set(statuses) <= {200, 400, 404}, statuses
  assert statuses[200] >= 30 and statuses[400] >= 100, statuses  # both sides were exercised
  for (status, answer), body in zip(answers, bodies):
    if status != 200 and answer is not None:
      assert isinstance(answer["error"]["message"], str), body
  health = served.client.get("/health").json()
  assert health["status"] == "ok" and health["engine_restarts"] == 0, health
  assert complete(served.client, **probe)["choices"] == before
  deadline = time.time() + 20  # the streams' cancels land on the engine's thread
  while served.engine.call(lambda engine: engine.requests()).result():
    assert time.time() < deadline, "finished requests are still kept"
    time.sleep(0.05)
  assert served.engine._listeners == {}


def test_the_engine_keeps_no_record_of_delivered_requests(served):
  """Memory stays bounded: after sixty requests (plain, n samples, streamed, stopped by a stop
  string) the engine holds no request and the worker no listener."""
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(lambda i: complete(served.client, prompt=f"r{i}", max_tokens=2, temperature=0,
                                     n=1 + i % 2), range(40)))
  for i in range(10):
    sse(served.client, prompt=f"s{i}", max_tokens=2, temperature=0)
    complete(served.client, prompt=f"t{i}", max_tokens=4, temperature=0, stop=["\x00", "e"])
  assert served.engine.call(lambda engine: engine.requests()).result() == []
  assert served.engine._listeners == {}


def fail_next_step(worker, times: int = 1):
  """Makes the engine's next ``times`` steps raise (then steps as before)."""
  def install(engine):
    left = [times]
    real = type(engine).step

    def failing(self=engine):
      if left[0]:
        left[0] -= 1
        raise RuntimeError("planted fault in the step")
      return real(self)
    engine.step = failing
  worker.call(install).result()


def step_as_before(worker):
  worker.call(lambda engine: vars(engine).pop("step", None)).result()


@contextlib.contextmanager
def engine_held(worker, queued: int):
  """Holds the engine's thread until ``queued`` calls wait for it (requests submitted inside
  the block), so that they all enter the engine's next step together."""
  release = threading.Event()
  worker.call(lambda engine: release.wait(60))
  try:
    yield
    deadline = time.time() + 30
    while worker._inbox.qsize() < queued:
      assert time.time() < deadline, "the requests did not reach the engine's queue"
      time.sleep(0.01)
  finally:
    release.set()


def test_a_failing_step_fails_its_requests_with_json_500_and_the_server_recovers(served):
  """The step raises with two requests in it (one streamed): both end with a JSON error naming
  the failure, /health counts the restart, and the next requests are served exactly."""
  body = dict(prompt="Doomed", max_tokens=30, temperature=0)
  want = complete(served.client, **body)["choices"]
  fail_next_step(served.engine)
  try:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      with engine_held(served.engine, queued=2):
        plain = pool.submit(served.client.post, "/v1/completions", json=body)
        streamed = pool.submit(sse, served.client, **body)
      error = assert_openai_error(plain.result(), 500, None, "planted fault in the step")
      events = streamed.result()
  finally:
    step_as_before(served.engine)
  assert error["type"] == "server_error"
  assert "planted fault" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
  health = served.client.get("/health").json()
  assert health["status"] == "ok" and health["engine_restarts"] == 1
  assert "planted fault" in health["last_error"]
  assert complete(served.client, **body)["choices"] == want
  assert served.engine.call(lambda engine: engine.requests()).result() == []


def test_requests_that_fail_the_step_again_and_again_do_not_end_the_server(served):
  """Three requests in a row whose steps raise (no good step between them, as a request that
  slipped past the checks would do): each gets its 500, the engine's own check of its empty
  slots passes each time, and the server goes on serving."""
  restarts = served.client.get("/health").json()["engine_restarts"]
  try:
    for _ in range(3):
      fail_next_step(served.engine)
      response = served.client.post("/v1/completions", json=dict(prompt="Again", max_tokens=3))
      assert_openai_error(response, 500, None, "planted fault in the step")
  finally:
    step_as_before(served.engine)
  health = served.client.get("/health").json()
  assert health["status"] == "ok" and health["engine_restarts"] == restarts + 3
  assert complete(served.client, prompt="Again", max_tokens=3, temperature=0)["choices"]


def test_an_engine_that_cannot_recover_ends_the_server(tmp_path):
  """Steps that fail every time, the engine's own checks of its empty slots too: after three
  restarts in a row the worker stops for good, calls ``on_fatal`` (kvm-serve's exits
  non-zero), answers every request 503 and /health 503."""
  model = make_model(("swa", "kvm"), 3, vocab_size=TOK.vocab_size)
  fatal = []
  with serving(model, on_fatal=fatal.append) as broken:
    fail_next_step(broken.engine, times=10)
    response = broken.client.post("/v1/completions", json=dict(prompt="x", max_tokens=2))
    assert_openai_error(response, 500, None, "planted fault")
    deadline = time.time() + 20
    while not fatal:  # the first failure recovered; the request above ended the third
      assert time.time() < deadline, "the worker did not give up"
      broken.client.post("/v1/completions", json=dict(prompt="x", max_tokens=2))
      time.sleep(0.05)
    assert isinstance(fatal[0], RuntimeError)
    health = broken.client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert_openai_error(broken.client.post("/v1/completions", json=dict(prompt="x")), 503,
                        None, "the engine stopped")


# ----------------------------------------------------------------------------------------------
# OpenAI's conventions: usage, a finished choice, chat, the openai client
# ----------------------------------------------------------------------------------------------


def test_usage_counts_the_prompt_once_and_every_samples_tokens(served):
  """OpenAI's usage: n samples of one prompt count its tokens once; the completion tokens of
  every sample add up; a streamed response with ``include_usage`` ends with the same usage in a
  chunk of its own (no choices) before [DONE], and only then."""
  body = dict(prompt="Count me:", max_tokens=5, temperature=1.0, seed=9, n=3)
  whole = complete(served.client, **body)
  prompt = len(TOK.encode(body["prompt"]))
  generated = sum(len(c["token_ids"]) for c in whole["choices"])
  assert whole["usage"] == {"prompt_tokens": prompt, "completion_tokens": generated,
                            "total_tokens": prompt + generated}
  two = complete(served.client, prompt=["ab", [1, 2, 3]], max_tokens=2, temperature=0, n=2)
  assert two["usage"]["prompt_tokens"] == 2 + 3 and len(two["choices"]) == 4
  events = sse(served.client, stream_options={"include_usage": True}, **body)
  assert events[-1] == "[DONE]" and events[-2]["choices"] == []
  assert events[-2]["usage"] == whole["usage"]
  assert all(e["usage"] is None for e in events[:-2])
  assert all("usage" not in e for e in sse(served.client, **body)[:-1])


class StopAt(ByteTokenizer):
  """Bytes, with the end of text at a token the tiny model generates (so a choice ends there)."""

  def __init__(self, eos_id: int):
    self.eos_id = eos_id


def test_a_choice_that_ends_on_the_stop_token(served):
  """Generation that draws the end-of-text token: the choice's token ids are those before it
  (the stop token is neither in them nor in the text), its finish reason is "stop", and usage
  counts exactly its token ids; streamed, the same ids and text arrive, the last chunk carries
  "stop" and no id. Oracle: ``kj.generate`` alone without a stop token."""
  prompt = TOK.encode("End here:")
  free, _ = alone(served.model, prompt, 12)
  cut = next(i for i in range(2, len(free)) if free[i] not in free[:i])
  with serving(served.model, StopAt(free[cut])) as stopping:
    response = complete(stopping.client, prompt=prompt, max_tokens=12, temperature=0, n=2)
    events = sse(stopping.client, prompt=prompt, max_tokens=12, temperature=0)
  for choice in response["choices"]:
    assert choice["token_ids"] == free[:cut] and choice["finish_reason"] == "stop"
    assert choice["text"] == TOK.decode(free[:cut])
  assert response["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 2 * cut,
                               "total_tokens": len(prompt) + 2 * cut}
  chunks = [e["choices"][0] for e in events[:-1]]
  assert sum((c["token_ids"] for c in chunks), []) == free[:cut]
  assert "".join(c["text"] for c in chunks) == TOK.decode(free[:cut])
  assert chunks[-1]["finish_reason"] == "stop" and chunks[-1]["token_ids"] == []
  assert [c["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
  # Ended by length instead: every drawn token counts.
  length = complete(served.client, prompt=prompt, max_tokens=cut, temperature=0)
  assert length["choices"][0]["finish_reason"] == "length"
  assert length["usage"]["completion_tokens"] == cut


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_completions_render_the_runs_template(served):
  """/v1/chat/completions: the messages rendered by the chat template (text parts joined) and
  continued exactly as /v1/completions continues that text; the response in chat's shape,
  streamed chunks as deltas whose first names the role. Without a template: a JSON 400."""
  from kvm_jax.generation.serve import ChatTemplate
  messages = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                           {"type": "text", "text": "there"}]}]
  rendered = "<system>Be brief.\n<user>Hi there\n<assistant>"
  want, _ = alone(served.model, TOK.encode(rendered), 7)
  with serving(served.model, chat_template=ChatTemplate(CHAT_TEMPLATE, "test")) as chat:
    response = chat.client.post("/v1/chat/completions", json=dict(
        messages=messages, max_tokens=7, temperature=0, model="tiny"))
    assert response.status_code == 200, response.text
    body = response.json()
    events = sse(chat.client, messages=messages, max_completion_tokens=7, temperature=0,
                 path="/v1/chat/completions")
    bad = chat.client.post("/v1/chat/completions", json=dict(messages=[{"role": "wizard",
                                                                        "content": "x"}]))
  (choice,) = body["choices"]
  assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
  assert choice["message"] == {"role": "assistant", "content": TOK.decode(want)}
  assert choice["token_ids"] == want
  assert body["usage"]["prompt_tokens"] == len(TOK.encode(rendered))
  deltas = [e["choices"][0]["delta"] for e in events[:-1]]
  assert deltas[0]["role"] == "assistant" and all("role" not in d for d in deltas[1:])
  assert "".join(d.get("content", "") for d in deltas) == TOK.decode(want)
  assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
  assert_openai_error(bad, 400, "messages", "messages[0].role must be one of")


def test_chat_templates_are_found_where_runs_keep_them(tmp_path):
  """A run's ``chat_template.jinja`` wins over its tokenizer's ``tokenizer_config.json``, whose
  ``chat_template`` (a string, or transformers' list of named templates) is read with its
  special tokens; a folder without either has none."""
  from kvm_jax.generation.serve import find_chat_template
  run, tok = tmp_path / "run", tmp_path / "tok"
  run.mkdir(), tok.mkdir()
  assert find_chat_template([run, tok]) is None
  (tok / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": [{"name": "tool_use", "template": "T"},
                        {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
      "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
  found = find_chat_template([run, tok])
  assert found.render([{"role": "user", "content": "hey"}]) == "<s>hey"
  assert found.eos_token == "</s>" and "tokenizer_config.json" in found.where
  (run / "chat_template.jinja").write_text("J{{ messages|length }}")
  assert find_chat_template([run, tok]).render([{"role": "user", "content": "x"}]) == "J1"
  (run / "chat_template.jinja").write_text("{% for m in messages %}")  # never closed
  with pytest.raises(ValueError, match="chat_template.jinja does not compile"):
    find_chat_template([run, tok])


def test_the_openai_client_talks_to_the_server(served):
  """The ``openai`` package, as users will point it here: completions equal ``kj.generate``
  alone, a stream with usage, and errors raised as its typed exceptions with our messages."""
  openai = pytest.importorskip("openai")
  client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
  got = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
  want, _ = alone(served.model, TOK.encode("Hello"), 6)
  assert got.choices[0].text == TOK.decode(want)
  assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == len(want)
  chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=6,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  assert "".join(c.choices[0].text for c in chunks if c.choices) == TOK.decode(want)
  assert chunks[-1].usage.completion_tokens == len(want)
  with pytest.raises(openai.BadRequestError, match="temperature must be 0"):
    client.completions.create(model="tiny", prompt="x", temperature=-1)
  with pytest.raises(openai.NotFoundError, match="is not served here") as wrong_model:
    client.completions.create(model="gpt-4", prompt="x")
  assert wrong_model.value.code == "model_not_found"
  with pytest.raises(openai.BadRequestError, match="no chat template.*to /v1/completions"):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])


class _SlowToWarm:
  """An engine stand-in whose warm-up waits for the test: what /health shows meanwhile."""

  busy, occupancy = False, (0, 0)

  def __init__(self):
    self.release = threading.Event()

  def lane_widths(self):
    return (0,)

  def warm_up(self, report):
    assert self.release.wait(30)
    return 0.0


def test_health_says_warming_until_the_programs_are_compiled():
  """While the engine compiles, /health answers 503 "warming" (and requests wait, not fail);
  once it is done, 200 "ok"."""
  from kvm_jax.generation.serve import EngineWorker, Settings, app_for
  engine = _SlowToWarm()
  worker = EngineWorker(engine, warm=True, log=lambda line: None)
  server, thread, url = start_server(app_for(worker, TOK, Settings(320, 64, 2, "tiny")))
  try:
    client = httpx.Client(base_url=url, timeout=30)
    warming = client.get("/health")
    assert warming.status_code == 503 and warming.json()["status"] == "warming"
    engine.release.set()
    assert wait_until_ready(client)[-1] == (200, "ok")
  finally:
    server.should_exit = True
    thread.join(timeout=30)


def test_kvm_serve_exits_non_zero_when_its_engine_cannot_recover(tmp_path, monkeypatch, capsys):
  """kvm-serve whose every step raises (here from the warm-up on) stops serving and exits 1
  with the error, instead of listening with a dead engine."""
  from kvm_jax.generation.engine import Engine
  from kvm_jax.runs.train_config import TrainConfig
  from kvm_jax.generation.serve import main
  cfg = TrainConfig(model=kj.presets.tiny(mixers=("swa", "kvm"), vocab_size=TOK.vocab_size),
                    task="text", seq_len=48)
  run = write_run(tmp_path / "broken", cfg, make_model(("swa", "kvm"), 5,
                                                       vocab_size=TOK.vocab_size))

  def broken_step(self):
    raise RuntimeError("planted fault in every step")
  monkeypatch.setattr(Engine, "step", broken_step)
  with pytest.raises(SystemExit) as exited:
    main([str(run), "--port", str(free_local_port()), "--compilation-cache", "off"])
  assert exited.value.code == 1
  assert "planted fault in every step" in capsys.readouterr().err


def test_null_means_the_default_as_openai_clients_send_it(served):
  """Clients send optional fields as null and earlier assistant turns back as they got them:
  null ``n``, ``seed``, ``temperature``, ``max_tokens`` are their defaults (16 tokens for a
  completion), and an assistant message's null ``tool_calls``/``refusal`` are no fields at all."""
  defaults = complete(served.client, prompt="Nulls", n=None, seed=None, temperature=0,
                      max_tokens=None, top_p=None, top_k=None, stop=None, stream=None)
  assert len(defaults["choices"]) == 1 and len(defaults["choices"][0]["token_ids"]) <= 16
  assert defaults["choices"] == complete(served.client, prompt="Nulls", temperature=0)["choices"]
  from kvm_jax.generation.serve import ChatTemplate
  with serving(served.model, chat_template=ChatTemplate(CHAT_TEMPLATE, "test")) as chat:
    response = chat.client.post("/v1/chat/completions", json=dict(
        messages=[{"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b", "tool_calls": None, "refusal": None},
                  {"role": "user", "content": "c"}],
        max_completion_tokens=None, max_tokens=3, temperature=0))
    tools = chat.client.post("/v1/chat/completions", json=dict(
        messages=[{"role": "assistant", "content": "b", "tool_calls": [{"id": "1"}]}]))
  assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) <= 3
  assert_openai_error(tools, 400, "messages", "tool calls are not supported")


def test_messages_show_any_value_however_nested():
  """An error message quotes the bad value, cut short, even one nested past what ``json`` and
  ``repr`` can walk (such a value gets a 400 like any other, not a 500 from the message)."""
  from kvm_jax.generation.serve import shown_value
  deep = []
  for _ in range(20_000):
    deep = [deep]
  assert shown_value(deep) == "a list nested too deeply to show"
  assert shown_value("x" * 500).endswith('xxx...') and len(shown_value("x" * 500)) == 83
  assert shown_value(float("nan")) == "NaN" and shown_value(2**80) == str(2**80)
