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

ALGOS=${ALGOS:-"gradient_allreduce bytegrad qadam decentralized decentralized_ring low_precision_decentralized_ring decentralized_topology low_precision_decentralized_topology async_model_average powersgd partial_allreduce_smart partial_allreduce_static partial_allreduce_smart_low_precision"}
# digits BACKEND NPROC PORT DEVICE: every algorithm, on DEVICE's tensors.
digits_lane() {
  local backend=$1 nproc=$2 port=$3 device=$4 algo status name
  for algo in $ALGOS; do
    # P-Reduce's groups have at least 2 members: with_bagua refuses one process.
    if [ "$nproc" -lt 2 ] && [[ $algo == partial_allreduce* ]]; then continue; fi
    name=digits_${device}_${backend}_x${nproc}_$algo
    BAGUA_BACKEND=$backend timeout "$STEP_LIMIT_S" $PY -m bagua.distributed.launch \
      --nproc_per_node "$nproc" --master_port "$port" \
      examples/digits_mlp.py --device "$device" --algorithm "$algo" \
      --results "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    status=$?
    echo "== digits $device $backend x$nproc $algo: exit $status; $(grep -E '^algorithm' "$OUT/$name.log" | tail -n 1)" >> "$OUT/lanes.txt"
  done
}

say "== tests and digits (CUDA: NCCL x1, host-staged Gloo x4; the same on the CPU), side by side"
tests_lane &
digits_lane nccl 1 29611 cuda &
digits_lane gloo 4 29622 cuda &
digits_lane gloo 1 29633 cpu &
digits_lane gloo 4 29644 cpu &
wait
sort "$OUT/lanes.txt" | tee -a "$OUT/summary.txt"

say "== digits accuracy, CUDA against the same run on the CPU (goal: within 0.5 points)"
$PY - "$OUT" "$ALGOS" <<'PYEOF' | tee -a "$OUT/summary.txt"
import json, os, sys
out, algos = sys.argv[1], sys.argv[2].split()
def accuracy(name):
    path = os.path.join(out, name + ".json")
    return 100 * json.load(open(path))["test_accuracy"] if os.path.exists(path) else None
# Where the averaging rounds or the groups follow the processes' timing, two
# runs on the same device differ too (asynchronous averaging on 4 CPU
# processes: 97.33-98.00 over six runs), so a miss there says little.
TIMING_DEPENDENT = ("async_model_average", "partial_allreduce_smart")
def verdict(algo, procs, diff):
    if algo.startswith("partial_allreduce") and procs < 2:
        return "not run: groups need 2 processes"
    if diff is None:
        return "MISSING"
    if abs(diff) <= 0.5 + 1e-9:
        return "ok"
    return "over, timing-dependent" if algo.startswith(TIMING_DEPENDENT) else "OVER"
print(f"{'algorithm':34s} {'procs':>5s} {'cuda':>7s} {'cpu':>7s} {'diff':>6s}  verdict")
rows = []
for algo in algos:
    for procs, cuda_name in ((1, f"digits_cuda_nccl_x1_{algo}"), (4, f"digits_cuda_gloo_x4_{algo}")):
        cuda, cpu = accuracy(cuda_name), accuracy(f"digits_cpu_gloo_x{procs}_{algo}")
        diff = None if cuda is None or cpu is None else cuda - cpu
        row = {"algorithm": algo, "processes": procs, "cuda": cuda, "cpu": cpu, "diff": diff,
               "verdict": verdict(algo, procs, diff)}
        rows.append(row)
        show = lambda v: f"{v:7.2f}" if v is not None else "    n/a"
        print(f"{algo:34s} {procs:5d} {show(cuda)} {show(cpu)} {show(diff)[1:]}  {row['verdict']}")
json.dump(rows, open(os.path.join(out, "digits_cuda_vs_cpu.json"), "w"), indent=1)
PYEOF
say "== done in $SECONDS s"
