"""Bagua's ``bagua.service``: tuning services around a job.

- :class:`AutotuneService` / :class:`AutotuneClient`: Bagua's HTTP autotune
  service, which tunes each model's buckets (bucket size, hierarchical
  reduction) from the speeds its ranks report, with a Bayesian optimizer.
  ``service.setup_app(flask.Flask(__name__))`` adds its routes to a Flask
  app; ``service.serve(host, port)`` runs one in a thread. Serving needs
  flask (Debian's python3-flask), the client requests; ``import bagua.service``
  needs neither. This runtime's own training tunes its buckets inside the
  job instead (``BAGUA_AUTOTUNE``, :mod:`bagua.torch_api.autotune`).
- :func:`pick_n_free_ports`, :func:`generate_and_broadcast_server_addr`:
  how the ranks agree on where the service listens.
- :func:`autotune_system_hyperparameters`: benchmarks the communication
  environment variables (``BAGUA_SHARED_MEMORY*``, or NCCL's under
  ``BAGUA_BACKEND=nccl``) on a list of hosts, locally or over ssh, with
  :mod:`bagua.service.sysperf`, and returns the fastest setting.
- :class:`BayesianOptimizer` and its parameter declarations, which all of
  them search with.
"""

from bagua.service.autotune_service import AutotuneClient, AutotuneServer, AutotuneService  # noqa: F401
from bagua.service.autotune_system import SystemTuningError, autotune_system_hyperparameters  # noqa: F401
from bagua.service.autotune_task_manager import AutotuneTaskManager, split_bucket_by_bucket_size  # noqa: F401
from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, FloatParam, IntParam  # noqa: F401
from bagua.service.service_discovery import generate_and_broadcast_server_addr, pick_n_free_ports  # noqa: F401
from bagua.service import autotune  # noqa: F401  (Bagua's package imported it)

__all__ = [
    "AutotuneService", "AutotuneServer", "AutotuneClient", "AutotuneTaskManager", "split_bucket_by_bucket_size",
    "pick_n_free_ports", "generate_and_broadcast_server_addr",
    "autotune_system_hyperparameters", "SystemTuningError",
    "BayesianOptimizer", "IntParam", "FloatParam", "BoolParam", "autotune",
]
