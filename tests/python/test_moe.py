"""bagua.torch_api.moe against references written here: the gating
functions against a per-token loop, the layer against each token run
through its experts, and 2 ranks (experts spread over them, tokens sent by
alltoall) against one process holding every expert."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bagua.torch_api import InvalidArgumentError
from bagua.torch_api.moe import MoE, sharded_moe
from launcher import run_workers


def reference_top1(logits, capacity):
    """Per token, in order: its expert (argmax) and its gate probability,
    in the next free slot while the expert has room."""
    gates = F.softmax(logits, dim=1)
    combine = torch.zeros(logits.shape[0], logits.shape[1], capacity)
    used = [0] * logits.shape[1]
    for s in range(logits.shape[0]):
        e = int(torch.argmax(gates[s]))
        if used[e] < capacity:
            combine[s, e, used[e]] = gates[s, e]
            used[e] += 1
    return combine


def test_top1_gating_matches_the_per_token_reference():
    logits = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    l_aux, combine, dispatch, counts = sharded_moe.top1gating(logits, capacity_factor=5.0, min_capacity=4)
    capacity = combine.shape[2]
    assert capacity == 25
    torch.testing.assert_close(combine, reference_top1(logits, capacity))
    assert torch.equal(dispatch, combine.bool())
    assert counts.tolist() == [int((logits.argmax(1) == e).sum()) for e in range(4)]
    gates = F.softmax(logits, dim=1)
    expected_aux = sum(gates[:, e].mean() * (logits.argmax(1) == e).float().mean() for e in range(4)) * 4
    torch.testing.assert_close(l_aux, expected_aux)


def test_top1_gating_drops_what_exceeds_the_capacity():
    logits = torch.zeros(12, 3)
    logits[:, 1] = 5.0  # every token wants expert 1
    _, combine, _, counts = sharded_moe.top1gating(logits, capacity_factor=1.0, min_capacity=2)
    capacity = combine.shape[2]
    assert capacity == 4 and counts.tolist() == [0, 12, 0]
    kept = combine[:, 1].sum(dim=1) > 0
    assert int(kept.sum()) == capacity  # 4 tokens kept, each in its own slot
    assert sorted(combine[:, 1].nonzero()[:, 1].tolist()) == [0, 1, 2, 3]
    assert combine[:, [0, 2]].abs().sum() == 0


def test_top2_gating_matches_the_reference(monkeypatch):
    monkeypatch.setattr(sharded_moe, "gumbel_rsample", lambda shape, device: torch.zeros(shape))
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    _, combine, _, _ = sharded_moe.top2gating(logits, capacity_factor=4.0)
    capacity = combine.shape[2]
    gates = F.softmax(logits, dim=1)
    expected = torch.zeros_like(combine)
    order = logits.argsort(dim=1, descending=True)
    used = [0] * 4
    for choice in range(2):  # first choices take their slots before second ones
        for s in range(16):
            e = int(order[s, choice])
            first, second = gates[s, order[s, 0]], gates[s, order[s, 1]]
            expected[s, e, used[e]] = gates[s, e] / (first + second)
            used[e] += 1
    assert capacity >= max(used)
    torch.testing.assert_close(combine, expected)


def test_moe_on_one_process_runs_each_token_through_its_expert():
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    moe = MoE(5, expert, num_local_experts=3, k=1, capacity_factor=10.0)
    x = torch.randn(2, 9, 5, requires_grad=True)
    out, l_aux, counts = moe(x)
    tokens = x.reshape(-1, 5)
    gates = F.softmax(moe.deepspeed_moe.gate.wg(tokens), dim=1)
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = torch.stack([gates[s].max() * experts[int(gates[s].argmax())](tokens[s]) for s in range(18)])
    torch.testing.assert_close(out.reshape(-1, 5), expected)
    assert int(counts.sum()) == 18 and l_aux.dim() == 0
    (out.sum() + l_aux).backward()
    assert x.grad is not None and all(p.grad is not None for p in moe.parameters() if p.requires_grad)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(InvalidArgumentError, match="k must be 1 or 2"):
        MoE(4, torch.nn.Linear(4, 4), k=3)
    with pytest.raises(InvalidArgumentError, match="noisy_gate_policy"):
        MoE(4, torch.nn.Linear(4, 4), noisy_gate_policy="Loud")


def test_experts_spread_over_two_ranks_match_one_process_with_all_of_them(tmp_path):
    results = run_workers("forward", 2, tmp_path, script=Path(__file__).with_name("moe_workers.py"))
    experts = []
    for result in results:  # experts 0-1 live on rank 0, 2-3 on rank 1
        for state in result["experts"]:
            e = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
            e.load_state_dict(state)
            experts.append(e)
    assert torch.equal(results[0]["gate"], results[1]["gate"])
    gate = results[0]["gate"]
    for rank, result in enumerate(results):
        gates = F.softmax(result["tokens"] @ gate.t(), dim=1)
        with torch.no_grad():
            expected = torch.stack([gates[s].max() * experts[int(gates[s].argmax())](result["tokens"][s])
                                    for s in range(12)])
        torch.testing.assert_close(result["output"], expected, msg=lambda m: f"rank {rank}: {m}")
        assert int(result["counts"].sum()) == 12
    # with_bagua averaged the gate's gradient, not the experts'
    torch.testing.assert_close(results[0]["gate_after"], results[1]["gate_after"], rtol=0, atol=0)
    assert not torch.equal(results[0]["expert_after"], results[1]["expert_after"])
    assert results[0]["communicated"] == ["deepspeed_moe.gate.wg.weight"]  # experts: allreduce = False
