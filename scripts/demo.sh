#!/usr/bin/env bash
# End to end on a fresh Debian 12 machine: installs what is missing, builds,
# and trains the digits MLP on 4 CPU workers with GradientAllReduce.
# Extra arguments go to the example (e.g. --algorithm gradient_allreduce_hierarchical).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
bash scripts/build.sh
source scripts/env.sh
exec "$BAGUA_PYTHON" -m bagua.distributed.launch --nproc_per_node 4 examples/digits_mlp.py "$@"
