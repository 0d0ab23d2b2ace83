#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, then the C++ doctest
# suite (meson test), the Python suite (pytest, multi-process on the CPU),
# the C++ threaded suites under ASan+UBSan and TSan, and a packaging check
# (pip install into a fresh venv, then a 2-rank run).
#
# The suites mostly wait (timeouts, peers, sockets): about a third of the two
# cores stays idle while they run. The sanitizer builds and the packaging
# build fill that time at the lowest priority (nice 19), beside the suites
# rather than before them.
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "== $1 (at ${SECONDS} s) =="; }  # the budget is 20 minutes on 2 cores
background=()
# On a failure, the builds still running in the background stop too.
trap 'for pid in "${background[@]}"; do pkill -P "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done; true' EXIT
bash scripts/install_deps.sh
stage "build"
bash scripts/build.sh
source scripts/env.sh

stage "C++ tests (doctest); the ASan+UBSan and TSan builds beside them, at the lowest priority"
nice -n 19 bash scripts/sanitizers.sh --threaded --build-only asan tsan \
  > build/sanitizer-build.out 2>&1 &
sanitizer_build=$!
background+=("$sanitizer_build")
meson test -C build --print-errorlogs

stage "Python tests (pytest)"
"$BAGUA_PYTHON" -m pytest -q --timeout=900 --durations=15 tests/python "$@"

stage "C++ threaded suites under ASan+UBSan and TSan; the packaging build beside them, at the lowest priority"
if ! wait "$sanitizer_build"; then
  cat build/sanitizer-build.out
  echo "the sanitizer builds failed" >&2
  exit 1
fi
nice -n 19 bash scripts/check_install.sh > build/check-install.out 2>&1 &
packaging=$!
background+=("$packaging")
bash scripts/sanitizers.sh --threaded --run-only asan tsan

stage "packaging: pip install into a fresh venv, then a 2-rank run"
packaging_status=0
wait "$packaging" || packaging_status=$?
cat build/check-install.out
[ "$packaging_status" -eq 0 ] || exit 1
stage "done"
