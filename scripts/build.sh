#!/usr/bin/env bash
# Configures (once) and builds the runtime into ./build. The Python package
# then runs from the source tree with PYTHONPATH=py:build.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/ccache_env.sh
if [ ! -f build/build.ninja ]; then
  meson setup build --buildtype=release
fi
ninja -C build
