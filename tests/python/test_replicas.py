"""The replica check (check_replicas_every / BAGUA_CHECK_REPLICAS): silent
where replicas are equal, and a one-ulp change on one rank named on every
rank, with the parameter and the step (replica_workers.py)."""

import pytest
import torch

from launcher import run_workers

SCRIPT = __import__("pathlib").Path(__file__).with_name("replica_workers.py")


@pytest.mark.parametrize("world_size", [2, 3])
def test_equal_replicas_pass_the_check(world_size, tmp_path):
    names = "gradient_allreduce,bytegrad,floatgrad,qadam,powersgd,auto"
    results = run_workers("quiet", world_size, tmp_path, script=SCRIPT, args=(names,))
    assert all(r["ok"] for r in results)


@pytest.mark.parametrize("world_size", [2, 5])
def test_a_one_rank_change_is_caught_on_every_rank(world_size, tmp_path):
    # Checked every 4 steps: the nudge right after step 8 shows at the check after
    # it (later updates could round a one-ulp difference away).
    results = run_workers("nudged", world_size, tmp_path, script=SCRIPT, extra_env={"BAGUA_CHECK_REPLICAS": "4"})
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank}: the nudge went unnoticed"
        assert "after step 8" in error and "'2.weight'" in error and "rank(s) [1]" in error, error


def test_the_check_argument_is_checked():
    import bagua.torch_api as bagua
    from bagua.torch_api.data_parallel.replicas import resolve_every

    with pytest.raises(bagua.InvalidArgumentError, match="check_replicas_every"):
        resolve_every(-1)
    with pytest.raises(bagua.InvalidArgumentError, match="check_replicas_every"):
        resolve_every(True)
    assert resolve_every(3) == 3
