"""bagua's algorithms as PyTorch DDP communication hooks
(bagua.torch_api.ddp_hooks, hook_workers.py): ByteGrad's hook gives
with_bagua's ByteGrad bit for bit on the same bucket at worlds 1-4, and in
segments (BAGUA_LOW_PRECISION_SEGMENT) at worlds 2-3; two hooked DDPs in one
process, their backwards interleaved, end as each alone; under Join as with
zero-gradient padding; over subgroups each group apart;
PowerSGD's hook (full precision and 8-bit) gives with_bagua's PowerSGD bit
for bit at worlds 1-3, and its state saved and loaded resumes bit for bit;
the digits MLP trained through each hook reaches DDP's accuracy within 1.5
points."""

import pytest
import torch

from launcher import run_workers

SCRIPT = __import__("pathlib").Path(__file__).with_name("hook_workers.py")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_bytegrad_hook_equals_with_bagua(world_size, tmp_path):
    results = run_workers("equal", world_size, tmp_path, script=SCRIPT)
    for rank, result in enumerate(results):
        assert result["buckets"] == 1
        if world_size > 1:  # one copy while DDP's bucket is in module order, in place after its rebuild
            assert result["bucket_runs"] == {"copied": 1, "in_place": 4}, result["bucket_runs"]
        for i, (a, b) in enumerate(zip(result["hook"], result["bagua"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: the hook's ByteGrad is not with_bagua's"
        for i, (a, b) in enumerate(zip(result["viewed"], result["hook"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: gradient_as_bucket_view=True changed the bits"
        for a, b in zip(result["hook"], results[0]["hook"]):
            assert torch.equal(a, b), f"rank {rank}: replicas differ"


@pytest.mark.parametrize("world_size", [2, 3])
def test_bytegrad_in_segments_hook_equals_with_bagua(world_size, tmp_path):
    """BAGUA_LOW_PRECISION_SEGMENT=1000 cuts the 3605-element bucket into 4
    segments, each reduced with chunks of its own (pipelined on the host): the
    hook and with_bagua still agree bit for bit, and the numbers are not the
    whole bucket's (the setting took effect)."""
    whole = run_workers("equal", world_size, tmp_path / "whole", script=SCRIPT)
    parts = run_workers("equal", world_size, tmp_path / "parts", script=SCRIPT,
                        extra_env={"BAGUA_LOW_PRECISION_SEGMENT": "1000"})
    for rank, result in enumerate(parts):
        for i, (a, b) in enumerate(zip(result["hook"], result["bagua"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: in segments, the hook's ByteGrad is not with_bagua's"
        for a, b in zip(result["hook"], parts[0]["hook"]):
            assert torch.equal(a, b), f"rank {rank}: replicas differ"
        assert any(not torch.equal(a, b) for a, b in zip(result["hook"], whole[rank]["hook"])), \
            "the segments gave the whole bucket's numbers: BAGUA_LOW_PRECISION_SEGMENT was not applied"


@pytest.mark.parametrize("world_size", [2, 3])
def test_two_hooked_models_in_one_process_equal_each_alone(world_size, tmp_path):
    """Two DDPs with a ByteGrad hook state each, trained in one process
    with their backwards interleaved in both orders and once summed into
    one backward, a no_sync() micro-batch and an unused branch: each ends
    bit for bit where it ends trained alone, replicas equal, and each hook
    reduced as many buckets as alone."""
    results = run_workers("two_models", world_size, tmp_path, script=SCRIPT)
    for rank, result in enumerate(results):
        for name in ("a", "b"):
            together, alone = result["together"][name], result[name]
            for i, (x, y) in enumerate(zip(together["weights"], alone["weights"])):
                assert torch.equal(x, y), f"rank {rank} model {name} tensor {i}: trained beside the other, it differs"
            for i, (x, y) in enumerate(zip(together["weights"], results[0]["together"][name]["weights"])):
                assert torch.equal(x, y), f"rank {rank} model {name} tensor {i}: replicas differ"
            assert together["bucket_runs"] == alone["bucket_runs"] > 0, (name, together, alone)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hook", ["bytegrad", "powersgd"])
def test_hooks_under_join_equal_zero_gradient_padding(world_size, hook, tmp_path):
    """Uneven data under torch.distributed.algorithms.join.Join: a rank out
    of data runs the hook on DDP's zero buckets (another buffer each time).
    The ops stay the same on every rank, so every rank ends bit for bit where
    the longest one ends when the others pad with backwards of zero gradients
    (Join then hands every rank the last joiner's model); the
    bucket is cut into segments (checked once per op across the ranks), where
    a new op on the joined rank alone was refused."""
    results = run_workers("join", world_size, tmp_path, script=SCRIPT, args=(hook,),
                          extra_env={"BAGUA_LOW_PRECISION_SEGMENT": "300"}, timeout=180)
    reference = results[-1]["padded"]  # Join ends with the last joiner's model on every rank
    for rank, result in enumerate(results):
        for i, (a, b) in enumerate(zip(result["joined"], reference)):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: under Join it ends elsewhere than with zero padding"


def test_hooks_over_subgroups_stay_in_their_group(tmp_path):
    """Two DDPs over torch subgroups [0, 1] and [2, 3] of 4 ranks, each with
    a ByteGrad hook over its group: replicas equal within a group, and the
    first group's weights do not move when only the second group's data
    changes (nothing crosses between the groups), while the second's do. A
    state left on the default group beside such a DDP is refused."""
    results = run_workers("subgroups", 4, tmp_path, script=SCRIPT)
    for rank, result in enumerate(results):
        peer = results[rank ^ 1]
        for run in range(2):
            for i, (a, b) in enumerate(zip(result["runs"][run], peer["runs"][run])):
                assert torch.equal(a, b), f"rank {rank} run {run} tensor {i}: replicas of one group differ"
        same = all(torch.equal(a, b) for a, b in zip(*result["runs"]))
        if result["group"] == 0:
            assert same, f"rank {rank}: group 0's weights changed with group 1's data"
        else:
            assert not same, f"rank {rank}: group 1's weights ignored its own data"
        # A state on the default group beside a DDP over a subgroup is refused.
        members = "[0, 1]" if result["group"] == 0 else "[2, 3]"
        assert result["refusal"] and f"over ranks {members}, the state over ranks [0, 1, 2, 3]" in result["refusal"], \
            result["refusal"]


def test_hooks_train_digits_as_ddp(tmp_path):
    results = run_workers("digits", 2, tmp_path, script=SCRIPT)
    for rank, result in enumerate(results):
        assert result["ddp"] > 0.9, result["ddp"]
        for hook in ("bytegrad_hook", "powersgd_hook", "powersgd8_hook"):
            assert abs(result[hook] - result["ddp"]) <= 0.015, (rank, hook, result["ddp"], result[hook])


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("low_precision", ["0", "1"])
def test_powersgd_hook_equals_with_bagua_and_resumes(world_size, low_precision, tmp_path):
    results = run_workers("powersgd", world_size, tmp_path, script=SCRIPT, args=(low_precision,))
    for rank, result in enumerate(results):
        for i, (a, b) in enumerate(zip(result["hook"], result["bagua"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: the hook's PowerSGD is not with_bagua's"
        for i, (a, b) in enumerate(zip(result["continued"], result["resumed"])):
            assert torch.equal(a, b), f"rank {rank} tensor {i}: resumed from the hook's state, not the same bits"
