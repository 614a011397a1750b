#!/usr/bin/env bash
# The one prepared device check: one run of at most 8 minutes on one NVIDIA H200 (jax with CUDA).
#
#   OUT=/path/to/out bash scripts/device_check.sh     # results in $OUT (default: ./device_out)
#   bash scripts/device_check.sh --smoke              # tiny shapes, any backend (CPU: < 1 minute)
#   bash scripts/device_check.sh --help               # every flag of the driver
#
# Stages, each in its own child process under its own time budget (a hung compile or a crash
# loses only that stage's remaining entries): env, compile (compile-only matrix of the Pallas and
# XLA paths at the paper's shapes), numerics (pallas vs xla, also under float32 matmuls),
# check (kvm-check --size paper), prefill / decode / backward timings against cuDNN attention,
# and one profiler trace. Outputs in $OUT: results.jsonl (one JSON object per measurement,
# appended as it goes), summary.md (the tables, built from results.jsonl at the end),
# logs/<stage>.log, check_<size>.txt, nvidia-smi.txt, trace/ and console.txt.
# The logic is in eval/device_check.py (kvm_jax.eval.device_check); arguments are passed to it.
#
# Nothing is installed: the installed package maps eval/ -> kvm_jax.eval, pallas_kernels/ ->
# kvm_jax.kernels and train/ -> kvm_jax.train (pyproject.toml), which PYTHONPATH=. cannot express,
# so this script builds that layout as a temporary folder of symlinks and puts it first on
# PYTHONPATH. $PYTHON selects the interpreter (default: python). Run it from anywhere; relative
# paths (OUT, flags) are relative to the current folder.
set -uo pipefail
out=${OUT:-device_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}

pkg=$(mktemp -d "${TMPDIR:-/tmp}/kvm_jax_path.XXXXXX")
trap 'rm -rf "$pkg"' EXIT   # removes the links only, never what they point to
mkdir "$pkg/kvm_jax"
for entry in "$repo"/kvm_jax/*; do
  [ "$(basename "$entry")" = "__pycache__" ] || ln -s "$entry" "$pkg/kvm_jax/"
done
ln -s "$repo/eval" "$pkg/kvm_jax/eval"
ln -s "$repo/pallas_kernels" "$pkg/kvm_jax/kernels"
ln -s "$repo/train" "$pkg/kvm_jax/train"
export PYTHONPATH="$pkg${PYTHONPATH:+:$PYTHONPATH}"
# The current folder must not come first on sys.path: run from the repository root, its own
# kvm_jax/ (without eval, kernels, train) would shadow the linked one (Python >= 3.11).
export PYTHONSAFEPATH=1

"$python" -m kvm_jax.eval.device_check --out "$out" "$@" 2>&1 | tee "$out/console.txt"
exit "${PIPESTATUS[0]}"
