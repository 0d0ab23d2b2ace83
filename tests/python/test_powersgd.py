"""PowerSGDAlgorithm against a single-process reference written here from
the formulas (every rank's gradient computed locally, the low-rank average
built with plain torch), and its pieces alone."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm, compresses, initial_q, orthogonalize
from launcher import run_workers
from workers import batches, fresh_model_and_optimizer

WORKERS = Path(__file__).with_name("powersgd_workers.py")


def test_compresses_follows_ddps_rule():
    assert not compresses(torch.Size([100]), 1, 2.0)            # vectors never
    assert compresses(torch.Size([37, 20]), 1, 2.0)              # (37 + 20) * 2 < 740
    assert not compresses(torch.Size([5, 13]), 4, 2.0)           # (5 + 13) * 4 * 2 > 65
    assert compresses(torch.Size([8, 3, 3, 3]), 1, 2.0)          # conv: 8 x 27
    assert not compresses(torch.Size([37, 20]), 1, 20.0)         # 57 * 20 > 740


def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns():
    p = torch.randn(50, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = orthogonalize(p.clone())
    torch.testing.assert_close(q.t() @ q, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
    # the span is kept: p = q r with r upper triangular
    r = q.t() @ p
    torch.testing.assert_close(q @ r, p, rtol=0, atol=1e-10)
    assert torch.equal(orthogonalize(torch.zeros(6, 2)), torch.zeros(6, 2))


def test_initial_q_is_the_same_for_a_name_and_differs_between_names():
    a = initial_q("fc1.weight", 20, 2, 0, torch.float32, "cpu")
    assert torch.equal(a, initial_q("fc1.weight", 20, 2, 0, torch.float32, "cpu"))
    assert not torch.equal(a, initial_q("fc2.weight", 20, 2, 0, torch.float32, "cpu"))
    assert not torch.equal(a, initial_q("fc1.weight", 20, 2, 1, torch.float32, "cpu"))


@pytest.mark.parametrize("bad", [dict(rank=0), dict(start_iter=-1), dict(min_compression_rate=0.5),
                                 dict(error_feedback="yes"), dict(orthogonalization_epsilon=-1.0),
                                 dict(low_precision=1)])
def test_bad_arguments_are_clear_errors(bad):
    with pytest.raises(InvalidArgumentError):
        PowerSGDAlgorithm(**bad)


def low_rank_step_reference(m, error, q, epsilon=0.0):
    """One PowerSGD step at world size 1 from the formulas, in float64."""
    m = m.double() + (error.double() if error is not None else 0)
    p = orthogonalize(m @ q.double(), epsilon)
    q = m.t() @ p
    approximation = p @ q.t()
    return approximation, m - approximation, q


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                             (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("rows,cols,rank,with_error", [(37, 23, 1, True), (5, 300, 3, True), (64, 9, 6, False),
                                                       (1, 17, 2, True)])
def test_low_rank_step_matches_the_formulas(dtype, tolerance, rows, cols, rank, with_error):
    """The C++ op's matrix steps (project, Gram-Schmidt, project back,
    reconstruct with the new error) against torch in float64."""
    import bagua_core
    from bagua.torch_api._core import tensor_view
    g = torch.Generator().manual_seed(rows * cols + rank)
    m, error = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    q = torch.randn(cols, rank, generator=g)
    m, error, q = m.to(dtype), error.to(dtype), q.to(dtype)
    expected = low_rank_step_reference(m, error if with_error else None, q)
    work = error if with_error else torch.empty(0, dtype=dtype)
    p = torch.empty(rows, rank, dtype=dtype)  # held: a view does not keep its tensor alive
    bagua_core.low_rank_step(tensor_view(m), tensor_view(work), tensor_view(q), tensor_view(p), rows, cols, rank)
    scale = max(1.0, expected[0].abs().max().item())
    torch.testing.assert_close(m.double(), expected[0], rtol=tolerance, atol=tolerance * scale)
    torch.testing.assert_close(q.double(), expected[2], rtol=tolerance, atol=tolerance * scale)
    if with_error:
        torch.testing.assert_close(error.double(), expected[1], rtol=tolerance, atol=tolerance * scale)


def test_low_rank_step_rejects_mismatched_or_integer_operands():
    import bagua_core
    from bagua.torch_api._core import tensor_view
    m, q, p = torch.zeros(4, 5), torch.zeros(5, 2), torch.zeros(4, 2)
    with pytest.raises(bagua_core.InvalidArgumentError, match="is not 4 x 6"):
        bagua_core.low_rank_step(tensor_view(m), tensor_view(m), tensor_view(q), tensor_view(p), 4, 6, 2)
    with pytest.raises(bagua_core.InvalidArgumentError, match="does not match"):
        bagua_core.low_rank_step(tensor_view(m), tensor_view(m.double()), tensor_view(q), tensor_view(p), 4, 5, 2)
    ints = [t.int() for t in (m, m, q, p)]
    with pytest.raises(bagua_core.InvalidArgumentError, match="floating point"):
        bagua_core.low_rank_step(*(tensor_view(t) for t in ints), 4, 5, 2)


def test_powersgd_op_rejects_state_of_the_wrong_shape_or_dtype():
    import bagua_core
    from bagua.torch_api._core import tensor_view
    grad = torch.zeros(6, 4)
    bucket = bagua_core.Bucket("b", [("w", tensor_view(grad))])
    comm = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix="powersgd-state")
    no_error = bagua_core.TensorView(0, 0, "float32", "cpu")
    from bagua_core import PowerSGDOptions
    for q, message in ((torch.zeros(4, 3), "q of 'w' must be 4 x 2"), (torch.zeros(4, 2).double(), "q of 'w'")):
        with pytest.raises(bagua_core.InvalidArgumentError, match=message):
            bucket.append_powersgd_op(comm, [(0, 6, 4, tensor_view(q), no_error)], PowerSGDOptions(rank=2))
    with pytest.raises(bagua_core.InvalidArgumentError, match="is not 5 x 4"):
        bucket.append_powersgd_op(comm, [(0, 5, 4, tensor_view(torch.zeros(4, 2)), no_error)], PowerSGDOptions(rank=2))


def reference_training(world_size, names, rank_r, start_iter, error_feedback, warm_start, steps=5):
    """The same training in one process: each rank's gradient from its own
    data, averaged by the PowerSGD formulas (plain average for the first
    start_iter steps and for tensors that are not compressed)."""
    model, opt = fresh_model_and_optimizer("sgd")
    data = [batches(r, steps=steps) for r in range(world_size)]
    qs, errors, draws, history = {}, {}, {}, []
    for step in range(1, steps + 1):
        grads = []
        for r in range(world_size):
            model.zero_grad()
            x, y = data[r][step - 1]
            F.cross_entropy(model(x), y).backward()
            grads.append([p.grad.detach().clone().double() for p in model.parameters()])
        averaged = []
        for i, (name, param) in enumerate(zip(names, model.parameters())):
            local = [g[i] for g in grads]
            if step <= start_iter or not compresses(param.shape, rank_r, 2.0):
                averaged.append(sum(local) / world_size)
                continue
            ms = [g.reshape(g.shape[0], -1) for g in local]
            if error_feedback:  # each rank adds what its compression lost last time
                ms = [m + errors.get((name, r), torch.zeros_like(m)) for r, m in enumerate(ms)]
            if name not in qs or not warm_start:
                draw = draws.get(name, 0)
                draws[name] = draw + 1
                qs[name] = initial_q(name if draw == 0 else f"{name}#{draw}", ms[0].shape[1], rank_r, 0,
                                     torch.float32, "cpu").double()
            p = orthogonalize(sum(m @ qs[name] for m in ms))
            qs[name] = sum(m.t() @ p for m in ms) / world_size
            approximation = p @ qs[name].t()
            if error_feedback:
                for r, m in enumerate(ms):
                    errors[(name, r)] = m - approximation
            averaged.append(approximation.view_as(param))
        for param, g in zip(model.parameters(), averaged):
            param.grad = g.float()
        opt.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize("world_size,rank_r,start_iter,error_feedback,warm_start,flatten,one_bucket", [
    (2, 2, 2, True, True, True, False),
    (3, 1, 0, True, True, False, True),
    (5, 2, 1, False, False, True, False),
    (2, 4, 1, True, True, False, False),  # rank 4: the row loops compiled for it (low_rank_steps.h)
])
def test_training_matches_the_reference(tmp_path, world_size, rank_r, start_iter, error_feedback, warm_start,
                                        flatten, one_bucket):
    flags = ["1" if f else "0" for f in (error_feedback, warm_start, flatten, False, one_bucket)]
    results = run_workers("training", world_size, tmp_path, script=WORKERS,
                          args=(str(rank_r), str(start_iter), *flags),
                          extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "2048"})  # several buckets
    assert (results[0]["buckets"] == 1) == one_bucket
    reference = reference_training(world_size, results[0]["names"], rank_r, start_iter, error_feedback,
                                   warm_start)
    for rank, result in enumerate(results):
        assert result["names"] == results[0]["names"]
        for step, (ours, expected) in enumerate(zip(result["params"], reference)):
            for name, a, b in zip(result["names"], ours, expected):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"rank {rank}, step {step + 1}, {name}: {m}")
    # after start_iter the matrices travel as factors: fewer bytes than plain averaging
    assert results[0]["bytes_sent"] < results[0]["bytes_uncompressed"]
    # the runtime's state (what checkpoints save) carries Q and the errors, and loads back
    compressed = [n for n, p in zip(results[0]["names"], results[0]["params"][0])
                  if compresses(p.shape, rank_r, 2.0)]
    assert results[0]["state_q"] == sorted(compressed)
    assert results[0]["state_error"] == (sorted(compressed) if error_feedback else [])
    assert all(r["round_trip"] for r in results)


@pytest.mark.parametrize("low_precision", ["0", "1"])
def test_bucket_layout_does_not_change_the_bits_at_two_ranks(tmp_path, low_precision):
    """At two ranks every tensor is averaged (and 8-bit coded) on its own, so
    the runtime's buckets, averaged during the backward, give the bits of one
    bucket averaged after it: the layout is a matter of speed only. Here two
    of the four buckets hold no compressed matrix (fc3's 13 x 5 would not
    shrink at rank 2); with 8 bits they are coded all the same."""
    def train(one_bucket):
        return run_workers("training", 2, tmp_path / one_bucket, script=WORKERS,
                           args=("2", "1", "1", "1", "1", low_precision, one_bucket),
                           extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "2048"})
    several, one = train("0"), train("1")
    assert several[0]["buckets"] > 1 and one[0]["buckets"] == 1
    for rank in range(2):
        for step, (a, b) in enumerate(zip(several[rank]["params"], one[rank]["params"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, step + 1)
    assert several[0]["params"][-1][0].ne(one[0]["params"][0][0]).any()  # it trained


@pytest.mark.parametrize("world_size,low_precision", [(2, "0"), (3, "1")])
def test_adopted_fresh_gradients_give_the_bits_of_kept_ones(tmp_path, world_size, low_precision):
    """With zero_grad(set_to_none=True) the buckets take autograd's fresh
    gradient as their memory instead of copying it in: the run is the same,
    bit for bit, as with the gradients kept in place."""
    results = run_workers("fresh_gradients", world_size, tmp_path, script=WORKERS, args=(low_precision,))
    for rank, result in enumerate(results):
        assert all(result["adopted"]), (rank, result["adopted"])
        for step, (fresh, kept) in enumerate(zip(result["fresh"], result["kept"])):
            for i, (a, b) in enumerate(zip(fresh, kept)):
                assert torch.equal(a, b), f"rank {rank}, step {step + 1}, parameter {i}"
        for step, params in enumerate(result["fresh"]):  # replicas agree
            assert all(torch.equal(a, b) for a, b in zip(params, results[0]["fresh"][step])), (rank, step)


@pytest.mark.parametrize("world_size,low_precision", [(1, "0"), (2, "0"), (3, "1")])
def test_host_threads_give_the_bits_of_one_thread(tmp_path, world_size, low_precision):
    """PowerSGD's factor passes on three host threads (core/host_threads.h,
    the count taken from torch.get_num_threads() when the algorithm is set
    up) train to the same parameters, bit for bit, as on one thread; the
    passes were really cut."""
    results = run_workers("host_threads", world_size, tmp_path, script=WORKERS, args=(low_precision,))
    for rank, result in enumerate(results):
        assert result["taken"] == {1: 1, 3: 3}, (rank, result["taken"])
        assert result["cuts"][1] == 0 and result["cuts"][3] >= 3 * 4, (rank, result["cuts"])
        for step, (three, one) in enumerate(zip(result["three"], result["one"])):
            for i, (a, b) in enumerate(zip(three, one)):
                assert torch.equal(a, b), f"rank {rank}, step {step + 1}, parameter {i}"
        for step, params in enumerate(result["three"]):  # replicas agree
            assert all(torch.equal(a, b) for a, b in zip(params, results[0]["three"][step])), (rank, step)


@pytest.mark.parametrize("world_size", [2, 3, 5])
@pytest.mark.parametrize("low_precision", [False, True])
def test_exchange_matches_the_reference(tmp_path, world_size, low_precision):
    """One averaging step of the C++ op on integer inputs equals the formulas
    computed with torch to float rounding (its sums run in another order),
    8-bit or not; the 8-bit one differs from the full precision one."""
    results = run_workers("exchange", world_size, tmp_path / str(low_precision), script=WORKERS,
                          args=("1" if low_precision else "0",))
    tolerance = dict(rtol=3e-5, atol=1e-5)  # c.weight's Q sums 600 rows: 1.5e-5 apart in float32
    for rank, result in enumerate(results):
        vector, grads, qs = result["expected"]
        torch.testing.assert_close(result["vector"], vector, **tolerance)
        for name in grads:
            torch.testing.assert_close(result["grads"][name], grads[name], **tolerance,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
            torch.testing.assert_close(result["q"][name], qs[name], **tolerance)
            assert torch.equal(result["grads"][name], results[0]["grads"][name])  # replicas agree
    if low_precision:
        plain = run_workers("exchange", world_size, tmp_path / "plain", script=WORKERS, args=("0",))
        assert results[0]["bytes_sent"] * 2 < plain[0]["bytes_sent"]
        assert any((results[0]["grads"][n] - plain[0]["grads"][n]).abs().max() > 1e-3 for n in grads)


def test_low_precision_training_matches_the_reference_within_8bit_error(tmp_path):
    """Training with 8-bit factors stays near the full precision reference
    (the factors' 8-bit error, absorbed by error feedback), replicas equal."""
    results = run_workers("training", 3, tmp_path, script=WORKERS, args=("2", "1", "1", "1", "1", "1"))
    reference = reference_training(3, results[0]["names"], 2, 1, True, True)
    for rank, result in enumerate(results):
        for step, (ours, expected) in enumerate(zip(result["params"], reference)):
            for name, a, b, c in zip(result["names"], ours, expected, results[0]["params"][step]):
                assert torch.equal(a, c), f"rank {rank} differs from rank 0 at step {step + 1}, {name}"
                torch.testing.assert_close(a, b, rtol=0, atol=2e-3, msg=lambda m: f"step {step + 1}, {name}: {m}")
    plain = run_workers("training", 3, tmp_path / "plain", script=WORKERS, args=("2", "1", "1", "1", "1", "0"))
    # The first step is exact; then every tensor's codes carry a min/max of
    # their own (8 bytes), which on this model's tensors of 5 to 74 elements
    # is up to 1.6x the codes.
    assert results[0]["bytes_sent"] < 0.7 * plain[0]["bytes_sent"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_low_precision_average_primitive_matches_the_formulas(tmp_path, world_size):
    from powersgd_workers import lp_average_input, low_precision_average

    results = run_workers("lp_average", world_size, tmp_path, script=WORKERS)
    inputs = [lp_average_input(r) for r in range(world_size)]
    expected = low_precision_average(inputs) if world_size > 1 else inputs[0]
    exact = sum(inputs) / world_size
    for rank, result in enumerate(results):
        assert torch.equal(result["f32"], expected), f"rank {rank}"
        assert result["f64"].dtype == torch.float64 and torch.equal(result["f64"].float(), expected)
        # within the 8-bit error of the exact mean: each chunk's step is its range / 255
        assert (result["f32"] - exact).abs().max() < 2 * (exact.max() - exact.min()) / 255 + 1e-6
        if world_size > 1:
            assert "low_precision_average" in result["mismatch"], result["mismatch"]


def test_accuracy_matches_ddps_powersgd_hook(tmp_path):
    """bench/powersgd_vs_ddp_hook.py, shortened: PowerSGDAlgorithm and DDP
    with powerSGD_hook train the digits MLP from the same model on the same
    batches (rank 2, 40 plain steps, 5 epochs); every rank of ours
    holds the same model and lands within 1.5 points of the hook's."""
    import json
    import subprocess
    import sys
    from launcher import free_port
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "hook.json"
    subprocess.run([sys.executable, "-m", "bagua.distributed.launch", "--nproc_per_node", "2",
                    "--master_port", str(free_port()), str(root / "bench" / "powersgd_vs_ddp_hook.py"),
                    "--epochs", "5", "--start-iter", "40", "--json", str(out)], check=True, timeout=600, cwd=root)
    result = json.loads(out.read_text())
    ours, hook = result["bagua_powersgd"]["test_accuracy"], result["ddp_powersgd_hook"]["test_accuracy"]
    assert len(set(ours)) == 1, ours
    assert ours[0] >= hook[0] - 0.015, (ours, hook)
    assert ours[0] >= 0.9, ours
