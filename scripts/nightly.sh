#!/usr/bin/env bash
# Nightly-style checks that are too slow for CI: the whole suite with XLA's default compilation
# (CI compiles with jax_disable_most_optimizations and XLA:CPU's elemental emitter to save time:
# tests/conftest.py), the tests marked `slow`, and the core speed benchmark (prints ratios
# against full attention measured in the same run).
set -euo pipefail
cd "$(dirname "$0")/.."
KVM_TEST_FAST_COMPILE=0 JAX_PLATFORMS=${JAX_PLATFORMS:-cpu} python -m pytest -n 2 --runslow
python -m kvm_jax.eval.bench.core_speed "$@"
python -m kvm_jax.eval.check
