"""What Bagua's master-branch tests ask of this package beyond the rest of
the compat suite (test_compat_api.py): a communicator cancelled by
``abort()``, torch's process groups patched with ``bagua_patch``,
``env.find_free_network_port`` and ``bagua_define.BaguaCoreTelemetrySpan``.
The fused optimizer's ``_bagua_fused_count`` is in test_fused_optimizer.py,
the autotune service's execution order in test_autotune_service.py."""

import socket
import typing
from pathlib import Path

import torch

import launcher

UPSTREAM_WORKERS = Path(__file__).with_name("upstream_workers.py")


def run_upstream(scenario, world_size, tmp_path):
    return launcher.run_workers(scenario, world_size, tmp_path, script=UPSTREAM_WORKERS, timeout=120)


def test_abort_cancels_the_blocked_call_and_every_later_one(tmp_path):
    """Bagua's test_abort: ranks 1 and 2 wait in an allreduce rank 0 never
    joins; abort() from another thread ends it without an error (the worker
    exits 0), the tensor untouched; later calls return at once and leave
    their outputs; check_abort() says so; a bad argument still raises."""
    from upstream_workers import ABORT_AFTER_S

    results = run_upstream("abort", 3, tmp_path)
    for rank, r in enumerate(results):
        assert torch.equal(r["first"], torch.full((4,), 1.0))  # before abort: the average of 0, 1, 2
        assert torch.equal(r["blocked"], torch.full((4,), 7.0))
        if rank > 0:
            assert r["blocked_s"] >= ABORT_AFTER_S * 0.5, "the call returned before abort()"
        assert torch.equal(r["later"], torch.ones(4)) and torch.equal(r["out"], torch.full((4,), -1.0))
        assert r["later_s"] < 1.0 and r["check_abort"]
        assert r["bad_root"] == "InvalidArgumentError"


def test_bagua_patch_on_torch_groups(tmp_path):
    """A torch subgroup patched by its members only, and the world group:
    each gets a bagua group of its ranks; destroying a torch group lets its
    bagua group go, destroying all empties the map."""
    results = run_upstream("torch_group_patch", 3, tmp_path)
    for rank, r in enumerate(results):
        if rank in (1, 2):
            assert r["before"] is False and r["same"] is True and r["ranks"] == [1, 2]
            assert torch.equal(r["upper_sum"], torch.full((3,), 3.0))
            assert r["patched"] == 2 and r["after_one"] == (1, True)
        else:
            assert "upper_sum" not in r and r["patched"] == 1 and r["after_one"] == (1, True)
        assert torch.equal(r["world_sum"], torch.full((3,), 3.0))
        assert r["after_all"] == 0


def test_find_free_network_port_and_telemetry_span():
    from bagua.bagua_define import BaguaCoreTelemetrySpan
    from bagua.torch_api.contrib.utils.redis_store import find_free_port
    from bagua.torch_api.env import find_free_network_port

    for port in (find_free_network_port(), find_free_port()):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))  # free, as promised
            assert 0 < port < 65536
    assert typing.get_type_hints(BaguaCoreTelemetrySpan) == {
        "trace_id": int, "action": str, "tensor_name": str, "start_time": int, "end_time": int}
