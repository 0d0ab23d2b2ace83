#!/usr/bin/env bash
# The GPU checks, in one command, for a GPU machine without package registries
# (the project's `device` machines). Run from the checkout root; logs and JSON
# go to $OUT (default ./gpu-results), a one-line verdict per step to
# $OUT/summary.txt.
#
# Before, on a machine with Debian's registry (once per checkout):
#   echo /.devdeps/ >> .git/info/exclude && ../shared/offline-build/fetch-debs.sh .devdeps
# then carry .devdeps to the GPU machine and run:  bash scripts/gpu_checks.sh
#
# Every step has its own time limit, so one hang costs that step, not the
# run. The timed benchmarks run first, alone on the GPU; the tests and the
# digits runs (NCCL with one process, host-staged Gloo with four processes
# sharing the GPU) then run side by side on their own rendezvous ports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
[ -f .devdeps/device-env.sh ] && source .devdeps/device-env.sh
PY=${PYTHON:-python3}
STEP_LIMIT_S=${STEP_LIMIT_S:-240}

say() { echo "$*" | tee -a "$OUT/summary.txt"; }

say "== machine: $(nvidia-smi -L 2>&1 | head -1); $($PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1); $(c++ --version | head -1)"

say "== build"
start=$SECONDS
{ meson setup build-gpu --buildtype=release -Dcuda=enabled -Dgpu_arch='90' \
    || meson setup --reconfigure build-gpu -Dcuda=enabled -Dgpu_arch='90'; } > "$OUT/build.log" 2>&1
ninja -C build-gpu >> "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; say "build FAILED"; exit 1; }
say "built in $((SECONDS - start)) s"
export PYTHONPATH=$PWD/py:$PWD/build-gpu

say "== kernel bandwidth vs device-to-device copy (alone on the GPU)"
timeout "$STEP_LIMIT_S" ./build-gpu/bench_kernels --json "$OUT/kernel_bandwidth.json" > "$OUT/bench_kernels.log" 2>&1
say "exit $?"; tail -n 40 "$OUT/bench_kernels.log" | tee -a "$OUT/summary.txt"

say "== NCCL allreduce through the Communicator vs raw ncclAllReduce (world 1)"
timeout "$STEP_LIMIT_S" ./build-gpu/bench_nccl_overhead --json "$OUT/nccl_overhead.json" > "$OUT/bench_nccl.log" 2>&1
say "exit $?"; tail -n 30 "$OUT/bench_nccl.log" | tee -a "$OUT/summary.txt"

tests_lane() {
  timeout "$STEP_LIMIT_S" ./build-gpu/bagua_cpp_tests > "$OUT/cpp_tests.log" 2>&1
  echo "== C++ tests (GPU build): exit $?; $(tail -n 2 "$OUT/cpp_tests.log" | head -1)" >> "$OUT/lanes.txt"
  timeout "$STEP_LIMIT_S" $PY -m pytest -q -rs --tb=short -p no:cacheprovider tests/python/test_gpu.py > "$OUT/test_gpu.log" 2>&1
  echo "== test_gpu.py: exit $?; $(tail -n 1 "$OUT/test_gpu.log")" >> "$OUT/lanes.txt"
}

ALGOS=${ALGOS:-"gradient_allreduce bytegrad qadam decentralized decentralized_ring low_precision_decentralized_ring async_model_average"}
# digits BACKEND NPROC PORT: every algorithm on CUDA tensors.
digits_lane() {
  local backend=$1 nproc=$2 port=$3 algo status
  for algo in $ALGOS; do
    BAGUA_BACKEND=$backend timeout "$STEP_LIMIT_S" $PY -m bagua.distributed.launch \
      --nproc_per_node "$nproc" --master_port "$port" \
      examples/digits_mlp.py --device cuda --algorithm "$algo" \
      --results "$OUT/digits_${backend}_$algo.json" > "$OUT/digits_${backend}_$algo.log" 2>&1
    status=$?
    echo "== digits $backend x$nproc $algo: exit $status; $(grep -E '^algorithm' "$OUT/digits_${backend}_$algo.log" | tail -n 1)" >> "$OUT/lanes.txt"
  done
}

say "== tests and digits (NCCL x1, host-staged Gloo x4), side by side"
tests_lane &
digits_lane nccl 1 29611 &
digits_lane gloo 4 29622 &
wait
sort "$OUT/lanes.txt" | tee -a "$OUT/summary.txt"
say "== done in $SECONDS s"
