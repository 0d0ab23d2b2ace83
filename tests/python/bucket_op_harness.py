"""One bucket with one communication op, run for a few steps on the CPU or
on CUDA (ready events, the op's kernels on the communication stream, host-
staged Gloo): the harness of the CPU-vs-CUDA comparisons in test_gpu.py, on
one process or on several sharing a GPU (gpu_workers.py)."""

import bagua_core
import torch

NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
         torch.float64: "float64", torch.int32: "int32", torch.uint8: "uint8"}

OPS = ["c_lp_s", "c_lp_s_error_feedback", "c_fp_s_scattergather", "d_lp_s", "d_fp_s_ring"]


def view(t):
    device = "cpu" if t.device.type == "cpu" else f"cuda:{t.device.index or 0}"
    return bagua_core.TensorView(t.data_ptr(), t.numel(), NAMES[t.dtype], device)


def stream():
    return torch.cuda.current_stream().cuda_stream


def peer_copies(op, data):
    """The op's extra buffers: D_LP_S keeps the weights and both neighbours'
    copies, D_FP_S the peer weight; they start as the op expects."""
    if op == "d_lp_s":
        return (data, data, data)
    if op == "d_fp_s_ring":
        return (torch.zeros_like(data),)
    return ()


def append_op(op, bucket, comm, extra):
    if op.startswith("c_lp_s"):
        bucket.append_centralized_low_precision_op(comm, None, bagua_core.CentralizedLowPrecisionOptions(
            hierarchical=False, error_feedback=op.endswith("feedback")))
    elif op == "c_fp_s_scattergather":
        bucket.append_centralized_synchronous_op(
            comm, None, bagua_core.CentralizedSynchronousOptions(hierarchical=False, scattergather=True))
    elif op == "d_lp_s":
        bucket.append_low_precision_decentralized_op(
            comm, None, *extra, bagua_core.LowPrecisionDecentralizedOptions(hierarchical=False))
    elif op == "d_fp_s_ring":
        bucket.append_decentralized_synchronous_op(comm, None, extra[0], bagua_core.DecentralizedSynchronousOptions(
            hierarchical=False, peer_selection=bagua_core.PeerSelection.RING))
    else:
        raise ValueError(f"unknown op {op}")


def run_bucket_op(device, data, op, comm, rank=0, steps=3):
    """Runs `op` on one bucket holding `data` for `steps` iterations over
    `comm` (every rank of it calls this alike), marking the tensor ready on
    the current stream after kernels that change it; returns the bucket's
    data after each step and the op's extra buffers at the end."""
    bucket_comm = comm.new_bucket_group(list(range(comm.size)))
    tensor = data.clone().to(device)
    extra = [c.clone().to(device) for c in peer_copies(op, data)]
    bucket = bagua_core.Bucket("b0", [("t0", view(tensor))])
    append_op(op, bucket, bucket_comm, [view(e) for e in extra])
    backend = bagua_core.Backend(rank, 30.0)
    backend.register_ordered_buckets([bucket])
    results = []
    for _ in range(steps):
        tensor.mul_(1.5).add_(0.25)  # kernels on the current stream before the ready mark
        if device == "cpu":
            backend.mark_communication_ready("t0")
        else:
            backend.mark_communication_ready("t0", cuda_stream=stream())
        backend.wait_pending_comm_ops()
        results.append(tensor.cpu().clone())
    return results, [e.cpu() for e in extra]
