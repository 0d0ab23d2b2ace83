"""Algorithms by name (Bagua's GlobalAlgorithmRegistry and Algorithm.init),
as Bagua's clients (e.g. its Lightning strategy) build them."""

import pytest
import torch

from bagua.torch_api.algorithms import Algorithm, GlobalAlgorithmRegistry
from bagua.torch_api.algorithms.base import GlobalAlgorithmRegistry as BaseRegistry
from bagua.torch_api.algorithms import (async_model_average, auto, bytegrad, decentralized, gradient_allreduce,
                                        partial_allreduce, powersgd, q_adam)

BAGUA_NAMES = {
    "gradient_allreduce": gradient_allreduce.GradientAllReduceAlgorithm,
    "bytegrad": bytegrad.ByteGradAlgorithm,
    "decentralized": decentralized.DecentralizedAlgorithm,
    "low_precision_decentralized": decentralized.LowPrecisionDecentralizedAlgorithm,
    "qadam": q_adam.QAdamAlgorithm,
    "async": async_model_average.AsyncModelAverageAlgorithm,
}
OUR_NAMES = {
    "powersgd": powersgd.PowerSGDAlgorithm,
    "partial_allreduce": partial_allreduce.PartialAllReduceAlgorithm,
    "auto": auto.AutoAlgorithm,
}


def test_registry_is_bagua_s_object():
    assert GlobalAlgorithmRegistry is BaseRegistry
    assert isinstance(GlobalAlgorithmRegistry, dict)


@pytest.mark.parametrize("name", sorted({**BAGUA_NAMES, **OUR_NAMES}))
def test_every_built_in_algorithm_by_name(name):
    cls = {**BAGUA_NAMES, **OUR_NAMES}[name]
    assert GlobalAlgorithmRegistry.get(name) is cls
    assert name in GlobalAlgorithmRegistry.available_algorithms()
    assert name in str(GlobalAlgorithmRegistry)
    if name == "qadam":
        opt = q_adam.QAdamOptimizer([torch.nn.Parameter(torch.ones(2))], lr=0.1, warmup_steps=5)
        algorithm = Algorithm.init(name, q_adam_optimizer=opt)
    else:
        algorithm = Algorithm.init(name)
    assert type(algorithm) is cls


def test_keyword_arguments_reach_the_algorithm():
    algorithm = Algorithm.init("gradient_allreduce", hierarchical=True, average=False)
    assert algorithm.hierarchical is True and algorithm.average is False
    algorithm = Algorithm.init("decentralized", peer_selection_mode="shift_one", communication_interval=2)
    assert algorithm.peer_selection_mode == "shift_one" and algorithm.communication_interval == 2
    with pytest.raises(TypeError):
        Algorithm.init("bytegrad", no_such_argument=1)


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(KeyError) as error:
        Algorithm.init("no_such_algorithm")
    message = str(error.value)
    assert "no_such_algorithm" in message
    for name in BAGUA_NAMES:
        assert name in message


def test_users_register_their_own_and_names_are_not_shadowed():
    class Mine(gradient_allreduce.GradientAllReduceAlgorithm):
        pass

    GlobalAlgorithmRegistry.register("mine_for_test", Mine, description="a test algorithm")
    try:
        assert type(Algorithm.init("mine_for_test", average=False)) is Mine
        assert GlobalAlgorithmRegistry["mine_for_test"]["description"] == "a test algorithm"
        with pytest.raises(ValueError, match="already present"):
            GlobalAlgorithmRegistry.register("mine_for_test", Mine)
        with pytest.raises(ValueError, match="already present"):
            GlobalAlgorithmRegistry.register("bytegrad", Mine)
    finally:
        del GlobalAlgorithmRegistry["mine_for_test"]
    with pytest.raises(TypeError):
        GlobalAlgorithmRegistry.register(3, Mine)
    with pytest.raises(TypeError):
        GlobalAlgorithmRegistry.register("not_callable", 3)


def test_the_older_spelling_still_builds_the_class():
    algorithm = bytegrad.ByteGradAlgorithm.init(hierarchical=False)
    assert type(algorithm) is bytegrad.ByteGradAlgorithm and algorithm.hierarchical is False
    with pytest.raises(TypeError, match="registered"):
        Algorithm.init()
