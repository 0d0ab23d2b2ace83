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
"""

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl
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

__all__ = ["Algorithm", "AlgorithmImpl", "async_model_average", "auto", "bytegrad", "decentralized", "gradient_allreduce", "partial_allreduce", "powersgd", "q_adam"]
