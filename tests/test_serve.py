"""kvm-serve (kvm_jax/serve.py): the OpenAI-compatible server, over real HTTP on localhost.

Oracle: ``kj.generate`` of each prompt alone with the seed's key, stopped at the tokenizer's EOS
(greedy prompts with their first token prefilled and the rest through the decode step, so that
one program serves every length; sampled ones prefilled whole, as ``generate`` draws no key
for a prompt it prefills). Every response of the running server, whatever else runs beside it, must
hold exactly those token ids and their text.
"""

from __future__ import annotations

import concurrent.futures
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
from kvm_jax.serve import build_app, cut_at_stop, safe_prefix
from kvm_jax.tasks.tokenizers import ByteTokenizer
from tests.conftest import make_model, write_run

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


@pytest.fixture(scope="module")
def served():
  model = make_model(("swa", "kvm"), 3, vocab_size=TOK.vocab_size)
  app = build_app(model, TOK, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=8, model_name="tiny")
  server, thread, url = start_server(app)
  yield types.SimpleNamespace(model=model, url=url, engine=app.state.engine_worker,
                              client=httpx.Client(base_url=url, timeout=120))
  server.should_exit = True
  thread.join(timeout=30)


def complete(client, **body):
  response = client.post("/v1/completions", json=body)
  assert response.status_code == 200, response.text
  return response.json()


def test_health_and_models(served):
  health = served.client.get("/health").json()
  assert health == {"status": "ok", "slots": SLOTS, "running": 0, "waiting": 0}
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


def sse(client, **body) -> list:
  """The events of a streamed completion (the JSON chunks, then "[DONE]")."""
  events = []
  with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
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
    (dict(prompt="hi", max_tokens=0), 400, "max_tokens must be an integer >= 1, got 0"),
    (dict(prompt="hi", max_token=4), 400, "unknown field(s) ['max_token']"),
    (dict(prompt="hi", temperature=-1), 400, "temperature must be a number >= 0, got -1"),
    (dict(prompt="hi", top_p=1.5), 400, "top_p must be a number in (0, 1], got 1.5"),
    (dict(prompt="hi", n=9), 400, "n must be an integer in [1, 3]"),
    (dict(prompt="hi", logprobs=5), 400, "logprobs=5 is not supported"),
    (dict(prompt="hi", stop=[""]), 400, "stop must be a non-empty string"),
    (dict(prompt="hi", model="gpt-4"), 404, "model 'gpt-4' is not served here"),
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
  with served.client.stream("POST", "/v1/completions", json=body) as response:
    lines = response.iter_lines()
    seen = [line for line, _ in zip(lines, range(4)) if line.startswith("data: ")]
    assert seen
  deadline = time.time() + 20
  while served.client.get("/health").json()["running"]:
    assert time.time() < deadline, "the disconnected request still holds its slot"
    time.sleep(0.05)
  last = served.engine.call(lambda engine: engine.requests()[-1]).result()
  assert last.prompt == tuple(TOK.encode("Interrupted:"))
  assert last.finish_reason == "cancelled" and len(last.tokens) < 240
  after = complete(served.client, prompt="Next:", max_tokens=6, temperature=0)["choices"][0]
  assert after["token_ids"] == alone(served.model, TOK.encode("Next:"), 6)[0]


def test_kvm_serve_serves_a_run_directory(tmp_path, subprocess_environ):
  """``kvm-serve RUN_DIR`` (a subprocess, as a user starts it) answers with the run's model."""
  from kvm_jax.runs.train_config import TrainConfig
  cfg = TrainConfig(model=kj.presets.tiny(mixers=("swa", "kvm"), vocab_size=TOK.vocab_size),
                    task="text", seq_len=48)
  model = make_model(("swa", "kvm"), 5, vocab_size=TOK.vocab_size)
  run = write_run(tmp_path / "tiny-run", cfg, model)
  port = free_local_port()
  server = subprocess.Popen([sys.executable, "-m", "kvm_jax.serve", str(run), "--port", str(port),
                             "--slots", "2"], env=subprocess_environ(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    deadline = time.time() + 120
    while True:
      try:
        health = client.get("/health").json()
        break
      except httpx.TransportError:
        assert server.poll() is None, server.stdout.read()
        assert time.time() < deadline, "kvm-serve did not start"
        time.sleep(0.2)
    assert health["slots"] == 2
    assert client.get("/v1/models").json()["data"][0]["max_len"] == 48  # the run's seq_len
    got = complete(client, prompt="Hello", max_tokens=5, temperature=0, model="tiny-run")
    assert got["choices"][0]["token_ids"] == alone(model, TOK.encode("Hello"), 5)[0]
  finally:
    server.terminate()
    server.wait(timeout=30)
