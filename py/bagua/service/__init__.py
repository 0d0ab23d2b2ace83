"""Bagua's ``bagua.service``: the Bayesian optimizer its autotune service
searched with, and its parameter declarations. The HTTP service itself
(``AutotuneService``, ``AutotuneClient``) is not here: tuning runs inside
the job (``BAGUA_AUTOTUNE``, bagua.torch_api.autotune)."""

from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, FloatParam, IntParam  # noqa: F401

__all__ = ["BayesianOptimizer", "IntParam", "FloatParam", "BoolParam"]
