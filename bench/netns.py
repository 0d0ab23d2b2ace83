"""Emulated hosts on one machine: a network namespace per rank, joined by a
bridge, each rank's egress optionally shaped with tbf (rate limit; netem's
delay is not available here). Needs root and iproute2.

    with emulated_hosts(4, rates_mbit={3: 10}) as hosts:
        results = launch_on_hosts(script, hosts, out, worker_args)

Ranks then talk over veth links instead of loopback (and so never through
shared memory, which needs one network namespace).
"""

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port  # noqa: E402


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def emulated_hosts(count: int, rates_mbit: dict = None, subnet: str = "10.233.0"):
    """Yields [(namespace, device, address)] per rank; rank r's egress is
    limited to rates_mbit[r] Mbit/s where given."""
    if os.geteuid() != 0:
        raise SystemExit("emulated hosts need root (network namespaces)")
    tag = uuid.uuid4().hex[:5]
    bridge = f"bgbr{tag}"
    hosts = [(f"bagua-h{r}-{tag}", f"bge{r}{tag}", f"{subnet}.{r + 1}") for r in range(count)]
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for rank, (ns, dev, addr) in enumerate(hosts):
            peer = f"bgp{rank}{tag}"
            _ip("netns", "add", ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", peer)
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", peer, "master", bridge)
            _ip("link", "set", peer, "up")
            _ip("netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", dev)
            _ip("netns", "exec", ns, "ip", "link", "set", dev, "up")
            _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
            rate = (rates_mbit or {}).get(rank)
            if rate:
                # tbf must be able to send a timer tick's worth of bytes
                # (HZ >= 250) in one burst, or it caps below the rate
                burst_kb = max(64, rate * 1000 // 8 // 250)
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", f"{rate}mbit", "burst", f"{burst_kb}kb", "latency", "2000ms"],
                               check=True, capture_output=True, text=True)
        yield hosts
    finally:
        for ns, _, _ in hosts:
            _ip("netns", "delete", ns, check=False)
        _ip("link", "delete", bridge, check=False)


def launch_on_hosts(script: str, hosts, out: Path, worker_args, extra_env: dict = None,
                    ranks_per_host: int = 1) -> dict:
    """As common.launch, ranks_per_host consecutive ranks in each namespace
    (rank r on host r // ranks_per_host, as torchrun numbers them; the ranks
    of one host talk over its own addresses, unshaped, and share memory),
    rendezvous at rank 0's address; returns the JSON rank 0 wrote to OUT."""
    port = free_port()
    master = hosts[0][2]
    world = len(hosts) * ranks_per_host
    procs = []
    for rank in range(world):
        ns, dev, addr = hosts[rank // ranks_per_host]
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % ranks_per_host),
                   LOCAL_WORLD_SIZE=str(ranks_per_host), MASTER_ADDR=master, MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev, **(extra_env or {}))
        env.pop("BAGUA_GLOO_HOSTNAME", None)
        cmd = ["ip", "netns", "exec", ns, sys.executable, script, "--worker", "--out", str(out), *worker_args]
        procs.append(subprocess.Popen(cmd, env=env))
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit("benchmark worker failed on an emulated host")
    return json.loads(out.read_text())
