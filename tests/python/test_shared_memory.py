"""Allreduce through shared memory between processes of one host
(include/bagua/comm/shared_memory.h): equal to the closed forms and to
torch.distributed, identical bits on every rank, really in use (and not when
disabled), and a peer that dies is an error naming it within a second, not
after BAGUA_COMM_TIMEOUT_S."""

from pathlib import Path

import pytest

from launcher import run_workers

WORKERS = Path(__file__).with_name("shm_workers.py")


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_shared_memory_allreduce_matches_closed_forms_and_torch(world_size, tmp_path):
    results = run_workers("allreduce", world_size, tmp_path, script=WORKERS)
    for rank, r in enumerate(results):
        for key, value in r.items():
            if key.startswith("sum_"):
                assert value, (rank, key)
        assert r["max_abs_diff_vs_torch"] < 1e-5, r
        assert r["identical_on_all_ranks"], rank
        assert r["maps_segment"], rank


def test_disabled_shared_memory_stays_on_the_network(tmp_path):
    results = run_workers("allreduce", 2, tmp_path, script=WORKERS,
                          extra_env={"BAGUA_SHARED_MEMORY": "0"})
    for r in results:
        assert r["max_abs_diff_vs_torch"] == 0.0  # Gloo's ring at 2 ranks adds like torch's
        assert not r["maps_segment"]


def test_a_peer_that_dies_is_named_within_a_second(tmp_path):
    results = run_workers("peer_dies", 3, tmp_path, script=WORKERS, may_fail={1},
                          # no size check first: its allgather would see the closed socket
                          extra_env={"BAGUA_COMM_TIMEOUT_S": "60", "BAGUA_CHECK_COLLECTIVES": "0"})
    assert results[1] is None
    for rank in (0, 2):
        error, seconds = results[rank]["error"], results[rank]["seconds"]
        assert error is not None and "rank 1 (pid" in error and "has exited" in error, error
        assert seconds < 10, seconds  # far below the 60 s timeout
