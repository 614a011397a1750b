"""Training: sharded == single-device, kill-and-resume exactness, data pipelines, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.nn.registry import memory_in_words
from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.tasks import mqar, text
from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.tasks.tokenizers import ByteTokenizer
from kvm_jax.train import sharding
from kvm_jax.train import demo as default_job
from kvm_jax.train.loop import train
from kvm_jax.train.main import apply_override, load_config, main
from tests.helpers import in_ci
from tests.helpers.reports import check_demo_report

from tests.helpers import ROOT  # noqa: E402
TINY = ["--config=train/configs/tiny_mqar.py", "--config.steps=50", "--config.batch_size=8",
        "--config.mqar.seq_len=64", "--config.mqar.num_pairs=4", "--config.log_every=1",
        "--config.checkpoint_every=10", "--config.eval_every=0", "--config.warmup_steps=5"]
STEPS = 50


def _lines(workdir: Path) -> dict[int, str]:
  """The raw ``metrics.jsonl`` line of every logged step (each step exactly once)."""
  lines = [l for l in (workdir / "metrics.jsonl").read_text().splitlines() if l.strip()]
  steps = [json.loads(l)["step"] for l in lines]
  assert len(set(steps)) == len(steps), f"a step was logged twice: {steps}"
  return dict(zip(steps, lines))


def _losses(workdir: Path) -> dict[int, float]:
  return {s: json.loads(l)["loss"] for s, l in _lines(workdir).items()}


def _checkpoints(workdir: Path) -> list[int]:
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


# The trainer's step as a function of the mesh and the micro-batching. Learning rate 1e-2 after a
# one-step warm-up and 6 steps: the parameters move by ~1e-2 per step, far more than the
# reduction-order noise between meshes; `grad_norm` is compared at every step because Adam is
# invariant to the scale of the gradient (a psum where a mean belongs, or micro-batch gradients
# summed without the whole-batch normalization, would leave the parameters almost unchanged).
SHARDED_STEPS = """
import jax, jax.numpy as jnp, numpy as np, dataclasses, optax
from flax import nnx
from kvm_jax.tasks.mqar import MQARSpec
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.train import loop, sharding
from kvm_jax.train.main import load_config
cfg = load_config("train/configs/tiny_mqar.py")
cfg = dataclasses.replace(cfg, batch_size=8, mqar=MQARSpec(seq_len=64, vocab_size=128,
                          num_pairs=4), learning_rate=1e-2, warmup_steps=1, steps=50)
it = batched_iterator(loop.task_dataset(cfg, "train"), cfg.batch_size)
batches = [next(it) for _ in range(N_STEPS)]
# The first step's gradient norm computed without the trainer: the model's own forward and an
# optax cross-entropy over the labelled tokens, differentiated on one device.
from kvm_jax.nn.model import LM
model = LM(cfg.model, rngs=nnx.Rngs(cfg.seed))
graphdef, params0 = nnx.split(model)
def plain_loss(p, b):
  logits = nnx.merge(graphdef, p)(jnp.asarray(b["inputs"]))
  labels = jnp.asarray(b["labels"]); valid = labels >= 0
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.sum(valid)
g = jax.grad(plain_loss)(params0, batches[0])
plain_norm = float(jnp.sqrt(sum(jnp.sum(x.astype(jnp.float32) ** 2)
                               for x in jax.tree_util.tree_leaves(g))))
runs = []
for mesh, accum in ((sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 1),
                    (sharding.make_mesh(2, 2, 2), ACCUM)):
  run = dataclasses.replace(cfg, grad_accum_steps=accum)
  graphdef, params, opt, optimizer, sh = loop.setup(run, mesh)
  start = jax.tree_util.tree_map(np.asarray, params)
  step = loop.make_train_step(graphdef, optimizer, sh, run)
  halted = jax.numpy.zeros((), bool)
  losses, norms = [], []
  for b in batches:
    params, opt, stats = step(params, opt, loop.put_batch(b, sh[2]), halted)
    losses.append(float(stats["loss"])); norms.append(float(stats["grad_norm"]))
  runs.append((losses, norms, jax.tree_util.tree_map(np.asarray, params)))
assert len(jax.devices()) == 8
leaves = lambda t: jax.tree_util.tree_leaves(t)
moved = max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(runs[0][2]), leaves(start)))
diffs = [max(float(np.max(np.abs(a - b))) for a, b in zip(leaves(runs[0][2]), leaves(r[2])))
         for r in runs[1:]]
print("RESULT", json.dumps({"losses": [r[0] for r in runs], "norms": [r[1] for r in runs],
                            "plain_norm": plain_norm, "moved": moved, "diffs": diffs}))
"""


@pytest.mark.parametrize("accum", in_ci([2, 1], {"2"}))
def test_sharded_train_step_matches_single_device(subprocess_environ, accum):
  """1 device == an 8-device (data 2, fsdp 2, tensor 2) mesh running the batch as ``accum``
  micro-batches: losses, gradient norms and parameters after 6 steps. (CI runs the mesh with
  accumulation, which is sharded too; the plain mesh nightly.)"""
  script = f"import json\nN_STEPS = 6\nACCUM = {accum}\n" + SHARDED_STEPS
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=subprocess_environ(8),
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  r = json.loads(next(l for l in out.stdout.splitlines() if l.startswith("RESULT"))[7:])
  (l1, l8), (n1, n8) = r["losses"], r["norms"]
  # The trainer's gradient is the gradient of the mean loss over labelled tokens, computed here
  # independently (float32: the same sums in another order).
  assert n1[0] == pytest.approx(r["plain_norm"], rel=1e-5)
  # float32; the sharded programs reduce over devices (and micro-batches) in another order: a few
  # ulps per step, amplified by Adam over 6 steps, but far below what a step changes.
  np.testing.assert_allclose(l8, l1, rtol=1e-4)
  np.testing.assert_allclose(n8, n1, rtol=1e-3)
  assert abs(l1[-1] - l1[0]) > 0.05, "the steps must move the loss"
  assert r["moved"] > 1e-2, r["moved"]
  assert max(r["diffs"]) < 1e-2 * r["moved"], (r["diffs"], r["moved"])


def _train_cmd(workdir, *extra):
  return [sys.executable, "-m", "kvm_jax.train.main", f"--workdir={workdir}", *TINY, *extra]


def _start(workdir, env, *extra) -> subprocess.Popen:
  return subprocess.Popen(_train_cmd(workdir, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _wait_until(proc: subprocess.Popen, done, what: str, timeout: float = 300) -> None:
  """Polls (every 20 ms) until ``done()``; fails if ``proc`` ends first."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    if done():
      return
    assert proc.poll() is None, f"the run ended before {what}:\n{proc.stdout.read()[-3000:]}"
    time.sleep(0.02)
  raise AssertionError(f"no {what} within {timeout} s")


def _logged(workdir: Path, step: int, old=()) -> bool:
  """Whether a step >= ``step`` is logged in a line not among ``old`` (an earlier process's)."""
  metrics = workdir / "metrics.jsonl"
  return metrics.exists() and any(json.loads(l)["step"] >= step for l in
                                  metrics.read_text().splitlines() if l.strip() and l not in old)


def test_kill_sigterm_and_resume_are_exact(tmp_path, subprocess_environ):
  """A run SIGKILLed after a checkpoint, resumed, stopped by SIGTERM, resumed, stopped by Ctrl-C
  (SIGINT), resumed again, ends with the same losses, bitwise, as a run that was never
  interrupted, and each process trained only the steps after the checkpoint it resumed from.

  What tells resuming from restarting: every process start logs ``compile_s`` on its first step,
  so the line of step s+1 carries it exactly when a process began at step s; and the lines of the
  steps before a resume point are left byte for byte as the earlier process wrote them (their
  timings could not be reproduced by a rerun)."""
  env = subprocess_environ(1)
  straight = tmp_path / "straight"
  subprocess.run(_train_cmd(straight), cwd=ROOT, env=env, check=True, capture_output=True,
                 timeout=600)
  run = tmp_path / "run"
  proc = _start(run, env)
  # Saves are asynchronous: the step-10 checkpoint is complete once orbax has renamed its
  # temporary directory, a few steps later. Kill after that.
  _wait_until(proc, lambda: (run / "checkpoints" / "10").is_dir(), "a finished checkpoint")
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  after_kill = _lines(run)
  assert max(after_kill) < STEPS, "the run finished before it could be killed"
  killed_at = _checkpoints(run)[-1]
  assert killed_at % 10 == 0 and killed_at < max(after_kill)

  proc = _start(run, env)  # resumes from the checkpoint, then SIGTERM
  old = set(after_kill.values())
  _wait_until(proc, lambda: _logged(run, killed_at + 3, old), f"step {killed_at + 3}")
  proc.send_signal(signal.SIGTERM)
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  assert f"resumed from step {killed_at}" in out
  after_term = _lines(run)
  stopped_at = max(after_term)
  assert stopped_at < STEPS, "the run finished before the signal"
  assert f"preempted: saved step {stopped_at}" in out
  assert _checkpoints(run)[-1] == stopped_at  # saved where it stopped, between periodic saves

  proc = _start(run, env)  # resumes, then Ctrl-C: saves and stops like SIGTERM
  old = set(after_term.values())
  _wait_until(proc, lambda: _logged(run, stopped_at + 3, old), f"step {stopped_at + 3}")
  proc.send_signal(signal.SIGINT)
  out = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "interrupted: finishing this step, saving it and stopping" in out
  assert "Traceback" not in out and "KeyboardInterrupt" not in out
  after_int = _lines(run)
  interrupted_at = max(after_int)
  assert stopped_at < interrupted_at < STEPS, "the run finished before Ctrl-C"
  assert f"preempted: saved step {interrupted_at}" in out
  assert _checkpoints(run)[-1] == interrupted_at

  out = subprocess.run(_train_cmd(run), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert f"resumed from step {interrupted_at}" in out.stdout
  final = _lines(run)
  a, b = _losses(straight), _losses(run)
  assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
  assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}  # bitwise
  starts = sorted(s for s, l in final.items() if "compile_s" in json.loads(l))
  assert starts == [1, killed_at + 1, stopped_at + 1, interrupted_at + 1], starts
  for s in range(1, killed_at + 1):
    assert final[s] == after_kill[s], s
  for s in range(1, stopped_at + 1):
    assert final[s] == after_term[s], s
  for s in range(1, interrupted_at + 1):
    assert final[s] == after_int[s], s


def test_mqar_examples_are_deterministic_and_well_formed():
  spec = mqar.MQARSpec(seq_len=64, vocab_size=128, num_pairs=6)
  a, b = mqar.mqar_example(3, 17, spec), mqar.mqar_example(3, 17, spec)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
  assert not np.array_equal(a["inputs"], mqar.mqar_example(3, 18, spec)["inputs"])
  inputs, labels, dist = a["inputs"], a["labels"], a["distance"]
  keys, values = inputs[0:12:2], inputs[1:12:2]
  assert np.all((keys >= 1) & (keys < 64)) and len(set(keys.tolist())) == 6
  assert np.all((values >= 64) & (values < 128))
  answer = np.flatnonzero(labels != IGNORE)
  assert len(answer) == 6                        # one answer per pair, loss only there
  for pos in answer:                             # the input at an answer is the queried key...
    key = inputs[pos]
    idx = int(np.flatnonzero(keys == key)[0])
    assert labels[pos] == values[idx]            # ...and the label its value from the context
    assert dist[pos] == pos - 2 * idx            # tokens back to where the key was given


def test_cram_packing_and_labels():
  tok = ByteTokenizer()
  docs = ["abc", "defgh", "x" * 50, "ij"]
  windows = text.cram_pack(docs, tok, seq_len=7)
  # "abc"+EOS (4) + "defgh"+EOS (6) -> buffer 10 >= 8: first 8 emitted, the rest dropped;
  # 50 x's truncated to 8 -> a window alone; "ij"+EOS stays in the buffer (never emitted).
  assert windows.shape == (2, 8)
  assert tok.decode(windows[0]) == "abcdefg" and windows[0][3] == tok.eos_id
  assert tok.decode(windows[1]) == "x" * 8
  ex = text.lm_example(windows[0], tok.eos_id)
  np.testing.assert_array_equal(ex["inputs"], windows[0][:-1])
  assert ex["labels"][3] == IGNORE           # input token 3 is EOS: no loss across docs
  assert ex["labels"][2] == tok.eos_id
  corpus = text.embedded_corpus()                 # the default corpus ships with Python
  assert len(corpus) > 50 and sum(map(len, corpus)) > 300_000


def test_iterator_resume_neither_repeats_nor_skips():
  spec = mqar.MQARSpec(seq_len=32, vocab_size=64, num_pairs=2)
  it = batched_iterator(mqar.mqar_dataset(0, spec), 4)
  first = [next(it)["inputs"] for _ in range(3)]
  state = it.get_state()
  rest = [next(it)["inputs"] for _ in range(2)]
  fresh = batched_iterator(mqar.mqar_dataset(0, spec), 4)
  fresh.set_state(state)
  np.testing.assert_array_equal(next(fresh)["inputs"], rest[0])
  np.testing.assert_array_equal(next(fresh)["inputs"], rest[1])
  assert not any(np.array_equal(rest[0], f) for f in first)


def test_reader_gives_each_host_its_rows_of_the_same_batches():
  """Hosts reading disjoint row sets of every global batch see exactly the slices of the batch
  one host reads whole (grain's own batching is the oracle), with or without prefetching, and a
  restored reader continues at the same batch on every host."""
  from kvm_jax.tasks.pipeline import BatchReader
  spec = mqar.MQARSpec(seq_len=32, vocab_size=64, num_pairs=2)
  dataset = mqar.mqar_dataset(0, spec)
  whole = iter(dataset.batch(8).to_iter_dataset())
  expected = [next(whole) for _ in range(3)]
  hosts = {(0, 1, 4, 5): True, (2, 3, 6, 7): False}  # rows of interleaved hosts; prefetch or not
  for rows, prefetch in hosts.items():
    reader = BatchReader(dataset, 8, rows, prefetch=prefetch)
    for batch in expected:
      got = next(reader)
      for key in batch:
        np.testing.assert_array_equal(got[key], batch[key][list(rows)])
    state = reader.get_state()
    assert state == {"next_batch": 3}
    reader.close()
    again = BatchReader(dataset, 8, rows)
    again.set_state({"next_batch": 1})
    np.testing.assert_array_equal(next(again)["inputs"], expected[1]["inputs"][list(rows)])
    again.close()
  with pytest.raises(ValueError, match="sorted, distinct indices in \\[0, 8\\)"):
    BatchReader(dataset, 8, [3, 1])
  with pytest.raises(ValueError, match="next_batch"):
    BatchReader(dataset, 8).set_state({"last_seen_index": 3})


def test_host_rows_follow_the_mesh_not_the_process_order():
  """The rows a process reads are those its devices hold under the batch sharding; with every
  device local they are all rows, and global_batch puts each row on the device that owns it."""
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  devices = jax.devices()
  mesh = Mesh(np.array(devices).reshape(len(devices)), ("data",))
  sh = NamedSharding(mesh, PartitionSpec("data"))
  B = 2 * len(devices)
  np.testing.assert_array_equal(sharding.host_rows(sh, B), np.arange(B))
  rows = np.arange(B)
  local = {"x": np.arange(B * 3).reshape(B, 3)}
  out = sharding.global_batch(local, sh, B, rows)["x"]
  np.testing.assert_array_equal(np.asarray(out), local["x"])
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), local["x"][shard.index])
  with pytest.raises(ValueError, match=f"has {B - 1} rows, expected {B}"):
    sharding.global_batch({"x": local["x"][:-1]}, sh, B, rows)


def test_bad_training_input(tmp_path):
  cfg = load_config(str(ROOT / "train/configs/tiny_mqar.py"))
  with pytest.raises(SystemExit, match="unknown config field 'stepz'"):
    apply_override(cfg, "stepz", "3")
  with pytest.raises(SystemExit, match="unknown config field 'layers'"):
    apply_override(cfg, "model.layers", "3")
  assert apply_override(cfg, "model.num_layers", "3").model.num_layers == 3
  with pytest.raises(SystemExit, match="--steps=0: train at least 1 step"):
    default_job.main(["--workdir", str(tmp_path / "demo"), "--steps", "0"])
  with pytest.raises(ValueError, match="does not divide the 1 available devices"):
    sharding.make_mesh(2, 1, 1)
  with pytest.raises(ValueError, match="batch_size=3 is not divisible"):
    _check_batch_on_fake_mesh()
  with pytest.raises(ValueError, match="data file 'nope.txt' does not exist"):
    text.read_documents(["nope.txt"])
  # A corrupt checkpoint is a clear error and nothing is overwritten.
  import jax.numpy as jnp
  ck = Checkpointer(tmp_path / "ck")
  ck.save(5, {"w": jnp.ones(3)}, {"next_index": 5}, force=True)
  ck.close()
  for f in (tmp_path / "ck" / "5").rglob("*"):
    if f.is_file() and f.stat().st_size > 0 and "state" in str(f):
      f.write_bytes(b"garbage")
  before = sorted(str(p) for p in (tmp_path / "ck").rglob("*"))
  with pytest.raises(ValueError, match="cannot be read"):
    Checkpointer(tmp_path / "ck").restore({"w": jax_struct()})
  assert sorted(str(p) for p in (tmp_path / "ck").rglob("*")) == before
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="is not a directory"):
    Checkpointer(tmp_path / "file")


def jax_struct():
  import jax
  import jax.numpy as jnp
  return jax.ShapeDtypeStruct((3,), jnp.float32)


def _check_batch_on_fake_mesh():
  """check_batch only reads axis sizes: a 2-way data axis is emulated with a stand-in object."""
  class FakeDevices:
    shape = (2, 1, 1)
  class FakeMesh:
    axis_names = sharding.AXES
    devices = FakeDevices()
  sharding.check_batch(3, FakeMesh())


def test_resume_flag_requires_a_checkpoint(tmp_path):
  with pytest.raises(SystemExit, match="--resume: no checkpoint"):
    main(["--config=train/configs/tiny_mqar.py", f"--workdir={tmp_path}", "--resume"])


def test_cli_help_explains_flags(subprocess_environ):
  out = subprocess.run([sys.executable, "-m", "kvm_jax.train.main", "--help"], cwd=ROOT,
                       env=subprocess_environ(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0
  for flag in ("--config", "--workdir", "--config.FIELD=VALUE", "resumes", "--resume",
               "--distributed"):
    assert flag in out.stdout


def test_demo_models_and_what_they_remember():
  """The demo's six models (the default four and the two baselines ``--models`` adds) and the
  memory each has beyond its exact window after the task's 64 tokens: KVM's schedule (fixed 8;
  4·√N with at least 8), OVQ's plateau floor(64·16 / 80) = 12 centroids, RWKV-7's 32 x 32 state
  per head (2 heads of width 64)."""
  configs = default_job.model_configs()
  assert set(default_job.DEFAULT_MODELS) < set(configs)
  assert {name: memory_in_words(cfg, 64) for name, cfg in configs.items()} == {
      "full": "all tokens", "bswa": "window only", "kvm-fixed": "8 state rows",
      "kvm-sqrt": f"{kj.state_rows_after(configs['kvm-sqrt'].kvm, 64)} state rows",
      "ovq-swa": "12 centroids", "rwkv7": "32x32 state/head"}
  # A hybrid says what each of its kinds keeps, in layer order.
  hybrid = dataclasses.replace(configs["kvm-fixed"], mixers=("full", "kvm"))
  assert memory_in_words(hybrid, 64) == "all tokens, 8 state rows"
  assert configs["ovq-swa"].layer_mixers == ("swa", "ovq")
  assert configs["ovq-swa"].options_of("swa").window == 16  # the KVM models' exact window
  assert {cfg.num_layers for cfg in configs.values()} == {2}
  assert {cfg.hidden_size for cfg in configs.values()} == {64}


def test_demo_sanity_rules_match_their_claims():
  """The demo's closing check: full attention recalls beyond the window (>= 0.9); BSWA sits at
  chance (1/32) there, within 0.1."""
  full, bswa = (default_job.SANITY[name][0] for name in ("full", "bswa"))
  assert full(0.9) and not full(0.89)
  assert bswa(1 / 32) and bswa(1 / 32 + 0.1) and not bswa(0.2) and not bswa(0.9)


def test_default_job_end_to_end_small(tmp_path):
  """The README's main job at a few steps: trains, evaluates (recall recomputed here from the
  trained model's own logits), writes table and plot, and a rerun after an interruption resumes
  from the last checkpoint instead of retraining."""
  from kvm_jax.runs.directory import load_trained, logits_fn
  argv = ["--workdir", str(tmp_path), "--steps", "30", "--models", "kvm-sqrt"]
  assert default_job.main(argv) == 0
  run = tmp_path / "kvm-sqrt"
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert set(summary) == {"kvm-sqrt"} and summary["kvm-sqrt"]["state_rows"] > 8
  check_demo_report((tmp_path / "report.md").read_text(), summary)
  png = (tmp_path / "recall.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

  # Recall, recomputed without the trainer: the eval stream is the task's examples under seed
  # + 10000, 8 batches of 64; a hit is an argmax equal to the label; "state only" answers have
  # their key at least L = 16 tokens back (outside the exact window).
  cfg, model, step = load_trained(run)
  assert step == 30
  spec = cfg.mqar
  examples = [mqar.mqar_example(cfg.seed + 10_000, i, spec) for i in range(8 * 64)]
  inputs, labels, distance = (np.stack([e[k] for e in examples])
                              for k in ("inputs", "labels", "distance"))
  pred = np.argmax(np.asarray(logits_fn(model)(inputs)), -1)  # one jitted forward, all rows
  valid = labels != IGNORE
  far = valid & (distance >= 16)
  for key, mask in (("recall", valid), ("recall_state_only", far),
                    ("recall_in_window", valid & ~far)):
    assert mask.sum() > 100
    assert summary["kvm-sqrt"][key] == pytest.approx((pred == labels)[mask].mean(), abs=1e-9), key

  # An interruption between the checkpoint at step 28 and the end: the rerun resumes at 28, keeps
  # the earlier lines as written (their timings could not be reproduced), logs its own first
  # step with `compile_s`, and reaches the same step-30 loss bitwise.
  before = _lines(run)
  shutil.rmtree(run / "checkpoints" / "30")
  assert _checkpoints(run)[-1] == 28
  assert default_job.main(argv) == 0
  after = _lines(run)
  assert sorted(after) == sorted(before) == [25, 30]
  assert after[25] == before[25]
  assert "compile_s" in json.loads(after[30]) and "compile_s" not in json.loads(before[30])
  assert json.loads(after[30])["loss"] == json.loads(before[30])["loss"]


@pytest.mark.slow  # CI trains on text in test_hf_checkpoints' fine-tuning test
def test_tiny_text_training_loss_falls_and_is_accounted(tmp_path):
  """End to end on the embedded corpus: byte-level loss falls by more than half in 40 steps; the
  metrics time every step but the first, say the compile time once, and a profile is written."""
  import dataclasses
  cfg = dataclasses.replace(load_config(str(ROOT / "train/configs/tiny_text.py")), steps=40,
                            warmup_steps=5, log_every=1, eval_every=0, checkpoint_every=40,
                            seq_len=128)
  train(cfg, tmp_path, verbose=False, profile_steps=(3, 4))
  losses = _losses(tmp_path)
  assert losses[40] < 0.5 * losses[1], losses  # from ~ln(320) = 5.8
  lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert lines[0]["compile_s"] > 0 and "step_time_s" not in lines[0]  # the warm-up step
  assert all("compile_s" not in l for l in lines[1:])
  for l in lines[1:]:
    assert l["step_time_s"] > 0 and 0 <= l["data_wait_s"] < l["step_time_s"]
    assert l["tokens_per_s"] == pytest.approx(8 * 128 / l["step_time_s"])
  assert list((tmp_path / "profile").rglob("*.xplane.pb")), "no trace was written"


def test_every_parameter_has_logical_axes_and_valid_specs():
  import jax
  from flax import nnx
  import kvm_jax as kj
  for cfg in (kj.presets.kvm_swa_sat1024_120m(), kj.presets.gpta2_350m()):
    params = nnx.state(nnx.eval_shape(lambda: kj.LM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
      axes = sharding.logical_axes(path, len(leaf.shape))
      assert len(axes) == (2 if len(leaf.shape) == 2 else 0)
  names = lambda *n: [type("K", (), {"key": x})() for x in n]
  assert sharding.logical_axes(names("blocks", "0", "mlp", "c_proj", "kernel"), 2) == ("mlp", "embed")
  assert sharding.logical_axes(names("blocks", "0", "attn", "c_q", "kernel"), 2) == ("embed", "heads")


def test_run_files_of_a_bucket_workdir_go_to_the_bucket(tmp_path, monkeypatch):
  """A gs:// workdir's config.json and metrics.jsonl are written through etils.epath (here its
  test double, which maps gs://bucket to a local folder), never to a local "gs:" folder; an
  object store cannot append, so the metrics file is rewritten whole, and a resume still drops
  the steps it will redo."""
  from etils.epath import testing as epath_testing
  from kvm_jax.runs.train_config import TrainConfig
  from kvm_jax.runs.directory import load_config as load_run_config, save_config
  from kvm_jax.train.metrics import MetricsWriter

  calls = []

  def to_local(original, path, *args, **kwargs):
    text = str(path)
    if text.startswith("gs://"):
      calls.append(text)
      text = os.path.join(tmp_path, "bucket-root", text[len("gs://"):])
    return original(text, *args, **kwargs)

  names = ("open", "exists", "isdir", "listdir", "glob", "makedirs", "mkdir", "remove", "rename",
           "replace", "rmtree", "stat")
  monkeypatch.chdir(tmp_path)
  with epath_testing.mock_epath(**{n: to_local for n in names}):
    cfg = TrainConfig(steps=7, warmup_steps=1)
    save_config(cfg, "gs://bucket/run")
    assert load_run_config("gs://bucket/run").steps == 7
    writer = MetricsWriter("gs://bucket/run")
    for step in (1, 2, 3):
      writer.write(step, loss=1.0 / step)
    writer.close()
    resumed = MetricsWriter("gs://bucket/run", resume_step=2)
    resumed.write(3, loss=0.25)
    resumed.close()
  local = tmp_path / "bucket-root" / "bucket" / "run"
  assert (local / "config.json").exists() and not (tmp_path / "gs:").exists()
  assert _losses(local) == {1: 1.0, 2: 0.5, 3: 0.25}
  assert any(c.endswith("metrics.jsonl") for c in calls)
