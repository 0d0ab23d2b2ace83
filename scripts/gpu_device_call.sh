#!/usr/bin/env bash
# One call of the `device` tool: what the machine is, then scripts/gpu_checks.sh
# under an overall time limit, then every log packed into one archive in $OUT
# (the tool brings back at most 8 files).
#   run(command="bash scripts/gpu_device_call.sh", carry=[".devdeps"])
# GPU_CHECKS_LIMIT_S bounds gpu_checks.sh; STEP_LIMIT_S each of its steps.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-/tmp/gpu-results}
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
{
  echo "== host: $(uname -r); $(nproc) cores; $(c++ --version | head -1); $(nvcc --version | tail -1)"
  python3 -c 'import sys, sysconfig, os; i = sysconfig.get_paths()["include"]; print("python", sys.version.split()[0], sys.executable, "Python.h:", os.path.exists(os.path.join(i, "Python.h")), i)'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  ls /usr/local/cuda/lib64 | grep -i nccl | head -3
} 2>&1 | tee "$RESULTS/host.txt"
OUT=$RESULTS STEP_LIMIT_S=${STEP_LIMIT_S:-180} timeout -k 10 "${GPU_CHECKS_LIMIT_S:-450}" \
  bash scripts/gpu_checks.sh
echo "gpu_checks.sh exit $?" | tee -a "$RESULTS/summary.txt"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS/summary.txt" "$OUT/" 2>/dev/null
  tar -czf "$OUT/gpu-results.tar.gz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
fi
