#!/usr/bin/env bash
# The C++ tests under the sanitizers: AddressSanitizer + UndefinedBehavior-
# Sanitizer, then ThreadSanitizer.
#
#   bash scripts/sanitizers.sh [--threaded] [--build-only|--run-only] [asan|tsan]...
#                                                           (default: both)
#
# --threaded: only the suites that run ranks as threads through the
#   scheduler, the async op and the communicators (the bagua_sanitizer_tests
#   target of meson.build), built at -O1 without debug information: about 3
#   minutes for both sanitizers on 2 cores. scripts/test.sh runs this.
# Without it: the whole C++ suite (bagua_cpp_tests) at -O2 with debug
#   information, about 5 minutes per sanitizer; run it before a change to the
#   runtime's threads, buffers or communicators lands.
#
# Any report fails the run: UBSan halts at its first error, ASan and LSan at
# theirs, TSan exits non-zero after the suite if it saw a race. The suites
# mostly wait (timeouts, peers), so the builds come first and the suites then
# run side by side, each printed when it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh >/dev/null
source scripts/ccache_env.sh

target=bagua_cpp_tests
build_options=(--buildtype=debugoptimized)
suffix=""
if [ "${1:-}" = "--threaded" ]; then
  shift
  target=bagua_sanitizer_tests
  build_options=(--buildtype=plain -Dcpp_args=-O1)
  suffix="-threaded"
fi
phases="build run"
case "${1:-}" in
  --build-only) phases=build; shift ;;
  --run-only) phases=run; shift ;;
esac

build_suite() {  # build_dir sanitize_option
  local dir=$1$suffix option=$2
  [ -f "$dir/build.ninja" ] || meson setup "$dir" -Db_sanitize="$option" -Db_lundef=false \
    "${build_options[@]}" -Dcuda=disabled >/dev/null
  ninja -C "$dir" "$target" | tail -n 1
}

# Starts the suite in the background; its output goes to DIR/sanitizer-run.log.
start_suite() {  # build_dir sanitize_option
  local dir=$1$suffix
  BAGUA_LOG_LEVEL=off "./$dir/$target" > "$dir/sanitizer-run.log" 2>&1 &
  pids+=($!)
  logs+=("$dir/sanitizer-run.log")
  names+=("$2")
}

dir_of() { case $1 in asan) echo build-asan ;; tsan) echo build-tsan ;; esac; }
option_of() { case $1 in asan) echo address,undefined ;; tsan) echo thread ;; esac; }

kinds=()
for kind in "${@:-asan tsan}"; do
  for k in $kind; do
    case $k in
      asan|tsan) kinds+=("$k") ;;
      *) echo "unknown sanitizer '$k' (asan or tsan)" >&2; exit 2 ;;
    esac
  done
done

if [[ $phases == *build* ]]; then
  for k in "${kinds[@]}"; do build_suite "$(dir_of "$k")" "$(option_of "$k")"; done
fi
[[ $phases == *run* ]] || exit 0

export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export TSAN_OPTIONS="halt_on_error=0 second_deadlock_stack=1 suppressions=$PWD/tests/cpp/tsan_suppressions.txt"
pids=() logs=() names=()
for k in "${kinds[@]}"; do start_suite "$(dir_of "$k")" "$(option_of "$k")"; done
status=0
for i in "${!pids[@]}"; do
  code=0
  wait "${pids[$i]}" || code=$?
  echo "== C++ $target under ${names[$i]}: exit $code =="
  if [ "$code" -eq 0 ]; then tail -n 4 "${logs[$i]}"; else cat "${logs[$i]}"; status=1; fi
done
exit $status
