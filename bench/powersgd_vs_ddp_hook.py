"""PowerSGDAlgorithm against PyTorch DDP with its PowerSGD communication hook,
on the digits MLP, in the same processes, interleaved step by step: the same
initial model, the same batches, the same rank r and start step. Prints each
one's test accuracy and median step time, and writes JSON.

    python -m bagua.distributed.launch --nproc_per_node 4 bench/powersgd_vs_ddp_hook.py \
        [--rank 2] [--start-iter 100] [--epochs 30] [--json bench/results/powersgd_vs_ddp_hook.json]

Step times here are on loopback, where bytes cost little: the comparison of
what compression buys on a slow link belongs to the bandwidth-shaped bench.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from digits_mlp import MLP, load_data  # noqa: E402


def accuracy(model, x_test, y_test) -> float:
    model.eval()
    with torch.no_grad():
        result = (model(x_test).argmax(dim=1) == y_test).float().mean().item()
    model.train()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=2, help="matrix approximation rank")
    parser.add_argument("--start-iter", type=int, default=100)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    bagua.init_process_group()  # also initializes torch.distributed (Gloo) over the same store
    rank, world = bagua.get_rank(), bagua.get_world_size()
    x_train, y_train, x_test, y_test = load_data(args.seed)
    shard = torch.arange(rank, len(x_train), world)
    x_shard, y_shard = x_train[shard], y_train[shard]

    torch.manual_seed(args.seed)
    initial = MLP()
    ddp_model = MLP()
    ddp_model.load_state_dict(initial.state_dict())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    ddp = DistributedDataParallel(ddp_model)
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                        start_powerSGD_iter=max(2, args.start_iter), use_error_feedback=True,
                                        warm_start=True)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    ours_model = MLP()
    ours_model.load_state_dict(initial.state_dict())
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=args.lr, momentum=0.9)
    ours = ours_model.with_bagua([ours_opt], PowerSGDAlgorithm(rank=args.rank, start_iter=max(2, args.start_iter)))

    generator = torch.Generator().manual_seed(args.seed + rank)
    steps_per_epoch = len(x_shard) // args.batch_size
    times = {"ddp_powersgd_hook": [], "bagua_powersgd": []}
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_shard), generator=generator)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            for name, model, opt in (("ddp_powersgd_hook", ddp, ddp_opt), ("bagua_powersgd", ours, ours_opt)):
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                F.cross_entropy(model(x_shard[batch]), y_shard[batch]).backward()
                opt.step()
                times[name].append(time.perf_counter() - start)
        if rank == 0 and (epoch + 1) % 10 == 0:
            print(f"epoch {epoch + 1}/{args.epochs}", flush=True)

    result = {"world_size": world, "rank": args.rank, "start_iter": args.start_iter, "epochs": args.epochs}
    for name, model in (("ddp_powersgd_hook", ddp_model), ("bagua_powersgd", ours_model)):
        acc = torch.tensor([accuracy(model, x_test, y_test)])
        accs = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(accs, acc)
        result[name] = {"test_accuracy": [a.item() for a in accs],
                        "median_step_ms": statistics.median(times[name]) * 1e3}
    # the compressed steps only, step by step: ours over the hook's
    skip = max(2, args.start_iter)
    ratios = sorted(o / h for o, h in zip(times["bagua_powersgd"][skip:], times["ddp_powersgd_hook"][skip:]))
    result["ratio_after_start_iter"] = {"median": statistics.median(ratios),
                                        "p10": ratios[len(ratios) // 10], "p90": ratios[len(ratios) * 9 // 10]}
    if rank == 0:
        for name in times:
            r = result[name]
            print(f"{name:20s} accuracy {', '.join(f'{a * 100:.2f}' for a in r['test_accuracy'])} %, "
                  f"median step {r['median_step_ms']:.2f} ms")
        q = result["ratio_after_start_iter"]
        print(f"ours / hook per compressed step (rank 0): median {q['median']:.3f} "
              f"(p10 {q['p10']:.3f}, p90 {q['p90']:.3f})")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
            print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
