# Source this to run bagua from the source tree: Debian's python with the
# package (py/) and the built extension (build/) on its path.
BAGUA_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$BAGUA_ROOT/py:$BAGUA_ROOT/build${PYTHONPATH:+:$PYTHONPATH}"
export BAGUA_PYTHON=/usr/bin/python3
