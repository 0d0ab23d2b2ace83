"""The bagua_core module's surface: test hooks apart in _testing, the ops'
options objects (the only form the ops take), the environment read once
with one parsing rule, and the queries the Python package needs (supports,
unready tensors, copy-back on a stream)."""

import threading

import pytest
import torch

import bagua_core
from bagua_core import _testing

TEST_ONLY = ["cuda_divide_inplace", "cuda_minmax_uint8_compress", "cuda_minmax_uint8_decompress",
             "cuda_chunked_reduce", "cuda_async_average_update", "cuda_async_average_drift",
             "cuda_event_pool_created",
             "scratch_pool_stats", "minmax_uint8_compressed_bytes", "minmax_uint8_compress",
             "minmax_uint8_decompress", "hash_store", "shift_one_peer", "execute_ops", "reload_env"]


def view(t):
    return bagua_core.TensorView(t.data_ptr(), t.numel(), "float32", "cpu")


def test_test_hooks_live_in_the_testing_submodule_only():
    for name in TEST_ONLY:
        assert hasattr(_testing, name), name
        assert not hasattr(bagua_core, name), name
    assert not hasattr(bagua_core.Bucket, "execute_ops")
    assert bagua_core._testing is _testing


def test_options_take_keywords_and_default_like_the_cpp_structs():
    c = bagua_core.CentralizedSynchronousOptions()
    assert (c.hierarchical, c.average, c.scattergather) == (False, True, False)
    lp = bagua_core.CentralizedLowPrecisionOptions(error_feedback=True)
    assert (lp.hierarchical, lp.average, lp.error_feedback) == (False, True, True)
    assert bagua_core.LowPrecisionDecentralizedOptions().hierarchical is True
    d = bagua_core.DecentralizedSynchronousOptions(peer_selection=bagua_core.PeerSelection.SHIFT_ONE)
    assert d.hierarchical is True and d.peer_selection == bagua_core.PeerSelection.SHIFT_ONE
    a = bagua_core.AsyncModelAverageOptions(sync_interval_ms=20)
    assert a.peer_selection == bagua_core.PeerSelection.ALL and a.sync_interval_ms == 20
    assert "scattergather=False" in repr(c) and "peer_selection=shift_one" in repr(d)
    with pytest.raises(TypeError):
        bagua_core.CentralizedSynchronousOptions(True)  # keywords only


def test_peer_selection_parses_once_from_its_name():
    assert bagua_core.parse_peer_selection("ring") == bagua_core.PeerSelection.RING
    assert bagua_core.parse_peer_selection("shift_one") == bagua_core.PeerSelection.SHIFT_ONE
    with pytest.raises(bagua_core.InvalidArgumentError, match="unknown peer_selection_mode 'star'"):
        bagua_core.parse_peer_selection("star")


def _two_ranks(body):
    """Runs body(comm, rank) on two ranks as threads over an in-process store."""
    store = _testing.hash_store()
    results, errors = [None, None], []

    def run(rank):
        try:
            comm = bagua_core.gloo_communicator(store, rank, 2, prefix="bindings", timeout_s=30)
            results[rank] = body(comm, rank)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append((rank, error))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


APPEND = {
    "c_fp_s": lambda b, c, x: b.append_centralized_synchronous_op(
        c, None, bagua_core.CentralizedSynchronousOptions(average=False, scattergather=True)),
    "c_lp_s": lambda b, c, x: b.append_centralized_low_precision_op(
        c, None, bagua_core.CentralizedLowPrecisionOptions(error_feedback=True)),
    "d_lp_s": lambda b, c, x: b.append_low_precision_decentralized_op(
        c, None, *x, bagua_core.LowPrecisionDecentralizedOptions(hierarchical=False)),
    "d_fp_s": lambda b, c, x: b.append_decentralized_synchronous_op(
        c, None, x[0], bagua_core.DecentralizedSynchronousOptions(
            hierarchical=False, peer_selection=bagua_core.PeerSelection.RING)),
}

# The signatures of before the options objects: rows of booleans and mode strings.
POSITIONAL = {
    "c_fp_s": lambda b, c, x: b.append_centralized_synchronous_op(c, None, False, False, True),
    "c_lp_s": lambda b, c, x: b.append_centralized_low_precision_op(c, None, False, True, True),
    "d_lp_s": lambda b, c, x: b.append_low_precision_decentralized_op(c, None, *x, False),
    "d_fp_s": lambda b, c, x: b.append_decentralized_synchronous_op(c, None, x[0], False, "ring"),
}


@pytest.mark.parametrize("op", sorted(APPEND))
def test_ops_take_their_options_object_only(op):
    def body(comm, rank):
        data = torch.linspace(-1, 1, 1001) * (rank + 1)
        copies = [data.clone() for _ in range(3)] if op == "d_lp_s" else [torch.zeros(1001)]
        bucket = bagua_core.Bucket(op, [("t", view(data))])
        with pytest.raises(TypeError):
            POSITIONAL[op](bucket, comm, [view(c) for c in copies])
        APPEND[op](bucket, comm.new_group([0, 1]), [view(c) for c in copies])
        for _ in range(2):
            _testing.execute_ops(bucket)
        return data, copies

    (data0, copies0), (data1, copies1) = _two_ranks(body)
    expected = torch.linspace(-1, 1, 1001)
    if op == "c_fp_s":  # 1x and 2x summed: 3x on both ranks, then 6x
        assert torch.allclose(data0, 6 * expected) and torch.equal(data0, data1)
    elif op == "c_lp_s":  # averaged within the compression error
        assert torch.allclose(data0, 1.5 * expected, atol=0.05) and torch.equal(data0, data1)
    elif op == "d_fp_s":  # the bucket is untouched, the average goes to peer_weight
        assert torch.equal(data0, expected) and torch.equal(copies0[0], copies1[0])
        assert torch.allclose(copies0[0], 1.5 * expected)
    else:
        assert all(torch.isfinite(c).all() for c in copies0 + copies1)


def test_async_op_takes_its_options_object_only():
    comm = bagua_core.gloo_communicator(_testing.hash_store(), 0, 1, prefix="async-options")
    weights = torch.zeros(16)
    bucket = bagua_core.Bucket("w", [("w0", view(weights))])
    with pytest.raises(TypeError):
        bucket.append_asynchronous_model_average_op(comm.new_group([0]), "all", 5)
    op = bucket.append_asynchronous_model_average_op(
        comm.new_group([0]), bagua_core.AsyncModelAverageOptions(sync_interval_ms=5))
    assert op.get_status() == "idle"
    with pytest.raises(bagua_core.InvalidArgumentError, match="'all' only"):
        bucket.append_asynchronous_model_average_op(
            comm.new_group([0]), bagua_core.AsyncModelAverageOptions(peer_selection=bagua_core.PeerSelection.RING))


def test_compat_functions_are_gone():
    assert not hasattr(bagua_core, "default_bucket_bytes")
    assert not hasattr(bagua_core, "comm_timeout_s")


def test_communicator_supports_names_devices():
    comm = bagua_core.gloo_communicator(_testing.hash_store(), 0, 1, prefix="supports")
    assert comm.supports("cpu")
    # Gloo reaches CUDA memory through pinned host staging in a CUDA build.
    assert comm.supports("cuda") == bagua_core.cuda_compiled()
    assert comm.supports("cuda:1") == bagua_core.cuda_compiled()
    with pytest.raises(bagua_core.InvalidArgumentError, match="unsupported device 'tpu'"):
        comm.supports("tpu")


def test_backend_reports_unready_tensors_in_bucket_order():
    comm = bagua_core.gloo_communicator(_testing.hash_store(), 0, 1, prefix="unready")
    tensors = [torch.ones(4) for _ in range(4)]
    buckets = [bagua_core.Bucket("b0", [("a", view(tensors[0])), ("b", view(tensors[1]))]),
               bagua_core.Bucket("b1", [("c", view(tensors[2])), ("d", view(tensors[3]))])]
    for bucket in buckets:
        bucket.append_centralized_synchronous_op(comm.new_bucket_group([0]), None)
    backend = bagua_core.Backend(0, 30.0)
    assert backend.unready_tensor_names() == []
    backend.register_ordered_buckets(buckets)
    assert backend.unready_tensor_names() == ["a", "b", "c", "d"]
    backend.mark_communication_ready("c")
    backend.mark_communication_ready("a")
    assert backend.unready_tensor_names() == ["b", "d"]
    for name in backend.unready_tensor_names():
        backend.mark_communication_ready(name)
    assert backend.unready_tensor_names() == []
    backend.wait_pending_comm_ops()
    assert backend.unready_tensor_names() == ["a", "b", "c", "d"]


def test_copy_back_with_a_stream_on_a_cpu_bucket_copies_on_the_host():
    comm = bagua_core.gloo_communicator(_testing.hash_store(), 0, 1, prefix="copy-back")
    weights, peer = torch.arange(8.0), torch.zeros(8)
    bucket = bagua_core.Bucket("w", [("w0", view(weights))])
    op = bucket.append_decentralized_synchronous_op(
        comm.new_bucket_group([0]), None, view(peer), bagua_core.DecentralizedSynchronousOptions(hierarchical=False))
    _testing.execute_ops(bucket)
    assert torch.equal(peer, torch.arange(8.0))
    peer.fill_(3.0)
    op.copy_back_peer_weight(bucket, cuda_stream=0)
    assert torch.equal(weights, torch.full((8,), 3.0))
    peer.fill_(4.0)
    op.copy_back_peer_weight(bucket)
    assert torch.equal(weights, torch.full((8,), 4.0))


@pytest.fixture
def environment(monkeypatch):
    """Sets BAGUA_* variables for one test and re-reads them; the process's
    reading is restored afterwards."""
    def apply(**variables):
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        return _testing.reload_env()

    yield apply
    monkeypatch.undo()
    _testing.reload_env()


def test_env_defaults(environment):
    names = ["BAGUA_LOG_LEVEL", "BAGUA_COMM_TIMEOUT_S", "BAGUA_DEFAULT_BUCKET_SIZE", "BAGUA_BACKEND",
             "BAGUA_CHECK_COLLECTIVES", "BAGUA_GLOO_HOSTNAME", "BAGUA_TIMELINE", "BAGUA_AUTOTUNE",
             "BAGUA_AUTOTUNE_PLAN", "BAGUA_AUTOTUNE_OUTPUT", "BAGUA_AUTOTUNE_WARMUP_STEPS",
             "BAGUA_AUTOTUNE_WINDOW_STEPS", "BAGUA_AUTOTUNE_MAX_TRIALS", "BAGUA_AUTOTUNE_MAX_SECONDS",
             "BAGUA_ALGORITHM"]
    env = environment(**{name: "" for name in names})  # empty means unset
    assert (env.log_level, env.comm_timeout_s, env.default_bucket_size) == ("warn", 300.0, 10 * 1024 * 1024)
    assert (env.backend, env.check_collectives, env.autotune) == ("gloo", True, False)
    assert (env.gloo_hostname, env.timeline, env.autotune_plan) == ("", "", "")
    assert env.autotune_output == "bagua_autotune.json"
    assert (env.autotune_warmup_steps, env.autotune_window_steps, env.autotune_max_trials,
            env.autotune_max_seconds) == (10, 10, 10, 300)
    assert env.algorithm == ""


def test_env_parses_typed_values(environment):
    env = environment(BAGUA_COMM_TIMEOUT_S="2.5", BAGUA_DEFAULT_BUCKET_SIZE="2000", BAGUA_BACKEND="NCCL",
                      BAGUA_CHECK_COLLECTIVES="false", BAGUA_AUTOTUNE="1", BAGUA_TIMELINE="/tmp/t",
                      BAGUA_LOG_LEVEL="Info", BAGUA_AUTOTUNE_MAX_TRIALS="4", BAGUA_ALGORITHM="PowerSGD_8bit")
    assert (env.comm_timeout_s, env.default_bucket_size, env.backend) == (2.5, 2000, "nccl")
    assert (env.check_collectives, env.autotune, env.timeline) == (False, True, "/tmp/t")
    assert (env.log_level, env.autotune_max_trials, env.algorithm) == ("info", 4, "powersgd_8bit")
    assert bagua_core.env().comm_timeout_s == 2.5  # cached: the same reading until reloaded


@pytest.mark.parametrize("name,value", [
    ("BAGUA_COMM_TIMEOUT_S", "0"), ("BAGUA_COMM_TIMEOUT_S", "-1"), ("BAGUA_COMM_TIMEOUT_S", "soon"),
    ("BAGUA_DEFAULT_BUCKET_SIZE", "0"), ("BAGUA_DEFAULT_BUCKET_SIZE", "1e6"),
    ("BAGUA_BACKEND", "mpi"), ("BAGUA_CHECK_COLLECTIVES", "maybe"), ("BAGUA_AUTOTUNE", "2"),
    ("BAGUA_LOG_LEVEL", "loud"), ("BAGUA_AUTOTUNE_WARMUP_STEPS", "-3"), ("BAGUA_ALGORITHM", "fastest")])
def test_env_rejects_invalid_values_naming_variable_and_value(environment, name, value):
    before = bagua_core.env()
    with pytest.raises(bagua_core.InvalidArgumentError, match=f"{name}='{value}'"):
        environment(**{name: value})
    assert bagua_core.env().comm_timeout_s == before.comm_timeout_s  # the old reading stays
