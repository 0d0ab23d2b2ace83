"""Where Bagua's ``bagua.service.autotune`` kept its optimizer names."""

from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, FloatParam, IntParam  # noqa: F401

__all__ = ["BayesianOptimizer", "IntParam", "FloatParam", "BoolParam", "autotune_system_hyperparameters"]


def autotune_system_hyperparameters(host_list, nproc_per_node: int, ssh_port: int):
    """Bagua tuned NCCL's environment by benchmarking every host over ssh
    (launcher ``--autotune_level 2``). This runtime does not log in to
    hosts: it raises, naming what tunes instead."""
    from bagua.torch_api import InvalidArgumentError
    raise InvalidArgumentError(
        "autotune_system_hyperparameters: system-level tuning over ssh is not part of this runtime; "
        "BAGUA_AUTOTUNE=1 (launcher --autotune_level 1) tunes the bucket size inside the job")
