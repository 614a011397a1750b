"""``kvm-bench --slots``: the engine's step compiled for one v5e chip (XLA:TPU runs through
libtpu on this CPU host) and the most slots that fit found from compiled memory.

The oracle for the bytes per slot is the caches' own size: a slot's growth of the compiled
program must be its decode cache (every array of ``LM.init_cache`` for one row, which the step
keeps as an argument and donates) plus a little of the step's per-slot working memory.
"""

from __future__ import annotations

import pytest

pytest.importorskip("libtpu")

import jax  # noqa: E402

from kvm_jax import presets  # noqa: E402
from kvm_jax.eval.bench import slots  # noqa: E402

pytestmark = [pytest.mark.chip_compile, pytest.mark.xdist_group("libtpu")]

CONTEXT = 1 << 18   # a full-attention slot of 2 layers x 4 heads x 32 dims: 256 MiB in bf16


def _full_attention():
  return presets.tiny(mixers="full", num_layers=2, num_heads=4, hidden_size=128)


def _cache_bytes(cfg, context: int) -> int:
  model = slots.serving_model(cfg)
  caches = jax.eval_shape(lambda: model.init_cache(1, context))
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(caches))


def _per_slot(cfg, context: int) -> tuple[int, int]:
  """``(bytes per slot of the compiled step, bytes of one slot's cache)`` on one v5e chip: the
  growth from slots.LANES to one more slot (beyond the step's prompt lanes, which grow with the
  slots up to their count)."""
  model = slots.serving_model(cfg)
  low, high = (slots.compile_step(model, n, context, "v5e:1x1", chunk=64)
               for n in (slots.LANES, slots.LANES + 1))
  assert low.fits and high.fits, (low.error, high.error)
  return high.total_bytes - low.total_bytes, _cache_bytes(cfg, context)


# A slot costs its cache and nothing more: the step updates the caches in place (a copy of them
# in the step, e.g. a select of stepped rows against kept ones or a ring relaid out for its
# write, costs a whole cache per slot, or four with a head dim padded to 128 lanes). The lower
# bound allows for XLA's fixed temporaries, which shift by under a MB from one compile to the
# next (measured 0.998 of the cache at 2**18 tokens, 1.015 at 2**16).
LEAST, MOST = 0.99, 1.05


def test_a_slot_of_the_compiled_step_costs_its_cache_at_64k():
  per_slot, cache = _per_slot(_full_attention(), 1 << 16)
  assert LEAST * cache <= per_slot <= MOST * cache, (per_slot, cache)


@pytest.mark.slow  # two compiles of a 256 MiB-per-slot step (a minute); the 64K check is CI's
def test_a_slot_of_the_compiled_step_costs_its_cache():
  per_slot, cache = _per_slot(_full_attention(), CONTEXT)
  assert LEAST * cache <= per_slot <= MOST * cache, (per_slot, cache)


@pytest.mark.slow  # about ten compiles; the 64K per-slot check above is CI's
def test_the_most_slots_fit_and_one_more_does_not():
  found = slots.most_slots(_full_attention(), CONTEXT, "v5e:1x1", chunk=64)
  assert found.slots > 8
  assert found.fitting.fits and found.fitting.name == f"{found.slots} slots"
  assert not found.failing.fits and found.failing.name == f"{found.slots + 1} slots"
  assert found.slots * _cache_bytes(_full_attention(), CONTEXT) <= found.fitting.memory
