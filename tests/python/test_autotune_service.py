"""bagua.service's services: the HTTP autotune service (over HTTP, and its
state machine through its methods), its bucketing, service discovery
across processes, and the system tuner running real benchmarks on this
machine."""

import csv
import logging
import math
import multiprocessing
import random
import socket
import threading
import time

import pytest

from bagua.bagua_define import BaguaHyperparameter
from bagua.service import (
    AutotuneService,
    SystemTuningError,
    autotune_system_hyperparameters,
    generate_and_broadcast_server_addr,
    pick_n_free_ports,
    split_bucket_by_bucket_size,
)
from bagua.service.autotune_service import UnknownModelError
from bagua.service.autotune_system import STOP_GRACE_S

MiB = 1024 ** 2
M = 1024 ** 2  # elements


def declarations(millions, dtype="f32"):
    return [{"name": "ABCDEFGHIJ"[i], "num_elements": n * M, "dtype": dtype} for i, n in enumerate(millions)]


# --- bucketing ---------------------------------------------------------------

def reference_split(tensors, bucket_size, groups):
    """Each dtype's tensors, in order, cut into the shortest runs holding
    bucket_size bytes (the rest forms the last run)."""
    unit = {"f16": 2, "f32": 4, "u8": 1}
    buckets = []
    for dtype in ("f16", "f32", "u8"):
        rest = [t for t in tensors if t["dtype"] == dtype]
        while rest:
            sizes = [t["num_elements"] * unit[dtype] for t in rest]
            length = next((k for k in range(1, len(rest) + 1) if sum(sizes[:k]) >= bucket_size), len(rest))
            buckets.append(sorted(rest[:length], key=lambda t: groups.get(t["name"], -1)))
            rest = rest[length:]
    return buckets


def test_split_bucket_by_bucket_size_matches_a_reference():
    rng = random.Random(0)
    for case in range(300):
        tensors = [{"name": f"t{i}", "num_elements": rng.randint(1, 5000), "dtype": rng.choice(["f16", "f32", "u8"])}
                   for i in range(rng.randint(0, 12))]
        groups = {t["name"]: rng.randint(0, 3) for t in tensors if rng.random() < 0.5}
        bucket_size = rng.choice([1, 2 ** rng.randint(4, 15), 10 ** 9])
        assert split_bucket_by_bucket_size(tensors, bucket_size, groups) == \
            reference_split(tensors, bucket_size, groups), (case, tensors, bucket_size, groups)
    # Bagua's test's models at 16 MiB, and the limits.
    assert [len(b) for b in split_bucket_by_bucket_size(declarations([1, 2, 3, 4, 5]), 16 * MiB)] == [3, 1, 1]
    assert [len(b) for b in split_bucket_by_bucket_size(declarations([1, 3, 5, 7, 11]), 16 * MiB)] == [2, 1, 1, 1]
    assert split_bucket_by_bucket_size([], 1) == []
    with pytest.raises(ValueError, match="dtype 'f64'"):
        split_bucket_by_bucket_size(declarations([1], dtype="f64"), 1)


# --- the service's state machine, through its methods ------------------------

def score_of(hp: BaguaHyperparameter) -> float:
    """Best at 4 MiB buckets (2 ** 22), without hierarchy; no two settings tie."""
    return -abs(math.log2(hp.bucket_size) - 22.4) - (0.25 if hp.is_hierarchical_reduce else 0.0)


def run_rank(service, rank, hp, train_iter):
    """One iteration of a rank: report the score of its setting, ask for the next."""
    service.report_metrics("m", rank, train_iter, hp.dict(), score_of(hp))
    answer = service.ask_hyperparameters("m", rank, train_iter)
    return BaguaHyperparameter().update(answer["recommended_hyperparameters"]), answer["is_autotune_completed"]


def register(service, rank_count=2):
    answers = [service.register_tensors("m", declarations([1, 2, 3])) for _ in range(rank_count)]
    return [BaguaHyperparameter().update(a["recommended_hyperparameters"]) for a in answers]


def test_service_warms_up_samples_and_keeps_the_best():
    warmup, confidence, max_samples = 0.4, 0.15, 4
    service = AutotuneService(2, autotune_level=1, max_samples=max_samples, sampling_confidence_time_s=confidence,
                              warmup_time_s=warmup, is_output_autotune_log=True)
    registered_at = time.monotonic()
    hps = register(service)
    assert hps[0] == hps[1] and hps[0].bucket_size == 10 * MiB
    assert [len(b) for b in hps[0].buckets] == [2, 1]  # 4 + 8 >= 10 MiB, then 12

    # Two ranks in step, as in training. The setting changes at most
    # max_samples + 1 times (the proposals, then the best), each change seen
    # first by the rank whose ask made it.
    in_force, changes, reported, train_iter = hps[0], [], [], 0
    deadline = time.monotonic() + 20
    while not service.is_autotune_completed("m"):
        assert time.monotonic() < deadline, "the search did not complete"
        train_iter += 1
        for rank in (0, 1):
            reported.append(hps[rank])
            hps[rank], _ = run_rank(service, rank, hps[rank], train_iter)
            if hps[rank] != in_force:
                in_force = hps[rank]
                changes.append(time.monotonic())
        time.sleep(0.01)
    assert 1 <= len(changes) <= max_samples + 1
    assert changes[0] - registered_at >= warmup + confidence
    for earlier, later in zip(changes, changes[1:]):
        assert later - earlier >= confidence - 0.05  # each seen just after it was made
    best = max(reported, key=score_of)
    assert hps[0] == hps[1] == best
    for train_iter in range(train_iter + 1, train_iter + 4):  # completed: the best stays
        for rank in (0, 1):
            assert run_rank(service, rank, hps[rank], train_iter) == (best, True)

    with open(service.autotune_log_path("m")) as log:
        rows = list(csv.DictReader(log))
    assert rows and list(rows[0]) == ["bucket_size_2p", "is_hierarchical_reduce", "score", "train_iter"]
    assert len(rows) == max_samples  # each proposal's score (the default 10 MiB is not in the space)
    assert {int(r["bucket_size_2p"]) for r in rows} <= set(range(10, 32))


def test_service_moves_on_only_once_every_rank_holds_the_setting():
    service = AutotuneService(2, autotune_level=1, max_samples=10, sampling_confidence_time_s=0.2, warmup_time_s=0.0)
    hp0, hp1 = register(service)
    samples = lambda: service.model_dict["m"].samples  # noqa: E731
    time.sleep(0.25)
    hp0, _ = run_rank(service, 0, hp0, 1)
    hp1, _ = run_rank(service, 1, hp1, 1)  # the warmup pass
    assert samples() == 0 and hp0 == hp1
    hp0, _ = run_rank(service, 0, hp0, 2)  # both hold the default, scored and due: the first proposal
    assert samples() == 1 and hp0 != hp1
    time.sleep(0.25)
    for train_iter in range(3, 8):  # the proposal is due, but rank 1 has not been given it
        assert run_rank(service, 0, hp0, train_iter)[0] == hp0
    assert samples() == 1
    run_rank(service, 1, hp1, 2)
    assert samples() == 2


def test_service_without_autotune_and_bad_requests():
    service = AutotuneService(2, autotune_level=0, sampling_confidence_time_s=0.0, warmup_time_s=0.0)
    hp = BaguaHyperparameter().update(service.register_tensors("m", declarations([1, 2]), whether_to_bucket=False)[
        "recommended_hyperparameters"])
    assert [len(b) for b in hp.buckets] == [2]  # one bucket
    for train_iter in range(1, 5):
        for rank in (0, 1):
            assert run_rank(service, rank, hp, train_iter) == (hp, False)
    with pytest.raises(UnknownModelError, match="'other' has not registered"):
        service.ask_hyperparameters("other", 0, 1)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        service.ask_hyperparameters("m", 2, 1)
    with pytest.raises(TypeError, match="hyperparameters must be an object"):
        service.report_metrics("m", 0, 9, [], 1.0)
    # Fields of other Bagua releases are left out.
    service.report_metrics("m", 0, 9, dict(hp.dict(), distributed_algorithm="allreduce"), 1.0)


def ready_span(name, start):
    return {"trace_id": start, "action": "tensor_ready", "tensor_name": name, "start_time": start,
            "end_time": start + 1}


def test_service_cuts_buckets_in_the_reported_execution_order():
    """Bagua's report_tensor_execution_order: each tensor takes the next
    position when first seen (by span start), and proposals cut the
    tensors into buckets in that order; names never reported keep their
    place ahead of the others."""
    service = AutotuneService(1, autotune_level=1, sampling_confidence_time_s=0.0, warmup_time_s=0.0)
    hp = BaguaHyperparameter().update(service.register_tensors("m", declarations([1, 2, 3, 4, 5]))[
        "recommended_hyperparameters"])
    assert service.report_tensor_execution_order(
        [ready_span("B", 7), ready_span("D", 1), ready_span("A", 5), ready_span("E", 3), ready_span("D", 9)]) == {}
    service.report_tensor_execution_order([ready_span("A", 0)])  # A has its place already
    assert service.tensor_partial_order == {"D": 0, "E": 1, "A": 2, "B": 3}
    for train_iter in (1, 2):  # a warmup pass, then the first proposal
        proposal, _ = run_rank(service, 0, hp, train_iter)
    assert service.model_dict["m"].samples == 1
    assert [t["name"] for bucket in proposal.buckets for t in bucket] == ["C", "D", "E", "A", "B"]
    with pytest.raises(TypeError, match="must be a list"):
        service.report_tensor_execution_order({"tensor_name": "A"})
    with pytest.raises(ValueError, match=r"lacks \['action', 'start_time'\]"):
        service.report_tensor_execution_order([{"tensor_name": "A"}])


# --- the service over HTTP -----------------------------------------------------

def bagua_metric(hp: BaguaHyperparameter) -> float:
    """Bagua's test's score: best at 5M elements per bucket."""
    score = -sum(abs(sum(t["num_elements"] for t in bucket) - 5 * M) for bucket in hp.buckets)
    return score + (0.0 if hp.is_hierarchical_reduce else abs(score) * 0.1)


def mock_rank(port, rank, model_name, tensors, results):
    from bagua.service import AutotuneClient

    client = AutotuneClient("127.0.0.1", port, timeout_s=30)
    response = client.register_tensors(model_name, tensors)
    assert response.status_code == 200, response.text
    hp = BaguaHyperparameter().update(response.json()["recommended_hyperparameters"])
    for train_iter in range(5000):
        response = client.report_metrics(model_name, rank, train_iter, hp.dict(), bagua_metric(hp))
        assert response.status_code == 200, response.text
        response = client.ask_hyperparameters(model_name, rank, train_iter)
        assert response.status_code == 200, response.text
        hp.update(response.json()["recommended_hyperparameters"])
        if response.json()["is_autotune_completed"]:
            break
    results[(model_name, rank)] = [len(bucket) for bucket in hp.buckets]


def test_service_over_http_tunes_two_models_for_two_ranks():
    pytest.importorskip("flask", reason="python3-flask is not installed (scripts/install_deps.sh installs it)")
    pytest.importorskip("requests", reason="python3-requests is not installed (scripts/install_deps.sh installs it)")
    import requests

    service = AutotuneService(2, autotune_level=1, sampling_confidence_time_s=0.05, warmup_time_s=0.2, max_samples=60)
    models = {"m1": declarations([1, 2, 3, 4, 5]), "m2": declarations([1, 3, 5, 7, 11])}
    results = {}
    with service.serve("127.0.0.1", 0) as server:
        threads = [threading.Thread(target=mock_rank, args=(server.port, rank, name, tensors, results))
                   for rank in (0, 1) for name, tensors in models.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert results == {("m1", 0): [3, 1, 1], ("m1", 1): [3, 1, 1],
                           ("m2", 0): [2, 1, 1, 1], ("m2", 1): [2, 1, 1, 1]}

        url = f"http://127.0.0.1:{server.port}/api/v1/"
        unknown = requests.post(url + "ask_hyperparameters", json={"model_name": "x", "rank": 0, "train_iter": 1},
                                timeout=10)
        assert unknown.status_code == 405 and "'x' has not registered" in unknown.text
        missing = requests.post(url + "report_metrics", json={"model_name": "m1"}, timeout=10)
        assert missing.status_code == 400 and "'speed'" in missing.text
        not_json = requests.post(url + "register_tensors", data=b"[", timeout=10)
        assert not_json.status_code == 400
        bad = requests.post(url + "report_metrics", json={"model_name": "m1", "rank": 0, "train_iter": 10 ** 6,
                                                          "hyperparameters": [], "speed": 1.0}, timeout=10)
        assert bad.status_code == 400 and "hyperparameters must be an object" in bad.text
        from bagua.service import AutotuneClient
        spans = AutotuneClient("127.0.0.1", server.port).report_tensor_execution_order([ready_span("x.A", 0)])
        assert spans.status_code == 200 and service.tensor_partial_order == {"x.A": 0}
        no_spans = requests.post(url + "report_tensor_execution_order", json={"spans": [{}]}, timeout=10)
        assert no_spans.status_code == 400 and "lacks" in no_spans.text


# --- service discovery ---------------------------------------------------------

def discover(rank, port, queue):
    try:
        queue.put((rank, generate_and_broadcast_server_addr("127.0.0.1", port, 3, rank, timeout_s=20)))
    except Exception as err:  # the test names it
        queue.put((rank, repr(err)))


def test_service_discovery_gives_every_rank_the_same_address():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = pick_n_free_ports(1)[0]
    processes = [context.Process(target=discover, args=(rank, port, queue)) for rank in (2, 1, 0)]
    for process in processes:
        process.start()
    try:
        answers = dict(queue.get(timeout=40) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    assert sorted(answers) == [0, 1, 2]
    addr, server_port, hostnames = answers[0]
    assert answers[1] == answers[2] == answers[0], answers
    assert addr == "127.0.0.1" and server_port != port and hostnames == [socket.gethostname()] * 3
    assert all(p.exitcode == 0 for p in processes)


def test_service_discovery_waits_are_bounded():
    ports = pick_n_free_ports(3)
    assert len(set(ports)) == 3
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 could not reach rank 0"):
        generate_and_broadcast_server_addr("127.0.0.1", ports[0], 2, 1, timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1, 2\] of 3 did not ask"):
        generate_and_broadcast_server_addr("127.0.0.1", ports[1], 3, 0, timeout_s=0.5)
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="outside world_size"):
        generate_and_broadcast_server_addr("127.0.0.1", ports[2], 2, 2)


# --- the system tuner ----------------------------------------------------------

def test_system_tuner_search_spaces():
    from bagua.service.autotune_system import _environment, _search_space

    _, first = _search_space("gloo")  # the runtime's defaults (docs/environment.md)
    assert _environment("gloo", first) == {"BAGUA_SHARED_MEMORY": "1", "BAGUA_SHARED_MEMORY_MIN_BYTES": "1"}
    assert _environment("gloo", {"shared_memory": False, "shared_memory_min_bytes_2p": 20}) == \
        {"BAGUA_SHARED_MEMORY": "0"}
    _, first = _search_space("nccl")  # NCCL's defaults: nothing set but its own buffer size
    assert _environment("nccl", first) == {"NCCL_BUFFSIZE": str(4 * MiB)}
    assert _environment("nccl", {"NCCL_MIN_NCHANNELS": 4, "NCCL_SOCKET_NTHREADS": 0, "NCCL_NSOCKS_PERTHREAD": 2,
                                 "nccl_buffsize_2p": 20}) == \
        {"NCCL_MIN_NCHANNELS": "4", "NCCL_NSOCKS_PERTHREAD": "2", "NCCL_BUFFSIZE": str(MiB)}
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        autotune_system_hyperparameters(["localhost"], 1, 22, backend="mpi")


def test_system_tuner_benchmarks_settings_on_this_machine(caplog):
    caplog.set_level(logging.INFO, logger="bagua.service.autotune_system")
    best = autotune_system_hyperparameters(["localhost"], 2, 22, max_trials=3, timeout_s=90, backend="gloo")
    assert isinstance(best, tuple) and list(best) == sorted(best)
    env = dict(best)
    assert env["BAGUA_SHARED_MEMORY"] in ("0", "1")
    assert set(env) <= {"BAGUA_SHARED_MEMORY", "BAGUA_SHARED_MEMORY_MIN_BYTES"}
    if env["BAGUA_SHARED_MEMORY"] == "1":
        min_bytes = int(env["BAGUA_SHARED_MEMORY_MIN_BYTES"])
        assert min_bytes & (min_bytes - 1) == 0 and 1 <= min_bytes <= 16 * MiB
    for trial in ("trial 1/3: BAGUA_SHARED_MEMORY=1 BAGUA_SHARED_MEMORY_MIN_BYTES=1 ->", "trial 2/3:",
                  "trial 3/3:", "system tuning: best"):
        assert trial in caplog.text


def test_system_tuner_names_a_host_that_fails_or_hangs():
    started = time.monotonic()
    # ssh fails (or, without an ssh client, cannot start); either way the host is named.
    with pytest.raises(SystemTuningError, match=r"host nonexistent\.invalid") as failed:
        autotune_system_hyperparameters([socket.gethostname(), "nonexistent.invalid"], 1, 22, timeout_s=20,
                                        backend="gloo")
    assert "ssh -tt -p 22" in str(failed.value)
    assert time.monotonic() - started < 20 + STOP_GRACE_S + 5

    started = time.monotonic()
    with pytest.raises(SystemTuningError, match="on host\\(s\\) localhost did not finish within timeout_s=1.5 s"):
        autotune_system_hyperparameters(["localhost"], 1, 22, timeout_s=1.5, backend="gloo")
    assert time.monotonic() - started < 1.5 + STOP_GRACE_S + 5

    with pytest.raises(ValueError, match="the first host, 'localhost', is where the other hosts connect"):
        autotune_system_hyperparameters(["localhost", "nonexistent.invalid"], 1, 22)
