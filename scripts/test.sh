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

stage "C++ tests (doctest)"
meson test -C build --print-errorlogs

stage "C++ threaded suites under ASan+UBSan and TSan"
bash scripts/sanitizers.sh --threaded asan tsan

stage "Python tests (pytest)"
"$BAGUA_PYTHON" -m pytest -q --timeout=900 --durations=15 tests/python "$@"

stage "packaging: pip install into a fresh venv"
bash scripts/check_install.sh
stage "done"
