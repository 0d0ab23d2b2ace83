"""Rendezvous across hosts whose hostname resolves to 127.0.0.1: a rank
advertising loopback to a peer on another host is an InvalidArgumentError on
every rank, naming the variable to set, within the timeout (it was
"connect on rank -1 ... Connection refused" on one rank and a hang of over
90 s, past BAGUA_COMM_TIMEOUT_S, on the other).

Faked: two processes of this machine claim different hosts (the network
identity hook). Real, where root may create network namespaces: two ranks
in namespaces joined by a veth pair, as two hosts."""

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launcher import free_port

ROOT = Path(__file__).resolve().parents[2]

WORKER = """
import os, sys, time
import torch
import bagua.torch_api as bagua
from bagua.torch_api import process_group
if os.environ.get("FAKE_HOST"):
    process_group._network_identity = lambda: os.environ["FAKE_HOST"]
start = time.monotonic()
try:
    bagua.init_process_group()
    x = torch.ones(2)
    bagua.allreduce_inplace(x)
    print("RESULT ok", x.tolist())
except Exception as e:
    print("RESULT", type(e).__name__, f"{time.monotonic() - start:.1f}s", e)
"""


def bagua_env(rank, port, master="127.0.0.1", **extra):
    env = dict(os.environ)
    for name in ("GLOO_SOCKET_IFNAME", "BAGUA_GLOO_HOSTNAME"):
        env.pop(name, None)
    env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR=master, MASTER_PORT=str(port), BAGUA_COMM_TIMEOUT_S="10",
               OMP_NUM_THREADS="1", **extra)
    return env


def results(procs, timeout=60):
    lines = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"a rank still runs after {timeout} s (BAGUA_COMM_TIMEOUT_S=10)")
        found = [line for line in out.splitlines() if line.startswith("RESULT")]
        assert found, (out, err[-3000:])
        lines.append(found[-1])
    return lines


def test_ranks_claiming_different_hosts_with_a_loopback_address_fail_on_every_rank():
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=bagua_env(rank, port, FAKE_HOST=f"fake-host-{rank}"))
             for rank in range(2)]
    for line in results(procs):
        assert line.startswith("RESULT InvalidArgumentError"), line
        for fragment in ("rank 0", "rank 1", "loopback", "GLOO_SOCKET_IFNAME"):
            assert fragment in line, line


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """Two network namespaces joined by a veth pair: (namespace, interface,
    address) per host. Skips where they cannot be made (not root, no ip)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"bagua-a-{tag}", f"bva{tag}", "10.231.0.1"), (f"bagua-b-{tag}", f"bvb{tag}", "10.231.0.2")]
    try:
        for ns, _, _ in hosts:
            _ip("netns", "add", ns)
        _ip("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            _ip("link", "set", dev, "netns", ns)
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            _ip("netns", "exec", ns, "ip", "link", "set", dev, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for ns, _, _ in hosts:
            _ip("netns", "delete", ns, check=False)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.strip()}")
    yield hosts
    for ns, _, _ in hosts:
        _ip("netns", "delete", ns, check=False)


def run_on_hosts(hosts, per_rank_env):
    port = free_port()
    procs = []
    for rank, (ns, dev, addr) in enumerate(hosts):
        env = bagua_env(rank, port, master=hosts[0][2], **per_rank_env(rank, dev, addr))
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", WORKER],
                                      cwd=ROOT, text=True, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return results(procs)


def test_network_namespaces_whose_hostname_is_loopback(two_hosts):
    import socket

    if not socket.gethostbyname(socket.gethostname()).startswith("127."):
        pytest.skip("this machine's hostname does not resolve to loopback")
    start = time.monotonic()
    lines = run_on_hosts(two_hosts, lambda rank, dev, addr: {})
    assert time.monotonic() - start < 30  # BAGUA_COMM_TIMEOUT_S=10, not a hang
    for line in lines:
        assert line.startswith("RESULT InvalidArgumentError"), line
        assert "GLOO_SOCKET_IFNAME" in line and "rank -1" not in line, line
    # What the message says to do works.
    lines = run_on_hosts(two_hosts, lambda rank, dev, addr: {"GLOO_SOCKET_IFNAME": dev})
    assert lines == ["RESULT ok [2.0, 2.0]"] * 2, lines
