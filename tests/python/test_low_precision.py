"""Low-precision algorithms across processes: QAdam against Adam, ByteGrad
against an exact allreduce, low-precision decentralized against a
pure-Python reference of its update and the ring invariant."""

import pytest
import torch

from launcher import run_workers
import minmax_reference as ref


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_qadam_warmup_equals_adam(world_size, tmp_path):
    results = run_workers("qadam", world_size, tmp_path)
    for rank, r in enumerate(results):
        for ours, adam in zip(r["qadam_warmup"], r["adam"]):
            if world_size == 1:
                assert torch.equal(ours, adam), "one rank: QAdam's warmup is exactly Adam"
            else:  # gradients averaged by DDP and by bagua in different orders
                torch.testing.assert_close(ours, adam, rtol=1e-5, atol=1e-6)
        # after warmup the momentum is communicated compressed...
        assert "centralized_low_precision" in r["ops"]
        # ...and every rank decodes the same bytes: the models stay identical
        for ours, rank0 in zip(r["qadam_after"], results[0]["qadam_after"]):
            assert torch.equal(ours, rank0)
        assert any(not torch.equal(a, b) for a, b in zip(r["qadam_after"], r["qadam_warmup"]))


@pytest.mark.parametrize("world_size", [3, 4])
def test_bytegrad_gradients_within_the_quantization_bound(world_size, tmp_path):
    results = run_workers("bytegrad", world_size, tmp_path, local_size=2)
    for r in results:
        for hierarchical in (False, True):
            out = r[hierarchical]
            # A chunk spans several gradients: bound with the range of all of
            # them over all ranks. Each rank's chunk is quantized once (error
            # <= range / 510, averaged over ranks), the reduced chunk once more.
            everything = torch.cat([g.reshape(-1) for res in results for g in res[hierarchical]["local"]])
            bound = 2 * (everything.max() - everything.min()).item() / 510 + 1e-6
            for i, (ours, exact) in enumerate(zip(out["bagua"], out["exact"])):
                assert (ours - exact).abs().max().item() <= bound, (hierarchical, i)
                assert not torch.equal(ours, exact)  # it was compressed
            ops = out["bytes"]["buckets"][0]["ops"][0]
            assert ops["name"] == "centralized_low_precision" and ops["bytes_sent"] > 0


@pytest.mark.parametrize("world_size", [3, 4])
def test_low_precision_decentralized_matches_reference_and_ring_invariant(world_size, tmp_path):
    results = run_workers("low_precision_decentralized", world_size, tmp_path)
    lr = results[0]["lr"]
    n = world_size
    for step in range(len(results[0]["steps"])):
        s = [r["steps"][step] for r in results]
        for rank in range(n):
            left, right = (rank - 1) % n, (rank + 1) % n
            w_after = s[rank]["after"][0]
            # ring invariant, bit for bit
            assert torch.equal(s[left]["after"][2], w_after), (step, rank)
            assert torch.equal(s[right]["after"][1], w_after), (step, rank)
            assert torch.equal(s[rank]["params"], w_after)
            # pure-Python reference of the update (chunks of 2^16 elements)
            W, L, R = s[rank]["before"]
            x = W - lr * s[rank]["grad"]
            chunk = 1 << 16

            def diff(r_):
                W_, L_, R_ = s[r_]["before"]
                x_ = W_ - lr * s[r_]["grad"]
                return x_ + L_ / 3 + R_ / 3 - 5 * W_ / 3

            expected_w = W + ref.roundtrip_chunked(diff(rank), chunk)
            expected_l = L + ref.roundtrip_chunked(diff(left), chunk)
            expected_r = R + ref.roundtrip_chunked(diff(right), chunk)
            torch.testing.assert_close(w_after, expected_w, rtol=0, atol=1e-5)
            torch.testing.assert_close(s[rank]["after"][1], expected_l, rtol=0, atol=1e-5)
            torch.testing.assert_close(s[rank]["after"][2], expected_r, rtol=0, atol=1e-5)
            assert not torch.equal(w_after, x)  # communication changed the weights
