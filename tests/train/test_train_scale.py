"""Training at long sequences: attention without [T, T] scores, the sliced loss, remat,
gradient accumulation, the memory report, config strings and the non-finite guard.

Every check compares against an independent path: the dense attention of ``kvm_jax.ops.attention.dense``
(``jax.nn.dot_product_attention``), whole float32 logits through optax / numpy, the unrolled model
without remat, and the whole batch in one piece.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvm_jax as kj
from kvm_jax import presets
from kvm_jax.nn.model import LM, layer_period
from kvm_jax.ops.attention import dense
from kvm_jax.ops.attention.api import (causal_attention, resolve_attention,
                                       resolve_attention_backend)
from kvm_jax.ops.attention.chunked import chunked_attention
from kvm_jax.ops.loss import IGNORE, sliced_loss_sums
from kvm_jax.runs.checkpoint import Checkpointer
from kvm_jax.tasks.pipeline import batched_iterator
from kvm_jax.train import loop
from kvm_jax.train.evaluation import evaluate
from kvm_jax.train.objectives import masked_loss
from kvm_jax.train.step import clip_to_norm, global_norm, loss_and_grads, micro_batches
from kvm_jax.train.main import load_config, main
from kvm_jax.train.memory import memory_report
from tests.helpers import in_ci

from tests.helpers import ROOT  # noqa: E402


def _qkv(B=2, T=77, H=4, Hkv=2, D=16, Dv=16, dtype=jnp.float32, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(k1, (B, T, H, D)).astype(dtype),
          jax.random.normal(k2, (B, T, Hkv, D)).astype(dtype),
          jax.random.normal(k3, (B, T, Hkv, Dv)).astype(dtype))


def _dense(q, k, v, window, scale=None):
  if window is None:
    return dense.full_attention(q, k, v, scale=scale)
  return dense.sliding_window_attention(q, k, v, window, scale=scale)


def _values_and_grads(fn, q, k, v):
  """fn(q, k, v) and the gradients of <fn, a fixed random cotangent> w.r.t. q, k, v (float32)."""
  out = fn(q, k, v)
  ct = jax.random.normal(jax.random.PRNGKey(7), out.shape)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct), (0, 1, 2))(q, k, v)
  return [np.asarray(x, np.float32) for x in (out, *grads)]


# ------------------------------------------------------------------------------------------------
# Attention without [T, T] scores
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,block", in_ci([(None, 8), (None, 512), (1, 8), (5, 16), (37, 8),
                                                (500, 16)], {"(None, 8)", "(5, 16)", "(500, 16)"}))
def test_chunked_attention_equals_dense_values_and_gradients(window, block):
  """float32: only the summation order differs (online softmax over blocks), so outputs and every
  gradient agree to a few float32 ulps of their O(1-10) magnitudes (T = 77 is not a multiple of
  any block; GQA with 2 query heads per KV head; a window longer than T is full attention)."""
  q, k, v = _qkv()
  got = _values_and_grads(lambda *a: chunked_attention(*a, window=window, block=block), q, k, v)
  want = _values_and_grads(lambda *a: _dense(*a, window), q, k, v)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=name)


def test_chunked_attention_value_dim_differs_from_key_dim():
  """Dv != D (``jax.nn.dot_product_attention`` cannot): against a plain softmax written here."""
  q, k, v = _qkv(T=30, D=16, Dv=8)
  G = q.shape[2] // k.shape[2]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, G, 2)) / 4.0
  pos = jnp.arange(30)
  s = jnp.where((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 9), s, -jnp.inf)
  want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), jnp.repeat(v, G, 2))
  np.testing.assert_allclose(chunked_attention(q, k, v, window=9, block=8), want, atol=2e-6)


def test_chunked_attention_scale_and_bf16():
  q, k, v = _qkv(T=64, D=32, Dv=32)
  got = chunked_attention(q, k, v, scale=0.05, block=16)
  np.testing.assert_allclose(got, _dense(q, k, v, None, scale=0.05), atol=2e-5, rtol=2e-5)
  # bf16 inputs: both paths multiply bf16 operands with float32 accumulation and cast the
  # probabilities to bf16 before P·V; what differs is rounding (bf16: 2^-8 relative) of
  # differently blocked sums, so a few bf16 ulps of O(1) outputs.
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  got = _values_and_grads(lambda *a: chunked_attention(*a, window=20, block=16), qb, kb, vb)
  want = _values_and_grads(lambda *a: _dense(*a, 20), qb, kb, vb)
  for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
    scale = max(1.0, float(np.max(np.abs(w))))
    assert float(np.max(np.abs(g - w))) <= 3e-2 * scale, name


def _softcapped_oracle(q, k, v, window, cap):
  """Written here: scaled scores, ``cap · tanh(s / cap)``, the causal (window) mask, softmax."""
  T, G = q.shape[1], q.shape[2] // k.shape[2]
  s = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, G, 2)) / np.sqrt(q.shape[-1])
  s = cap * jnp.tanh(s / cap)
  pos = jnp.arange(T)
  visible = pos[None, :] <= pos[:, None]
  if window is not None:
    visible &= pos[None, :] > pos[:, None] - window
  p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), -1)
  return jnp.einsum("bhqk,bkhd->bqhd", p, jnp.repeat(v, G, 2))


def test_softcapped_attention_equals_a_plain_oracle():
  """Gemma 2's soft-capped scores (cap 2 against scores of standard deviation ~3, so most are
  bent) on the dense path, the chunked path over several blocks (its hand-written backward
  multiplies by 1 - tanh²) and packed documents: values and gradients equal a softmax written
  here (float32, as the uncapped comparisons above), and differ from the uncapped attention."""
  q, k, v = _qkv(T=40)
  q = 3.0 * q
  cap = 2.0
  for window in (None, 9):
    want = _values_and_grads(lambda *a: _softcapped_oracle(*a, window, cap), q, k, v)
    paths = {"xla": lambda *a: causal_attention(*a, window=window, softcap=cap,
                                                implementation="xla"),
             "chunked": lambda *a: chunked_attention(*a, window=window, block=8, softcap=cap)}
    for path, fn in paths.items():
      got = _values_and_grads(fn, q, k, v)
      for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=f"{path} {name} {window}")
    assert np.max(np.abs(np.asarray(_dense(q, k, v, window)) - want[0])) > 0.1
  # packed documents: each of the two documents as if alone
  ids = jnp.asarray([[1] * 17 + [2] * 23] * 2, jnp.int32)
  got = causal_attention(q, k, v, window=9, softcap=cap, implementation="chunked",
                         segment_ids=ids)
  alone = [_softcapped_oracle(q[:, a:b], k[:, a:b], v[:, a:b], 9, cap) for a, b in ((0, 17),
                                                                                   (17, 40))]
  np.testing.assert_allclose(got, jnp.concatenate(alone, 1), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("implementation", ["xla", "chunked", "splash"])
def test_attention_registry_implementations_equal_dense(implementation):
  """splash runs its Pallas TPU kernel in interpret mode on CPU (T must be a multiple of 128)."""
  q, k, v = _qkv(B=1, T=128, D=32, Dv=32)
  for window in (None, 48):
    got = _values_and_grads(
        lambda *a: causal_attention(*a, window=window, implementation=implementation), q, k, v)
    want = _values_and_grads(lambda *a: _dense(*a, window), q, k, v)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
      np.testing.assert_allclose(g, w, atol=5e-5, rtol=5e-5, err_msg=f"{name} window={window}")


def test_attention_registry_resolution_and_errors():
  q32 = jnp.zeros((1, 1024, 4, 64), jnp.float32)
  q16 = q32.astype(jnp.bfloat16)
  assert resolve_attention("auto", q16, "gpu") == "cudnn"
  assert resolve_attention("auto", q32, "gpu") == "chunked"      # cuDNN has no float32 kernel
  assert resolve_attention("auto", q16, "tpu") == "splash"
  assert resolve_attention("auto", q16[:, :1000], "tpu") == "chunked"  # not a multiple of 128
  assert resolve_attention("auto", q16, "cpu") == "chunked"
  assert resolve_attention("auto", q16[:, :512], "cpu") == "xla"  # one block: dense is cheap
  assert resolve_attention("xla", q16, "gpu") == "xla"
  with pytest.raises(ValueError, match="'flash'.*choose from"):
    resolve_attention("flash", q32)
  q, k, v = _qkv(T=16)
  with pytest.raises(ValueError, match="cudnn.*bfloat16"):
    causal_attention(q, k, v, implementation="cudnn")
  with pytest.raises(ValueError, match="multiple of 128, got 16"):
    causal_attention(q, k, v, implementation="splash")
  # cuDNN's fused attention cannot soft-cap: "auto" avoids it, asking for it is refused
  assert resolve_attention_backend("auto", q16, platform="gpu", softcap=50.0).implementation \
      == "chunked"
  with pytest.raises(ValueError, match="'cudnn' cannot soft-cap scores"):
    causal_attention(q, k, v, implementation="cudnn", softcap=50.0)


@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
def test_splash_compiles_for_tpu_with_gradients():
  """Splash attention (a Mosaic kernel) and its backward compile for a TPU v5e."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(B=1, T=256, D=128, Dv=128))
  f = lambda q, k, v: causal_attention(q, k, v, window=100, implementation="splash")
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), (0, 1, 2))
  with kj.compile_target("v5e:2x2") as chip:
    args = chip.structs((q, k, v))
    lowered = jax.jit(f).lower(*args)
    lowered.compile()
    jax.jit(grad).lower(*args).compile()
  assert "tpu_custom_call" in lowered.as_text()


@pytest.mark.slow  # the registry test above covers chunked vs dense; this adds a whole model
def test_model_attention_implementations_agree():
  """A hybrid (SWA and full layers, GQA) gives the same logits with dense and chunked attention."""
  cfg = presets.tiny(mixers=("swa", "full"), num_kv_heads=2,
                     options={"swa": dataclasses.replace(presets.TINY_OPTIONS["swa"], window=6)})
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)
  logits = {}
  for impl in ("xla", "chunked"):
    model = LM(dataclasses.replace(cfg, attention_implementation=impl), rngs=nnx.Rngs(0))
    logits[impl] = np.asarray(model(tokens))
  np.testing.assert_allclose(logits["chunked"], logits["xla"], atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------------------------------------
# The loss over slices of the sequence
# ------------------------------------------------------------------------------------------------
def _numpy_loss(features, kernel, labels):
  """Independent float64 cross-entropy sum and count."""
  logits = np.asarray(features, np.float64) @ np.asarray(kernel, np.float64)
  logits -= logits.max(-1, keepdims=True)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  valid = labels != IGNORE
  picked = np.take_along_axis(logp, np.where(valid, labels, 0)[..., None], -1)[..., 0]
  return -(picked * valid).sum(), int(valid.sum())


@pytest.mark.parametrize("slice_len", [0, 7, 16, 64])
def test_sliced_loss_equals_whole_logits_values_and_gradients(slice_len):
  B, T, C, V = 3, 37, 16, 50
  kf, kk, kl = jax.random.split(jax.random.PRNGKey(0), 3)
  features = jax.random.normal(kf, (B, T, C))
  kernel = jax.random.normal(kk, (C, V)) * 0.5
  labels = np.array(jax.random.randint(kl, (B, T), 0, V))
  labels[0, :10] = IGNORE
  labels[2] = IGNORE  # a row without any loss
  labels = jnp.asarray(labels)

  def loss(f, w, n):
    total, count, _ = sliced_loss_sums(f, w, labels, compute_dtype="float32", slice_len=n)
    return total / count

  want_sum, want_count = _numpy_loss(features, kernel, np.asarray(labels))
  total, count, pred = sliced_loss_sums(features, kernel, labels, compute_dtype="float32",
                                        slice_len=slice_len, predictions=True)
  assert int(count) == want_count
  np.testing.assert_allclose(float(total), want_sum, rtol=1e-5)
  np.testing.assert_array_equal(pred, np.argmax(np.asarray(features @ kernel), -1))
  g_whole = jax.grad(loss, (0, 1))(features, kernel, 0)
  g_slice = jax.grad(loss, (0, 1))(features, kernel, slice_len)
  for a, b in zip(g_slice, g_whole):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_masked_loss_value_against_numpy():
  """The trainer's loss is the mean over labelled positions only (-100 carries nothing)."""
  logits = jax.random.normal(jax.random.PRNGKey(3), (2, 9, 11)) * 3
  labels = np.array(jax.random.randint(jax.random.PRNGKey(4), (2, 9), 0, 11))
  labels[1, 3:] = IGNORE
  eye = np.eye(11, dtype=np.float64)
  total, count = _numpy_loss(np.asarray(logits), eye, labels)
  np.testing.assert_allclose(float(masked_loss(logits, jnp.asarray(labels))),
                             total / count, rtol=1e-6)


# ------------------------------------------------------------------------------------------------
# Remat and accumulation
# ------------------------------------------------------------------------------------------------
REMAT_MODELS = {  # name: (model, policies compared with "none")
    "uniform kvm (scanned, period 1)": (dict(mixers="kvm", num_layers=2), ("block",)),
    "swa/kvm hybrid (scanned, period 2)": (dict(mixers=("swa", "kvm", "swa", "kvm"),
                                                num_layers=4), ("block_dots",)),
    "fusedkv (unrolled checkpoint)": (dict(mixers="full", num_layers=2, kv_sharing="fusedkv"),
                                      ("block",)),
    # a period longer than two checkpoints each layer inside the group too (Gemma 3's six)
    "full/full/swa (scanned, period 3, layers nested)": (
        dict(mixers=("full", "full", "swa") * 2, num_layers=6), ("block",)),
}


# CI: the scan with nested layer checkpoints (the period-1 scan is the same code without them)
@pytest.mark.parametrize("name", in_ci(list(REMAT_MODELS),
                                       {"full/full/swa (scanned, period 3, layers nested)"}))
def test_remat_policies_give_the_same_loss_and_gradients(name):
  overrides, policies = REMAT_MODELS[name]
  cfg = presets.tiny(**overrides)
  assert (layer_period(cfg) is None) == ("unrolled" in name)
  graphdef, params = nnx.split(LM(cfg, rngs=nnx.Rngs(0)))
  # Output projections start at zero, which makes every block the identity: perturb every
  # parameter so that each layer computes something of its own (a layer run in another's place
  # must show).
  leaves, tree = jax.tree_util.tree_flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
  params = jax.tree_util.tree_unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype)
                                               for x, k in zip(leaves, keys)])
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, cfg.vocab_size)

  def loss(p, remat):
    return jnp.mean(nnx.merge(graphdef, p)(tokens, remat=remat) ** 2)

  want_loss, want = jax.value_and_grad(loss)(params, "none")
  for remat in policies:
    got_loss, got = jax.value_and_grad(loss)(params, remat)
    assert float(got_loss) == pytest.approx(float(want_loss), rel=1e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(a, b, atol=1e-7, rtol=1e-5, err_msg=f"{remat} {path}")


@pytest.mark.slow  # compiles a model's step three ways; the memory report test below stays in CI
def test_block_remat_lowers_the_compiled_memory():
  """Rematerialization must actually happen in the compiled program (XLA:CPU folds unrolled
  ``jax.checkpoint`` recomputation back into the forward pass; the scanned blocks cannot)."""
  cfg = _tiny_train_config(seq_len=128, batch_size=4, num_layers=4)
  temps = {}
  for remat in ("none", "block"):
    temps[remat] = memory_report(dataclasses.replace(cfg, remat=remat)).temporaries
  assert temps["block"] < 0.6 * temps["none"], temps


def _tiny_train_config(seq_len=64, batch_size=8, num_layers=2, mixers="kvm", **kw):
  cfg = load_config(str(ROOT / "train/configs/tiny_mqar.py"))
  model = dataclasses.replace(cfg.model, num_layers=num_layers, mixers=mixers)
  return dataclasses.replace(cfg, model=model, batch_size=batch_size,
                             mqar=dataclasses.replace(cfg.mqar, seq_len=seq_len, num_pairs=4),
                             **kw)


@pytest.mark.slow  # CI: tests/train/test_train.py compares accumulation on 8 devices with 1 device
def test_accumulation_and_slicing_equal_the_whole_batch():
  """Micro-batches with different numbers of labelled tokens: weighting by the whole batch's
  token count makes the summed gradients those of the large batch, which the oracle computes from
  whole float32 logits (no remat, no slicing, one piece). Softmax-attention layers: KVM's
  routing is discrete, and a batch-size-dependent matmul rounding could flip a near-tie merge
  target between the two paths, which would test XLA's blocking, not the accumulation."""
  cfg = _tiny_train_config(mixers=("full", "swa"))
  graphdef, params, *_ = loop.setup(cfg)
  batch = next(batched_iterator(loop.task_dataset(cfg, "train"), cfg.batch_size))
  labels = np.asarray(batch["labels"]).copy()
  labels[1] = IGNORE
  labels[4, : labels.shape[1] // 2] = IGNORE
  batch = {"inputs": jnp.asarray(batch["inputs"]), "labels": jnp.asarray(labels)}

  def oracle(p):
    return masked_loss(nnx.merge(graphdef, p)(batch["inputs"]), batch["labels"])

  want_loss, want = jax.value_and_grad(oracle)(params)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(want))
  for accum, slice_len, remat in ((4, 24, "block"),):
    run = dataclasses.replace(cfg, grad_accum_steps=accum, loss_slice_len=slice_len, remat=remat)
    loss, grads = jax.jit(lambda p: loss_and_grads(graphdef, p, batch, run))(params)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5), (accum, slice_len)
    for a, b in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want)):
      assert float(jnp.max(jnp.abs(a - b))) <= 1e-5 * scale, (accum, slice_len, remat)


def test_micro_batches_interleave_rows():
  x = jnp.arange(8)[:, None] * jnp.ones((1, 3), jnp.int32)
  np.testing.assert_array_equal(micro_batches(x, 4)[:, :, 0], [[0, 4], [1, 5], [2, 6],
                                                                       [3, 7]])


def test_clip_to_norm():
  grads = {"a": jnp.array([3.0, 0.0]), "b": jnp.array([[4.0]])}
  norm = global_norm(grads)
  assert float(norm) == pytest.approx(5.0)
  clipped = clip_to_norm(grads, norm, 1.0)
  np.testing.assert_allclose(clipped["a"], [0.6, 0.0], rtol=1e-6)
  np.testing.assert_allclose(clipped["b"], [[0.8]], rtol=1e-6)
  same = clip_to_norm(grads, norm, 10.0)
  np.testing.assert_array_equal(same["a"], grads["a"])


# ------------------------------------------------------------------------------------------------
# kvm-train --memory-report and config strings
# ------------------------------------------------------------------------------------------------
def test_memory_report_reads_no_data_and_prints_the_peak(tmp_path):
  workdir = tmp_path / "never-created"
  out = subprocess.run(
      [sys.executable, "-m", "kvm_jax.train.main", "--config=train/configs/tiny_text.py",
       f"--workdir={workdir}", "--config.text_files=('/nonexistent/corpus.txt',)",
       "--config.tokenizer_file=/nonexistent/tokenizer.json", "--memory-report"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  last = out.stdout.strip().splitlines()[-1]
  m = re.fullmatch(r"per-device peak: (\d+\.\d\d) GiB \(arguments (\d+\.\d\d) GiB, temporaries "
                   r"(\d+\.\d\d) GiB, outputs (\d+\.\d\d) GiB beyond the donated arguments\)", last)
  assert m, last
  peak, args, temps, outs = map(float, m.groups())
  assert peak == pytest.approx(args + temps + outs, abs=0.015)
  assert not workdir.exists()
  assert "depth-first" in out.stdout


@pytest.mark.slow
def test_memory_report_arguments_match_the_parameter_count():
  """Independent check of the report: float32 parameters + AdamC's two float32 moments are
  12 bytes per parameter, plus the int32 inputs and labels."""
  from kvm_jax import count_params
  cfg = _tiny_train_config()
  report = memory_report(cfg)
  n = count_params(cfg.model)["total"]
  batch_bytes = 2 * 4 * cfg.batch_size * cfg.sequence_length
  assert report.arguments == pytest.approx(12 * n + batch_bytes, rel=0.01)
  assert report.peak >= report.arguments
  assert report.lines(cfg)[-1].startswith("per-device peak: ")


def test_config_strings_select_the_paper_recipe_for_any_preset():
  cfg = load_config("train/configs/paper.py:kvm_sqrt16_120m")
  assert cfg.model == dataclasses.replace(presets.kvm_sqrt16_120m(), param_dtype="bfloat16",
                                          compute_dtype="bfloat16")
  assert (cfg.steps, cfg.seq_len, cfg.batch_size, cfg.remat) == (6000, 8192, 64, "block")
  big = load_config("train/configs/paper.py:gpta2_350m")
  assert big.steps == 15000 and big.learning_rate == pytest.approx(1.26491e-3, rel=1e-5)
  assert load_config("train/configs/paper_120m.py") == load_config(
      "train/configs/paper.py:kvm256_120m")
  assert load_config("train/configs/paper_350m.py") == load_config(
      "train/configs/paper.py:kvm256_350m")
  with pytest.raises(SystemExit, match="no paper recipe for 'tiny'"):
    load_config("train/configs/paper.py:tiny")
  with pytest.raises(SystemExit, match=":ARG"):
    load_config("train/configs/paper.py")
  with pytest.raises(SystemExit, match="takes no argument"):
    load_config("train/configs/tiny_mqar.py:x")


# ------------------------------------------------------------------------------------------------
# Non-finite loss or gradient
# ------------------------------------------------------------------------------------------------
POISONED_STEP = 8  # the batch of step 8 (1-based) carries an out-of-vocabulary token -> NaN


def _poison(monkeypatch, batch_size=4):
  """The training stream with one bad example in the batch of POISONED_STEP: an id outside the
  vocabulary embeds as NaN (``jnp.take`` fills), as corrupt data would."""
  clean = loop.task_dataset
  first = (POISONED_STEP - 1) * batch_size

  def poisoned(c, split):
    ds = clean(c, split)
    if split != "train":
      return ds

    def bad(i, ex):
      if i == first:
        ex = dict(ex, inputs=np.where(np.arange(len(ex["inputs"])) == 3, c.model.vocab_size,
                                      ex["inputs"]))
      return ex
    return ds.map_with_index(bad)

  monkeypatch.setattr(loop, "task_dataset", poisoned)


def _args(workdir, **overrides):
  base = dict(steps=12, batch_size=4, log_every=1, checkpoint_every=5, eval_every=0,
              warmup_steps=2)
  base.update(overrides)
  return ["--config=train/configs/tiny_mqar.py", f"--workdir={workdir}",
          "--config.mqar.seq_len=64", "--config.mqar.num_pairs=4",
          *[f"--config.{k}={v}" for k, v in base.items()]]


def _finite_checkpoints(workdir: Path) -> list[int]:
  ckpt = Checkpointer(workdir / "checkpoints")
  steps = sorted(ckpt.manager.all_steps())
  cfg = load_config(str(ROOT / "train/configs/tiny_mqar.py"))
  abstract = nnx.eval_shape(lambda: LM(cfg.model, rngs=nnx.Rngs(0)))
  target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  nnx.state(abstract))
  for step in steps:
    _, params = ckpt.restore_params(target, step)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(params)), step
  ckpt.close()
  return steps


@pytest.mark.slow  # two short runs; the "skip" policy below keeps the guard's device side in CI
def test_nonfinite_stops_without_saving_and_the_run_resumes(tmp_path, monkeypatch, capsys):
  workdir = tmp_path / "stop"
  _poison(monkeypatch)
  assert main(_args(workdir)) == 1
  err = capsys.readouterr().err
  assert f"non-finite loss at step {POISONED_STEP}" in err and "on_nonfinite=skip" in err
  assert _finite_checkpoints(workdir) == [5]  # step 10 was never written
  monkeypatch.undo()  # the data is fixed; the same command resumes from step 5
  assert main(_args(workdir)) == 0
  assert "resumed from step 5" in capsys.readouterr().out
  lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in lines] == list(range(1, 13))
  assert all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in lines)


def test_nonfinite_skip_drops_the_update_and_counts_it(tmp_path, monkeypatch, capsys):
  workdir = tmp_path / "skip"
  _poison(monkeypatch)
  assert main(_args(workdir, on_nonfinite="skip")) == 0
  assert f"skipped the update of step(s) {POISONED_STEP}" in capsys.readouterr().out
  lines = {r["step"]: r for r in map(json.loads,
                                      (workdir / "metrics.jsonl").read_text().splitlines())}
  assert [lines[s]["skipped_steps"] for s in (POISONED_STEP - 1, POISONED_STEP, 12)] == [0, 1, 1]
  assert lines[POISONED_STEP]["loss"] is None  # JSON has no NaN: written as null
  assert all(np.isfinite(lines[s]["loss"]) for s in lines if s != POISONED_STEP)
  assert _finite_checkpoints(workdir) == [5, 10, 12]


# ------------------------------------------------------------------------------------------------
# Sharded evaluation
# ------------------------------------------------------------------------------------------------
def test_eval_step_sums_equal_whole_logits_metrics():
  """The jitted eval step (micro-batches, loss slices, only sums leave the device) gives the
  token-weighted loss and the MQAR recall split that whole logits give through numpy."""
  from kvm_jax.tasks import mqar
  cfg = _tiny_train_config(grad_accum_steps=2, loss_slice_len=24)
  graphdef, params, *_ = loop.setup(cfg)
  dataset = loop.task_dataset(cfg, "eval")
  got = evaluate(graphdef, params, cfg, 2, dataset)
  it = batched_iterator(dataset, cfg.batch_size)
  total = count = 0.0
  counts = None
  for _ in range(2):
    batch = next(it)
    logits = np.asarray(nnx.merge(graphdef, params)(jnp.asarray(batch["inputs"])), np.float64)
    s, n = _numpy_loss(logits, np.eye(logits.shape[-1]), np.asarray(batch["labels"]))
    total, count = total + s, count + n
    c = mqar.recall_counts(logits.argmax(-1), batch["labels"], batch["distance"],
                           cfg.model.kvm.window_len)
    counts = c if counts is None else {k: counts[k] + c[k] for k in c}
  assert got["eval_loss"] == pytest.approx(total / count, rel=1e-5)
  for name, value in mqar.recall_ratios(counts).items():
    assert got[name] == pytest.approx(value, nan_ok=True), name
