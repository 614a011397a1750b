"""Pallas kernels in interpret mode against the XLA path (outputs, log-sum-exp, routing decisions,
final state, VJPs), through the model and decode, and built for a TPU v5e (Mosaic) and an H100
(Triton) at the paper's shapes on this CPU-only machine (compiled in the nightly run)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.kernels import backend
from kvm_jax.kernels.readout import fused_readout
from kvm_jax.kernels.update import update_state_pallas
from kvm_jax.ops.kvm.api import chunk_ops
from kvm_jax.ops.kvm.documents import kvm_attention_documents
from kvm_jax.ops.kvm.cases import (TOLERANCE, random_inputs, random_params, rel_rms, select,
                                   valid_rows)
from kvm_jax.ops.kvm.scan import XLA_OPS, kvm_attention_scan
from kvm_jax.ops.kvm.state import update_state
from kvm_jax.config.target import program_bytes
from tests.helpers import ROOT, in_ci, make_model

CASES = {c.name: c for c in select("kernels")}
PALLAS = chunk_ops("pallas", interpret=True)


def _case(name, seed=0):
  case = CASES[name]
  return case.cfg, case.inputs(seed), case.dtype


def _run(cfg, args, ops):
  return kvm_attention_scan(*args, cfg=cfg, return_routing=True, ops=ops)


@pytest.mark.parametrize("name", sorted(CASES))
def test_scan_with_kernels_matches_xla(name):
  cfg, args, dtype = _case(name)
  y0, s0, r0 = _run(cfg, args, XLA_OPS)
  y1, s1, r1 = _run(cfg, args, PALLAS)
  assert rel_rms(y1, y0) < TOLERANCE[dtype]["output"]
  for a, b in zip(valid_rows(s1), valid_rows(s0)):
    assert rel_rms(a, b) < TOLERANCE["float32"]["output"]  # the state is float32 in both
  assert int(s1.num_rows) == int(s0.num_rows)
  for a, b in zip(r1, r0):  # routing decisions: identical
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name", in_ci(["fixed_sink1_gqa", "sqrt_sink0", "sqrt_bf16"],
                                       {"fixed_sink1_gqa"}))
def test_kernel_vjps_match_xla(name):
  cfg, args, dtype = _case(name, seed=3)
  w = jnp.cos(jnp.arange(16.0))

  def loss(ops):
    return lambda *a: jnp.sum(kvm_attention_scan(*a, cfg=cfg, ops=ops)[0].astype(jnp.float32)
                              * w)

  g0 = jax.jit(jax.grad(loss(XLA_OPS), argnums=(0, 1, 2, 3, 4)))(*args)
  g1 = jax.jit(jax.grad(loss(PALLAS), argnums=(0, 1, 2, 3, 4)))(*args)
  names = ["q", "k", "v", "gate", "ln_scale", "ln_bias", "window_temperature",
           "state_temperature"]
  for n, a, b in zip(names, jax.tree_util.tree_leaves(g0), jax.tree_util.tree_leaves(g1)):
    assert rel_rms(b, a) < TOLERANCE[dtype]["grad"], n


@pytest.mark.parametrize("tiles", ["cpu", "tpu"])
@pytest.mark.parametrize("shape", [(2, 2, 2, 8, 12, 16, 16), (1, 1, 2, 128, 256, 256, 16),
                                   (1, 1, 3, 50, 100, 100, 16)],
                         ids=["one_block", "blocked", "ragged"])
def test_readout_kernel_log_sum_exp_and_masks(shape, tiles):
  """The kernel's LSE equals logsumexp over the visible [state ; window] scores computed
  densely, and masked rows/slots get no weight. "blocked": 2 query blocks x 2 state blocks x 2
  window blocks of 128, so the online softmax really streams. "one_block": two batch rows that see
  7 and 5 state rows (packed documents' per-row masks). "ragged": 150 query rows, 100 state rows
  and 100 window slots, none a whole tile: the kernel pads them itself. ``tiles``: the CPU's
  tiling, or the TPU's (interpreted: 128-row state and window steps, everything padded to them)."""
  B, Hkv, G, Tq, R, W, D = shape
  ks = jax.random.split(jax.random.PRNGKey(0), 6)
  q = jax.random.normal(ks[0], (B, Hkv, G * Tq, D))
  sk, sv = jax.random.normal(ks[1], (B, Hkv, R, D)), jax.random.normal(ks[2], (B, Hkv, R, D))
  wk, wv = jax.random.normal(ks[3], (B, Hkv, W, D)), jax.random.normal(ks[4], (B, Hkv, W, D))
  seen = 7 - 2 * np.arange(B)[:, None] if R < 100 else min(200, R - 10)  # rows each row sees
  state_ok = np.arange(R)[None] < seen                                              # [B, R]
  window_ok = np.arange(W)[None, :] <= W - Tq + np.arange(Tq)[:, None]
  sbias = jnp.broadcast_to(jnp.where(state_ok, 0.0, -1e30)[:, None, None], (B, Hkv, 1, R))
  wbias = jnp.tile(jnp.where(window_ok, 0.0, -1e30), (G, 1))
  scale = jnp.full((Hkv, G * Tq, 1), 0.25)
  kc = backend.KernelConfig(tiles, interpret=True)
  y, lse = fused_readout(q, sk, sv, sbias, wk, wv, wbias, scale, scale, kc)
  assert y.shape == (B, Hkv, G * Tq, D) and lse.shape == (B, Hkv, G * Tq, 1)
  scores = jnp.concatenate([jnp.einsum("bhqd,bhkd->bhqk", q, sk) * 0.25 + sbias,
                            jnp.einsum("bhqd,bhkd->bhqk", q, wk) * 0.25 + wbias], axis=-1)
  np.testing.assert_allclose(lse[..., 0], jax.nn.logsumexp(scores, axis=-1), rtol=1e-5, atol=1e-5)
  p = jax.nn.softmax(scores, axis=-1)
  want = jnp.einsum("bhqk,bhkv->bhqv", p, jnp.concatenate([sv, wv], axis=2))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  # Changing a masked state row changes nothing.
  sv2 = sv.at[:, :, R - 3].set(100.0)
  y2, _ = fused_readout(q, sk, sv2, sbias, wk, wv, wbias, scale, scale, kc)
  np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))


def test_update_kernel_decisions_on_hand_made_ties():
  """Novelty ties go to the lower token, merge ties to the lower row, sinks never merge: the
  kernel and the XLA update agree on a state built to have exact ties."""
  cfg = kj.KVMConfig(chunk_size=4, window_chunks=2, sink_rows=1, rope_dims=0,
                     budget=kj.FixedBudget(6), gate_keys=False)
  D = 4
  params = kj.KVMParams.init(D, 1)
  state = kj.KVMState(keys=jnp.zeros((1, 1, 6, D)).at[0, 0, :3].set(jnp.eye(D)[:3] * 2.0),
                      values=jnp.ones((1, 1, 6, D)), radius=jnp.ones((1, 1, 6)),
                      num_rows=jnp.asarray(3, jnp.int32))
  k = jnp.asarray([[[[1.0, 0, 0, 0]], [[0, 1.0, 0, 0]], [[0, 0, 0, 1.0]], [[0, 0, 0, 1.0]]]])
  v = jnp.arange(16.0).reshape(1, 4, 1, 4)
  g = jnp.ones((1, 4, 1))
  for n_append in (0, 1, 2):
    a, ra = update_state(state, k, v, g, n_append, params, cfg, return_routing=True)
    b, rb = update_state_pallas(state, k, v, g, n_append, params, cfg, return_routing=True,
                                kc=backend.KernelConfig("cpu", interpret=True))
    for x, y in zip(ra, rb):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    np.testing.assert_allclose(b.keys, a.keys, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.values, a.values, rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(rb[1]) == 0)  # row 0 is the sink


def test_decode_and_prefill_with_kernels():
  cfg, (q, k, v, g, params), _ = _case("fixed_sink1_gqa", seed=5)
  want, _ = kj.kvm_attention(q, k, v, g, params, cfg)
  cache = kj.kvm_init_cache(cfg, batch=2, kv_heads=2, head_dim=16, value_dim=16, max_len=61)
  pallas = kj.resolve_kvm_backend(cfg, implementation="pallas")
  y, cache = kj.kvm_prefill(q[:, :20], k[:, :20], v[:, :20], g[:, :20], params, cfg, cache,
                            backend=pallas)
  outs = [y]
  for t in range(20, 61):
    s = slice(t, t + 1)
    y, cache = kj.kvm_decode_step(q[:, s], k[:, s], v[:, s], g[:, s], params, cfg, cache,
                                  backend=pallas)
    outs.append(y)
  assert rel_rms(jnp.concatenate(outs, axis=1), want) < 2e-5


def test_model_with_pallas_implementation():
  xla = make_model("kvm", seed=7)
  pallas = make_model("kvm", seed=7, kvm_implementation="pallas")
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 30), 0, 256)
  assert rel_rms(pallas(tokens), xla(tokens)) < 2e-5


def test_implementation_choices():
  cfg, (q, k, v, g, params), _ = _case("sqrt_sink0")
  decided = lambda **kw: kj.resolve_kvm_backend(cfg, **kw)  # noqa: E731
  auto, _ = kj.kvm_attention(q, k, v, g, params, cfg, backend=decided(implementation="auto"))
  xla, _ = kj.kvm_attention(q, k, v, g, params, cfg, backend=decided(implementation="xla"))
  np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))  # nothing measured faster yet
  with pytest.raises(ValueError, match="implementation='cuda'"):
    decided(implementation="cuda")
  bf16_readout = kj.KVMConfig(chunk_size=8, window_chunks=2, rope_dims=8,
                              budget=kj.FixedBudget(12), readout_value_dtype="bfloat16")
  with pytest.raises(ValueError, match="readout_value_dtype"):
    kj.resolve_kvm_backend(bf16_readout, implementation="pallas")
  with pytest.raises(ValueError, match="kvm_implementation"):
    kj.presets.tiny(kvm_implementation="triton")


# -- lowering for accelerators, at the paper's shapes (C=256, D=128) -----------------------------

PAPER = dict(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64)


# The chip each platform's programs are built for: compile_target makes every decision the chip's
# (kernels compiled, not interpreted; the scan's layouts and row update).
CHIPS = {"tpu": "v5e:2x2", "cuda": "h100:1x1"}


def _build_for_chip(f, args, kernels: list, platform: str, *, compile: bool) -> None:
  """``f`` built for ``platform``'s chip calls the named kernels (Mosaic: one ``tpu_custom_call``
  each at least; Triton: by name); with ``compile``, ``f`` and its backward compile for the chip
  (Mosaic / Triton and XLA run) and fit its memory."""
  grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
  with kj.compile_target(CHIPS[platform]) as chip:
    structs = chip.structs(args)
    lowered = jax.jit(f).lower(*structs)
    text = lowered.as_text()
    if platform == "tpu":
      assert text.count("tpu_custom_call") >= len(kernels)
    else:
      for name in kernels:
        assert name in text, name
    if compile:
      for compiled in (lowered.compile(), jax.jit(grad).lower(*structs).compile()):
        assert program_bytes(compiled) <= chip.memory_per_chip


def _paper_scan(rows, heads, dtype):
  """The scan on the kernels at the paper's operator shape (B=8, D=128, C=256, two window
  chunks) with R state rows, and the kernels it must call."""
  cfg = kj.KVMConfig(**PAPER, budget=kj.FixedBudget(rows))
  (H, Hkv), dtype = heads, jnp.dtype(dtype)
  B, D = 8, 128
  T = rows + 4 * 256  # the state fills to R rows before the last chunks
  assert kj.kvm_schedule(cfg, T).final_rows == rows
  spec = lambda *s, dt=dtype: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = (spec(B, T, H, D), spec(B, T, Hkv, D), spec(B, T, Hkv, D), spec(B, T, Hkv, dt=jnp.float32),
          jax.eval_shape(lambda: kj.KVMParams.init(D, H)))
  f = lambda *a: kvm_attention_scan(*a, cfg=cfg, ops=chunk_ops("pallas"))[0]  # noqa: E731
  # novelty is computed only where the static schedule appends rows (R > C here)
  kernels = ["kvm_fused_readout", "kvm_route_argmax", "kvm_add_rows"]
  kernels += ["kvm_route_novelty"] if any(kj.kvm_schedule(cfg, T).n_append) else []
  assert (rows > 256) == ("kvm_route_novelty" in kernels)
  return f, args, kernels


@pytest.mark.xdist_group("libtpu")  # built for a v5e: libtpu, held by one process at a time
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_scan_calls_the_kernels_on_chips(platform):
  """Built for a v5e / an H100, the scan's forward calls the readout, both routing kernels and
  the row accumulation (the kernels themselves compile in tests/kernels/test_chip_compile.py)."""
  _build_for_chip(*_paper_scan(1024, (32, 8), "float32"), platform, compile=False)


@pytest.mark.slow  # minutes each: the whole scan forward and backward through XLA and the kernels
@pytest.mark.chip_compile
@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("rows, heads, dtype", [
    (256, (32, 32), "bfloat16"), (1024, (32, 8), "float32"), (4096, (32, 8), "bfloat16"),
    (4096, (24, 8), "float32")],
    ids=["R256-G1-bf16", "R1024-G4-f32", "R4096-G4-bf16", "R4096-G3-f32"])
def test_scan_compiles_for_chips(platform, rows, heads, dtype):
  """The paper's operator shapes with R state rows: the forward (readout, both routing kernels,
  row accumulation) and the backward compile for a v5e and an H100 and fit their memory."""
  _build_for_chip(*_paper_scan(rows, heads, dtype), platform, compile=True)


def _paper_documents():
  cfg = kj.KVMConfig(**PAPER, budget=kj.FixedBudget(1024))
  B, T, H, Hkv, D = 2, 4096, 8, 4, 128
  spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
  args = (spec(B, T, H, D), spec(B, T, Hkv, D), spec(B, T, Hkv, D), spec(B, T, Hkv, dt=jnp.float32),
          jax.eval_shape(lambda: kj.KVMParams.init(D, H)), spec(B, T, dt=jnp.int32))
  f = lambda q, k, v, g, p, seg: kvm_attention_documents(  # noqa: E731
      q, k, v, g, p, seg, cfg=cfg, ops=chunk_ops("pallas"))[0]
  kernels = ["kvm_fused_readout", "kvm_route_novelty", "kvm_route_argmax", "kvm_add_rows"]
  return f, args, kernels


@pytest.mark.xdist_group("libtpu")
@pytest.mark.parametrize("compile", [
    False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.chip_compile])],
    ids=["calls-kernels", "compiles"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_document_kernels_on_chips(platform, compile):
  """Packed documents on the kernels (a state mask per batch row in the readout, row bounds per
  batch row in the routing kernels) at the paper's operator shapes with a budget that appends
  rows: built for a v5e / an H100 the op calls every kernel; it compiles there, forward and
  backward (nightly)."""
  _build_for_chip(*_paper_documents(), platform, compile=compile)


def test_gpu_target_rejects_non_power_of_two_chunks():
  cfg = kj.KVMConfig(chunk_size=24, window_chunks=2, rope_dims=8, budget=kj.FixedBudget(24))
  q, k, v, g = random_inputs(0, 1, 100, 2, 2, 16, 16)
  ops = chunk_ops("pallas", target="cuda", interpret=False)
  f = lambda *a: kvm_attention_scan(*a, cfg=cfg, ops=ops)
  with pytest.raises(ValueError, match="power-of-two sizes, got {'chunk_size': 24}"):
    jax.jit(f).trace(q, k, v, g, random_params(0, 16, 2))


def test_kernels_run_per_shard_under_a_mesh(subprocess_environ):
  """On 8 simulated devices, batch over (data, fsdp) and KV heads over tensor (the axis names
  given by the caller): the kernels run inside shard_map, keep the input sharding, and match the
  unsharded XLA path (values and grads). Without axis names they are not split."""
  import subprocess
  import sys
  import textwrap
  from pathlib import Path
  root = ROOT
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp
      import kvm_jax as kj
      from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      from kvm_jax.ops.kvm.api import chunk_ops, kernel_sharding
      from kvm_jax.ops.kvm.cases import random_inputs, random_params, rel_rms
      from kvm_jax.ops.kvm.documents import kvm_attention_documents
      from kvm_jax.ops.kvm.scan import XLA_OPS, kvm_attention_scan
      cfg = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=8,
                         budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))
      q, k, v, g = random_inputs(0, 4, 45, 4, 2, 16, 16)
      params = random_params(0, 16, 4)
      loss = lambda ops, q, k, v, g: jnp.sum(kvm_attention_scan(
          q, k, v, g, params, cfg=cfg, ops=ops)[0])
      ref = kvm_attention_scan(q, k, v, g, params, cfg=cfg)[0]
      ref_grad = jax.grad(lambda q: loss(XLA_OPS, q, k, v, g))(q)
      mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
      spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
      qs, ks, vs, gs = (jax.device_put(x, spec) for x in (q, k, v, g))
      run = lambda ops: jax.jit(lambda *a: kvm_attention_scan(*a, params, cfg=cfg, ops=ops)[0])
      with jax.set_mesh(mesh):
        unsplit = run(chunk_ops("pallas", interpret=True))
        assert "manual" not in unsplit.lower(qs, ks, vs, gs).as_text()  # no names: no shard_map
        with kernel_sharding(batch_axes=("data", "fsdp"), head_axis="tensor"):
          pallas = chunk_ops("pallas", interpret=True)
        f = run(pallas)
        y = f(qs, ks, vs, gs)
        assert "manual" in f.lower(qs, ks, vs, gs).as_text()  # shard_map: manual sharding
        grad = jax.jit(jax.grad(lambda q: loss(pallas, q, ks, vs, gs)))(qs)
        # Packed documents: the routing kernels' row bounds are per batch row, split with it.
        seg = jnp.asarray([[1] * 20 + [2] * 25] * 2 + [[0] * 3 + [3] * 42] * 2, jnp.int32)
        segs = jax.device_put(seg, NamedSharding(mesh, P(("data", "fsdp"), None)))
        docs = jax.jit(lambda *a: kvm_attention_documents(*a, params, segs, cfg=cfg,
                                                          ops=pallas)[0])(qs, ks, vs, gs)
      docs_ref = kvm_attention_documents(q, k, v, g, params, seg, cfg=cfg)[0]
      assert y.sharding.spec == P(("data", "fsdp"), None, "tensor"), y.sharding
      assert rel_rms(y, ref) < 2e-5 and rel_rms(grad, ref_grad) < 1e-4
      assert rel_rms(docs, docs_ref) < 2e-5
      print("OK")
  """)
  # The suite's fast compilation and shared compilation cache, 8 host devices.
  proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=subprocess_environ(8),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
