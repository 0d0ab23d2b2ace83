"""Where Bagua's ``bagua.service.autotune`` kept its names: the Bayesian
optimizer and its parameter declarations, and the system tuner
:func:`autotune_system_hyperparameters` (:mod:`bagua.service.autotune_system`),
which benchmarks the communication environment variables on a list of hosts
and returns the fastest setting as sorted ``(name, value)`` pairs."""

from bagua.service.autotune_system import autotune_system_hyperparameters  # noqa: F401
from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, FloatParam, IntParam  # noqa: F401

__all__ = ["BayesianOptimizer", "IntParam", "FloatParam", "BoolParam", "autotune_system_hyperparameters"]
