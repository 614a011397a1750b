"""The Pallas decode kernel (kvm_jax.kernels.decode) in interpret mode against the XLA decode
attention (``decode_attention`` with ``joint_attention``), its tiling model, and its lowering for
TPU (Mosaic) and GPU (Triton) at the paper's shapes on this CPU-only machine.

Every position case poisons what the token must not see (state rows past ``num_rows``, ring slots
before the window or never written) with 1e30: a kernel that reads and uses any of them is off by
orders of magnitude, not by a tolerance."""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.kernels import backend
from kvm_jax.kernels.decode import decode_attention_pallas, decode_blocks, decode_bytes
from kvm_jax.ops.common import joint_attention, ring_positions
from kvm_jax.ops.kvm.decode import decode_attention
from tests.helpers import ROOT

# C = 8, L = 16 (two chunks), R = 40 state rows (not a power of two, not a multiple of a block).
CFG = kj.KVMConfig(chunk_size=8, window_chunks=2, rope_dims=8, budget=kj.FixedBudget(16))
B, HKV, R, D, DV = 2, 2, 40, 16, 16
POISON = 1e30
# (t, num_rows): t < L with a partly written ring and state rows that are not visible yet; t = L;
# mid-chunk (ring slots before the window: positions t-L+1 .. window_begin-1 are hidden);
# num_rows = R; past two laps of the ring.
POSITIONS = ((3, 0), (12, 9), (16, 17), (20, 33), (23, R), (45, 26))
# Several splits: 3 over the state (16 + 16 + 8 rows, blocks of 8), 2 over the ring (8 + 8 slots,
# blocks of 4), so the third program has no ring and a straddling block is masked.
SPLITS = dict(splits=3, state_split=16, state_block=8, window_split=8, window_block=4)
# float32: the same float32 products (HIGHEST on both sides) in another order, and the online
# softmax's rescaling exp(m_i - m_j) applied in steps: a few ulps, observed < 1e-6.
# bfloat16: the kernel rounds the keys to bfloat16 and scales the float32 scores by
# temperature/sqrt(D) (one GQA dot for the G heads), joint_attention rounds the per-head scaled
# keys, and the kernel rounds probabilities against a running max, not the global max: bfloat16
# rounding (epsilon 2^-8 = 4e-3) of different terms, observed < 5e-3.
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def _inputs(G, dtype, seed=0, state_dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(seed), 7)
  L = CFG.window_len
  normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
  temp = lambda k: jax.random.uniform(k, (HKV, G), jnp.float32, 0.5, 2.0)
  return dict(q=normal(ks[0], (B, 1, HKV * G, D)).astype(dtype),
              sk=normal(ks[1], (B, HKV, R, D)).astype(state_dtype),
              sv=normal(ks[2], (B, HKV, R, DV)).astype(state_dtype),
              wk=normal(ks[3], (B, L, HKV, D)).astype(dtype),
              wv=normal(ks[4], (B, L, HKV, DV)).astype(dtype), st=temp(ks[5]), wt=temp(ks[6]))


def _poisoned(x, t, num_rows):
  """State rows >= num_rows and ring slots outside [window_begin, t] set to 1e30 (state rows
  below num_rows stay genuine while t < L: the kernel must hide them by position alone)."""
  L, C = CFG.window_len, CFG.chunk_size
  window_begin = max(0, (t // C + 1) * C - L)
  hidden_slot = np.asarray(ring_positions(t, L)) < window_begin
  hidden_row = np.arange(R) >= num_rows
  poison = lambda a, hide, axis: jnp.where(
      jnp.asarray(hide).reshape([-1 if i == axis else 1 for i in range(a.ndim)]),
      jnp.asarray(POISON, a.dtype), a)
  return dict(x, sk=poison(x["sk"], hidden_row, 2), sv=poison(x["sv"], hidden_row, 2),
              wk=poison(x["wk"], hidden_slot, 1), wv=poison(x["wv"], hidden_slot, 1))


def _args(x, t, num_rows):
  return (x["q"], x["sk"], x["sv"], jnp.int32(num_rows), x["wk"], x["wv"], jnp.int32(t),
          x["st"], x["wt"])


def _max_rel(a, e):
  a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
  return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


REFERENCE = jax.jit(lambda *a: decode_attention(*a, CFG, attend=joint_attention))


# (G, dtype, target interpreted, tiling, state dtype): query heads per KV head G = 1, 3 and 4, both dtypes, the
# three kernel bodies (plain loads; TPU scalar prefetch with clamped index maps; Triton masked
# loads), one split and several, the readout state in float32 and in the cache's bfloat16.
F32, BF16 = "float32", "bfloat16"
CASES = {
    "g1_f32_splits": (1, F32, "cpu", SPLITS, F32),
    "g3_f32_splits": (3, F32, "cpu", SPLITS, F32),
    "g4_f32_default": (4, F32, "cpu", None, F32),
    "g4_bf16_splits": (4, BF16, "cpu", SPLITS, F32),
    "g3_f32_tpu_prefetch": (3, F32, "tpu", SPLITS, F32),
    "g4_bf16_gpu_masked_bf16_state": (4, BF16, "gpu", None, BF16),
    "g3_f32_gpu_masked_splits": (3, F32, "gpu", dict(SPLITS, state_block=16, window_block=16,
                                                     window_split=16), F32),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_kernel_matches_xla(name):
  G, dtype, target, tiling, state_dtype = CASES[name]
  kc = backend.KernelConfig.for_target(target, interpret=True)
  blocks = None
  if tiling is not None:
    blocks = dict(tiling, g_pad=16 if target == "gpu" else G)
  kernel = jax.jit(lambda *a: decode_attention_pallas(*a, CFG, kc=kc, blocks=blocks))
  x = _inputs(G, jnp.dtype(dtype), state_dtype=jnp.dtype(state_dtype))
  for t, num_rows in POSITIONS:
    args = _args(_poisoned(x, t, num_rows), t, num_rows)
    want, got = REFERENCE(*args), kernel(*args)
    assert got.shape == want.shape == (B, 1, HKV, G, DV) and got.dtype == jnp.float32
    assert _max_rel(got, want) < TOL[dtype], (t, num_rows, _max_rel(got, want))


def test_decode_blocks_fit_and_cover():
  """Block sizes cover every row, respect each backend's tiling, and keep one GPU program's
  working set under ~100 KiB at D = 128 for any R up to 4096 and G up to 8."""
  for platform in ("gpu", "tpu", "cpu"):
    for R_ in (1, 40, 256, 1000, 1024, 4096):
      for G in (1, 3, 4, 8):
        for dtype in (jnp.bfloat16, jnp.float32):
          L = 512
          b = decode_blocks(R_, L, G, 128, 128, dtype, platform)
          streams = ((b["state_split"], b["state_block"], R_),
                     (b["window_split"], b["window_block"], L))
          assert b["splits"] == max(-(-n // split) for split, _, n in streams)  # none idle
          for split, block, n in streams:
            assert split % block == 0
            if platform == "tpu":   # a whole dimension, or whole (8, 128) tiles
              assert split == n or (split % 128 == 0 and block % 128 == 0)
          if platform == "gpu":
            assert b["g_pad"] >= max(16, G) and b["working_set_bytes"] <= 100 * 1024, b
            assert all(v & (v - 1) == 0
                       for v in (b["g_pad"], b["state_block"], b["window_block"]))
          if platform == "tpu":
            assert b["g_pad"] % 8 == 0 and b["working_set_bytes"] < 8 << 20, b


def test_decode_bytes():
  """Bytes moved: visible state rows (float32) + the whole ring + queries + float32 partials."""
  B_, Hkv, G, D_, L, S = 8, 8, 4, 128, 512, 3
  n = decode_bytes(1000, L, B_, Hkv, G, D_, D_, 2, splits=S, g_pad=16)
  per_head = 1000 * 256 * 4 + L * 256 * 2 + 16 * D_ * 2 + S * 16 * 130 * 4
  assert n == B_ * Hkv * per_head + 2 * Hkv * 16 * 4
  more = decode_bytes(2000, L, B_, Hkv, G, D_, D_, 2) - decode_bytes(1000, L, B_, Hkv, G, D_, D_, 2)
  assert more == B_ * Hkv * 1000 * 256 * 4


# -- lowering for accelerators, at the paper's shapes (C=256, window 2 chunks, D=128) ------------

PAPER = kj.KVMConfig(chunk_size=256, window_chunks=2, sink_rows=1, rope_dims=64,
                     budget=kj.FixedBudget(256))


@pytest.mark.xdist_group("libtpu")  # built for a v5e: libtpu, held by one process at a time
@pytest.mark.parametrize("compile", [
    False, pytest.param(True, marks=[pytest.mark.slow, pytest.mark.chip_compile])],
    ids=["reads-the-cache", "compiles"])
@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_decode_kernel_on_chips(platform, compile):
  """B=8, H=32 with Hkv=32 (MHA) and Hkv=8 (GQA), R in {256, 1024, 4096}; bf16 queries and ring
  with the readout state in float32 or in the cache's bf16, and all float32: built for a v5e / an
  H100, one Mosaic / Triton custom call each, reading the cache in place; every shape compiles
  (nightly; tests/kernels/test_chip_compile.py compiles two of them in every run)."""
  chip = {"tpu": "v5e:2x2", "cuda": "h100:1x1"}[platform]
  kc = backend.KernelConfig.for_target(chip)
  Bp, H, Dp, L = 8, 32, 128, PAPER.window_len
  spec = jax.ShapeDtypeStruct
  marker = "tpu_custom_call" if platform == "tpu" else "xla.gpu.triton"
  shapes = list(itertools.product((32, 8), (256, 1024, 4096), [(jnp.bfloat16, jnp.float32)]))
  shapes += itertools.product((32, 8), (4096,), [(jnp.bfloat16, jnp.bfloat16),
                                                 (jnp.float32, jnp.float32)])
  for Hkv, rows, (dtype, state) in shapes:
    G = H // Hkv
    args = (spec((Bp, 1, H, Dp), dtype), spec((Bp, Hkv, rows, Dp), state),
            spec((Bp, Hkv, rows, Dp), state), spec((), jnp.int32),
            spec((Bp, L, Hkv, Dp), dtype), spec((Bp, L, Hkv, Dp), dtype),
            spec((), jnp.int32), spec((Hkv, G), jnp.float32), spec((Hkv, G), jnp.float32))
    f = lambda *a: decode_attention_pallas(*a, PAPER, kc=kc)
    with kj.compile_target(chip) as target:
      lowered = jax.jit(f).lower(*target.structs(args))
      if compile:
        lowered.compile()
    text = lowered.as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and marker in calls[0], (Hkv, rows, dtype, state)
    # No copy of the cache: the state (%arg1, %arg2) and the ring (%arg4, %arg5) reach the
    # kernel directly or through a reshape (the ring's free [B, L, Hkv*D] view), nothing else.
    main = text[text.index("func.func public @main"):].split("func.func", 2)[1].splitlines()
    for arg in ("%arg1", "%arg2", "%arg4", "%arg5"):
      users = [line for line in main[1:] if re.search(arg + r"\b", line)]
      assert users and all("stablehlo.custom_call" in u or "stablehlo.reshape" in u
                           for u in users), (arg, users)


def test_decode_kernel_runs_per_shard_under_a_mesh(subprocess_environ):
  """On 4 simulated devices, batch over "data" and KV heads over "tensor": the kernel runs inside
  shard_map (the time-major ring split on its head axis, no gather) and matches the XLA path."""
  import subprocess
  import sys
  import textwrap
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      from kvm_jax.kernels import backend
      from kvm_jax.kernels.decode import decode_attention_pallas
      from kvm_jax.kernels.sharding import ShardAxes
      import tests.kernels.test_pallas_decode as T
      x = T._poisoned(T._inputs(3, jnp.float32), 20, 33)
      args = T._args(x, 20, 33)
      want = T.REFERENCE(*args)
      mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
      put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
      q, sk, sv, nr, wk, wv, t, st, wt = args
      sharded = (put(q, "data", None, "tensor"), put(sk, "data", "tensor"),
                 put(sv, "data", "tensor"), nr, put(wk, "data", None, "tensor"),
                 put(wv, "data", None, "tensor"), t, put(st, "tensor"), put(wt, "tensor"))
      kc = backend.KernelConfig.for_target("cpu", shard_axes=ShardAxes(("data",), "tensor"))
      f = jax.jit(lambda *a: decode_attention_pallas(*a, T.CFG, kc=kc, blocks=dict(
          T.SPLITS, g_pad=3)))
      with jax.set_mesh(mesh):
        text = f.lower(*sharded).as_text()
        got = f(*sharded)
      assert "manual" in text and "all-gather" not in text and "all_gather" not in text
      assert T._max_rel(got, want) < 1e-5, T._max_rel(got, want)
      print("OK")
  """)
  proc = subprocess.run([sys.executable, "-c", script], cwd=str(ROOT), env=subprocess_environ(4),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
