"""Bagua's HTTP autotune service: rank 0's launcher served it, and every
rank of every model asked it for its bucketing while training.

A rank registers its model's tensors (``/api/v1/register_tensors``) and
gets the starting buckets. Then, each iteration, it reports the speed it
saw with its current setting (``/api/v1/report_metrics``) and asks for the
setting to use next (``/api/v1/ask_hyperparameters``). The service moves a
model to a new setting only when:

1. ``autotune_level >= 1``;
2. every rank has been given the setting in force (no rank is still
   switching), and the asking rank is at a new iteration;
3. the setting has run long enough to be judged: ``warmup_time_s`` plus
   ``sampling_confidence_time_s`` for the first, ``sampling_confidence_time_s``
   for the others (and at least one ask is always passed over as warmup);
4. a rank has reported a score with it.

Then the setting's latest score goes to the model's Bayesian optimizer,
which proposes the next one. After ``max_samples`` proposals the best
setting reported is handed out for good and ``is_autotune_completed``
turns true.

Ranks may also report when their tensors became ready
(``/api/v1/report_tensor_execution_order``, a list of
:class:`~bagua.bagua_define.BaguaCoreTelemetrySpan`): a proposed setting
then cuts the tensors into buckets in that order (the order in which each
tensor was first seen, by span start), so that a bucket holds tensors that
are ready together. As in Bagua, the order is the service's, by tensor
name, shared by every model (the spans name no model).

Each request is also a plain method (:meth:`AutotuneService.register_tensors`
...), which the HTTP routes call. :meth:`AutotuneService.setup_app` adds the
routes to a Flask app, as Bagua's did; :meth:`AutotuneService.serve` runs one
in a thread. :class:`AutotuneClient` speaks to it with ``requests``.
"""

import logging
import threading
import time
from dataclasses import fields
from typing import Dict, List, Optional, Set, Tuple

from bagua.bagua_define import BaguaCoreTelemetrySpan, BaguaHyperparameter, TensorDeclaration
from bagua.service.autotune_task_manager import AutotuneTaskManager, split_bucket_by_bucket_size

__all__ = ["AutotuneService", "AutotuneServer", "AutotuneClient", "UnknownModelError"]

log = logging.getLogger(__name__)

NO_BUCKETING_SIZE = 10 * 1024 ** 5  # Bagua's bucket size for whether_to_bucket=False: one bucket per dtype
_HYPERPARAMETER_FIELDS = {f.name for f in fields(BaguaHyperparameter)}


class UnknownModelError(LookupError):
    """A request for a model that has not registered its tensors."""


class _ModelState:
    """What the service knows of one model: its search, the setting in
    force, since when, and which ranks have been given it."""

    def __init__(self, name: str, world_size: int, need_to_log: bool):
        self.task = AutotuneTaskManager(name, need_to_log)
        self.lock = threading.Lock()
        self.samples = 0
        self.warmup_passes = 0
        self.last_asked_iter = [-1] * world_size
        self.grant(BaguaHyperparameter())

    def grant(self, hyperparameter: BaguaHyperparameter) -> None:
        self.hyperparameter = hyperparameter
        self.granted_at = time.monotonic()
        self.holders: Set[int] = set()


class AutotuneService:
    """The service for a job of ``world_size`` ranks (Bagua's arguments and
    defaults). ``is_output_autotune_log``: each model's scores also go to a
    CSV file, ``autotune_log_path(model_name)``."""

    def __init__(self, world_size: int, autotune_level: int = 0, max_samples: int = 60,
                 sampling_confidence_time_s: float = 5, warmup_time_s: float = 30,
                 is_output_autotune_log: bool = False, default_bucket_size: int = 10 * 1024 ** 2):
        if world_size < 1:
            raise ValueError(f"AutotuneService: world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.autotune_level = autotune_level
        self.max_samples = max_samples
        self.sampling_confidence_time_s = sampling_confidence_time_s
        self.warmup_time_s = warmup_time_s
        self.is_output_autotune_log = is_output_autotune_log
        self.default_bucket_size = default_bucket_size
        self.model_dict: Dict[str, _ModelState] = {}
        self._models_lock = threading.Lock()
        # tensor name -> its position in the order tensors became ready
        self.tensor_partial_order: Dict[str, int] = {}
        self._traced: Set[Tuple[str, str]] = set()  # (tensor name, action) already taken in
        self._order_lock = threading.Lock()

    # The requests.

    def register_tensors(self, model_name: str, tensor_list: List[TensorDeclaration],
                         whether_to_bucket: bool = True) -> dict:
        """The model's starting buckets. Until the search has begun, a
        registration (each rank sends one) restarts the model's clock; later
        ones get the setting in force."""
        with self._models_lock:
            if model_name not in self.model_dict:
                self.model_dict[model_name] = _ModelState(model_name, self.world_size, self.is_output_autotune_log)
            state = self.model_dict[model_name]
        bucket_size = self.default_bucket_size if whether_to_bucket else NO_BUCKETING_SIZE
        with state.lock:
            if state.samples == 0:
                state.grant(BaguaHyperparameter(buckets=split_bucket_by_bucket_size(tensor_list, bucket_size),
                                                bucket_size=bucket_size))
            return {"recommended_hyperparameters": state.hyperparameter.dict()}

    def report_metrics(self, model_name: str, rank: int, train_iter: int, hyperparameters: dict,
                       speed: float) -> dict:
        """The speed rank ``rank`` saw at ``train_iter`` with ``hyperparameters``."""
        state = self._model(model_name)
        self._check_rank(rank)
        if not isinstance(hyperparameters, dict):
            raise TypeError(f"hyperparameters must be an object of BaguaHyperparameter's fields, "
                            f"got {hyperparameters!r}")
        # Fields of other Bagua releases (e.g. distributed_algorithm) are left out.
        known = {name: value for name, value in hyperparameters.items() if name in _HYPERPARAMETER_FIELDS}
        hyperparameter = BaguaHyperparameter().update(known)
        with state.lock:
            state.task.report_metrics(int(train_iter), hyperparameter, float(speed))
        return {}

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int) -> dict:
        """The setting rank ``rank`` is to use from ``train_iter`` on."""
        state = self._model(model_name)
        self._check_rank(rank)
        with state.lock:
            new_iteration = train_iter > state.last_asked_iter[rank]
            state.last_asked_iter[rank] = max(train_iter, state.last_asked_iter[rank])
            state.holders.add(rank)  # this reply gives it the setting in force
            if self.autotune_level >= 1 and new_iteration and len(state.holders) == self.world_size:
                self._autotune_step(state, rank, train_iter)
                state.holders.add(rank)  # a new setting starts with this rank holding it
            return {"recommended_hyperparameters": state.hyperparameter.dict(),
                    "is_autotune_completed": self._completed(state)}

    def report_tensor_execution_order(self, spans: List[BaguaCoreTelemetrySpan]) -> dict:
        """Takes in when tensors became ready: each tensor not seen before
        gets the next position, in the order of its span's ``start_time``
        (later reports only add tensors they name first)."""
        if not isinstance(spans, list):
            raise TypeError(f"spans must be a list of BaguaCoreTelemetrySpan objects, got {spans!r}")
        for span in spans:
            missing = [key for key in ("tensor_name", "action", "start_time") if not isinstance(span, dict) or
                       key not in span]
            if missing:
                raise ValueError(f"span {span!r} lacks {missing}")
        with self._order_lock:
            for span in sorted(spans, key=lambda span: span["start_time"]):
                key = (str(span["tensor_name"]), str(span["action"]))
                if key in self._traced:
                    continue
                self._traced.add(key)
                self.tensor_partial_order.setdefault(key[0], len(self.tensor_partial_order))
        return {}

    def is_autotune_completed(self, model_name: str) -> bool:
        return self._completed(self._model(model_name))

    def autotune_log_path(self, model_name: str) -> Optional[str]:
        return self._model(model_name).task.autotune_logfile_path

    def _completed(self, state: _ModelState) -> bool:
        return state.samples > self.max_samples

    def _model(self, model_name: str) -> _ModelState:
        with self._models_lock:
            if model_name not in self.model_dict:
                raise UnknownModelError(f"model {model_name!r} has not registered its tensors")
            return self.model_dict[model_name]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")

    def _autotune_step(self, state: _ModelState, rank: int, train_iter: int) -> None:
        """Moves the model to its next setting if the one in force has been
        judged (the conditions in the module's docstring)."""
        if self._completed(state):
            return
        running_s = time.monotonic() - state.granted_at
        if state.samples == 0:
            if state.warmup_passes == 0 or running_s < self.warmup_time_s:
                state.warmup_passes += 1
                return
            if running_s < self.warmup_time_s + self.sampling_confidence_time_s:
                return
        elif running_s < self.sampling_confidence_time_s:
            return
        judged = state.task.latest_score_of(state.hyperparameter)
        if judged is None:
            return  # no rank has reported with it yet
        reported_iter, score = judged
        state.task.tell(reported_iter, state.hyperparameter, score)
        if state.samples < self.max_samples:
            with self._order_lock:
                order = dict(self.tensor_partial_order)
            next_setting = state.task.recommend(state.hyperparameter, order)
        else:
            next_setting = state.task.best_hyperparameter()
        log.info("autotune %s: sample %d/%d (rank %d, iteration %d): bucket_size=%d hierarchical=%s scored %g; "
                 "next bucket_size=%d hierarchical=%s", state.task.task_name, state.samples + 1, self.max_samples + 1,
                 rank, train_iter, state.hyperparameter.bucket_size, state.hyperparameter.is_hierarchical_reduce,
                 score, next_setting.bucket_size, next_setting.is_hierarchical_reduce)
        state.grant(next_setting)
        state.samples += 1

    # HTTP.

    def setup_app(self, app):
        """Adds the four routes to the Flask ``app`` and returns it. A bad
        request is answered 400, a model that has not registered 405 (as
        Bagua's did), each with the reason."""
        from flask import request  # flask only for those who serve

        def handle(method, *names):
            body = request.get_json(force=True, silent=True)
            if not isinstance(body, dict):
                return "the request body must be a JSON object", 400
            missing = [name for name in names if name not in body]
            if missing:
                return f"the request lacks {missing}", 400
            try:
                return method(*(body[name] for name in names))
            except UnknownModelError as err:
                return f"Service not ready: {err}", 405
            except (KeyError, ValueError, TypeError) as err:
                return f"bad request: {err!r}", 400

        app.add_url_rule("/api/v1/register_tensors", "register_tensors", methods=["POST"], view_func=lambda: handle(
            self.register_tensors, "model_name", "tensor_list", "whether_to_bucket"))
        app.add_url_rule("/api/v1/report_metrics", "report_metrics", methods=["POST"], view_func=lambda: handle(
            self.report_metrics, "model_name", "rank", "train_iter", "hyperparameters", "speed"))
        app.add_url_rule("/api/v1/ask_hyperparameters", "ask_hyperparameters", methods=["POST"],
                         view_func=lambda: handle(self.ask_hyperparameters, "model_name", "rank", "train_iter"))
        app.add_url_rule("/api/v1/report_tensor_execution_order", "report_tensor_execution_order",
                         methods=["POST"], view_func=lambda: handle(self.report_tensor_execution_order, "spans"))
        return app

    def serve(self, host: str = "0.0.0.0", port: int = 0) -> "AutotuneServer":
        """Serves the routes from a thread of this process (port 0: any free
        port, see ``.port``) until ``.shutdown()``."""
        from flask import Flask
        from werkzeug.serving import make_server

        app = self.setup_app(Flask("bagua.service"))
        return AutotuneServer(make_server(host, port, app, threaded=True))


class AutotuneServer:
    """A running :meth:`AutotuneService.serve`; a context manager."""

    def __init__(self, server):
        self._server = server
        self.port = server.server_port
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="bagua-autotune-service", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


class AutotuneClient:
    """Speaks to the service at ``service_addr:service_port``. Each method
    returns the ``requests.Response``; ``.json()`` holds the answer.
    ``timeout_s`` bounds every request; ``proxies`` default to none."""

    def __init__(self, service_addr: str, service_port: int, proxies: Optional[dict] = None,
                 timeout_s: float = 60.0):
        import requests  # only for those who ask

        self.autotune_service_addr = f"{service_addr}:{service_port}"
        self.session = requests.Session()
        self.proxies = {"http": None, "https": None} if proxies is None else proxies
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict):
        return self.session.post(f"http://{self.autotune_service_addr}/api/v1/{route}", json=body,
                                 proxies=self.proxies, timeout=self.timeout_s)

    def register_tensors(self, model_name: str, tensor_list: List[TensorDeclaration], whether_to_bucket: bool = True):
        return self._post("register_tensors", {"model_name": model_name, "tensor_list": tensor_list,
                                               "whether_to_bucket": whether_to_bucket})

    def report_metrics(self, model_name: str, rank: int, train_iter: int, hyperparameters: dict, speed: float):
        return self._post("report_metrics", {"model_name": model_name, "rank": rank, "train_iter": train_iter,
                                             "hyperparameters": hyperparameters, "speed": speed})

    def ask_hyperparameters(self, model_name: str, rank: int, train_iter: int):
        return self._post("ask_hyperparameters", {"model_name": model_name, "rank": rank, "train_iter": train_iter})

    def report_tensor_execution_order(self, spans: List[BaguaCoreTelemetrySpan]):
        return self._post("report_tensor_execution_order", {"spans": spans})
