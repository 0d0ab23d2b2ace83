"""Built-in algorithms: ``bagua.torch_api.algorithms``.

The sources live in the repository's top-level ``algorithms/`` folder,
written only against bagua's public Python API; they double as examples of
how to write an algorithm (docs/writing_an_algorithm.md). How Python finds
them as ``bagua.torch_api.algorithms``:

- installed (``pip install .``): meson installs ``algorithms/*.py`` into
  ``bagua/torch_api/algorithms`` (see meson.build);
- in the source tree (``source scripts/env.sh``, which puts ``py`` on
  PYTHONPATH): ``py/bagua/torch_api/algorithms`` is a symbolic link, checked
  into git, to ``algorithms/``.

Each built-in algorithm is also registered by name in
``GlobalAlgorithmRegistry`` (Bagua's names where Bagua had the algorithm),
so ``Algorithm.init("bytegrad", hierarchical=False)`` builds one.
"""

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl
from bagua.torch_api.algorithms.registry import GlobalAlgorithmRegistry
from bagua.torch_api.algorithms import (
    async_model_average,
    auto,
    bytegrad,
    decentralized,
    gradient_allreduce,
    partial_allreduce,
    powersgd,
    q_adam,
)

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry", "async_model_average", "auto", "bytegrad",
           "decentralized", "gradient_allreduce", "partial_allreduce", "powersgd", "q_adam"]

_BUILT_IN = [
    ("gradient_allreduce", gradient_allreduce.GradientAllReduceAlgorithm, "Gradient AllReduce Algorithm"),
    ("bytegrad", bytegrad.ByteGradAlgorithm, "ByteGrad Algorithm (8-bit gradients)"),
    ("floatgrad", bytegrad.Float16GradAlgorithm, "Float16 gradient AllReduce Algorithm (DDP's fp16 hook)"),
    ("decentralized", decentralized.DecentralizedAlgorithm, "Decentralized SGD Algorithm"),
    ("low_precision_decentralized", decentralized.LowPrecisionDecentralizedAlgorithm,
     "Low Precision Decentralized SGD Algorithm"),
    ("qadam", q_adam.QAdamAlgorithm, "QAdam Algorithm (needs q_adam_optimizer=QAdamOptimizer(...))"),
    ("async", async_model_average.AsyncModelAverageAlgorithm, "Asynchronous Model Average Algorithm"),
    ("powersgd", powersgd.PowerSGDAlgorithm, "PowerSGD Algorithm (low-rank gradients)"),
    ("partial_allreduce", partial_allreduce.PartialAllReduceAlgorithm,
     "Partial AllReduce Algorithm (Ripples' P-Reduce)"),
    ("auto", auto.AutoAlgorithm, "Chooses the algorithm predicted fastest after measuring the first steps"),
]
for _name, _algorithm, _description in _BUILT_IN:
    if _name not in GlobalAlgorithmRegistry:  # a reload of this package registers nothing twice
        GlobalAlgorithmRegistry.register(_name, _algorithm, description=_description)
