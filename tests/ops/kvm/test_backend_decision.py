"""One backend decision: ``resolve_kvm_backend`` / ``resolve_attention_backend`` decide every choice
of their op for a platform given as an argument (no device needed), the KVM entry points take the
same backend arguments, and bad requests name the bad value and the choices."""

from __future__ import annotations

import inspect

import jax.numpy as jnp
import numpy as np
import pytest

import kvm_jax as kj
from kvm_jax.kernels.tokamax_readout import tokamax_available
from kvm_jax.kernels.backend import KernelConfig
from kvm_jax.kernels.sharding import ShardAxes
from kvm_jax.ops.attention.api import AttentionBackend, resolve_attention_backend
from kvm_jax.ops.kvm import (XLA_OPS, KVMBackend, chunk_ops, kernel_sharding,
                             resolve_kvm_backend)
from kvm_jax.ops.kvm.cases import random_inputs

CFG = kj.KVMConfig(chunk_size=8, window_chunks=2, sink_rows=1, rope_dims=4,
                   budget=kj.PowerLawBudget(4.0, 0.5, min_rows=8))

# platform -> (source_layout of XLA ops, source_layout of the kernels, row_update)
EXPECTED = {"cpu": ("time", "heads", "scatter"), "gpu": ("heads", "heads", "onehot"),
            "tpu": ("time", "time", "onehot")}


@pytest.mark.parametrize("platform", sorted(EXPECTED))
def test_kvm_decisions_per_platform(platform):
  xla_layout, kernel_layout, row_update = EXPECTED[platform]
  for requested in ("auto", "xla"):  # no platform is in AUTO_PALLAS_BACKENDS yet
    assert resolve_kvm_backend(CFG, implementation=requested, platform=platform) == KVMBackend(
        platform=platform, implementation="xla", readout="own", source_layout=xla_layout,
        row_update=row_update, kernel_config=None)
  pallas = resolve_kvm_backend(CFG, implementation="pallas", platform=platform)
  assert (pallas.implementation, pallas.readout, pallas.source_layout, pallas.row_update) == (
      "pallas", "own", kernel_layout, row_update)
  assert pallas.kernel_config == KernelConfig(platform, interpret=platform == "cpu")
  # the decision is printable: it says what runs
  assert f"platform='{platform}'" in repr(pallas) and "source_layout=" in repr(pallas)


def test_kvm_decision_details():
  """'cuda' names the GPU; the default platform is this machine's; the kernel configuration is
  taken as given, or built over the enclosing kernel_sharding; the chunk operations follow."""
  assert resolve_kvm_backend(CFG, platform="cuda").platform == "gpu"
  assert resolve_kvm_backend(CFG).platform == kj.current_platform()
  mine = KernelConfig("gpu", interpret=True)
  assert resolve_kvm_backend(CFG, implementation="pallas", kernel_config=mine,
                             platform="gpu").kernel_config is mine
  with kernel_sharding(batch_axes=("data",), head_axis="tensor"):
    kc = resolve_kvm_backend(CFG, implementation="pallas", platform="tpu").kernel_config
  assert kc.shard_axes == ShardAxes(batch=("data",), heads="tensor")
  pallas = resolve_kvm_backend(CFG, implementation="pallas", platform="cpu")
  assert pallas.chunk_ops() == chunk_ops("pallas", interpret=True)
  xla = resolve_kvm_backend(CFG, implementation="xla", platform="cpu")
  assert xla.chunk_ops() is XLA_OPS
  if tokamax_available():
    tok = resolve_kvm_backend(CFG, readout="tokamax", platform="gpu")
    assert tok.readout == "tokamax" and "tokamax" in tok.chunk_ops().name


def test_heads_split_follows_the_named_head_axis_and_the_mesh():
  """The scan's TPU pins keep heads whole only where heads may arrive split: a head axis named
  around the decision, unless the mesh set there gives it one device. A backend decided inside
  the context is accepted outside it (the decision carries the answer), and its chunk operations
  carry it to the scan."""
  import jax
  assert not resolve_kvm_backend(CFG, platform="tpu").heads_split
  with kernel_sharding(batch_axes=("data",)):
    assert not resolve_kvm_backend(CFG, platform="tpu").heads_split
  with kernel_sharding(batch_axes=("data",), head_axis="tensor"):
    split = resolve_kvm_backend(CFG, platform="tpu")
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    with jax.set_mesh(mesh):
      assert not resolve_kvm_backend(CFG, platform="tpu").heads_split
  assert split.heads_split and split.chunk_ops().heads_split
  assert not resolve_kvm_backend(CFG, platform="tpu").chunk_ops().heads_split
  q, k, v, g = random_inputs(0, B, 2 * CFG.chunk_size, H, HKV, D, D)
  params = kj.KVMParams.init(D, H)
  with kernel_sharding(head_axis="tensor"):
    chosen = resolve_kvm_backend(CFG)
  np.testing.assert_array_equal(kj.kvm_attention(q, k, v, g, params, CFG, backend=chosen).y,
                                kj.kvm_attention(q, k, v, g, params, CFG,
                                                 backend=resolve_kvm_backend(CFG)).y)


@pytest.mark.parametrize("kwargs, match", [
    (dict(implementation="triton"), r"implementation='triton'.*'xla', 'pallas'"),
    (dict(readout="flash"), r"readout='flash'.*'own', 'tokamax'"),
    (dict(platform="metal"), r"platform='metal'.*'cpu', 'gpu', 'tpu'"),
    (dict(kernel_config="tpu"), r"kernel_config='tpu'.*KernelConfig"),
    (dict(implementation="xla", kernel_config=KernelConfig("cpu", True)),
     r"kernel_config=.*implementation='xla'"),
])
def test_bad_kvm_requests_name_the_value(kwargs, match):
  with pytest.raises(ValueError, match=match):
    resolve_kvm_backend(CFG, **kwargs)


def test_pallas_refuses_readout_value_dtype():
  import dataclasses
  cfg = dataclasses.replace(CFG, readout_value_dtype="bfloat16")
  with pytest.raises(ValueError, match="readout_value_dtype"):
    resolve_kvm_backend(cfg, implementation="pallas", platform="cpu")


def test_entry_points_take_one_decided_backend():
  """The three entry points take the backend as one keyword-only ``backend=`` (default: the XLA
  scan); the choices it is decided from are the resolver's arguments, not theirs."""
  choices = {"implementation", "readout", "kernel_config"}
  for fn in (kj.kvm_attention, kj.kvm_prefill, kj.kvm_decode_step):
    params = inspect.signature(fn).parameters
    assert params["backend"].default is None, fn.__name__
    assert params["backend"].kind is inspect.Parameter.KEYWORD_ONLY, fn.__name__
    assert not choices & set(params), fn.__name__
  assert choices | {"platform"} <= set(inspect.signature(resolve_kvm_backend).parameters)


# The decode step at t = T = 32 folds a chunk (t >= L + C).
B, T, H, HKV, D = 1, 32, 4, 2, 16


def _prefill_then_decode(seed: int, **backend):
  """Prefill T tokens, then decode token T, with the given backend arguments: (prefill output,
  decoded output, state keys), and the inputs and empty cache for further calls."""
  q, k, v, g = random_inputs(seed, B, T + 1, H, HKV, D, D)
  params = kj.KVMParams.init(D, H)
  cache0 = kj.kvm_init_cache(CFG, batch=B, kv_heads=HKV, head_dim=D, value_dim=D,
                             max_len=T + 1)
  y, cache = kj.kvm_prefill(q[:, :T], k[:, :T], v[:, :T], g[:, :T], params, CFG, cache0,
                            **backend)
  y_t, cache = kj.kvm_decode_step(q[:, T:], k[:, T:], v[:, T:], g[:, T:], params, CFG, cache,
                                  **backend)
  return (y, y_t, cache.state.keys), ((q, k, v, g), params, cache0)


def test_prefill_and_decode_with_an_explicit_readout_equal_the_default():
  default, ((q, k, v, g), params, cache0) = _prefill_then_decode(3)
  own, _ = _prefill_then_decode(3, backend=resolve_kvm_backend(CFG, implementation="xla",
                                                               readout="own"))
  for a, b in zip(default, own):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="readout='flash'"):
    resolve_kvm_backend(CFG, readout="flash")


def test_a_backend_is_checked_against_the_decision():
  """With no backend the ops run the XLA scan; a backend not decided by
  ``resolve_kvm_backend`` for this config (hand-made), or not a backend, is refused by name."""
  q, k, v, g = random_inputs(4, B, T + 1, H, HKV, D, D)
  params = kj.KVMParams.init(D, H)
  plain, _ = kj.kvm_attention(q, k, v, g, params, CFG)
  xla = kj.kvm_attention(q, k, v, g, params, CFG,
                         backend=resolve_kvm_backend(CFG, implementation="xla"))
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(xla.y))
  backend = resolve_kvm_backend(CFG, implementation="xla", readout="own")
  import dataclasses
  with pytest.raises(ValueError, match="is not what resolve_kvm_backend decides"):
    kj.kvm_attention(q, k, v, g, params, CFG,
                     backend=dataclasses.replace(backend, row_update="onehot"))
  with pytest.raises(ValueError, match="backend='xla' is not a KVMBackend"):
    kj.kvm_attention(q, k, v, g, params, CFG, backend="xla")


# -- softmax attention ---------------------------------------------------------------------------


def test_attention_decisions_per_platform():
  q16 = jnp.zeros((1, 1024, 4, 64), jnp.bfloat16)
  q32 = q16.astype(jnp.float32)
  want = [("gpu", q16, "cudnn"), ("gpu", q32, "chunked"), ("tpu", q16, "splash"),
          ("cpu", q16, "chunked"), ("cpu", q16[:, :512], "xla")]
  for platform, q, impl in want:
    be = resolve_attention_backend("auto", q, platform=platform)
    assert be == AttentionBackend(platform=platform, implementation=impl,
                                  interpret=platform != "tpu", shard_axes=ShardAxes()), be
  compiled = resolve_attention_backend("splash", q16, platform="cpu", interpret=False)
  assert compiled.interpret is False
  with kernel_sharding(batch_axes=("data",)):
    assert resolve_attention_backend("splash", q16, platform="tpu").shard_axes == ShardAxes(
        batch=("data",))


@pytest.mark.parametrize("implementation, q, match", [
    ("flash", jnp.zeros((1, 128, 2, 8)), r"'flash'.*choose from"),
    ("cudnn", jnp.zeros((1, 128, 2, 8)), r"'cudnn'.*bfloat16.*float32"),
    ("splash", jnp.zeros((1, 100, 2, 8)), r"'splash'.*multiple of 128, got 100"),
])
def test_bad_attention_requests_name_the_value(implementation, q, match):
  with pytest.raises(ValueError, match=match):
    resolve_attention_backend(implementation, q, platform="gpu")


@pytest.mark.skipif(not tokamax_available(), reason="needs the optional tokamax package")
def test_decode_runs_the_tokamax_readout():
  """With XLA, decode's one-token attention runs on the requested readout: tokamax's result
  equals the own readout's to float32 rounding (as tokamax's one-query case does)."""
  def decided(readout):
    return resolve_kvm_backend(CFG, implementation="xla", readout=readout)
  (_, own, _), _ = _prefill_then_decode(4, backend=decided("own"))
  (_, tokamax, _), _ = _prefill_then_decode(4, backend=decided("tokamax"))
  np.testing.assert_allclose(tokamax, own, rtol=1e-5, atol=1e-5)


def test_the_benchmarks_baseline_follows_the_one_backend_decision(monkeypatch):
  """kvm-bench's full-attention baseline (``jax.nn.dot_product_attention``) takes cuDNN exactly
  where the library's decision would: bf16 heads on GPU, not float32 ones (cuDNN refuses them),
  nowhere on TPU."""
  import jax

  from kvm_jax.eval.bench import timing
  from kvm_jax.ops.attention import api as attention_api
  heads = lambda dtype: jax.ShapeDtypeStruct((1, 1024, 4, 128), dtype)  # noqa: E731
  monkeypatch.setattr(attention_api, "current_platform", lambda: "gpu")
  assert timing.full_attention_impl(heads(jnp.bfloat16)) == "cudnn"
  assert timing.full_attention_impl(heads(jnp.float32)) == "xla"
  monkeypatch.setattr(attention_api, "current_platform", lambda: "tpu")
  assert timing.full_attention_impl(heads(jnp.bfloat16)) == "xla"
