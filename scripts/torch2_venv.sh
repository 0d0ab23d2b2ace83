#!/usr/bin/env bash
# Creates, once, a venv with the current PyTorch 2.x and Lightning from PyPI
# (scripts/requirements-torch2.txt) and prints its path. Debian's python
# (the one the extension is built for) with Debian's packages visible.
#
# It is cached in $BAGUA_TORCH2_VENV (default ~/.cache/bagua/venv-torch2)
# and made again when the requirements change. PyPI's Linux wheels of torch
# bring CUDA's libraries: about 5.4 GB on disk.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
requirements="$root/scripts/requirements-torch2.txt"
venv="${BAGUA_TORCH2_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/bagua/venv-torch2}"
wanted="$(sha256sum "$requirements" | cut -d' ' -f1)"
if [ "$(cat "$venv/.bagua-requirements" 2>/dev/null)" != "$wanted" ]; then
  echo "torch2_venv: creating $venv from $requirements" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
  echo "$wanted" > "$venv/.bagua-requirements"
fi
echo "$venv"
