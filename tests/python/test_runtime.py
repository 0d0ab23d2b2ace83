"""The runtime's behaviour across processes: re-planning from the profile,
the watchdog, and errors raised on the communication thread."""

import torch

from launcher import run_workers


def test_buckets_follow_the_profiled_ready_order(tmp_path):
    results = run_workers("replan", 3, tmp_path, extra_env={"BAGUA_DEFAULT_BUCKET_SIZE": "2000"})
    for rank, r in enumerate(results):
        # initial plan: reverse registration order; after profiling: ready order
        assert r["initial_order"][0].startswith("middle"), r["initial_order"]
        assert r["final_order"] != r["initial_order"]
        assert r["final_order"] == r["ready_order"] == results[0]["final_order"]
        assert r["final_order"][0].startswith("last")
        for ours, theirs in zip(r["bagua"], r["ddp"]):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        buckets = r["stats"]["buckets"]
        assert len(buckets) > 1 and all(b["flat"] for b in buckets)
        assert all(b["ops"][0]["name"] == "centralized_synchronous" for b in buckets)
        # 9 steps ran on the re-planned buckets (the first on the initial plan)
        assert all(b["ops"][0]["executions"] == 9 for b in buckets)


def test_a_rank_that_stops_communicating_is_a_timeout_not_a_hang(tmp_path):
    results = run_workers("straggler_timeout", 2, tmp_path, extra_env={"BAGUA_COMM_TIMEOUT_S": "3"},
                          timeout=60)
    name, message, mro = results[0]["error"]
    assert "CommTimeoutError" in mro and "TimeoutError" in mro, (name, message)
    assert "rank 0" in message and "bucket" in message and "centralized_synchronous" in message, message
    assert results[0]["seconds"] < 15
    assert results[0]["again"] is not None and "CommTimeoutError" in results[0]["again"][2]


def test_python_op_exception_reaches_the_training_thread(tmp_path):
    results = run_workers("python_op_error", 2, tmp_path)
    for rank, r in enumerate(results):
        name, message, mro = r["error"]
        assert "BackendError" in mro, (name, message)
        assert f"rank {rank}: op 'python_op' of bucket" in message and "no such thing" in message, message
