"""Worker scenario of test_gpu.py, run on several processes sharing one GPU
by launcher.run_workers. Usage: gpu_workers.py SCENARIO OUT_DIR [cpu];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import bagua_core
import torch

from bucket_op_harness import OPS, run_bucket_op


def scenario_bucket_ops(out_dir, devices="cpu,cuda"):
    """Every op, fp32 and fp16, on this rank's own data, first on a CPU
    bucket and then on a CUDA bucket, each over its own Gloo communicator
    (staged through host memory for CUDA). Saves {op-dtype: (cpu results,
    cuda results)}, each the bucket after every step followed by the op's
    extra buffers."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(os.path.join(out_dir, "store"), exist_ok=True)
    store = bagua_core.file_store(os.path.join(out_dir, "store"))
    results = {}
    for op in OPS:
        for dtype in (torch.float32, torch.float16):
            key = f"{op}-{str(dtype).split('.')[-1]}"
            data = (torch.randn(70001, generator=torch.Generator().manual_seed(7 + rank)) * 2).to(dtype)
            runs = []
            for device in devices.split(","):
                comm = bagua_core.gloo_communicator(store, rank, world, prefix=f"{key}-{device}")
                steps, extra = run_bucket_op(device, data, op, comm, rank=rank)
                runs.append(steps + extra)
            results[key] = (runs[0], runs[1] if len(runs) > 1 else None)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_partial_allreduce(out_dir):
    """P-Reduces of this rank's data, on host tensors and then on CUDA tensors
    (Gloo, staged through host memory): first over the whole world, then
    ranks 0 and world-1 together while the others are alone. Saves
    {call-dtype: (cpu result, cuda result)}."""
    from bucket_op_harness import view

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.makedirs(os.path.join(out_dir, "store"), exist_ok=True)
    store = bagua_core.file_store(os.path.join(out_dir, "store"))
    results = {}
    for dtype in (torch.float32, torch.float16, torch.float64):
        data = (torch.randn(70_001, generator=torch.Generator().manual_seed(11 + rank)) * 3).to(dtype)
        for call, members in (("world", list(range(world))), ("pair", sorted({0, world - 1}))):
            if rank not in members:
                members = [rank]
            key = f"{call}-{str(dtype).split('.')[-1]}"
            runs = []
            for device in ("cpu", "cuda"):
                comm = bagua_core.gloo_communicator(store, rank, world, prefix=f"{key}-{device}")
                send = data.to(device)
                recv = torch.empty_like(send)
                comm.partial_allreduce(view(send), view(recv), members, "avg", 7, True)
                if device == "cuda":
                    torch.cuda.synchronize()
                assert torch.equal(send.cpu(), data), "the input changed"
                if members == [rank]:
                    assert torch.equal(recv.cpu(), data), "a group of one changed the data"
                runs.append(recv.cpu())
            results[key] = tuple(runs)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_bluefog_windows(out_dir, devices="cpu,cuda"):
    """BlueFog's one-sided windows on host tensors, then on CUDA tensors
    (host-staged), the same calls with a barrier between steps: put, update,
    accumulate with a self weight, get, update into a clone, associated p.
    Saves {device: [results...]} (host copies)."""
    import bagua.bluefog as bf

    bf.init()
    rank = bf.rank()
    results = {}
    for device in devices.split(","):
        name = f"w_{device}"
        x = torch.arange(1000, dtype=torch.float64, device=device) * 0.001 + rank
        assert bf.win_create(x, name)
        steps = []
        bf.win_put(x, name)
        bf.barrier()
        steps.append(bf.win_update(name).cpu().clone())
        bf.barrier()
        bf.win_accumulate(x, name, self_weight=0.5)
        steps.append(x.cpu().clone())
        bf.barrier()
        bf.win_get(name)
        bf.barrier()
        clone = bf.win_update(name, clone=True)
        steps.append(clone.cpu().clone())
        assert clone.device == x.device
        steps.append(x.cpu().clone())
        bf.turn_on_win_ops_with_associated_p()
        bf.win_put(x, name, self_weight=0.5)
        bf.barrier()
        steps.append(bf.win_update(name).cpu().clone())
        steps.append(torch.tensor(bf.win_associated_p(name)))
        bf.turn_off_win_ops_with_associated_p()
        bf.barrier()
        assert bf.win_free(name)
        results[device] = steps
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_bluefog_ops(out_dir, devices="cpu,cuda"):
    """BlueFog's neighbour ops and collectives on host tensors, then on CUDA
    tensors (staged through host memory on Gloo), the same calls in the same
    order: neighbor_allreduce on the static exponential graph, with the
    dynamic one-peer weights and fused nonblocking, neighbor_allgather,
    pair_gossip (ring pairs), allreduce, broadcast, allgather and the
    in-place allreduce_. Every output must be on the input's device. Saves
    {device: {call: host copy}}."""
    import bagua.bluefog as bf
    from bagua.bluefog import topology_util

    bf.init()
    rank, size = bf.rank(), bf.size()
    results = {}
    for device in devices.split(","):
        x = torch.arange(1000, dtype=torch.float64, device=device) * 0.001 + rank
        y = (torch.arange(600, dtype=torch.float32, device=device).reshape(200, 3) + 10 * rank)
        out = {}
        out["static"] = bf.neighbor_allreduce(x)
        send, recv = next(topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), rank))
        out["dynamic"] = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={r: 0.5 / max(len(recv), 1)
                                                                              for r in recv},
                                               dst_weights=send)
        handles = [bf.neighbor_allreduce_nonblocking(x * (k + 1), name=f"fused{k}") for k in range(3)]
        for k, h in enumerate(handles):
            out[f"fused{k}"] = bf.synchronize(h)
        out["allgather_neighbors"] = bf.neighbor_allgather(y)
        partner = rank ^ 1
        if partner < size:
            out["pair_gossip"] = bf.pair_gossip(x, partner)
        else:  # the odd rank out takes part in the pattern check, with nobody
            out["pair_gossip"] = bf.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=[])
        out["allreduce"] = bf.allreduce(y)
        out["broadcast"] = bf.broadcast(x, 0)
        out["allgather"] = bf.allgather(y)
        z = y.clone()
        bf.allreduce_(z, average=False)
        out["allreduce_"] = z
        for call, tensor in out.items():
            assert tensor.device == x.device, (call, tensor.device, x.device)
        results[device] = {call: tensor.cpu().clone() for call, tensor in out.items()}
        bf.barrier()
    results["pattern"] = {"in_neighbors": bf.in_neighbor_ranks(), "send": send, "recv": recv}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


SCENARIOS = {"bucket_ops": scenario_bucket_ops, "partial_allreduce": scenario_partial_allreduce,
             "bluefog_windows": scenario_bluefog_windows, "bluefog_ops": scenario_bluefog_ops}

if __name__ == "__main__":
    scenario, out_dir, *args = sys.argv[1:]
    if scenario not in SCENARIOS:
        raise SystemExit(f"unknown scenario {scenario}")
    SCENARIOS[scenario](out_dir, *args)
