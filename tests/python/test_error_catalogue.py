"""The error catalogue (docs/errors.md): each case gets a clear exception on
every rank, never a hang, a crash or wrong numbers. CATALOGUE names every
case the document lists and the test that covers it; a test here checks
that the two agree."""

import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from launcher import run_workers

WORKERS = Path(__file__).with_name("catalogue_workers.py")
ERRORS_MD = Path(__file__).resolve().parents[2] / "docs" / "errors.md"

# case -> (exception class, fragment of the message) for the cases of the
# catalogue scenario; every rank must raise it.
EVERY_RANK = {
    "allgather_output_size_on_one_rank": ("InvalidArgumentError", "the call was refused"),
    "gather_output_size_on_the_root": ("InvalidArgumentError", "rank 0: gather: expected a tensor of"),
    "reduce_scatter_indivisible": ("InvalidArgumentError", "do not split into"),
    "alltoall_indivisible": ("InvalidArgumentError", "do not split into"),
    "not_a_tensor": ("InvalidArgumentError", "must be a torch.Tensor, got list"),
    "meta_tensor": ("InvalidArgumentError", "unsupported device meta"),
    "bool_tensor": ("InvalidArgumentError", "unsupported dtype torch.bool"),
    "send_to_self": ("InvalidArgumentError", "is not another rank"),
    "send_out_of_range": ("InvalidArgumentError", "is not a rank of a group"),
    "new_group_out_of_range": ("InvalidArgumentError", "is outside the group"),
    "new_group_duplicates": ("InvalidArgumentError", "sorted and unique"),
    "bytegrad_average": ("InvalidArgumentError", "average must be True or False"),
    "decentralized_mode": ("InvalidArgumentError", "peer_selection_mode must be one of"),
    "decentralized_interval": ("InvalidArgumentError", "communication_interval must be an integer >= 1"),
    "low_precision_interval": ("InvalidArgumentError", "communication_interval must be an integer >= 1"),
    "qadam_warmup": ("InvalidArgumentError", "warmup_steps must be an integer >= 1"),
    "qadam_lr": ("InvalidArgumentError", "lr must be positive"),
    "async_interval": ("InvalidArgumentError", "sync_interval_ms must be an integer >= 0"),
    "powersgd_rank": ("InvalidArgumentError", "rank must be an integer >= 1"),
    "partial_group_size": ("InvalidArgumentError", "group_size must be an integer >= 2"),
    "model_shape_differs": ("InvalidArgumentError", "the ranks wrapped different models"),
    "model_count_differs": ("InvalidArgumentError", "parameters and buffers, rank 0 has"),
    "empty_model": ("InvalidArgumentError", "has no parameter that requires a gradient"),
    "frozen_model": ("InvalidArgumentError", "has no parameter that requires a gradient"),
    "tensor_twice_in_a_bucket": ("InvalidArgumentError", "holds tensor 'catalogue_t' twice"),
    "dtypes_mixed_in_a_bucket": ("InvalidArgumentError", "mixes catalogue_a"),
}

THIS = "test_error_catalogue.py"
# Every case of docs/errors.md: id -> the test that covers it.
CATALOGUE = {name: f"{THIS}::test_every_rank_raises" for name in EVERY_RANK}
CATALOGUE.update({
    "mixed_dtype_model": f"{THIS}::test_every_rank_raises",
    "world_size_1": f"{THIS}::test_world_size_1",
    "after_shutdown": f"{THIS}::test_calls_after_shutdown",
    "port_in_use": f"{THIS}::test_port_in_use",
    "closed_store": f"{THIS}::test_closed_store",
    "before_init": "test_errors.py::test_with_bagua_before_init_process_group",
    "unsupported_dtype": "test_errors.py::test_bad_input_raises_on_every_rank",
    "non_contiguous": "test_errors.py::test_bad_input_raises_on_every_rank",
    "sizes_differ": "test_errors.py::test_bad_input_raises_on_every_rank",
    "dtypes_differ": "test_errors.py::test_bad_input_raises_on_every_rank",
    "bad_reduce_op": "test_errors.py::test_bad_input_raises_on_every_rank",
    "bad_root": "test_errors.py::test_bad_input_raises_on_every_rank",
    "algorithm_argument": "test_errors.py::test_algorithm_argument_out_of_range",
    "not_optimizers": "test_errors.py::test_bad_input_raises_on_every_rank",
    "nccl_without_nccl": "test_errors.py::test_nccl_backend_request_without_nccl_is_a_clear_error",
    "comm_timeout_value": "test_errors.py::test_a_non_positive_comm_timeout_is_refused_at_init",
    "init_retry": "test_errors.py::test_init_process_group_can_be_retried_after_a_failure",
    "rank_stops_communicating": "test_runtime.py::test_a_rank_that_stops_communicating_is_a_timeout_not_a_hang",
    "python_op_raises": "test_runtime.py::test_python_op_exception_reaches_the_training_thread",
    "dead_peer": "test_kill.py",
})


def _outcome(result, case, rank):
    outcome = result[case]
    assert outcome is not None, f"rank {rank}: {case} raised nothing"
    return outcome


@pytest.mark.parametrize("world_size", [3])
def test_every_rank_raises(world_size, tmp_path):
    results = run_workers("catalogue", world_size, tmp_path, script=WORKERS)
    for rank, result in enumerate(results):
        for case, (cls, fragment) in EVERY_RANK.items():
            name, message, mro = _outcome(result, case, rank)
            assert cls in mro, f"rank {rank}: {case} raised {name}: {message}"
            assert fragment in message, f"rank {rank}: {case}: {message}"
        assert result["group_still_works"] == [float(world_size)] * 3
    # the ranks that refused name themselves on every rank
    for result in results:
        message = result["allgather_output_size_on_one_rank"][1]
        assert f"rank {world_size - 1}: allgather: expected a tensor" in message, message
        assert "ranks 0, 1: " not in message  # only the last rank passed a wrong output
        shape = result["model_shape_differs"][1]
        assert "rank 0's is parameter 'weight' torch.float32[3, 4]" in shape, shape
    for a, b in zip(results[0]["mixed_dtype_model_weights"], results[1]["mixed_dtype_model_weights"]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert {w.dtype for w in results[0]["mixed_dtype_model_weights"]} == {torch.float32, torch.float64}


def test_world_size_1(tmp_path):
    """One process: primitives are the identity, argument errors still raise."""
    results = run_workers("catalogue", 1, tmp_path, script=WORKERS)
    result = results[0]
    assert result["group_still_works"] == [1.0] * 3
    for case in ("not_a_tensor", "meta_tensor", "bool_tensor", "qadam_lr", "empty_model",
                 "tensor_twice_in_a_bucket", "send_to_self"):
        _outcome(result, case, 0)
    # the models differ nowhere: the same process on both sides
    assert result["model_shape_differs"] is None and result["model_count_differs"] is None


def test_calls_after_shutdown(tmp_path):
    results = run_workers("after_shutdown", 2, tmp_path, script=WORKERS)
    for rank, result in enumerate(results):
        name, message, _ = _outcome(result, "collective", rank)
        assert name == "RuntimeError" and "init_process_group" in message, message
        name, message, _ = _outcome(result, "forward", rank)
        assert name == "RuntimeError" and "bagua shut down at exit" in message, message


class SilentListener:
    """Another program on a port: accepts connections and never answers."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.connections, self.running = [], True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while self.running:
            try:
                self.connections.append(self.socket.accept()[0])
            except OSError:
                pass

    def close(self):
        self.running = False
        self.thread.join()
        for c in self.connections:
            c.close()
        self.socket.close()


def test_port_in_use(tmp_path, monkeypatch):
    listener = SilentListener()
    # The other program hangs up after 15 s, so that a regression fails the
    # bound below instead of hanging the test.
    hang_up = threading.Timer(15, listener.close)
    hang_up.start()
    try:
        import launcher
        monkeypatch.setattr(launcher, "free_port", lambda: listener.port)
        results = run_workers("port_in_use", 2, tmp_path, script=WORKERS, timeout=60,
                              extra_env={"BAGUA_COMM_TIMEOUT_S": "3"})
    finally:
        hang_up.cancel()
        if listener.running:
            listener.close()
    name, message, mro = _outcome(results[0], "init", 0)
    assert "StoreError" in mro and f"MASTER_PORT {listener.port} is in use" in message, message
    name, message, mro = _outcome(results[1], "init", 1)
    assert "CommTimeoutError" in mro and "did not answer as rank 0's store within 3 s" in message, message
    assert results[1]["seconds"] < 3 + 10, results[1]["seconds"]


def test_closed_store(tmp_path):
    """A RedisStore whose server was shut down fails at once, naming it."""
    redis = pytest.importorskip("redis")
    from bagua.torch_api.contrib.utils.redis_store import RedisStore

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    try:
        store = RedisStore(hosts=[{"host": "127.0.0.1", "port": port}])
        store.set("key", b"value")
        assert store.get("key") == b"value"
    finally:
        server.terminate()
        server.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(redis.exceptions.ConnectionError, match=f"127.0.0.1:{port}"):
        store.get("key")
    assert time.monotonic() - start < 5


def test_the_catalogue_lists_every_case_and_its_test():
    text = ERRORS_MD.read_text()
    listed = set(re.findall(r"^\| `([a-z0-9_]+)` \|", text, flags=re.M))
    assert listed == set(CATALOGUE), (sorted(listed - set(CATALOGUE)), sorted(set(CATALOGUE) - listed))
    assert len(CATALOGUE) >= 30
    tests = Path(__file__).parent
    for case, test in CATALOGUE.items():
        module, _, function = test.partition("::")
        source = (tests / module).read_text()
        assert not function or f"def {function}(" in source, (case, test)
        assert test in text, f"docs/errors.md does not name {test} for {case}"


def test_soak_script_runs_short(tmp_path):
    """bench/soak.py end to end at a small scale (the long run's figures are
    in docs/benchmarks.md): replicas equal where the algorithm makes them so."""
    import json
    import os

    out = tmp_path / "soak.json"
    script = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
    subprocess.run([sys.executable, str(script), "--world-size", "2", "--steps", "30", "--cycles", "8",
                    "--json", str(out)], check=True, timeout=300, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, BAGUA_COMM_TIMEOUT_S="60"))
    result = json.loads(out.read_text())
    assert result["abort_resume"]["cycles"] == 8
    for name, r in result["algorithms"].items():
        assert r["steps"] == 30
        if r["max_replica_difference"] is not None:
            assert r["max_replica_difference"] == 0.0, (name, r["max_replica_difference"])
