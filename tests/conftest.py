"""Fixtures and hooks of the test session: the persistent compilation cache, the ``slow`` marker,
subprocess environments and bounded memory mappings. What tests import lives in
:mod:`tests.helpers`.

Random inputs, parameters, the error metric and the case matrix of the KVM checks are shared
with ``kvm-check``: they live in :mod:`kvm_jax.ops.kvm.cases`.
"""

from __future__ import annotations

import os
import shutil
import tempfile

# First: the helpers set the fast-compilation environment before JAX starts.
from tests.helpers import subprocess_env

import jax
import pytest




@pytest.fixture
def subprocess_environ(tmp_path_factory):
  """:func:`subprocess_env` bound to this worker's temporary root: ``subprocess_environ(devices)``."""
  root = tmp_path_factory.getbasetemp()
  return lambda devices=1, **extra: subprocess_env(root, devices, **extra)


def pytest_configure(config):
  """One persistent compilation cache per test session, shared by the xdist workers.

  Most of the suite's time is XLA compiling many small programs, and tests build the same ones
  again through fresh ``jax.jit`` objects (a new model, a new trainer, an eager op in another
  worker), which the in-memory caches cannot see. The session's first process (the xdist
  controller, or pytest alone) makes the directory and removes it at the end; workers inherit
  it through the environment. ``KVM_TEST_COMPILE_CACHE=0`` turns it off."""
  if os.environ.get("KVM_TEST_COMPILE_CACHE", "1") != "1":
    return
  if "KVM_TEST_CACHE_DIR" not in os.environ:
    os.environ["KVM_TEST_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvm-jax-test-cache-")
    config._kvm_cache_owner = True
  jax.config.update("jax_compilation_cache_dir", os.environ["KVM_TEST_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if getattr(config, "_kvm_cache_owner", False):
    shutil.rmtree(os.environ.pop("KVM_TEST_CACHE_DIR"), ignore_errors=True)


# Every compiled XLA:CPU program keeps memory mappings of its own while any jit cache holds it,
# and a long-lived xdist worker compiles thousands: past the kernel's vm.max_map_count (65530 by
# default) the next mmap fails inside LLVM and the worker dies mid-compile (segfault or abort).
# tests/nn/test_model.py alone leaves ~12k mappings. Above this many (20k below the limit, more than
# a whole test file adds), the caches are dropped after the test; dropping them costs retracing,
# so it happens rarely, and the persistent compilation cache on disk spares the recompiling.
MAX_MAPPINGS = 45_000


def _mappings() -> int:
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux: no such limit to watch
    return 0


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
  yield
  if _mappings() > MAX_MAPPINGS:
    import gc
    jax.clear_caches()
    gc.collect()


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
  if config.getoption("--runslow"):
    return
  skip = pytest.mark.skip(reason="slow: run with --runslow (scripts/nightly.sh)")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


