"""Sparse embedding gradients: bagua's GradientAllReduce against PyTorch DDP
on a recommendation-style model (an EmbeddingBag table of 1 M x 64 with
sparse=True, then an MLP), in the same processes, the same initial model and
batches, interleaved step by step with a barrier before each. Prints the
median step time of each, the per-step ratio bagua / DDP (median and
p10-p90), and the bytes one rank sends per step for the table against what
the dense table would cost; writes JSON.

    /usr/bin/python3 bench/sparse_embedding.py [--world-size 2] [--steps 40] \
        [--json bench/results/sparse_embedding.json]
"""

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

ROWS, WIDTH, BAG, BATCH = 1_000_000, 64, 20, 64


def build(torch):
    torch.manual_seed(0)

    class Recommender(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.EmbeddingBag(ROWS, WIDTH, mode="sum", sparse=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(WIDTH, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                           torch.nn.ReLU(), torch.nn.Linear(256, 1))

        def forward(self, items, offsets):
            return self.mlp(self.table(items, offsets))

    return Recommender()


def worker(args):
    import torch
    import torch.nn.functional as F

    import bagua.torch_api as bagua
    from bagua.torch_api.algorithms import Algorithm

    bagua.init_process_group()
    rank = bagua.get_rank()
    ddp_model, ours_model = build(torch), build(torch)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.05)
    runs = {"ddp": (torch.nn.parallel.DistributedDataParallel(ddp_model), ddp_opt),
            "bagua": (ours_model.with_bagua([ours_opt], Algorithm.init("gradient_allreduce")), ours_opt)}
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, ROWS, (BATCH * BAG,), generator=g), torch.arange(0, BATCH * BAG, BAG),
                torch.randn(BATCH, 1, generator=g)) for _ in range(8)]
    times, sent = {kind: [] for kind in runs}, []
    for step in range(args.steps):
        items, offsets, y = batches[step % len(batches)]
        for kind, (model, opt) in runs.items():
            bagua.barrier()
            start = time.perf_counter()
            opt.zero_grad()
            F.mse_loss(model(items, offsets), y).backward()
            opt.step()
            times[kind].append(time.perf_counter() - start)
        sent.append(ours_model.bagua_ddp.sparse_gradients.last_bytes_sent)
        if rank == 0 and (step + 1) % 10 == 0:
            print(f"step {step + 1}/{args.steps}", flush=True)
    slowest = torch.tensor([times["ddp"], times["bagua"]], dtype=torch.float64)
    bagua.allreduce_inplace(slowest, op=bagua.ReduceOp.MAX)
    warm = slice(3, None)  # the first steps build buckets and plans
    ddp_s, ours_s = slowest[0].tolist()[warm], slowest[1].tolist()[warm]
    ratios = sorted(o / d for o, d in zip(ours_s, ddp_s))
    dense_bytes = ROWS * WIDTH * 4
    result = {"world_size": bagua.get_world_size(), "rows": ROWS, "width": WIDTH, "batch": BATCH, "bag": BAG,
              "steps": args.steps, "ddp_median_s": statistics.median(ddp_s), "bagua_median_s": statistics.median(ours_s),
              "ratio_median": statistics.median(ratios), "ratio_p10": ratios[len(ratios) // 10],
              "ratio_p90": ratios[(9 * len(ratios)) // 10], "table_bytes_sent_per_step": statistics.median(sent),
              "dense_table_bytes": dense_bytes, "machine": common.machine()}
    weights_equal = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                        for a, b in zip(ddp_model.parameters(), ours_model.parameters()))
    result["weights_close_to_ddp"] = weights_equal
    if rank == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


def report(result, args):
    print(f"EmbeddingBag {ROWS} x {WIDTH} (sparse) + MLP, {args.world_size} ranks, batch {BATCH} x {BAG} items")
    print(f"  DDP    median step {result['ddp_median_s'] * 1e3:.1f} ms")
    print(f"  bagua  median step {result['bagua_median_s'] * 1e3:.1f} ms")
    print(f"  bagua / DDP per step: median {result['ratio_median']:.3f} (p10 {result['ratio_p10']:.3f}, "
          f"p90 {result['ratio_p90']:.3f})")
    print(f"  table bytes sent per step by a rank: {result['table_bytes_sent_per_step'] / 1e3:.1f} kB, against "
          f"{result['dense_table_bytes'] / 1e6:.0f} MB for the dense table "
          f"({result['dense_table_bytes'] / max(result['table_bytes_sent_per_step'], 1):.0f}x)")
    print(f"  weights close to DDP's at the end: {result['weights_close_to_ddp']}")


if __name__ == "__main__":
    common.steps_bench_main(__file__, __doc__, worker, report, default_steps=40)
