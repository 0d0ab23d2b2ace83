"""Built-in algorithms. Their sources live in the repository's top-level
``algorithms/`` folder, written only against the public primitives; meson
installs them here, and in a source checkout this package's path reaches them
directly."""

import os as _os

_source_dir = _os.path.normpath(
    _os.path.join(_os.path.dirname(__file__), _os.pardir, _os.pardir, _os.pardir, _os.pardir, "algorithms"))
if _os.path.isfile(_os.path.join(_source_dir, "gradient_allreduce.py")) and _source_dir not in __path__:
    __path__.append(_source_dir)

from bagua.torch_api.algorithms.base import Algorithm, AlgorithmImpl  # noqa: E402
from bagua.torch_api.algorithms import (  # noqa: E402
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)

__all__ = ["Algorithm", "AlgorithmImpl", "async_model_average", "bytegrad", "decentralized", "gradient_allreduce", "q_adam"]
