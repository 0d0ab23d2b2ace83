"""BlueFog's claim on a bandwidth-limited network: one neighbour averaging
step of a 1 MB tensor against an allreduce of it, as the world grows.

Each rank runs in its own network namespace, joined by a bridge, its egress
shaped with tbf to --rate Mbit/s (bench/netns.py; needs root). In the same
processes, for every world size:

- `allreduce`: `bf.allreduce(x)` (the average over all ranks);
- `neighbor_dynamic`: `bf.neighbor_allreduce(x, ...)` over BlueFog's
  dynamic one-peer schedule on the exponential graph
  (`topology_util.GetDynamicOnePeerSendRecvRanks`): each rank sends to one
  peer and receives from one per step, weights 1/2;
- `neighbor_static`: `bf.neighbor_allreduce(x)` over the static
  exponential graph (log2(n) in-neighbours, uniform weights).

Time: the kinds interleaved call by call with a barrier before each; a
call's time is the slowest rank's; the median over --calls calls. Bytes:
what each rank's interface sent (the namespace's /proc/net/dev), per call,
measured over --calls calls of each kind run back to back, TCP/IP headers
and Gloo's framing included; the mean over ranks.

    /usr/bin/python3 bench/bluefog_neighbor.py                 # 2, 4, 6, 8 ranks at 200 Mbit/s
    /usr/bin/python3 bench/bluefog_neighbor.py --sizes 8 --rate 100

Prints a table per world size, writes bench/results/bluefog_neighbor.json
and the plot docs/bluefog_neighbor.png.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, quantiles  # noqa: E402

KINDS = ["allreduce", "neighbor_dynamic", "neighbor_static"]
NUMEL = 1 << 18  # 1 MB of fp32


def tx_bytes() -> int:
    """Bytes sent by this network namespace's non-loopback interfaces."""
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            name, fields = line.split(":", 1)
            if name.strip() != "lo":
                total += int(fields.split()[8])
    return total


def make_calls(bf, topology_util, x):
    """{kind: a function running one call of that kind}."""
    n, rank = bf.size(), bf.rank()
    schedule = topology_util.GetDynamicOnePeerSendRecvRanks(topology_util.ExponentialGraph(n), rank)

    def dynamic():
        send, recv = next(schedule)
        weight = 1.0 / (len(recv) + 1)
        return bf.neighbor_allreduce(x, self_weight=weight, src_weights={r: weight for r in recv},
                                     dst_weights=send, enable_topo_check=False)

    return {"allreduce": lambda: bf.allreduce(x), "neighbor_dynamic": dynamic,
            "neighbor_static": lambda: bf.neighbor_allreduce(x)}


def worker(args):
    import torch

    import bagua.bluefog as bf
    import bagua.torch_api as bagua
    from bagua.bluefog import topology_util

    torch.set_num_threads(1)
    bf.init()
    bf.set_topology(topology_util.ExponentialGraph(bf.size()))
    x = torch.randn(NUMEL)
    calls = make_calls(bf, topology_util, x)
    for call in calls.values():  # warm up: connections, buffers
        call()
    sent = {}
    for kind, call in calls.items():
        bf.barrier()
        before = tx_bytes()
        for _ in range(args.calls):
            call()
        sent[kind] = (tx_bytes() - before) / args.calls
        bf.barrier()
    seconds = {kind: [] for kind in calls}
    for _ in range(args.calls):
        for kind, call in calls.items():
            bf.barrier()
            start = time.perf_counter()
            call()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            bagua.allreduce_inplace(elapsed, op=bagua.ReduceOp.MAX)
            seconds[kind].append(elapsed.item())
    mean_sent = torch.tensor([sent[k] for k in calls], dtype=torch.float64)
    bagua.allreduce_inplace(mean_sent, op=bagua.ReduceOp.AVG)
    if bf.rank() == 0:
        result = {kind: {**quantiles(seconds[kind]), "bytes_sent_per_rank": b}
                  for kind, b in zip(calls, mean_sent.tolist())}
        Path(args.out).write_text(json.dumps(result))


def print_table(n, result):
    base = result["allreduce"]["median"]
    print(f"{n} ranks: {'kind':>17} {'median ms':>10} {'p90 ms':>8} {'x allreduce':>12} {'MB sent/rank':>13}")
    for kind in KINDS:
        r = result[kind]
        print(f"{'':9} {kind:>17} {1000 * r['median']:10.1f} {1000 * r['p90']:8.1f} "
              f"{r['median'] / base:12.3f} {r['bytes_sent_per_rank'] / 1e6:13.3f}")


def plot(report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(report["sizes"], key=int)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in KINDS:
        left.plot([int(n) for n in sizes], [1000 * report["sizes"][n][kind]["median"] for n in sizes],
                  marker="o", label=kind)
        right.plot([int(n) for n in sizes], [report["sizes"][n][kind]["bytes_sent_per_rank"] / 1e6
                                             for n in sizes], marker="o", label=kind)
    left.set(xlabel="ranks", ylabel="ms per call (median)",
             title=f"1 MB at {report['config']['rate']} Mbit/s per rank")
    right.set(xlabel="ranks", ylabel="MB sent per rank per call", title="bytes on the wire")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,4,6,8", help="world sizes, comma-separated")
    parser.add_argument("--rate", type=int, default=200, help="Mbit/s of every rank's egress")
    parser.add_argument("--calls", type=int, default=15, help="timed calls of each kind")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bluefog_neighbor.json"))
    parser.add_argument("--plot", default=str(Path(__file__).resolve().parents[1] / "docs" / "bluefog_neighbor.png"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from netns import emulated_hosts, launch_on_hosts

    report = {"machine": machine(), "config": vars(args), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            print(f"{n} ranks at {args.rate} Mbit/s, {args.calls} calls per kind ...", flush=True)
            with emulated_hosts(n, rates_mbit={r: args.rate for r in range(n)}) as hosts:
                result = launch_on_hosts(__file__, hosts, Path(tmp) / f"{n}.json", ["--calls", str(args.calls)])
            report["sizes"][str(n)] = result
            print_table(n, result)
    summary = {n: round(r["neighbor_dynamic"]["median"] / r["allreduce"]["median"], 3)
               for n, r in report["sizes"].items()}
    print("neighbor_dynamic / allreduce:", summary)
    report["neighbor_dynamic_over_allreduce"] = summary
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    plot(report, Path(args.plot))


if __name__ == "__main__":
    main()
