"""Where older Bagua releases kept the autotuner's optimizer
(``from bagua.autotune import BayesianOptimizer, IntParam``); the names live
in :mod:`bagua.service.autotune` now."""

from bagua.service.autotune import (  # noqa: F401
    BayesianOptimizer,
    BoolParam,
    FloatParam,
    IntParam,
    autotune_system_hyperparameters,
)

__all__ = ["BayesianOptimizer", "IntParam", "FloatParam", "BoolParam", "autotune_system_hyperparameters"]
