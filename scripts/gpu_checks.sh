#!/usr/bin/env bash
# The GPU checks, in one command, for a GPU machine without package registries
# (the project's `device` machines). Run from the checkout root; logs and JSON
# go to $OUT (default ./gpu-results).
#
# Before, on a machine with Debian's registry (once per checkout):
#   echo /.devdeps/ >> .git/info/exclude && ../shared/offline-build/fetch-debs.sh .devdeps
# then carry .devdeps to the GPU machine and run:  bash scripts/gpu_checks.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
[ -f .devdeps/device-env.sh ] && source .devdeps/device-env.sh
PY=${PYTHON:-python3}

step() { echo "== $*" | tee -a "$OUT/summary.txt"; }

step "build"
meson setup build-gpu --buildtype=release -Dcuda=enabled -Dgpu_arch='80;90' > "$OUT/build.log" 2>&1 \
  && ninja -C build-gpu >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
nvidia-smi -L | tee -a "$OUT/summary.txt"
export PYTHONPATH=$PWD/py:$PWD/build-gpu

step "C++ tests"
./build-gpu/bagua_cpp_tests 2>&1 | tail -3 | tee -a "$OUT/summary.txt"

step "GPU tests: kernels against the CPU (bit equality, reductions)"
$PY -m pytest -q -rs tests/python/test_gpu.py 2>&1 | tee "$OUT/test_gpu.log" | tail -3 | tee -a "$OUT/summary.txt"

step "kernel bandwidth vs device-to-device copy"
./build-gpu/bench_kernels --json "$OUT/kernel_bandwidth.json" 2>&1 | tee -a "$OUT/summary.txt"

step "NCCL allreduce through the Communicator vs raw ncclAllReduce (world 1)"
./build-gpu/bench_nccl_overhead --json "$OUT/nccl_overhead.json" 2>&1 | tee -a "$OUT/summary.txt"

# Every algorithm on CUDA tensors, first NCCL with one process, then 4
# processes sharing the GPU over host-staged Gloo.
ALGOS="gradient_allreduce bytegrad qadam decentralized decentralized_ring low_precision_decentralized_ring async_model_average"
# digits BACKEND NPROC WHAT: every algorithm on CUDA tensors.
digits() {
  local backend=$1 nproc=$2 what=$3
  for algo in $ALGOS; do
    step "digits, $algo, $what"
    BAGUA_BACKEND=$backend $PY -m bagua.distributed.launch --nproc_per_node "$nproc" \
      examples/digits_mlp.py --device cuda --algorithm "$algo" \
      --results "$OUT/digits_${backend}_$algo.json" 2>&1 \
      | tee "$OUT/digits_${backend}_$algo.log" | grep -E "^algorithm|Error" | tee -a "$OUT/summary.txt"
  done
}
digits nccl 1 "NCCL, 1 process"
digits gloo 4 "4 processes sharing the GPU over host-staged Gloo"
