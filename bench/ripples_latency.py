"""Ripples' per-call costs: how long one P-Reduce of a small tensor takes, how
long a rank waits for its group, and whether the generator serves every rank
alike when its host (rank 0) trains too.

Latency (--calls calls per rank, no communicator created per group):

- ``primitive``: every rank draws the same random partition of the ranks
  into groups of --group-size (a shared seed) and calls
  ``bagua.partial_allreduce_inplace`` on a tensor of --numel float32 in its
  group, --calls times, without a barrier in between;
- ``random`` / ``smart``: the group comes from ``GroupGenerator`` (the host
  is rank 0): ``acquire`` (the request), the P-Reduce, ``complete``;
- ``barrier``: ``bagua.barrier()`` among all ranks, the machine's floor: one
  round of messages and process wake-ups (on a loaded 2-core machine a
  woken process may wait for the next 4 ms scheduler tick).

Reported per rank: median and 99th percentile of the call (for the
generators also of the request alone), in milliseconds.

Fairness (--fair-seconds, smart generator): every rank trains a small MLP
(one real step, torch on one thread, then --compute-ms of emulated compute
by sleeping) and P-Reduces its weights in the group it acquires, for
--fair-seconds; rank 0 hosts the generator. Reported: each rank's requests
per second and rank 0's rate over the other ranks' median.

    /usr/bin/python3 bench/ripples_latency.py [--world-size 6 --calls 300]

Writes bench/results/ripples_latency.json.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402

MODES = ["barrier", "primitive", "random", "smart"]


def _percentiles(values):
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p99": None}
    return {"p50": statistics.median(ordered), "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def _primitive(args, rank, world):
    import torch

    import bagua.torch_api as bagua

    shared = torch.Generator().manual_seed(11)
    x = torch.full((args.numel,), float(rank))
    calls = []
    bagua.barrier()
    for _ in range(args.calls):
        order = torch.randperm(world, generator=shared).tolist()
        groups = [sorted(order[i:i + args.group_size]) for i in range(0, world, args.group_size)]
        mine = next(g for g in groups if rank in g)
        start = time.perf_counter()
        bagua.partial_allreduce_inplace(x, mine)
        calls.append((time.perf_counter() - start) * 1e3)
    return {"call_ms": calls, "request_ms": []}


def _allreduce(args):
    """The whole world's allreduce of the same small tensor: among ranks of
    one host it goes through shared memory, not Gloo's sockets."""
    import torch

    import bagua.torch_api as bagua

    x = torch.ones(args.numel)
    calls = []
    bagua.barrier()
    for _ in range(args.calls):
        start = time.perf_counter()
        bagua.allreduce_inplace(x)
        calls.append((time.perf_counter() - start) * 1e3)
    return {"call_ms": calls, "request_ms": []}


def _barrier(args):
    import bagua.torch_api as bagua

    calls = []
    bagua.barrier()
    for _ in range(args.calls):
        start = time.perf_counter()
        bagua.barrier()
        calls.append((time.perf_counter() - start) * 1e3)
    return {"call_ms": calls, "request_ms": []}


def _generator(args, rank, world, mode):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.partial_allreduce import GroupGenerator

    gen = GroupGenerator(group_size=args.group_size, mode=mode, seed=5)
    x = torch.full((args.numel,), float(rank))
    calls, requests = [], []
    bagua.barrier()
    for _ in range(args.calls):
        start = time.perf_counter()
        group = gen.acquire_group()
        got = time.perf_counter()
        bagua.partial_allreduce_inplace(x, group.ranks, group_id=group.id)
        gen.complete(group)
        calls.append((time.perf_counter() - start) * 1e3)
        requests.append((got - start) * 1e3)
    gen.close(drain=lambda g: bagua.partial_allreduce_inplace(x, g.ranks, group_id=g.id))
    return {"call_ms": calls, "request_ms": requests}


def _fairness(args, rank, world):
    """Real training steps plus sleeping compute, then the group's P-Reduce
    of the weights: requests per second of this rank."""
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms.partial_allreduce import GroupGenerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gen = GroupGenerator(group_size=args.group_size, mode="smart", seed=5)
    bagua.barrier()
    start = time.perf_counter()
    requests = 0
    while time.perf_counter() - start < args.fair_seconds:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(args.compute_ms / 1000)
        with gen.acquire() as group:
            bagua.partial_allreduce_inplace(flat, group.ranks, group_id=group.id)
        requests += 1
    seconds = time.perf_counter() - start
    stats = gen.stats()
    gen.close(drain=lambda grp: bagua.partial_allreduce_inplace(flat, grp.ranks, group_id=grp.id))
    return {"requests": requests, "seconds": seconds, "rate": requests / seconds,
            "solo_share": stats["solo"] / max(1, stats["requests"]),
            "request_ms": stats["request_latency_ms"]}


def worker(args):
    import torch

    import bagua.torch_api as bagua

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    mine = {}
    for mode in args.modes:
        if mode == "barrier":
            mine[mode] = _barrier(args)
        elif mode == "allreduce":
            mine[mode] = _allreduce(args)
        elif mode == "primitive":
            mine[mode] = _primitive(args, rank, world)
        else:
            mine[mode] = _generator(args, rank, world, mode)
        bagua.barrier()
    if args.fair_seconds > 0:
        mine["fairness"] = _fairness(args, rank, world)
        bagua.barrier()
    out = Path(args.out)
    part = out.with_name(f"{out.stem}.rank{rank}.json")
    part.write_text(json.dumps(mine))
    bagua.barrier()
    if rank == 0:
        out.write_text(json.dumps([json.loads(out.with_name(f"{out.stem}.rank{r}.json").read_text())
                                   for r in range(world)]))


def summarize(per_rank, args):
    rows = {}
    for mode in args.modes:
        rows[mode] = [{"call": _percentiles(r[mode]["call_ms"]), "request": _percentiles(r[mode]["request_ms"])}
                      for r in per_rank]
    if args.fair_seconds > 0:
        rates = [r["fairness"]["rate"] for r in per_rank]
        others = statistics.median(rates[1:])
        rows["fairness"] = {"rates": rates, "host_over_others": rates[0] / others,
                            "spread": max(rates) / min(rates),
                            "solo_share": [r["fairness"]["solo_share"] for r in per_rank],
                            "request_ms_p50": [r["fairness"]["request_ms"]["p50"] for r in per_rank]}
    return rows


def report(rows, args):
    print(f"{args.world_size} ranks, groups of {args.group_size}, {args.numel} float32, {args.calls} calls per rank "
          f"(ms: median / p99 per rank)")
    for mode in args.modes:
        calls = "  ".join(f"{r['call']['p50']:.2f}/{r['call']['p99']:.1f}" for r in rows[mode])
        print(f"{mode:>10} call     {calls}")
        if mode not in ("primitive", "barrier", "allreduce"):
            asks = "  ".join(f"{r['request']['p50']:.2f}/{r['request']['p99']:.1f}" for r in rows[mode])
            print(f"{mode:>10} request  {asks}")
    if "fairness" in rows:
        fair = rows["fairness"]
        print(f"fairness (smart, MLP step + {args.compute_ms:g} ms, {args.fair_seconds:g} s): requests/s per rank "
              + ", ".join(f"{r:.1f}" for r in fair["rates"])
              + f"; rank 0 over the others' median {fair['host_over_others']:.3f}, max/min {fair['spread']:.3f}"
              + "; solo share " + ", ".join(f"{s:.2f}" for s in fair["solo_share"])
              + "; request ms p50 " + ", ".join(f"{s:.2f}" for s in fair["request_ms_p50"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=6)
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--numel", type=int, default=256, help="float32 elements per P-Reduce")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=MODES)
    parser.add_argument("--fair-seconds", type=float, default=8.0, help="0: skip the fairness run")
    parser.add_argument("--compute-ms", type=float, default=10.0, help="fairness: emulated compute per step")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "ripples_latency.json"))
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    import tempfile

    worker_args = ["--group-size", str(args.group_size), "--numel", str(args.numel), "--calls", str(args.calls),
                   "--modes", ",".join(args.modes), "--fair-seconds", str(args.fair_seconds),
                   "--compute-ms", str(args.compute_ms)]
    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch(__file__, args.world_size, Path(tmp) / "latency.json", worker_args)
    rows = summarize(per_rank, args)
    report(rows, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "config": vars(args), "results": rows}, indent=1))
    print(f"wrote {args.out}")
    return None


if __name__ == "__main__":
    main()
