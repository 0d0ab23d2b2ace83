"""Bagua scripts run unchanged: behaviour user scripts rely on (issues 13
and 14). The multi-process scenarios are in behaviour_workers.py."""

import json
import re
import sys
from pathlib import Path

import pytest
import torch

import bagua.torch_api as bagua
from launcher import run_workers

WORKERS = Path(__file__).with_name("behaviour_workers.py")
ROOT = Path(__file__).resolve().parents[2]


def run(scenario, world_size, tmp_path, **kwargs):
    return run_workers(scenario, world_size, tmp_path, script=WORKERS, **kwargs)


def assert_same(ours, theirs, what):
    assert len(ours) == len(theirs), what
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


# -- 1 -----------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2])
def test_lr_scheduler_with_a_wrapped_optimizer(world_size, tmp_path):
    for rank, r in enumerate(run("lr_scheduler", world_size, tmp_path)):
        for when in ("after", "before"):
            case = r[when]
            assert case["error"] is None, f"scheduler created {when} with_bagua: {case['error']}"
            assert case["bound"], "optimizer.step must stay a bound method"
            assert not [w for w in case["warnings"] if "lr_scheduler" in w or "optimizer.step()" in w], \
                case["warnings"]
            assert case["lr"] == [0.05 * 0.5 ** 4]  # fresh_model_and_optimizer: lr 0.05
            if case["post_hook_calls"] is not None:  # torch 2: the optimizer's own hooks still run
                assert case["post_hook_calls"] == 4
            assert_same(case["params"], r["ddp"], f"rank {rank}, scheduler {when} with_bagua")


# -- 2 -----------------------------------------------------------------------------
def test_with_bagua_again_switches_algorithm(tmp_path):
    results = run("model_switch", 2, tmp_path, timeout=300)
    for rank, r in enumerate(results):
        assert r["errors"] == {}, f"rank {rank}: {r['errors']}"
        # the background averaging of the replaced algorithm was stopped,
        # whether or not the script aborted it itself
        assert r["async_status_after_switch"] == {"async": ["stopped"], "async_no_abort": ["stopped"]}
        # the replaced engines are released (only the current one lives)
        assert r["engines_alive"] == [False] * 7 + [True]
        assert r["class"] == "Net"
        for ours, rank0 in zip(r["params"], results[0]["params"]):
            assert torch.equal(ours, rank0)


# -- 3 -----------------------------------------------------------------------------
def test_new_group_gives_non_members_a_group(tmp_path):
    results = run("new_group", 3, tmp_path)
    for rank, r in enumerate(results):
        assert not r["is_none"]
        assert r["none_not_in_group"] is False
        assert r["ranks"] == [0, 2]
        assert r["after"] == [3.0, 3.0]
        if rank == 1:
            # As in Bagua: on a rank outside the group the call does nothing.
            assert r["not_in_group"] is True
            assert r["allreduce"] is None
            assert r["value"] == 2.0
        else:
            assert r["not_in_group"] is False
            assert r["allreduce"] is None
            assert r["value"] == 1.0 + 3.0


# -- 4 -----------------------------------------------------------------------------
def test_ensure_bagua_tensor_returns_the_tensor_itself():
    p = torch.nn.Parameter(torch.arange(4.0))
    assert not p.is_bagua_tensor()
    assert p.ensure_bagua_tensor("w", "model") is p
    assert p.is_bagua_tensor()
    assert (p.bagua_tensor_name, p.bagua_module_name) == ("w", "model")
    assert p.bagua_getter_closure() is p  # no getter: the tensor itself
    assert p.bagua_ensure_grad() is p and torch.equal(p.grad, torch.zeros(4))
    assert isinstance(p, bagua.BaguaTensor)
    assert not isinstance(torch.zeros(1), bagua.BaguaTensor)

    # getter and setter closures take the proxy tensor
    p.ensure_bagua_tensor("w", "model", getter_closure=lambda t: t.grad,
                          setter_closure=lambda t, value: setattr(t, "grad", value))
    assert p.bagua_getter_closure() is p.grad
    new_grad = torch.ones(4)
    p.bagua_setter_closure(new_grad)
    assert p.grad is new_grad

    # bagua_set_storage: the effective tensor (here the gradient) moves to the storage
    storage_owner = torch.full((6,), 7.0)
    p.bagua_set_storage(storage_owner.untyped_storage() if hasattr(storage_owner, "untyped_storage")
                        else storage_owner.storage(), 2)
    assert p.grad.data_ptr() == storage_owner[2:].data_ptr()
    assert torch.equal(p.grad, torch.full((4,), 7.0))

    # to_bagua_tensor: a new tensor sharing the storage, the original untouched
    q = torch.arange(3.0)
    r = q.to_bagua_tensor("q")
    assert r is not q and r.is_bagua_tensor() and not q.is_bagua_tensor()
    assert r.data_ptr() == q.data_ptr()
    assert r.bagua_backend_tensor() is not None

    with pytest.raises(RuntimeError, match="with_bagua"):
        r.bagua_mark_communication_ready()


def test_a_bagua_style_algorithm_on_the_tensors_themselves(tmp_path):
    for rank, r in enumerate(run("bagua_style_algorithm", 2, tmp_path)):
        assert r["error"] is None, r["error"]
        assert r["buckets_hold_parameters"] and r["ddp_tensors_are_parameters"]
        assert_same(r["params"], r["reference"], f"rank {rank}")


# -- 5 -----------------------------------------------------------------------------
def test_clean_exit(tmp_path):
    run("exit", 2, tmp_path)
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert "terminate called" not in log, log
        assert "[error]" not in log, log  # e.g. the background thread losing its peer
        state = json.loads((tmp_path / f"rank{rank}_exit.json").read_text())
        assert state == {"torch_pg_initialized": False, "async_status": ["stopped"]}, state


def test_exit_destroys_a_torch_group_bagua_joined(tmp_path):
    """torch 2.x with Gloo aborts a process now and then whose default group
    is left to interpreter teardown ('terminate called without an active
    exception', once in CI in a Trainer run): bagua's exit handler destroys
    the group it joined too, not only one it created."""
    run("exit_joined_group", 3, tmp_path)
    for rank in range(3):
        log = (tmp_path / f"rank{rank}.log").read_text()
        assert "terminate called" not in log, log
        state = json.loads((tmp_path / f"rank{rank}_exit.json").read_text())
        assert state == {"torch_pg_initialized": False}, (rank, state)


# -- 6 -----------------------------------------------------------------------------
def test_installed_torch_satisfies_the_declared_requirement():
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    from importlib.metadata import version

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [requirements.Requirement(d) for d in project["dependencies"]
                    if re.match(r"torch\b", d)]
    installed = version("torch")  # Debian's is 1.13.0a0+gitunknown
    # pip keeps an installed distribution when the specifier contains its
    # version (pre-releases allowed), otherwise it downloads another torch.
    assert torch_req.specifier.contains(installed, prereleases=True), (torch_req, installed)
    assert torch_req.specifier.contains("1.13.0a0", prereleases=True)


def test_pip_keeps_the_installed_torch():
    """What pip itself decides for the declared requirement, offline."""
    import os
    import subprocess

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_req,) = [d for d in project["dependencies"] if re.match(r"torch\b", d)]
    env = dict(os.environ, PIP_BREAK_SYSTEM_PACKAGES="1", PIP_NO_INDEX="1")
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", torch_req],
                            capture_output=True, text=True, env=env, timeout=120)
    if "no such option: --dry-run" in result.stderr:
        pytest.skip("pip without --dry-run")
    assert "Requirement already satisfied: torch" in result.stdout, result.stdout + result.stderr


# -- 7 -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_parameter_unused_on_one_rank_with_set_to_none(kind, tmp_path):
    results = run("unused_parameter", 2, tmp_path, args=(kind,))
    for rank, r in enumerate(results):
        assert_same(r["bagua"], r["ddp"], f"rank {rank} against DDP")
        for ours, rank0 in zip(r["bagua"], results[0]["bagua"]):
            assert torch.equal(ours, rank0), f"rank {rank} diverged from rank 0"


# -- 8, 9, 10 ------------------------------------------------------------------------
def test_async_weight_lock_held_until_the_last_optimizer_stepped(tmp_path):
    for rank, r in enumerate(run("async_two_optimizers", 2, tmp_path)):
        for between, after in r["gaps"]:
            # a round finishing just after the forward took the lock may land; no more
            assert between <= 1, f"rank {rank}: {r['gaps']}"
            assert after >= 3, f"rank {rank}: {r['gaps']}"


def test_async_evaluation_forward_takes_the_weight_lock(tmp_path):
    for rank, r in enumerate(run("async_eval_forward", 2, tmp_path)):
        for mode in ("no_grad", "eval"):
            assert r[mode]["during"] <= 1, f"rank {rank} {mode}: {r}"
            assert r[mode]["after"] >= 3, f"rank {rank} {mode}: released after forward: {r}"


def test_without_bagua_stops_the_async_thread(tmp_path):
    for rank, r in enumerate(run("async_without_bagua", 2, tmp_path)):
        assert r["status"] == ["stopped"], r
        assert r["rounds_after"] == 0 and r["unchanged"], r
        assert not r["is_bagua_module"]


# -- no_sync -------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", ["0", "1"])
def test_no_sync_accumulates_like_ddp(set_to_none, tmp_path):
    for rank, r in enumerate(run("no_sync", 2, tmp_path, args=(set_to_none,))):
        assert r["error"] is None, r["error"]
        assert_same(r["bagua"], r["ddp"], f"rank {rank}")
        # one communication per optimizer step, none for the micro-batches in no_sync
        assert r["executions"] and all(n == 4 for n in r["executions"]), r["executions"]
