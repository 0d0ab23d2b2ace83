#!/usr/bin/env bash
# Runs every test: installs what is missing, builds, then the C++ doctest
# suite (meson test), its threaded suites under ASan+UBSan and TSan, the
# Python suite (pytest, multi-process on the CPU) and a packaging check
# (pip install into a fresh venv, then a 2-rank run).
set -euo pipefail
cd "$(dirname "$0")/.."
stage() { echo "== $1 (at ${SECONDS} s) =="; }  # the budget is 20 minutes on 2 cores
bash scripts/install_deps.sh
stage "build"
bash scripts/build.sh
source scripts/env.sh

stage "C++ threaded suites built under ASan+UBSan and TSan"
bash scripts/sanitizers.sh --threaded --build-only asan tsan

# The three suites mostly wait (timeouts, peers): side by side they take the
# time of the longest.
stage "C++ tests (doctest), and the threaded suites under ASan+UBSan and TSan, side by side"
meson test -C build --print-errorlogs > build/meson-test.out 2>&1 &
doctest=$!
sanitizers=0
bash scripts/sanitizers.sh --threaded --run-only asan tsan || sanitizers=$?
doctests=0
wait "$doctest" || doctests=$?
echo "== C++ tests (doctest): exit $doctests =="
if [ "$doctests" -eq 0 ]; then tail -n 8 build/meson-test.out; else cat build/meson-test.out; fi
[ "$doctests" -eq 0 ] && [ "$sanitizers" -eq 0 ] || exit 1

stage "Python tests (pytest)"
"$BAGUA_PYTHON" -m pytest -q --timeout=900 --durations=15 tests/python "$@"

stage "packaging: pip install into a fresh venv"
bash scripts/check_install.sh
stage "done"
