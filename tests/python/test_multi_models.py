"""Several wrapped models in one process: each equal to its PyTorch DDP twin
(GradientAllReduce), replicas equal where the algorithm promises it, and no
algorithm hanging or failing, whatever the interleaving of the models'
forwards and backwards (multi_model_workers.py has the loops).

The models' buckets pair up size for size (the same shapes, a small bucket
size), so collectives of two models mixed on one connection would sum one
rank's A gradient with another's B gradient: consistent replicas, wrong
weights. Only the comparison with DDP sees that."""

import pytest
import torch

from launcher import run_workers

SCRIPT = __import__("pathlib").Path(__file__).with_name("multi_model_workers.py")
KINDS = ["gan", "gan_one_backward", "joint", "alternating", "two_groups", "threads"]
# Replicas equal on every rank after every step (the weights stay one model).
EQUAL_REPLICAS = ["bytegrad", "floatgrad", "qadam", "powersgd", "auto"]
LOCAL_REPLICAS = ["decentralized", "low_precision_decentralized", "async", "partial_allreduce"]
# Several buckets per model, equal in size between the two models.
ENV = {"BAGUA_DEFAULT_BUCKET_SIZE": "1024", "BAGUA_COMM_TIMEOUT_S": "30"}


def _check_against_ddp(results, kinds, name, exact):
    for rank, result in enumerate(results):
        for kind in kinds:
            for m, (mine, ddp) in enumerate(zip(result[f"{kind}/{name}"], result[f"{kind}/ddp"])):
                for i, (a, b) in enumerate(zip(mine, ddp)):
                    if exact:
                        assert torch.equal(a, b), f"rank {rank} {kind} {name}: model {m} tensor {i} not DDP's bits"
                    else:
                        torch.testing.assert_close(
                            a, b, rtol=1e-5, atol=1e-6,
                            msg=lambda msg, r=rank, k=kind, mm=m, ii=i: f"rank {r} {k} {name} model {mm} "
                                                                         f"tensor {ii}: {msg}")


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gradient_allreduce_equals_ddp_twins(world_size, tmp_path):
    results = run_workers("multi", world_size, tmp_path, script=SCRIPT, extra_env=ENV,
                          args=(",".join(KINDS), "gradient_allreduce"), timeout=300)
    # At 2 ranks the sum has one order, Gloo's and ours: bit for bit.
    _check_against_ddp(results, KINDS, "gradient_allreduce", exact=world_size == 2)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_with_two_models(world_size, tmp_path):
    names = EQUAL_REPLICAS + LOCAL_REPLICAS
    # Two threads run under GradientAllReduce above; here, QAdam rebuilding
    # its communicators after warmup in both threads at once once timed out
    # in the store at 3 ranks (README: not supported yet).
    kinds = ["gan", "joint"]
    results = run_workers("multi", world_size, tmp_path, script=SCRIPT, extra_env=ENV,
                          args=(",".join(kinds), ",".join(names)), timeout=400)
    for kind in kinds:
        for name in names:
            for rank, result in enumerate(results):
                for m, weights in enumerate(result[f"{kind}/{name}"]):
                    assert all(torch.isfinite(w).all() for w in weights), f"rank {rank} {kind} {name} model {m}"
                    if name in EQUAL_REPLICAS:
                        for i, (a, b) in enumerate(zip(weights, results[0][f"{kind}/{name}"][m])):
                            assert torch.equal(a, b), f"{kind} {name}: model {m} tensor {i} differs on rank {rank}"


def test_torch_ddp_over_a_bagua_module_is_refused(tmp_path):
    for result in run_workers("ddp_on_top", 2, tmp_path, script=SCRIPT):
        assert result["error"] is not None and "twice" in result["error"] and "without_bagua" in result["error"]
