"""Bad input gets a clear exception on every rank: never a crash, a hang or
wrong numbers."""

import pytest
import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from launcher import run_workers


def test_with_bagua_before_init_process_group():
    assert not bagua.is_initialized()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        model.with_bagua([opt], GradientAllReduceAlgorithm())
    with pytest.raises(RuntimeError, match="init_process_group"):
        bagua.allreduce_inplace(torch.zeros(2))


def test_algorithm_argument_out_of_range():
    with pytest.raises(bagua.InvalidArgumentError, match="hierarchical must be True, False or .auto."):
        GradientAllReduceAlgorithm(hierarchical=3)
    with pytest.raises(ValueError):  # also a ValueError
        GradientAllReduceAlgorithm(average=None)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bad_input_raises_on_every_rank(world_size, tmp_path):
    results = run_workers("errors", world_size, tmp_path)
    for rank, result in enumerate(results):
        def expect(case, cls, fragment):
            outcome = result[case]
            assert outcome is not None, f"rank {rank}: {case} raised nothing"
            name, message, mro = outcome
            assert cls in mro, f"rank {rank}: {case} raised {name}: {message}"
            assert fragment in message, f"rank {rank}: {case}: {message}"

        expect("unsupported_dtype", "InvalidArgumentError", "unsupported dtype torch.complex64")
        expect("non_contiguous", "InvalidArgumentError", "not contiguous")
        # the same error on every rank, naming what each rank passed
        expect("sizes_differ", "InvalidArgumentError", "rank 1: float32[5]")
        expect("sizes_differ", "InvalidArgumentError", "rank 0: float32[4]")
        expect("dtypes_differ", "InvalidArgumentError", "rank 0: float64[4]")
        expect("bad_reduce_op", "InvalidArgumentError", "not supported")
        expect("bad_root", "InvalidArgumentError", "is not a rank")
        expect("algorithm_argument", "ValueError", "hierarchical must be True, False or 'auto'")
        expect("bad_optimizer_list", "InvalidArgumentError", "torch.optim.Optimizer")
        assert result["second_with_bagua"] is None  # switches algorithm, as in Bagua
        assert result["rewrap_after_reset"] is None
        assert result["after_errors"] == [float(world_size)] * 3


def test_nccl_backend_request_without_nccl_is_a_clear_error(tmp_path):
    import bagua_core

    results = run_workers("backend_choice", 2, tmp_path, extra_env={"BAGUA_BACKEND": "nccl"})
    reason = bagua_core.nccl_unavailable_reason()
    for r in results:
        if not reason:  # NCCL usable here: init succeeded
            assert r["nccl"] is None
            continue
        name, message, mro = r["nccl"]
        assert "RuntimeError" in mro and "BAGUA_BACKEND=nccl" in message and reason in message, message


def test_init_process_group_can_be_retried_after_a_failure(tmp_path):
    # The first call fails after the launcher's rendezvous; the second must
    # reuse that rendezvous (it was two TCPStore servers on one port: the
    # ranks met on different ones and both timed out in Gloo's rendezvous).
    results = run_workers("retry_after_failed_init", 2, tmp_path, timeout=120,
                          extra_env={"GLOO_SOCKET_IFNAME": "bagua-no-such-if",
                                     "BAGUA_COMM_TIMEOUT_S": "20"})
    for r in results:
        assert r["first"] is not None and "bagua-no-such-if" in r["first"][1], r["first"]
        assert r["bagua_sum"] == [3.0] * 3 and r["torch_sum"] == [2.0] * 2


@pytest.mark.parametrize("value", ["0", "-5", "-0.5", "abc", "1e300"])
def test_a_non_positive_comm_timeout_is_refused_at_init(value, tmp_path):
    # A zero or negative timeout would make every wait fail at once (or, read
    # as "unset", never): init_process_group refuses it, naming the variable.
    import os
    import subprocess
    import sys

    from launcher import free_port

    code = ("import bagua.torch_api as bagua\n"
            "try:\n"
            "    bagua.init_process_group()\n"
            "except bagua.InvalidArgumentError as e:\n"
            "    print('refused:', e)\n")
    env = dict(os.environ, BAGUA_COMM_TIMEOUT_S=value, RANK="0", WORLD_SIZE="1",
               LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"refused: environment variable BAGUA_COMM_TIMEOUT_S='{value}' is invalid" in proc.stdout, proc.stdout


@pytest.fixture
def comm_timeout(monkeypatch):
    """Sets BAGUA_COMM_TIMEOUT_S and re-reads the runtime's variables; the
    process's reading is restored afterwards."""
    import bagua_core

    def apply(value):
        monkeypatch.setenv("BAGUA_COMM_TIMEOUT_S", value)
        return bagua_core._testing.reload_env().comm_timeout_s

    yield apply
    monkeypatch.undo()
    bagua_core._testing.reload_env()


@pytest.mark.parametrize("value,seconds", [("0.0001", 0.001), ("1e-300", 0.001), ("0.0015", 0.002),
                                           ("2.5", 2.5)])
def test_a_tiny_comm_timeout_is_at_least_one_millisecond(comm_timeout, value, seconds):
    # Timeouts are kept in milliseconds: 0.0001 s rounded to 0 ms, a wait
    # that fails at once (torch's store: "timed out after 0s") or, read as
    # "no timeout", never. Rounded up instead: never shorter than asked.
    assert comm_timeout(value) == seconds


@pytest.mark.parametrize("value", ["abc", "1e300", "1e17", "nan", "inf"])
def test_an_unusable_comm_timeout_is_an_invalid_argument_naming_the_variable(comm_timeout, value):
    # 1e300 s overflowed the conversion to milliseconds (undefined; here a
    # negative timeout); abc must not surface as a bare ValueError.
    with pytest.raises(bagua.InvalidArgumentError, match=f"BAGUA_COMM_TIMEOUT_S='{value}' is invalid"):
        comm_timeout(value)
