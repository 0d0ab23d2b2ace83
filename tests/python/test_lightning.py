"""bagua.lightning.BaguaStrategy: Lightning's Trainer on 2 CPU ranks, on
scikit-learn's digits (lightning_workers.py).

Every algorithm trains to >= 90 % test accuracy, the synchronous ones with
equal replicas; manual optimization equals automatic; accumulated gradients
communicate once per optimizer step; sync_dist logging and the collectives
give the values known per rank; a checkpoint resumes each rank's own
weights and the algorithm's state (exactly, for low-precision
decentralized), and without bagua's part does not; strategy="bagua" by name
under Lightning's own launcher; QAdam with two optimizers is a clear error.
Lightning is optional: importing bagua never imports it, and the tests that
need it skip without it (Debian's PyTorch 1.13 has none: run them with the
PyTorch 2.x venv). lightning-bagua 0.1.0, where installed (with Lightning
2.0), is run against this package too.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from launcher import run_workers

WORKERS = Path(__file__).with_name("lightning_workers.py")
ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam",
              "async", "powersgd", "partial_allreduce", "auto"]
# the ranks hold one model (all-reduced gradients or momenta; "auto" picks among such)
SYNCHRONOUS = {"gradient_allreduce", "bytegrad", "floatgrad", "qadam", "powersgd", "auto"}


def _lightning_supported():
    """None if bagua.lightning can run here, else why not."""
    if importlib.util.find_spec("lightning") is None:
        return "lightning is not installed (e.g. Debian's PyTorch 1.13)"
    from lightning.pytorch.strategies import strategy

    if not hasattr(strategy, "_ForwardRedirection"):
        import lightning

        return f"lightning {lightning.__version__} is older than 2.1"
    return None


needs_lightning = pytest.mark.skipif(_lightning_supported() is not None, reason=str(_lightning_supported()))


def _algorithms():
    from bagua.torch_api.algorithms import GlobalAlgorithmRegistry

    return ALGORITHMS + [n for n in ("floatgrad",) if n in GlobalAlgorithmRegistry]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits split once (workers do not import scikit-learn)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, data.target, test_size=0.25, random_state=0,
                                                        stratify=data.target)
    path = tmp_path_factory.mktemp("digits") / "digits.npz"
    np.savez(path, x_train=x_train, x_test=x_test, y_train=y_train, y_test=y_test)
    return str(path)


def run(scenario, tmp_path, *args, **kwargs):
    return run_workers(scenario, 2, tmp_path, args=args, script=WORKERS, **kwargs)


def _fresh(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{ROOT / 'py'}:{ROOT / 'build'}"})


def test_importing_bagua_never_imports_lightning():
    result = _fresh(
        "import sys, bagua, bagua.torch_api, bagua.torch_api.algorithms, bagua.torch_api.checkpoint\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', "
        "'lightning_fabric', 'lightning_bagua')]\n"
        "print('LOADED', loaded)")
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stdout, result.stdout


def test_without_lightning_the_import_error_says_what_to_install():
    result = _fresh("import sys\nsys.modules['lightning'] = None  # as if not installed\nimport bagua.lightning")
    assert result.returncode != 0
    assert "ModuleNotFoundError: bagua.lightning needs PyTorch Lightning" in result.stderr, result.stderr
    assert "pip install lightning" in result.stderr, result.stderr


@needs_lightning
def test_bad_arguments_fail_before_any_process_starts_and_bagua_is_registered():
    import lightning as L
    from lightning.pytorch.strategies import StrategyRegistry

    from bagua.lightning import BaguaStrategy
    from bagua.torch_api import InvalidArgumentError

    with pytest.raises(KeyError, match="'nope' not found in registry. Available names: .*bytegrad"):
        BaguaStrategy("nope")
    with pytest.raises(InvalidArgumentError, match="hierarchical"):
        BaguaStrategy("bytegrad", hierarchical="yes")
    with pytest.raises(TypeError, match="registered name"):
        BaguaStrategy(object())
    with pytest.raises(TypeError, match="flatten must be a bool"):
        BaguaStrategy(flatten=1)
    with pytest.raises(ValueError, match="do not pass q_adam_optimizer"):
        BaguaStrategy("qadam", q_adam_optimizer=None)
    with pytest.raises(ValueError, match="group_generator='static'"):
        BaguaStrategy("partial_allreduce", group_generator="smart")
    assert StrategyRegistry["bagua"]["strategy"] is BaguaStrategy
    trainer = L.Trainer(strategy="bagua", accelerator="cpu", devices=2, logger=False)
    assert type(trainer.strategy) is BaguaStrategy and trainer.strategy.num_processes == 2


@pytest.fixture(scope="module")
def trained(digits, tmp_path_factory):
    """Every algorithm, then gradient_allreduce with manual optimization and
    with accumulated gradients, one after another in one 2-rank job:
    {name: [rank 0's, rank 1's]}."""
    names = _algorithms() + ["manual", "accumulate"]
    results = run("algorithms", tmp_path_factory.mktemp("algorithms"), digits, ",".join(names), timeout=400)
    return {name: [r[name] for r in results] for name in names}


@needs_lightning
@pytest.mark.parametrize("name", ALGORITHMS + ["floatgrad"])
def test_every_algorithm_trains_digits(name, trained):
    if name not in trained:
        pytest.skip(f"{name} is not registered here")
    ranks = trained[name]
    for rank, r in enumerate(ranks):
        assert r["steps"] == 4 * 22, r["steps"]  # 4 epochs of each rank's half (the DistributedSampler's)
        assert r["accuracy"] >= 0.9, (name, rank, r["accuracy"], r["decisions"])
    if name in SYNCHRONOUS:
        assert torch.equal(ranks[0]["weights"], ranks[1]["weights"]), name
    if name in ("bytegrad", "floatgrad", "powersgd"):  # compressed: not gradient_allreduce's numbers
        assert not torch.equal(ranks[0]["weights"], trained["gradient_allreduce"][0]["weights"]), name


@needs_lightning
def test_manual_optimization_equals_automatic(trained):
    for manual, automatic in zip(trained["manual"], trained["gradient_allreduce"]):
        assert torch.equal(manual["weights"], automatic["weights"])


@needs_lightning
def test_accumulated_gradients_communicate_once_per_optimizer_step(trained):
    for r in trained["accumulate"]:
        assert r["steps"] == 4 * 22 // 2 and r["accuracy"] >= 0.9, r["accuracy"]
        (op,) = r["stats"]["buckets"][0]["ops"]  # 88 backwards, of which 44 end an accumulation
        assert op["executions"] == 44 == r["stats"]["completed_iterations"], r["stats"]
    assert torch.equal(trained["accumulate"][0]["weights"], trained["accumulate"][1]["weights"])


@needs_lightning
def test_sync_dist_logging_and_collectives(digits, tmp_path):
    results = run("collectives", tmp_path, digits, timeout=300)
    local = [r["local"]["val_acc"] for r in results]
    assert all(count == 225 for _, count in local), local  # each rank half of the 450 test digits
    mean_of_ranks = sum(correct / count for correct, count in local) / 2
    for r in results:
        m = r["metrics"]
        assert m["val_acc"] == pytest.approx(mean_of_ranks, abs=1e-6), (m, local)
        assert (m["rank_mean"], m["rank_max"], m["rank_min"], m["train_rank"]) == (0.5, 1.0, 0.0, 0.5), m
        assert r["num_training_batches"] == 22  # 674 of the 1347 training digits per rank
        c = r["calls"]
        assert torch.equal(c["gathered"], torch.tensor([[0, 0], [1, 10]])), c
        assert torch.equal(c["scalar_gathered"], torch.tensor([0.0, 1.0])), c
        assert torch.equal(c["gathered_grad"], torch.full((3,), 3.0)), c
        assert c["broadcast"] == {"from": 0} and c["broadcast_1"] == [1], c
        assert c["sum"].item() == 3 and c["torch_sum"].tolist() == [3.0] and c["max"].item() == 2, c
        assert c["int_mean"].dtype == torch.int32 and c["int_mean"].item() == 2, c
        assert c["bool_min"].dtype == torch.bool and not c["bool_min"].item(), c
        assert (c["all_true"], c["any_true"]) == (False, True), c
        assert "reduce_op 'bxor' is not supported" in c["bad_op"], c
        assert "exactly one optimizer" in r["qadam_error"] and "2: QAdamOptimizer, SGD" in r["qadam_error"]
    # trainer.test after rank 1 drifted: every rank tested rank 0's model
    assert torch.equal(results[0]["test_weights"], results[1]["test_weights"])
    test_mean = sum(c / n for c, n in (r["test_local"] for r in results)) / 2
    assert results[0]["test"]["test_acc"] == pytest.approx(test_mean, abs=1e-6)


@needs_lightning
@pytest.mark.parametrize("algorithm", ["low_precision_decentralized", "async"])
def test_checkpoint_resumes_each_rank_and_the_algorithm_state(algorithm, digits, tmp_path):
    """Ranks that keep their own weights: the checkpoint holds each rank's
    weights, optimizer and engine state, and a resumed fit starts from them."""
    results = run("checkpoint", tmp_path, digits, algorithm, timeout=300)
    assert "bagua" in results[0]["saved_keys"]
    assert results[0]["saved_ranks"] == [["engine"], ["engine", "optimizer_states", "state_dict"]]
    saved = results[0]["saved_weights"]
    for rank, r in enumerate(results):
        weights, steps = r["resumed"]["start"]
        assert torch.equal(weights, saved[rank]), rank  # its own, not rank 0's
        assert steps == 22  # the engine's step count, restored
        assert r["stripped"]["start"][1] == 0  # a checkpoint without bagua's part: afresh
    if algorithm == "async":
        return  # its background rounds follow timing: no exact comparison
    straight = [r["straight"] for r in results]
    assert not torch.equal(saved[0], saved[1])
    for rank, r in enumerate(results):
        assert torch.equal(saved[rank], straight[rank]["epoch0"][0]), rank
        assert torch.equal(r["resumed"]["final"], straight[rank]["final"]), rank  # continues exactly
        # without bagua's part: rank 0's weights everywhere, the neighbours' copies afresh
        assert not torch.equal(r["stripped"]["final"], straight[rank]["final"]), rank


@needs_lightning
def test_strategy_by_name_under_lightnings_own_launcher(digits, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "NODE_RANK", "PL_GLOBAL_SEED")}
    env.update(OMP_NUM_THREADS="1", BAGUA_COMM_TIMEOUT_S="60")
    result = subprocess.run([sys.executable, str(WORKERS), "by_name", str(tmp_path), digits], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert r["strategy"] == "bagua.lightning.strategy.BaguaStrategy" and r["world_size"] == 2, r
        assert r["environment"] == "LightningEnvironment" and r["accuracy"] >= 0.9, r
    assert torch.equal(ranks[0]["weights"], ranks[1]["weights"])


def test_lightning_bagua_0_1_runs_unchanged_on_this_package(digits, tmp_path):
    """lightning-bagua 0.1.0 (for Lightning 2.0) over this package, where it
    is installed: its six algorithms train digits."""
    pytest.importorskip("lightning_bagua")
    names = ["gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized", "qadam", "async"]
    results = run("lightning_bagua", tmp_path, digits, ",".join(names), timeout=400)
    for name in names:
        assert all(r[name]["accuracy"] >= 0.9 for r in results), (name, [r[name]["accuracy"] for r in results])
        if name in SYNCHRONOUS:
            assert torch.equal(results[0][name]["weights"], results[1][name]["weights"]), name
