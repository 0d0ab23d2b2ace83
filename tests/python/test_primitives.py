"""Every communication primitive equals torch.distributed's result on the
same inputs, world sizes 1 to 5, every dtype, sizes 1, 7 and 1001."""

import pytest
import torch

from launcher import run_workers


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_primitives_equal_torch_distributed(world_size, tmp_path):
    results = run_workers("primitives", world_size, tmp_path)
    for rank, result in enumerate(results):
        assert any(k.startswith("allreduce/avg") for k in result)
        if world_size > 1:
            assert any(k.startswith("send_recv/") for k in result)
        if rank % 2 == 0:
            assert "subgroup/even_sum" in result
        for key, (ours, reference) in result.items():
            assert ours.dtype == reference.dtype, key
            if ours.dtype in (torch.float16, torch.bfloat16):
                torch.testing.assert_close(ours.float(), reference.float(), rtol=1e-2, atol=1e-2,
                                           msg=f"rank {rank} {key}")
            else:
                assert torch.equal(ours, reference), f"rank {rank} {key}: {ours} != {reference}"
