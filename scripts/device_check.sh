#!/usr/bin/env bash
# The one prepared script for a GPU/TPU machine: verifies the compiled Pallas kernels against the
# XLA path at the paper's geometry (kvm-check), then times both implementations against
# jax.nn.dot_product_attention (cuDNN on GPU) at the paper's operator setup (B=8, H=32, D=128,
# bf16). Results go to $OUT (or ./device_out).
#   bash scripts/device_check.sh            # ~5-8 minutes on an H200
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-device_out}
mkdir -p "$out"
python -c "import jax; print(jax.devices())" | tee "$out/devices.txt"
python -m kvm_jax.eval.check --size paper 2>&1 | tee "$out/kvm_check_paper.txt"
python -m kvm_jax.eval.check 2>&1 | tee "$out/kvm_check_small.txt"
for impl in xla pallas; do
  timeout 400 python -m kvm_jax.eval.speed --paper --implementation "$impl" --repeats 5 \
      --lengths 512,2048,8192,32768 --json "$out/bench_$impl.json" 2>&1 | tee "$out/bench_$impl.txt"
done
