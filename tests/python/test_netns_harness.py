"""bench/netns.py, the slow-network benchmarks' harness: two shaped network
namespaces run one training step and are removed afterwards. Skipped with
the reason where namespaces cannot be made (not root, no iproute2, a
container without the capability)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
WORKER = Path(__file__).with_name("netns_step_worker.py")


def _namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_two_shaped_namespaces_run_a_step_and_are_removed(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs root, iproute2 and tc for network namespaces")
    sys.path.insert(0, str(BENCH))
    from netns import emulated_hosts, launch_on_hosts

    try:
        with emulated_hosts(2, rates_mbit={0: 50, 1: 50}) as hosts:
            names = [ns for ns, _, _ in hosts]
            qdisc = subprocess.run(["ip", "netns", "exec", names[0], "tc", "qdisc", "show", "dev", hosts[0][1]],
                                   capture_output=True, text=True).stdout
            env = {"PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")]),
                   "BAGUA_COMM_TIMEOUT_S": "30"}
            result = launch_on_hosts(str(WORKER), hosts, tmp_path / "out.json", [], extra_env=env)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create shaped network namespaces here: {(e.stderr or '').strip()}")
    assert "tbf" in qdisc and "50Mbit" in qdisc, qdisc
    assert result["equal"] and result["gradient_bytes"] < 8192
    assert result["ifname"] == hosts[0][1]  # Gloo bound to the rank's veth, not loopback
    listed = _namespaces()
    assert not any(name in listed for name in names), listed  # torn down
