"""A model zoo nobody here wrote (zoo_workers.py), on PyTorch 2 with
transformers and torchvision (scripts/requirements-torch2.txt): GPT-2, BERT,
ResNet-18 and ResNet-18 in channels_last through every registered
algorithm, GradientAllReduce equal to DDP, replicas equal where promised,
the others training to finite weights; and the loop habits (GradScaler,
torch.distributed first, freezing, save_pretrained) equal to DDP."""

import pytest
import torch

from launcher import run_workers

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

SCRIPT = __import__("pathlib").Path(__file__).with_name("zoo_workers.py")
KINDS = ["gpt2", "bert", "resnet18", "resnet18_channels_last"]
SHARED = ["bytegrad", "floatgrad", "qadam", "powersgd", "auto"]
LOCAL = ["decentralized", "low_precision_decentralized", "async", "partial_allreduce"]


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", KINDS)
def test_zoo_through_every_algorithm(kind, tmp_path):
    names = ["gradient_allreduce"] + SHARED + LOCAL
    results = run_workers("zoo", 2, tmp_path, script=SCRIPT, args=(kind, ",".join(names)), timeout=600)
    for rank, result in enumerate(results):
        for i, (a, b) in enumerate(zip(result[f"{kind}/gradient_allreduce"], result[f"{kind}/ddp"])):
            _close(a, b, f"rank {rank} {kind} gradient_allreduce tensor {i}")
        for name in SHARED + LOCAL:
            weights = result[f"{kind}/{name}"]
            assert all(torch.isfinite(w).all() for w in weights), f"rank {rank} {kind} {name}"
            if name in SHARED:
                for i, (a, b) in enumerate(zip(weights, results[0][f"{kind}/{name}"])):
                    assert torch.equal(a, b), f"{kind} {name}: tensor {i} differs on rank {rank}"


def test_loop_habits_equal_ddp(tmp_path):
    results = run_workers("habits", 2, tmp_path, script=SCRIPT, timeout=600)
    for rank, result in enumerate(results):
        for habit in ("grad_scaler", "freezing", "save_pretrained"):
            for i, (a, b) in enumerate(zip(result[f"{habit}/bagua"], result[f"{habit}/ddp"])):
                _close(a, b, f"rank {rank} {habit} tensor {i}")
