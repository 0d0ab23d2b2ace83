"""Step time and accuracy on a bandwidth-limited network: bagua's algorithms
and algorithm="auto" against PyTorch DDP and DDP's fp16 and PowerSGD
communication hooks.

Each rank runs in its own network namespace, joined by a bridge, its egress
shaped with tbf to the given rate (bench/netns.py; needs root); at
'loopback' the ranks are local processes (bagua then goes through shared
memory, DDP's Gloo through loopback TCP). At each rate every kind trains the
same model (--model: the MLP 64-2048-2048-10, the MLP 64-1024-2048-1024-10
or a small transformer over the rows of a digit) on digits from the same
initial weights for the same fixed number of steps, all kinds in the same
processes, interleaved step by step with a barrier before each step; a
step's time is the slowest rank's. The step time reported is the median
(and p90) of the steps after --skip-steps (PowerSGD's and the hook's
uncompressed start, auto's measuring and checking steps); the accuracy is
the test accuracy after the last step. DDP's PowerSGD hook and our PowerSGD
both run with one bucket (the hook needs it on Gloo, see make_run; ours with
one_bucket=True, as auto runs it); DDP and its fp16 hook keep DDP's default
buckets, ours the runtime's. "local" trains each rank alone, without
communicating: the compute floor. "ddp_bagua_bytegrad_hook" and
"ddp_bagua_powersgd_8bit_hook" are PyTorch's DDP with bagua's hooks
(bagua.torch_api.ddp_hooks), the latter with one bucket as DDP's PowerSGD
hook.

With --breakdown the workers record a timeline (BAGUA_TIMELINE) and print,
per rank, where each bagua kind's median step went: compute (to the last
gradient ready), each op phase after it (PowerSGD's factor passes and
exchanges), the rest of the wait after backward, the optimizer step. Every
run also times the factor math alone: our op's passes and the same math
with the torch calls of DDP's hook.

    /usr/bin/python3 bench/slow_network.py                       # 2 ranks, 100, 1000, 10000 Mbit/s
    /usr/bin/python3 bench/slow_network.py --model deep_mlp --rates 100,1000,10000,loopback --breakdown
    /usr/bin/python3 bench/slow_network.py --rates 100 --steps 30 --kinds ddp,powersgd,auto
    /usr/bin/python3 bench/slow_network.py --plot-only bench/results/slow_network.json

Prints a table per rate (median, p90, ratio to DDP, accuracy, stage
medians, auto's choice), writes bench/results/slow_network.json (--out) and
with --plot PATH the plot (step time against bandwidth). The plot in the
docs, docs/slow_network.png, is redrawn from the report it shows with
--plot-only, so a partial run (a few kinds, one rate) leaves it alone.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from common import gather_json, interleaved_windows, machine, quantiles, step_window  # noqa: E402

KINDS = ["ddp", "ddp_fp16_hook", "ddp_powersgd_hook", "ddp_bagua_bytegrad_hook", "ddp_bagua_powersgd_8bit_hook",
         "gradient_allreduce", "gradient_allreduce_flat",
         "gradient_allreduce_hierarchical", "bytegrad", "bytegrad_hierarchical", "powersgd", "powersgd_8bit",
         "powersgd_buckets", "powersgd_8bit_buckets",
         "auto", "local"]
DEFAULT_KINDS = ["ddp", "ddp_fp16_hook", "ddp_powersgd_hook", "gradient_allreduce", "bytegrad", "powersgd",
                 "powersgd_8bit", "auto", "local"]
DOCS_PLOT = Path(__file__).resolve().parents[1] / "docs" / "slow_network.png"
CANDIDATE_KINDS = ("gradient_allreduce", "bytegrad", "powersgd", "powersgd_8bit")  # what auto chooses from
INPUT, CLASSES = 64, 10
START_ITER = 10  # PowerSGD's and the hook's uncompressed first steps
MODELS = {  # name: what it is (for the tables and the plot)
    "mlp": "MLP 64-2048-2048-10 (4.35 M parameters, 17.4 MB of gradients)",
    "deep_mlp": "MLP 64-1024-2048-1024-10 (4.27 M parameters, 17.1 MB of gradients)",
    "transformer": "transformer, 2 layers of width 256 over the 8 rows of a digit (1.59 M parameters)",
    "issue_mlp": "MLP 512-1536-1536-1024-10 over each digit's 64 pixels repeated 8 times "
                 "(4.72 M parameters, issue 43's MLP)",
    "transformer12": "transformer, 12 layers of width 256 over the 8 rows of a digit (9.48 M parameters)",
}


def mlp(*widths):
    import torch

    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def build_transformer(layers=2):
    """A small encoder over the 8 rows of an 8 x 8 digit (8 tokens of 8
    pixels), mean-pooled into the classes: attention, layer norms and
    matrices of several shapes, unlike the MLPs."""
    import torch

    class RowTransformer(torch.nn.Module):
        def __init__(self, width=256, layers=layers):
            super().__init__()
            self.embed = torch.nn.Linear(8, width)
            self.position = torch.nn.Parameter(torch.zeros(8, width))
            layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
            self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, CLASSES)

        def forward(self, x):
            tokens = self.embed(x.view(-1, 8, 8)) + self.position
            return self.head(self.encoder(tokens).mean(dim=1))

    return RowTransformer()


def build_model(name="mlp"):
    import torch

    if name == "transformer":
        return build_transformer()
    if name == "transformer12":
        return build_transformer(layers=12)
    if name == "issue_mlp":  # its 512 inputs: the 64 pixels 8 times over
        class Repeat(torch.nn.Module):
            def forward(self, x):
                return x.repeat(1, 8)

        return torch.nn.Sequential(Repeat(), mlp(8 * INPUT, 1536, 1536, 1024, CLASSES))
    return mlp(INPUT, 2048, 2048, CLASSES) if name == "mlp" else mlp(INPUT, 1024, 2048, 1024, CLASSES)


def make_run(kind, rank_r, lr, model_name="mlp", seed=0, bucket_view=False):
    """(model, optimizer) for one kind; every kind starts from the same
    weights (those of ``seed``). ``bucket_view``: every DDP kind with
    ``gradient_as_bucket_view=True`` (no copies into and out of its buckets)."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    torch.manual_seed(seed)
    model = build_model(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if kind == "local":  # no communication: the compute floor of a step
        return model, opt
    if kind.startswith("ddp"):
        if kind in ("ddp_powersgd_hook", "ddp_bagua_powersgd_8bit_hook"):
            # One DDP bucket for the hook: with several, its chained
            # allreduces (P, then Q from a callback) of different buckets
            # are issued in a different order on different ranks, and Gloo
            # matches collectives by issue order: a size error or a hang
            # (seen here on torch 1.13 and 2.6 with DDP's default buckets).
            import torch.distributed as dist

            dist._DEFAULT_FIRST_BUCKET_BYTES, default = 1 << 30, dist._DEFAULT_FIRST_BUCKET_BYTES
            model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024,
                                                              gradient_as_bucket_view=bucket_view)
            dist._DEFAULT_FIRST_BUCKET_BYTES = default
        else:
            model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        if kind == "ddp_fp16_hook":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif kind == "ddp_powersgd_hook":
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank_r,
                                                start_powerSGD_iter=START_ITER, use_error_feedback=True,
                                                warm_start=True)
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif kind.startswith("ddp_bagua_"):  # bagua's ops as DDP hooks (bagua.torch_api.ddp_hooks)
            from bagua.torch_api import ddp_hooks

            if kind == "ddp_bagua_bytegrad_hook":
                ddp_hooks.register(model, "bytegrad")
            else:
                ddp_hooks.register(model, "powersgd", rank=rank_r, start_iter=START_ITER, low_precision=True)
        return model, opt
    from bagua.torch_api.algorithms.auto import AutoAlgorithm
    from bagua.torch_api.algorithms.bytegrad import ByteGradAlgorithm
    from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

    algorithm = {"gradient_allreduce": lambda: GradientAllReduceAlgorithm(),  # its default: hierarchical="auto"
                 "gradient_allreduce_flat": lambda: GradientAllReduceAlgorithm(hierarchical=False),
                 "gradient_allreduce_hierarchical": lambda: GradientAllReduceAlgorithm(hierarchical=True),
                 "bytegrad": lambda: ByteGradAlgorithm(hierarchical=False),
                 "bytegrad_hierarchical": lambda: ByteGradAlgorithm(hierarchical=True),
                 "powersgd": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER, one_bucket=True),
                 "powersgd_8bit": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER, low_precision=True,
                                                            one_bucket=True),
                 # the runtime's buckets, each averaged as soon as the backward fills it
                 "powersgd_buckets": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER),
                 "powersgd_8bit_buckets": lambda: PowerSGDAlgorithm(rank=rank_r, start_iter=START_ITER,
                                                                    low_precision=True),
                 "auto": lambda: AutoAlgorithm(powersgd_rank=rank_r, powersgd_start_iter=START_ITER)}[kind]()
    return model.with_bagua([opt], algorithm), opt


def rank_batches(rank, world, batch, seed=0):
    """This rank's shard of the digits training set, in batches (the order
    of ``seed``; the train/test split is always the same)."""
    import torch
    from digits_mlp import load_data

    x_train, y_train, x_test, y_test = load_data(0)
    order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))[rank::world]
    batches = [(x_train[order[i:i + batch]], y_train[order[i:i + batch]])
               for i in range(0, len(order) - batch + 1, batch)]
    return batches, (x_test, y_test)


def accuracy(model, test):
    import torch

    model.eval()
    with torch.no_grad():
        result = (model(test[0]).argmax(dim=1) == test[1]).float().mean().item()
    model.train()
    return 100.0 * result


def comm_op_seconds(model):
    """Seconds the communication thread spent in this model's bucket ops
    since its buckets were last built (None for DDP and local)."""
    if not hasattr(model, "bagua_ddp"):
        return None
    stats = model.bagua_ddp.communication_stats()
    return sum(op["total_seconds"] for bucket in stats["buckets"] for op in bucket["ops"])



def step_breakdown(events, start_us, end_us):
    """Where one bagua step's time went, in ms, from this rank's timeline:
    compute (step start to the last gradient ready: zero_grad, forward,
    backward), then until backward returned: the bucket ops' phases
    (PowerSGD's factor passes and exchanges; other ops whole) and the rest
    of that wait (hand-offs between the threads, waking), and the optimizer
    step; None for a step without gradients marked ready (DDP, local)."""
    window = step_window(events, start_us, end_us)
    if window is None:
        return None
    inside, last_ready, backward_end = window
    row = {"compute": last_ready - start_us}
    exposed = 0
    phases = [e for e in inside if e.get("cat") == "op_phase"]

    def nested(e):  # a phase inside another (shm.* inside hierarchical.*): counted by the outer one
        end = e["ts"] + e.get("dur", 0)
        return any(f is not e and f["ts"] <= e["ts"] and end <= f["ts"] + f.get("dur", 0)
                   and f.get("dur", 0) > e.get("dur", 0) for f in phases)

    inside = [e for e in inside if not (e.get("cat") == "op_phase" and nested(e))]
    for e in inside:
        end = e["ts"] + e.get("dur", 0)
        if e.get("cat") in ("op_phase", "comm_op") and end > last_ready:
            phases = [f for f in inside if f.get("cat") == "op_phase" and e["ts"] <= f["ts"] <= end]
            if e["cat"] == "comm_op" and phases:
                continue  # counted by its phases
            took = min(end, backward_end) - max(e["ts"], last_ready)
            row[e["name"]] = row.get(e["name"], 0) + took
            exposed += took
    row["waiting"] = backward_end - last_ready - exposed
    row["optimizer"] = sum(e["dur"] for e in inside if e.get("cat") == "phase" and e["name"] == "optimizer_step")
    row["other"] = end_us - start_us - sum(row.values())
    return {k: v / 1e3 for k, v in row.items()}


def breakdowns(events, windows, skip):
    """Per bagua kind, the median over the measured steps of each part of
    step_breakdown (ms, this rank)."""
    import statistics

    result = {}
    for kind, spans in windows.items():
        rows = [r for r in (step_breakdown(events, a, b) for a, b in spans[skip:]) if r]
        if rows:
            last = ["waiting", "optimizer", "other"]
            parts = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in last] + last
            result[kind] = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in parts}
    return result


def torch_powersgd_math(params, rank_r, repeats=5):
    """Seconds of DDP's PowerSGD hook's math for gradients shaped as
    ``params`` (its calls: error feedback and its copy, Q's Gram-Schmidt,
    P = MQ, P's Gram-Schmidt, Q = M^T P, M = PQ^T, the new error), one
    thread, no communication; the least of ``repeats``."""
    import time

    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    from bagua.torch_api.algorithms.powersgd import compresses

    flat = torch.randn(sum(p.numel() for p in params))
    error = torch.randn_like(flat)
    matrices, offset = [], 0
    for p in params:
        view = flat[offset:offset + p.numel()].view(p.shape[0], -1)
        offset += p.numel()
        if compresses(p.shape, rank_r, 2.0):
            matrices.append((view.unsqueeze(0), torch.randn(1, view.shape[1], rank_r),
                             torch.empty(1, view.shape[0], rank_r)))

    def once():
        flat.add_(error)
        copy = torch.clone(flat)
        for m, q, p in matrices:
            _orthogonalize(q)
            torch.bmm(m, q, out=p)
            _orthogonalize(p)
            torch.bmm(m.transpose(1, 2), p, out=q)
            torch.bmm(p, q.transpose(1, 2), out=m)
        torch.sub(copy, flat, out=error)

    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def ours_powersgd_math(params, rank_r, repeats=5):
    """Seconds of our op's factor passes (include/bagua/ops/low_rank_steps.h:
    M += e and P = MQ, Gram-Schmidt, Q = M^T P, M = PQ^T and the new error)
    for gradients shaped as ``params``, one thread, no communication; the
    least of ``repeats``."""
    import time

    import torch

    from bagua.torch_api._core import core, tensor_view
    from bagua.torch_api.algorithms.powersgd import compresses

    work = []
    for p in params:
        if compresses(p.shape, rank_r, 2.0):
            rows, cols = p.shape[0], p.numel() // p.shape[0]
            work.append((torch.randn(rows, cols), torch.randn(rows, cols), torch.randn(cols, rank_r),
                         torch.empty(rows, rank_r), rows, cols))

    def once():
        for m, error, q, p, rows, cols in work:
            core.low_rank_step(*(tensor_view(t) for t in (m, error, q, p)), rows, cols, rank_r)

    once()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - start)
    return best


def factor_math(model, rank_r):
    """Per step on this rank, without communication: our op's factor passes
    and the hook's torch calls for this model's gradient shapes."""
    params = [p.detach() for p in model.parameters()]
    return {"ours_s": ours_powersgd_math(params, rank_r), "hook_s": torch_powersgd_math(params, rank_r)}


def worker(args):
    import torch

    import bagua.torch_api as bagua
    from bagua.torch_api import timeline
    from bagua.torch_api.algorithms.auto import AutoAlgorithm

    torch.set_num_threads(1)
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    batches, test = rank_batches(rank, world, args.batch)
    global START_ITER
    START_ITER = args.start_iter
    runs = {kind: make_run(kind, args.rank, args.lr, args.model, bucket_view=args.bucket_view)
            for kind in args.kinds.split(",")}
    math = factor_math(next(iter(runs.values()))[0], args.rank)
    clock = timeline.get(rank)  # with --breakdown (BAGUA_TIMELINE set)
    tail = {kind: [] for kind in runs}  # accuracy after each of the last --accuracy-tail steps

    def after_step(i):
        if i >= args.steps - args.accuracy_tail:
            for kind, (model, _) in runs.items():
                tail[kind].append(accuracy(model, test))

    samples, windows = interleaved_windows(runs, batches, args.steps, clock, {"comm_op": comm_op_seconds},
                                           after_step)
    result = {}
    for kind, stages in samples.items():
        result[kind] = quantiles(stages["total"][args.skip_steps:])
        result[kind]["stages_median"] = {s: quantiles(v[args.skip_steps:])["median"] for s, v in stages.items()}
        result[kind]["steps"] = stages["total"]
        result[kind]["accuracy"] = accuracy(runs[kind][0], test)
        if tail[kind]:  # one step's accuracy moves with its last updates; the mean over the tail less
            result[kind]["accuracy_tail"] = tail[kind]
            result[kind]["accuracy_tail_mean"] = sum(tail[kind]) / len(tail[kind])
        if kind == "auto":
            result[kind]["decision"] = AutoAlgorithm.decision(runs[kind][0])
            result[kind]["decisions"] = AutoAlgorithm.decisions(runs[kind][0])
        engine = getattr(runs[kind][0], "bagua_ddp", None)
        hierarchy = getattr(getattr(engine, "bagua_algorithm_impl", None), "hierarchy", None)
        if hierarchy is not None:  # GradientAllReduce and its kin: the form of the allreduce, and why
            result[kind]["hierarchy"] = hierarchy.decision
    # every rank's accuracy must agree (the synchronous kinds train one model)
    mine = torch.tensor([result[k]["accuracy"] for k in runs], dtype=torch.float64)
    spread = mine.clone()
    bagua.allreduce_inplace(spread, op=bagua.ReduceOp.MAX)
    low = mine.clone()
    bagua.allreduce_inplace(low, op=bagua.ReduceOp.MIN)
    for kind, hi, lo in zip(runs, spread.tolist(), low.tolist()):
        result[kind]["accuracy_spread_over_ranks"] = hi - lo
    parts = breakdowns(json.loads(clock.to_json())["traceEvents"], windows, args.skip_steps) if clock else {}
    parts = gather_json(parts)  # every rank's: one waits in the exchanges for the other's compute
    if rank == 0:
        Path(args.out).write_text(json.dumps({"kinds": result, "factor_math": math, "breakdown": parts}))


def print_table(rate, result):
    ddp = result["ddp"]["median"] if "ddp" in result else None
    print(f"{'kind':>20} {'median ms':>10} {'p90 ms':>9} {'x DDP':>7} {'accuracy':>9}"
          f" | {'fwd':>6} {'bwd':>7} {'opt':>5} {'comm op':>8}")
    for kind, q in result.items():
        ratio = f"{q['median'] / ddp:7.3f}" if ddp else "    n/a"
        note = f"  (chose {q['decision']['choice']})" if kind == "auto" and q.get("decision") else ""
        if "accuracy_tail_mean" in q:
            note += f"  (accuracy over the last {len(q['accuracy_tail'])} steps: {q['accuracy_tail_mean']:.2f}%)"
        if q.get("hierarchy") and "measured_step_s" in q["hierarchy"]:
            measured = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in q["hierarchy"]["measured_step_s"].items())
            note += f"  ({'hierarchical' if q['hierarchy']['hierarchical'] else 'flat'}: {measured} ms)"
        st = {k: v * 1e3 for k, v in q["stages_median"].items()}
        print(f"{kind:>20} {q['median'] * 1e3:10.1f} {q['p90'] * 1e3:9.1f} {ratio} {q['accuracy']:8.2f}%"
              f" | {st['forward']:6.1f} {st['backward']:7.1f} {st['step']:5.1f} {st['comm_op']:8.1f}{note}")


def print_decisions(decisions):
    """auto's decisions: the step, the choice, why, its predicted and
    measured step time (ms, forward to the end of backward)."""
    for d in decisions or []:
        predicted = d.get("predicted_step_s", {}).get(d["choice"])
        measured = d.get("measured_step_s", {}).get(d["choice"])
        fmt = lambda v: "-" if v is None else f"{v * 1e3:.1f}"  # noqa: E731
        print(f"{'auto':>20} step {d.get('step', '-')}: {d['choice']} (predicted {fmt(predicted)}, "
              f"measured {fmt(measured)} ms): {d['reason']}")



def print_breakdown(per_rank):
    """Each rank's median step of each bagua kind, by part (ms)."""
    for rank, parts in enumerate(per_rank):
        for kind, row in parts.items():
            print(f"{kind:>20} rank {rank}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))


def run_at(rate, world_size, out, worker_args, ranks_per_host=1):
    """The workers' result at one rate: ranks_per_host ranks in each shaped
    network namespace (an emulated host, whose egress is the rate), or, for
    'loopback', local processes (bagua then goes through shared memory, DDP's
    Gloo through loopback TCP)."""
    from common import launch
    from netns import emulated_hosts, launch_on_hosts

    if rate == "loopback":
        return launch(__file__, world_size, out, worker_args)
    hosts = world_size // ranks_per_host
    with emulated_hosts(hosts, rates_mbit={h: int(rate) for h in range(hosts)}) as emulated:
        return launch_on_hosts(__file__, emulated, out, worker_args, ranks_per_host=ranks_per_host)


def plot(report, path: Path) -> None:
    """Median step time against bandwidth, one line per kind (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted((r for r in report["rates"] if r.isdigit()), key=int)
    if not rates:
        return  # loopback alone: nothing to draw against bandwidth
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kinds = list(report["rates"][rates[0]])
    for kind in kinds:
        xs = [int(r) for r in rates if kind in report["rates"][r]]
        ys = [report["rates"][r][kind]["median"] * 1e3 for r in rates if kind in report["rates"][r]]
        style = "--" if kind.startswith("ddp") else "-"
        ax.plot(xs, ys, style, marker="o", label=kind, linewidth=2.5 if kind == "auto" else 1.2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth per rank (Mbit/s, tbf)")
    ax.set_ylabel("median step time (ms)")
    cfg = report["config"]
    ax.set_title(f"{cfg['world_size']} ranks, {MODELS[cfg.get('model', 'mlp')]}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100,1000,10000",
                        help="Mbit/s per rank's egress, comma-separated; 'loopback': ranks on one host, unshaped")
    parser.add_argument("--model", default="mlp", choices=sorted(MODELS), help="; ".join(
        f"{k}: {v}" for k, v in MODELS.items()))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="ranks in each emulated host (network namespace), which share its shaped link "
                             "and memory; e.g. --world-size 4 --ranks-per-host 2: 2 hosts x 2 ranks")
    parser.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="from: " + ", ".join(KINDS))
    parser.add_argument("--rank", type=int, default=2,
                        help="PowerSGD's matrix approximation rank (ours, the hook's, auto's); at rank 1, "
                             "60 steps left both 2.9-4 points of accuracy below DDP's")
    parser.add_argument("--start-iter", type=int, default=START_ITER,
                        help="PowerSGD's (ours, the hooks', auto's) uncompressed first steps; at 10 Mbit/s "
                             "each takes seconds")
    parser.add_argument("--steps", type=int, default=60, help="training steps of every kind")
    parser.add_argument("--skip-steps", type=int, default=20, help="steps left out of the step time")
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--accuracy-tail", type=int, default=0,
                        help="also the test accuracy after each of the last N steps, and its mean")
    parser.add_argument("--breakdown", action="store_true",
                        help="record a timeline (BAGUA_TIMELINE) and print where each bagua kind's step went")
    parser.add_argument("--bucket-view", action="store_true",
                        help="every DDP kind with gradient_as_bucket_view=True (its gradients are views of its buckets)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "slow_network.json"))
    parser.add_argument("--plot", default=None, help="also draw the plot there (with --plot-only, default "
                        + str(DOCS_PLOT) + ")")
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the plot from a saved report")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.plot_only:
        return plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot or DOCS_PLOT))
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {KINDS}")
    if args.ranks_per_host < 1 or args.world_size % args.ranks_per_host:
        parser.error("--ranks-per-host must divide --world-size")
    if args.skip_steps >= args.steps:
        parser.error("--skip-steps must be below --steps")
    if any(r != "loopback" and not r.isdigit() for r in args.rates.split(",")):
        parser.error("--rates: Mbit/s numbers or 'loopback'")

    worker_args = ["--kinds", args.kinds, "--rank", str(args.rank), "--start-iter", str(args.start_iter),
                   "--steps", str(args.steps),
                   "--skip-steps", str(args.skip_steps), "--batch", str(args.batch), "--lr", str(args.lr),
                   "--accuracy-tail", str(args.accuracy_tail),
                   "--model", args.model] + (["--bucket-view"] if args.bucket_view else [])
    report = {"machine": machine(), "config": vars(args), "rates": {}, "factor_math": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.breakdown:
            os.environ["BAGUA_TIMELINE"] = str(Path(tmp) / "timeline")
        for rate in args.rates.split(","):
            print(f"{rate}{'' if rate == 'loopback' else ' Mbit/s'}, {args.world_size} ranks "
                  f"({args.ranks_per_host} per host), {args.model}, {args.steps} steps, "
                  f"load {os.getloadavg()[0]:.1f} ...", flush=True)
            result = run_at(rate, args.world_size, Path(tmp) / f"{rate}.json", worker_args, args.ranks_per_host)
            report["rates"][rate], report["factor_math"][rate] = result["kinds"], result["factor_math"]
            report.setdefault("breakdown", {})[rate] = result["breakdown"]
            print_table(rate, result["kinds"])
            print_decisions(result["kinds"].get("auto", {}).get("decisions"))
            print_breakdown(result["breakdown"])
            math = result["factor_math"]
            print(f"factor math per step (rank 0, no communication): ours {math['ours_s'] * 1e3:.1f} ms, "
                  f"DDP hook's torch calls {math['hook_s'] * 1e3:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    if args.plot:
        plot(report, Path(args.plot))


if __name__ == "__main__":
    main()
