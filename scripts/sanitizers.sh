#!/usr/bin/env bash
# The C++ suite under the sanitizers: AddressSanitizer + UndefinedBehavior-
# Sanitizer (build-asan), then ThreadSanitizer (build-tsan). Each build takes
# about 5 minutes on 2 cores, which is why scripts/test.sh does not run them
# (its budget is 20 minutes); run this before a change to the runtime's
# threads, buffers or communicators lands.
#
#   bash scripts/sanitizers.sh [asan|tsan]...     (default: both)
#
# Any report fails the run: UBSan halts at its first error, ASan and LSan at
# theirs, TSan exits non-zero after the suite if it saw a race.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null

run_suite() {  # build_dir sanitize_option
  local dir=$1 option=$2
  [ -f "$dir/build.ninja" ] || meson setup "$dir" -Db_sanitize="$option" -Db_lundef=false \
    --buildtype=debugoptimized -Dcuda=disabled
  ninja -C "$dir" bagua_cpp_tests
  echo "== C++ suite under $option =="
  BAGUA_LOG_LEVEL=off "./$dir/bagua_cpp_tests"
}

for kind in "${@:-asan tsan}"; do
  for k in $kind; do
    case $k in
      asan) ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
              run_suite build-asan address,undefined ;;
      tsan) TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1" \
              run_suite build-tsan thread ;;
      *) echo "unknown sanitizer '$k' (asan or tsan)" >&2; exit 2 ;;
    esac
  done
done
