"""bagua's DDP hooks inside stacks that wrap DDP themselves
(trainer_workers.py): Hugging Face's Trainer through BaguaHookTrainer, and
Accelerate's prepare() followed by ddp_hooks.register. Each trains with the
hook (replicas equal, weights moved off plain DDP's by the 8-bit rounding but
close to them)."""

import pytest
import torch

from launcher import run_workers

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SCRIPT = __import__("pathlib").Path(__file__).with_name("trainer_workers.py")


def _check(results, plain_key, hooked_key):
    for rank, result in enumerate(results):
        for i, (a, b) in enumerate(zip(result[hooked_key], results[0][hooked_key])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: replicas differ"
        differs = any(not torch.equal(a, b) for a, b in zip(result[hooked_key], result[plain_key]))
        assert differs, f"rank {rank}: the weights are plain DDP's bits: the hook did not run"
        for a, b in zip(result[hooked_key], result[plain_key]):
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.01)


def test_trainer_with_bagua_hook(tmp_path):
    results = run_workers("trainer", 2, tmp_path, script=SCRIPT, timeout=400)
    for result in results:
        assert result["wrapped"] == ("DistributedDataParallel", "DistributedDataParallel")
        assert result["buckets_run"] >= 1
    _check(results, "plain", "bagua")


def test_accelerate_with_bagua_hook(tmp_path):
    results = run_workers("accelerate", 2, tmp_path, script=SCRIPT, timeout=400)
    assert all(r["bytegrad/wrapped"] == "DistributedDataParallel" for r in results)
    _check(results, "plain", "bytegrad")


def test_trainer_ends_on_the_weights_of_the_same_loop_by_hand(tmp_path):
    """BaguaHookTrainer's weights equal, bit for bit, those of DDP with the
    same hook registered by hand, fed the batches Trainer handed out."""
    results = run_workers("trainer_by_hand", 2, tmp_path, script=SCRIPT, timeout=400)
    for rank, result in enumerate(results):
        assert result["losses_equal"] == [True] * 4, f"rank {rank}: the loss by hand is not Trainer's"
        assert all(n is not None for n in result["num_items"]), result["num_items"]
        for i, (a, b) in enumerate(zip(result["trainer"], result["by_hand"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: Trainer and the loop by hand differ"
        for a, b in zip(result["trainer"], results[0]["trainer"]):
            assert torch.equal(a, b), f"rank {rank}: replicas differ"
