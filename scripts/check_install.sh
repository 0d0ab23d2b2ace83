#!/usr/bin/env bash
# Installs the package with meson-python into a throwaway venv (Debian's
# python, system site packages for torch) and runs a 2-rank job from outside
# the source tree, so nothing can come from the checkout by accident.
#
#   bash scripts/check_install.sh                 both, in a temporary directory
#   bash scripts/check_install.sh --install DIR   only the install, into DIR/venv
#   bash scripts/check_install.sh --run DIR       only the 2-rank job, on DIR/venv (then removes DIR)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
phase=both
if [ "${1:-}" = "--install" ] || [ "${1:-}" = "--run" ]; then
  phase=${1#--}
  work=$2
  mkdir -p "$work"
else
  work="$(mktemp -d)"
fi
[ "$phase" = install ] || trap 'rm -rf "$work"' EXIT
if [ "$phase" != run ]; then
  /usr/bin/python3 -m venv --system-site-packages "$work/venv"
  # The doctest suite is not part of the package: skip building it.
  "$work/venv/bin/pip" install -q --no-build-isolation --no-deps --config-settings=setup-args=-Dtests=false "$root"
  [ "$phase" = install ] && exit 0
fi
cd "$work"
cat > check.py <<'PY'
import torch
import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
bagua.init_process_group()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model = model.with_bagua([opt], GradientAllReduceAlgorithm())
model(torch.full((3, 4), float(bagua.get_rank()))).sum().backward()
opt.step()
weights = model.weight.detach().clone()
bagua.broadcast(weights, 0)
assert torch.equal(weights, model.weight.detach()), "ranks disagree"
assert "site-packages" in bagua.__file__, bagua.__file__
print(f"rank {bagua.get_rank()}: installed package OK ({bagua.__file__})")
PY
env -u PYTHONPATH "$work/venv/bin/python" -m bagua.distributed.launch --nproc_per_node 2 \
  --master_port 29731 check.py
