"""bagua.bagua_define and bagua.service: Bagua's hyperparameter types, and
the Bayesian optimizer finding the optimum of a known function (the
services built on them: test_autotune_service.py)."""

import json

import pytest

from bagua.bagua_define import BaguaHyperparameter, TensorDtype, get_tensor_declaration_bytes
from bagua.service import BayesianOptimizer, BoolParam, FloatParam, IntParam


def test_hyperparameter_defaults_update_and_round_trip():
    hp = BaguaHyperparameter()
    assert hp.dict() == {"buckets": [], "bucket_size": 0, "is_hierarchical_reduce": False}
    assert BaguaHyperparameter(buckets=[], bucket_size=1024, is_hierarchical_reduce=True).bucket_size == 1024
    bucket = [{"name": "w", "num_elements": 10, "dtype": TensorDtype.F16}]
    assert hp.update({"buckets": [bucket], "is_hierarchical_reduce": True}) is hp
    again = BaguaHyperparameter.parse_obj(json.loads(hp.json()))
    assert again.is_hierarchical_reduce and again.buckets[0][0]["num_elements"] == 10
    with pytest.raises(ValueError, match="no field"):
        hp.update({"bucket_count": 1})
    assert get_tensor_declaration_bytes(bucket[0]) == 20
    assert get_tensor_declaration_bytes({"name": "u", "num_elements": 3, "dtype": "u8"}) == 3


def score(p):
    return -((p["x"] - 70) ** 2) / 100 - 10 * (p["y"] - 0.3) ** 2 + (1.0 if p["b"] else 0.0)


def test_bayesian_optimizer_finds_the_optimum():
    optimizer = BayesianOptimizer({"x": IntParam(10, (0, 100)), "y": FloatParam(0.0, (-1.0, 1.0)),
                                   "b": BoolParam(False)}, n_initial_points=10, random_state=0)
    optimizer.tell({"x": 10, "y": 0.0, "b": False}, score({"x": 10, "y": 0.0, "b": False}))  # the defaults
    for _ in range(60):
        params = optimizer.ask()
        assert 0 <= params["x"] <= 100 and -1 <= params["y"] <= 1
        optimizer.tell(params, score(params))
    best, value = optimizer.best()
    assert value > 0.5, (best, value)  # the optimum is 1.0 at x=70, y=0.3, b=True
    assert best["b"] is True and abs(best["x"] - 70) <= 7 and abs(best["y"] - 0.3) <= 0.25


def test_bayesian_optimizer_rejects_bad_declarations_and_skips_values_outside_the_space(caplog):
    with pytest.raises(TypeError, match="IntParam, FloatParam or BoolParam"):
        BayesianOptimizer({"x": (0, 1)})
    optimizer = BayesianOptimizer({"x": IntParam(1, (0, 10))})
    optimizer.tell({"x": 50}, 1.0)
    assert "skipped" in caplog.text
    with pytest.raises(KeyError):
        optimizer.tell({}, 1.0)


def test_bagua_service_autotune_names():
    # The system tuner itself runs in test_autotune_service.py.
    import bagua.autotune
    from bagua.service import autotune, autotune_system_hyperparameters
    assert autotune.BayesianOptimizer is BayesianOptimizer and autotune.IntParam is IntParam
    assert autotune.autotune_system_hyperparameters is autotune_system_hyperparameters
    assert bagua.autotune.autotune_system_hyperparameters is autotune_system_hyperparameters
