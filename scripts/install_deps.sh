#!/usr/bin/env bash
# Installs what bagua needs from Debian's packages, if anything is missing.
# Safe to run again: packages already there are left alone.
set -euo pipefail

PACKAGES=(
  meson ninja-build pkg-config g++ libgloo-dev libspdlog-dev nlohmann-json3-dev doctest-dev
  pybind11-dev python3-torch python3-numpy python3-pytest python3-pytest-timeout python3-sklearn
  python3-tqdm python3-optuna python3-matplotlib python3-mesonpy python3-pip python3-venv
  python3-networkx redis-server python3-redis python3-flask python3-requests
  # meson compiles through ccache when it is there: a rebuild of unchanged
  # sources (a fresh clone in CI, the sanitizer builds) then takes seconds.
  ccache
  # Debian's libtorch recommends an optimized BLAS, and --no-install-recommends
  # below would leave torch on the netlib reference BLAS: 2.5 GFLOP/s instead
  # of ~50 for a 32x1024 by 1024x1024 multiply on one core of the development
  # machine. The OpenMP build follows torch.set_num_threads.
  libopenblas0-openmp
)

missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
