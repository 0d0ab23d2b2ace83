"""Fusion of nonblocking neighbour allreduces: per-parameter
`bf.neighbor_allreduce_nonblocking` over a model's parameters (many small
tensors, as BlueFog's optimizers issue them from their hooks), fused
(`BLUEFOG_FUSION_THRESHOLD`, 8 MiB by default) against unfused (threshold
0), on local processes over Gloo.

One run per world size; in it the two modes alternate step by step (the
order swapped every step), switched on every rank at the same point of the
call sequence. A step: barrier, issue one call per parameter, synchronize
them all; its time is the slowest rank's. Reported: the median and spread
(p10, p90, min, max) of the per-step ratio fused / unfused, over pairs of
adjacent steps, and each mode's median step time.

    /usr/bin/python3 bench/bluefog_fusion.py                        # 4 and 2 ranks
    /usr/bin/python3 bench/bluefog_fusion.py --sizes 4 --steps 40 --json out.json
    /usr/bin/python3 bench/bluefog_fusion.py --pattern dynamic      # one-peer, dst weights
    /usr/bin/python3 bench/bluefog_fusion.py --no-check             # no pattern check per op

By default every op first checks the ranks' patterns (an allgather), as
BlueFog's calls do by default; fusion saves that per call too. `--no-check`
leaves only the exchange itself (and, fused, the agreement).
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import launch, machine  # noqa: E402

MODES = {"fused": 8 * 1024 * 1024, "unfused": 0}


def model(blocks: int, width: int):
    """`blocks` conv-norm blocks: a 3x3 convolution (weight, bias) and a
    BatchNorm (weight, bias) each, 4 tensors per block, mostly small."""
    import torch

    layers = []
    for _ in range(blocks):
        layers += [torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.BatchNorm2d(width)]
    return torch.nn.Sequential(*layers)


def step_calls(bf, topology_util, pattern: str, check: bool):
    """A function issuing one call per tensor of a list, returning handles;
    `dynamic`: BlueFog's one-peer schedule, the pattern changing every step.
    `check`: the ranks compare patterns before each op (BlueFog's default)."""
    schedule = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    bf.set_skip_negotiate_stage(not check)  # the static calls' check

    def issue(tensors):
        if pattern == "static":
            return [bf.neighbor_allreduce_nonblocking(t, name=f"p{i}") for i, t in enumerate(tensors)]
        send, recv = next(schedule)
        w = 1.0 / (len(recv) + 1)
        return [bf.neighbor_allreduce_nonblocking(t, self_weight=w, src_weights={r: w for r in recv},
                                                  dst_weights=send, enable_topo_check=check,
                                                  name=f"p{i}")
                for i, t in enumerate(tensors)]
    return issue


def worker(args):
    import torch

    import bagua.bluefog as bf
    import bagua.torch_api as bagua
    from bagua.bluefog import topology_util
    from bagua.bluefog._state import state

    torch.set_num_threads(1)
    bf.init()
    tensors = [p.detach() for p in model(args.blocks, args.width).parameters()]
    issue = step_calls(bf, topology_util, args.pattern, not args.no_check)

    def step(mode):
        state().worker.set_threshold(MODES[mode])
        bf.barrier()
        start = time.perf_counter()
        for h in issue(tensors):
            bf.synchronize(h)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        bagua.allreduce_inplace(elapsed, op=bagua.ReduceOp.MAX)
        return elapsed.item()

    for mode in MODES:  # warm up: connections, buffers
        step(mode)
    seconds = {mode: [] for mode in MODES}
    before = state().worker.stats()
    for i in range(args.steps):
        order = list(MODES) if i % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            seconds[mode].append(step(mode))
    after = state().worker.stats()
    if bf.rank() == 0:
        Path(args.out).write_text(json.dumps({
            "seconds": seconds, "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors),
            "ops": after["ops"] - before["ops"], "calls": after["calls"] - before["calls"]}))


def spread(values):
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]
    return {"median": statistics.median(ordered), "p10": at(0.1), "p90": at(0.9),
            "min": ordered[0], "max": ordered[-1]}


def summarize(raw) -> dict:
    ratios = [f / u for f, u in zip(raw["seconds"]["fused"], raw["seconds"]["unfused"])]
    return {"tensors": raw["tensors"], "bytes": raw["bytes"], "ops": raw["ops"],
            "calls": raw["calls"], "ratio_fused_over_unfused": spread(ratios),
            "median_ms": {m: 1000 * statistics.median(raw["seconds"][m]) for m in MODES}}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,2", help="world sizes, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each mode")
    parser.add_argument("--blocks", type=int, default=16, help="conv-norm blocks (4 tensors each)")
    parser.add_argument("--width", type=int, default=32, help="channels of every block")
    parser.add_argument("--pattern", choices=["static", "dynamic"], default="static")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the pattern check before each op (enable_topo_check=False, "
                             "set_skip_negotiate_stage(True))")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    report = {"machine": machine(), "config": vars(args), "sizes": {}}
    worker_args = ["--steps", str(args.steps), "--blocks", str(args.blocks), "--width",
                   str(args.width), "--pattern", args.pattern] + (["--no-check"] if args.no_check else [])
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            result = summarize(launch(__file__, n, Path(tmp) / f"{n}.json", worker_args))
            report["sizes"][str(n)] = result
            r, ms = result["ratio_fused_over_unfused"], result["median_ms"]
            print(f"{n} ranks, {result['tensors']} tensors ({result['bytes'] / 1e6:.2f} MB), "
                  f"{args.pattern}{', no check' if args.no_check else ''}: fused {ms['fused']:.2f} ms, unfused {ms['unfused']:.2f} ms per step; "
                  f"ratio fused/unfused median {r['median']:.3f} (p10 {r['p10']:.3f}, p90 {r['p90']:.3f}, "
                  f"min {r['min']:.3f}, max {r['max']:.3f}); {result['ops']} ops for "
                  f"{result['calls']} calls", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
