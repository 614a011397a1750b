"""Training: sharded == single-device, kill-and-resume exactness, data pipelines, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.tasks import mqar, text
from kvm_jax.tasks.labels import IGNORE
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.tasks.tokenizers import ByteTokenizer
from kvm_jax.train import sharding
from kvm_jax.train import default_job
from kvm_jax.train.loop import train
from kvm_jax.train.main import apply_override, load_config, main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config=train/configs/tiny_mqar.py", "--config.steps=30", "--config.batch_size=8",
        "--config.mqar.seq_len=64", "--config.mqar.num_pairs=4", "--config.log_every=1",
        "--config.checkpoint_every=10", "--config.eval_every=0", "--config.warmup_steps=5"]


def _env(devices: int = 1) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _losses(workdir: Path) -> dict[int, float]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(l) for l in lines if l.strip()]
  assert len({s["step"] for s in steps}) == len(steps), "a step was logged twice"
  return {s["step"]: s["loss"] for s in steps}


def test_sharded_train_step_matches_single_device():
  script = textwrap.dedent("""
    import jax, numpy as np, dataclasses
    from kvm_jax.tasks.mqar import MQARSpec
    from kvm_jax.tasks.pipeline import batched_iterator
    from kvm_jax.train import loop, sharding
    from kvm_jax.train.main import load_config
    cfg = load_config("train/configs/tiny_mqar.py")
    cfg = dataclasses.replace(cfg, batch_size=8, mqar=MQARSpec(seq_len=64, vocab_size=128,
                              num_pairs=4))
    batch = next(batched_iterator(loop.task_dataset(cfg, "train"), cfg.batch_size))
    results = []
    for mesh, accum in ((sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), 1),
                        (sharding.make_mesh(2, 2, 2), 1), (sharding.make_mesh(2, 2, 2), 2)):
      run = dataclasses.replace(cfg, grad_accum_steps=accum)
      graphdef, params, opt, optimizer, sh = loop.setup(run, mesh)
      step = loop.make_train_step(graphdef, optimizer, sh, run)
      halted = jax.numpy.zeros((), bool)
      for _ in range(3):
        params, opt, stats = step(params, opt, loop.put_batch(batch, sh[2]), halted)
      results.append((float(stats["loss"]), jax.tree_util.tree_map(np.asarray, params)))
    assert len(jax.devices()) == 8
    kernel = results[1][1]["blocks"][0]["attn"]["c_q"]["kernel"]
    (l1, p1), (l8, p8), (la, pa) = results
    diff = lambda p, q: max(float(np.max(np.abs(a - b))) for a, b in
                            zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)))
    print("RESULT", l1, l8, diff(p1, p8), la, diff(p1, pa))
  """)
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(8), capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  _, l1, l8, diff, la, diff_accum = next(
      l for l in out.stdout.splitlines() if l.startswith("RESULT")).split()
  # float32; the sharded program reduces gradients over devices in another order: a few ulps
  # per step, amplified slightly by Adam's normalization over 3 steps. The same holds for the
  # batch run as 2 interleaved micro-batches on the 8-device mesh.
  assert abs(float(l1) - float(l8)) < 1e-5 and abs(float(l1) - float(la)) < 1e-5
  assert float(diff) < 1e-5 and float(diff_accum) < 1e-5


def _train_cmd(workdir):
  return [sys.executable, "-m", "kvm_jax.train.main", f"--workdir={workdir}", *TINY]


def test_kill_and_resume_is_exact(tmp_path):
  straight = tmp_path / "straight"
  subprocess.run(_train_cmd(straight), cwd=ROOT, env=_env(), check=True, capture_output=True,
                 timeout=600)
  killed = tmp_path / "killed"
  proc = subprocess.Popen(_train_cmd(killed), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline:
    metrics = killed / "metrics.jsonl"
    if metrics.exists() and any(json.loads(l)["step"] >= 14 for l in
                                metrics.read_text().splitlines() if l.strip()):
      break
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert max(_losses(killed)) < 30, "the run finished before it could be killed"
  subprocess.run(_train_cmd(killed), cwd=ROOT, env=_env(), check=True, capture_output=True,
                 timeout=600)
  a, b = _losses(straight), _losses(killed)
  assert sorted(a) == sorted(b) == list(range(1, 31))
  assert all(a[s] == b[s] for s in a), {s: (a[s], b[s]) for s in a if a[s] != b[s]}  # bitwise


def test_sigterm_saves_and_resumes(tmp_path):
  workdir = tmp_path / "term"
  cmd = _train_cmd(workdir) + ["--config.steps=400", "--config.checkpoint_every=1000"]
  proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  deadline = time.time() + 300
  while time.time() < deadline and not (workdir / "metrics.jsonl").exists():
    time.sleep(0.05)
  time.sleep(1.0)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 0
  last = max(_losses(workdir))
  assert last < 400
  steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps and steps[-1] == last  # the final save happened at the step it stopped


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


def test_cli_help_explains_flags():
  out = subprocess.run([sys.executable, "-m", "kvm_jax.train.main", "--help"], cwd=ROOT,
                       env=_env(),
                       capture_output=True, text=True, timeout=120)
  assert out.returncode == 0
  for flag in ("--config", "--workdir", "--config.FIELD=VALUE", "resumes", "--resume",
               "--distributed"):
    assert flag in out.stdout


def test_default_job_end_to_end_small(tmp_path):
  """The README's main job at a few steps: trains, evaluates, writes table/plot, resumes."""
  assert default_job.main(["--workdir", str(tmp_path), "--steps", "30",
                           "--models", "kvm-sqrt"]) == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert set(summary) == {"kvm-sqrt"} and summary["kvm-sqrt"]["state_rows"] > 8
  assert 0 <= summary["kvm-sqrt"]["recall_state_only"] <= 1
  png = (tmp_path / "recall.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
  # Re-running resumes the finished model instead of retraining it.
  assert default_job.main(["--workdir", str(tmp_path), "--steps", "30",
                           "--models", "kvm-sqrt"]) == 0
  assert max(_losses(tmp_path / "kvm-sqrt")) == 30


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
  import os
  from etils.epath import testing as epath_testing
  from kvm_jax.runs.config import TrainConfig
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
