#!/usr/bin/env bash
# The one prepared device check: one run of at most 9.5 minutes on one NVIDIA H200 (jax with CUDA),
# from a plain checkout (nothing installed).
#
#   OUT=/path/to/out bash scripts/device_check.sh     # results in $OUT (default: ./device_out)
#   bash scripts/device_check.sh --smoke              # tiny shapes, any backend (CPU: ~1 minute)
#   bash scripts/device_check.sh --help               # the stages, the files, every flag
#
# The harness is benchmarks/device/ (python -m benchmarks.device; never installed by pip).
# $PYTHON selects the interpreter (default: python3). Run it from anywhere; relative paths (OUT,
# flags) are relative to the current folder.
#
# Nothing is installed: the installed package maps eval/ -> kvm_jax.eval, pallas_kernels/ ->
# kvm_jax.kernels and train/ -> kvm_jax.train (pyproject.toml), which PYTHONPATH=. cannot
# express, so this script builds that layout as a temporary folder of symlinks (with benchmarks/
# beside it) and puts it first on PYTHONPATH.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

pkg=$(mktemp -d "${TMPDIR:-/tmp}/kvm_jax_path.XXXXXX")
trap 'rm -rf "$pkg"' EXIT   # removes the links only, never what they point to
mkdir "$pkg/kvm_jax"
for entry in "$repo"/kvm_jax/*; do
  [ "$(basename "$entry")" = "__pycache__" ] || ln -s "$entry" "$pkg/kvm_jax/"
done
ln -s "$repo/eval" "$pkg/kvm_jax/eval"
ln -s "$repo/pallas_kernels" "$pkg/kvm_jax/kernels"
ln -s "$repo/train" "$pkg/kvm_jax/train"
ln -s "$repo/benchmarks" "$pkg/benchmarks"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
# The current folder must not come first on sys.path: run from the repository root, its own
# kvm_jax/ (without eval, kernels, train) would shadow the linked one (Python >= 3.11).
export PYTHONSAFEPATH=1
export PYTHONUNBUFFERED=1

"$python" -m benchmarks.device "$@"
