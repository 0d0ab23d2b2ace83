#!/usr/bin/env bash
# Checks that the engine's includes point one way:
#   core -> comm / compression -> runtime -> ops
# (a layer includes only itself and the layers before it; comm and
# compression are siblings). Headers in include/bagua/<layer> and sources in
# lib/<layer> are checked; kernels/ implements both runtime's and the ops'
# kernels and is not. Prints every offending include; exits 1 if any.
#
# Then the same for the Python package (scripts/python_imports.py): no
# import circle, and every import points down the layers that
# docs/architecture.md draws ("The Python layers").
set -euo pipefail
cd "$(dirname "$0")/.."

status=0
# check LAYER FORBIDDEN-LAYERS (a regex alternation)
check() {
  local layer=$1 forbidden=$2 dir hits
  for dir in "include/bagua/$layer" "lib/$layer"; do
    [ -d "$dir" ] || continue
    hits=$(grep -rnE "^#include \"(bagua/)?($forbidden)/" "$dir" || true)
    if [ -n "$hits" ]; then
      echo "$dir must not include $forbidden:"
      echo "$hits"
      status=1
    else
      echo "ok: $dir includes none of $forbidden"
    fi
  done
}

check core 'comm|compression|runtime|ops'
check comm 'compression|runtime|ops'
check compression 'comm|runtime|ops'
check runtime 'ops'
python3 scripts/python_imports.py --cycles --layers || status=1
exit $status
