"""Worker scenarios of test_powersgd.py, run on several processes by
launcher.run_workers. Usage: powersgd_workers.py SCENARIO OUT_DIR [ARGS...];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
import bagua_core
from bagua.torch_api._core import tensor_view
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

import minmax_reference as ref
from bagua.torch_api.algorithms.powersgd import orthogonalize
from workers import batches, fresh_model_and_optimizer

# The exchange scenario's tensors: integer values, so that P = M Q is exact
# in float32 and the reference quantizes the very values the algorithm does.
EXCHANGE_SHAPES = {"a.weight": (37, 23), "b.weight": (16, 12), "c.weight": (600, 5)}  # c: P over 1024
EXCHANGE_VECTOR = 7
EXCHANGE_RANK = 2


def exchange_inputs(rank):
    """(vector, {name: matrix}) of rank ``rank``, small integers."""
    g = torch.Generator().manual_seed(1000 + rank)
    vector = torch.randint(-8, 9, (EXCHANGE_VECTOR,), generator=g).float()
    return vector, {n: torch.randint(-8, 9, s, generator=g).float() for n, s in EXCHANGE_SHAPES.items()}


def exchange_q():
    g = torch.Generator().manual_seed(7)
    return {n: torch.randint(-3, 4, (s[1], EXCHANGE_RANK), generator=g).float()
            for n, s in EXCHANGE_SHAPES.items()}


def chunk_of(n, m, j):
    """The low-precision average's chunk j of n elements over m ranks:
    (offset, count), the first n % m chunks one longer."""
    base, rest = divmod(n, m)
    return j * base + min(j, rest), base + (1 if j < rest else 0)


CODE_CHUNK = 1024  # PowerSGDOp::kCodeChunk: elements per min/max of its 8-bit codes


def pieces(offset, count, segments):
    """The op's 8-bit pieces (lo, hi) of elements [offset, offset + count)
    of a buffer holding tensors of lengths ``segments`` back to back: every
    tensor's CODE_CHUNK-element chunks, counted from its start, cut to the
    range."""
    out, start = [], 0
    for length in segments:
        for chunk in range(start, start + length, CODE_CHUNK):
            lo, hi = max(chunk, offset), min(chunk + CODE_CHUNK, start + length, offset + count)
            if lo < hi:
                out.append((lo, hi))
        start += length
    return out


def roundtrip(buffer, offset, count, segments=None):
    """Elements [offset, offset + count) of ``buffer`` through 8-bit codes:
    one min/max for all, or (``segments``) one per piece."""
    if segments is None:
        return ref.decompress(*ref.compress(buffer[offset:offset + count]))
    out = buffer[offset:offset + count].clone()
    for lo, hi in pieces(offset, count, segments):
        out[lo - offset:hi - offset] = ref.decompress(*ref.compress(buffer[lo:hi]))
    return out


def low_precision_average(buffers, segments=None):
    """The 8-bit average of every rank's float32 buffer, from the formulas:
    owner j of chunk j adds the decoded 8-bit chunks of the others to its
    exact own, divides by the rank count, and everyone decodes the 8-bit form
    of that average. A chunk is coded whole, or (``segments``) in pieces."""
    m, out = len(buffers), torch.empty_like(buffers[0])
    for j in range(m):
        off, cnt = chunk_of(buffers[0].numel(), m, j)
        acc = buffers[j][off:off + cnt].clone()
        for r in range(m):
            if r != j:
                acc += roundtrip(buffers[r], off, cnt, segments)
        acc /= m
        whole = torch.zeros_like(buffers[0])
        whole[off:off + cnt] = acc
        out[off:off + cnt] = roundtrip(whole, off, cnt, segments)
    return out


def segmented_roundtrip(buffer, segments):
    """``buffer`` through the op's 8-bit codes at two ranks: each segment (a
    vector, one matrix's factor) in chunks of its own, a min/max per
    CODE_CHUNK elements."""
    parts = torch.split(buffer, list(segments))
    return torch.cat([ref.roundtrip_chunked(part, CODE_CHUNK) for part in parts])


def op_low_precision_average(buffers, segments):
    """The op's 8-bit average, each tensor coded apart: at two ranks every
    rank's buffer quantized segment by segment, decoded and averaged in rank
    order (one allgather round); at more, the chunk-owner average with each
    chunk coded in pieces."""
    if len(buffers) != 2:
        return low_precision_average(buffers, segments)
    return (segmented_roundtrip(buffers[0], segments) + segmented_roundtrip(buffers[1], segments)) / 2


def reference_exchange(world, low_precision):
    """What every rank's vector, gradients and Q must be after one PowerSGD
    exchange (no error feedback), in float32 with plain torch."""
    inputs = [exchange_inputs(r) for r in range(world)]
    q = exchange_q()
    names = list(EXCHANGE_SHAPES)

    def average(buffers, segments):
        return op_low_precision_average(buffers, segments) if low_precision else sum(buffers) / world

    first_segments = [EXCHANGE_VECTOR] + [EXCHANGE_SHAPES[n][0] * EXCHANGE_RANK for n in names]
    q_segments = [EXCHANGE_SHAPES[n][1] * EXCHANGE_RANK for n in names]
    first = average([torch.cat([v] + [(ms[n] @ q[n]).reshape(-1) for n in names]) for v, ms in inputs],
                    first_segments)
    vector, offset, ps = first[:EXCHANGE_VECTOR], EXCHANGE_VECTOR, {}
    for n in names:
        rows = EXCHANGE_SHAPES[n][0]
        ps[n] = orthogonalize(first[offset:offset + rows * EXCHANGE_RANK].view(rows, EXCHANGE_RANK).clone())
        offset += rows * EXCHANGE_RANK
    q_flat = average([torch.cat([(ms[n].t() @ ps[n]).reshape(-1) for n in names]) for _, ms in inputs],
                     q_segments)
    offset, grads, qs = 0, {}, {}
    for n in names:
        qs[n] = q_flat[offset:offset + q[n].numel()].view_as(q[n])
        offset += q[n].numel()
        grads[n] = ps[n] @ qs[n].t()
    return vector, grads, qs


def params_after_each_step(model, opt, rank, steps=5):
    """Trains on this rank's batches; the parameters after every step."""
    params = []
    for x, y in batches(rank, steps=steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    return params


def scenario_training(out_dir, rank_r="2", start_iter="2", error_feedback="1", warm_start="1", flatten="1",
                      low_precision="0", one_bucket="0"):
    """Five SGD steps of workers.Net with PowerSGD; saves the parameters
    after every step, the bagua names of the parameters and the bytes."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    algorithm = PowerSGDAlgorithm(rank=int(rank_r), start_iter=int(start_iter),
                                  error_feedback=error_feedback == "1", warm_start=warm_start == "1",
                                  low_precision=low_precision == "1", one_bucket=one_bucket == "1")
    model = model.with_bagua([opt], algorithm, do_flatten=flatten == "1")
    params = params_after_each_step(model, opt, rank)
    impl = model.bagua_ddp.bagua_algorithm_impl
    state = model.bagua_ddp.state_dict()["algorithm_state"]
    restored = PowerSGDAlgorithm().reify(None)
    restored.load_state_dict(model.bagua_ddp, state)
    # the error as the state says it (deferred on the CPU: M - p_prev q_prev^T)
    round_trip = all(torch.equal(restored._q[k], impl._q[k]) for k in impl._q) and \
        all(torch.equal(restored._materialized_error(k, restored._error[k]), impl._materialized_error(k, v))
            for k, v in impl._error.items())
    torch.save({"params": params, "state_q": sorted(state["q"]), "state_error": sorted(state["error"]),
                "round_trip": round_trip, "names": [p.bagua_tensor_name for p in model.parameters()],
                "bytes_sent": impl.bytes_sent, "bytes_uncompressed": impl.bytes_uncompressed,
                "buckets": len(model.bagua_ddp.bagua_buckets)},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_fresh_gradients(out_dir, low_precision="0"):
    """The same PowerSGD run with zero_grad(set_to_none=True), whose fresh
    gradients the buckets adopt instead of copying, and with
    set_to_none=False, which keeps the gradients in place: the parameters
    after every step, and whether the first run's buckets worked on the
    gradient autograd allocated (its memory, not a copy)."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithmImpl

    assert PowerSGDAlgorithmImpl.adopts_fresh_gradients  # on by default (see there)
    runs = {}
    adopted, held = [], []  # held: every step's gradients stay alive, so none's id is reused
    for set_to_none in (True, False):
        model, opt = fresh_model_and_optimizer("sgd")
        model = model.with_bagua([opt], PowerSGDAlgorithm(rank=2, start_iter=1,
                                                          low_precision=low_precision == "1"))
        params = []
        for x, y in batches(rank, steps=5):
            opt.zero_grad(set_to_none=set_to_none)
            F.cross_entropy(model(x), y).backward()
            if set_to_none:  # the registered memory is the tensor autograd made this step
                held.append([p.grad for p in model.parameters()])
                adopted.append(all(p.grad is p.bagua_registered_tensor() and
                                   all(p.grad is not earlier[i] for earlier in held[:-1])
                                   for i, p in enumerate(model.parameters())))
            opt.step()
            params.append([p.detach().clone() for p in model.parameters()])
        runs[set_to_none] = params
    torch.save({"fresh": runs[True], "kept": runs[False], "adopted": adopted},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_host_threads(out_dir, low_precision="0"):
    """The same PowerSGD run with the factor passes on one host thread and on
    three: the parameters after every step, the thread count PowerSGD took
    from torch when it was set up, and how many passes were cut."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    runs, cuts, taken = {}, {}, {}
    for threads in (1, 3):
        torch.manual_seed(7)  # matrices large enough to be cut (64 Ki elements a range)
        model = torch.nn.Sequential(torch.nn.Linear(20, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 5))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # PowerSGD takes torch's count when set up...
        model = model.with_bagua([opt], PowerSGDAlgorithm(rank=2, start_iter=1, low_precision=low_precision == "1"))
        taken[threads] = bagua_core.host_threads()
        torch.set_num_threads(torch_threads)  # ...and torch's own ops stay on one thread in both runs
        before = bagua_core.host_ranges_cut()
        params = params_after_each_step(model, opt, rank)
        runs[threads], cuts[threads] = params, bagua_core.host_ranges_cut() - before
    torch.save({"one": runs[1], "three": runs[3], "cuts": cuts, "taken": taken},
               os.path.join(out_dir, f"rank{rank}.pt"))


def scenario_exchange(out_dir, low_precision):
    """One compressed exchange of the C++ op on the exchange inputs (one flat
    bucket: the vector, then the matrices), and the reference computed in
    this same process."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    vector, matrices = exchange_inputs(rank)
    names = ["v"] + list(matrices)
    flat = torch.cat([vector] + [m.reshape(-1) for m in matrices.values()])
    tensors, offset = [], 0
    for t in [vector] + list(matrices.values()):
        tensors.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    q = exchange_q()
    comm = bagua.communication._get_default_group().get_global_communicator()
    bucket = bagua_core.Bucket("b0", [(n, tensor_view(t)) for n, t in zip(names, tensors)])
    no_error = bagua_core.TensorView(0, 0, "float32", "cpu")
    op = bucket.append_powersgd_op(
        comm.new_bucket_group(list(range(world))),
        [(i + 1, *EXCHANGE_SHAPES[n], tensor_view(q[n]), no_error) for i, n in enumerate(matrices)],
        bagua_core.PowerSGDOptions(rank=EXCHANGE_RANK, low_precision=low_precision == "1"))
    op.compressing = True
    backend = bagua_core.Backend(rank, 30.0)
    backend.register_ordered_buckets([bucket])
    for n in names:
        backend.mark_communication_ready(n)
    backend.wait_pending_comm_ops()
    expected = reference_exchange(world, low_precision == "1")
    torch.save({"vector": tensors[0], "grads": dict(zip(matrices, tensors[1:])), "q": q, "expected": expected,
                "bytes_sent": op.exchanged_bytes}, os.path.join(out_dir, f"rank{rank}.pt"))


def lp_average_input(rank, numel=1001):
    return torch.randn(numel, generator=torch.Generator().manual_seed(50 + rank))


def scenario_lp_average(out_dir):
    """bagua.low_precision_average_inplace on float32 and float64 tensors,
    and a call where the last rank passes another size."""
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()
    f32 = lp_average_input(rank)
    f64 = f32.double()
    bagua.low_precision_average_inplace(f32)
    bagua.low_precision_average_inplace(f64)
    mismatch = None
    try:
        bagua.low_precision_average_inplace(torch.zeros(10 + (rank == world - 1)))
    except bagua.InvalidArgumentError as e:
        mismatch = str(e)
    torch.save({"f32": f32, "f64": f64, "mismatch": mismatch}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
