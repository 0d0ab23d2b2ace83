"""The bucket-size search of one model ("task") in the autotune service:
the scores its ranks reported, the best setting so far, and the Bayesian
optimizer proposing the next one. :class:`AutotuneService` decides when to
move to the next setting; this class decides which.

A setting is a bucket size of ``2 ** bucket_size_2p`` bytes (1 KiB to 2 GiB)
and whether reductions are hierarchical; its buckets come from
:func:`split_bucket_by_bucket_size`.
"""

import collections
import csv
import logging
import os
import tempfile
from typing import Deque, Dict, List, Optional, Tuple

from bagua.bagua_define import BaguaHyperparameter, TensorDeclaration, TensorDtype, get_tensor_declaration_bytes
from bagua.service.bayesian_optimizer import BayesianOptimizer, BoolParam, IntParam

__all__ = ["AutotuneTaskManager", "split_bucket_by_bucket_size"]

log = logging.getLogger(__name__)

BUCKET_SIZE_2P_RANGE = (10, 31)  # 1 KiB .. 2 GiB
# Bagua put the tensors of each dtype together, the dtypes in this order.
_DTYPE_ORDER = sorted(dtype.value for dtype in TensorDtype)


def split_bucket_by_bucket_size(tensor_list: List[TensorDeclaration], bucket_size: int,
                                param_group_info: Optional[Dict[str, int]] = None) -> List[List[TensorDeclaration]]:
    """Cuts ``tensor_list`` into buckets of ``bucket_size`` bytes or more.

    Tensors are taken dtype by dtype (f16, f32, u8), each dtype's in the
    given order; a bucket is closed as soon as it holds ``bucket_size``
    bytes, so only the last bucket of a dtype may be smaller. A bucket holds
    one dtype (it is flattened into one buffer; Bagua's let a bucket's
    leftover run into the next dtype). Within a bucket, tensors are ordered
    by ``param_group_info[name]`` (stable; names it lacks first).
    """
    dtypes = [_dtype(tensor) for tensor in tensor_list]
    group_of = param_group_info or {}
    buckets = []
    for dtype in _DTYPE_ORDER:
        bucket, filled = [], 0
        for tensor in (t for t, t_dtype in zip(tensor_list, dtypes) if t_dtype == dtype):
            bucket.append(tensor)
            filled += get_tensor_declaration_bytes(tensor)
            if filled >= bucket_size:
                buckets.append(bucket)
                bucket, filled = [], 0
        if bucket:
            buckets.append(bucket)
    return [sorted(bucket, key=lambda t: group_of.get(t["name"], -1)) for bucket in buckets]


def _dtype(tensor: TensorDeclaration) -> str:
    try:
        return TensorDtype(tensor["dtype"]).value
    except ValueError:
        raise ValueError(f"split_bucket_by_bucket_size: tensor {tensor.get('name')!r} has dtype "
                         f"{tensor['dtype']!r}; known: {_DTYPE_ORDER}") from None


def _bucket_size_2p(bucket_size: int) -> Optional[int]:
    """The exponent if ``bucket_size`` is a power of two in the search range."""
    if bucket_size <= 0 or bucket_size & (bucket_size - 1):
        return None
    exponent = bucket_size.bit_length() - 1
    low, high = BUCKET_SIZE_2P_RANGE
    return exponent if low <= exponent <= high else None


class AutotuneTaskManager:
    """One model's search. ``report_metrics`` records the first report of
    each iteration; ``tell`` gives the optimizer a setting's score;
    ``recommend`` asks it for the next setting; ``best_hyperparameter`` is
    the best reported so far. With ``need_to_log``, every told score is
    also appended to a CSV file (``autotune_logfile_path``)."""

    RECORD_MAX_NUM = 1000

    def __init__(self, task_name: str, need_to_log: bool = False, n_initial_points: int = 20,
                 random_state: Optional[int] = 0):
        self.task_name = task_name
        self.records: Deque[Tuple[int, BaguaHyperparameter, float]] = collections.deque(maxlen=self.RECORD_MAX_NUM)
        self._best: Optional[Tuple[float, BaguaHyperparameter]] = None
        self.autotune_logfile_path: Optional[str] = None
        if need_to_log:
            handle, self.autotune_logfile_path = tempfile.mkstemp(prefix="bagua_autotune_", suffix=".log")
            os.close(handle)
            log.info("autotune %s: logging the scores to %s", task_name, self.autotune_logfile_path)
        self.bayesian_optimizer = BayesianOptimizer({
            "bucket_size_2p": IntParam(23, BUCKET_SIZE_2P_RANGE),
            "is_hierarchical_reduce": BoolParam(False),
        }, n_initial_points=n_initial_points, random_state=random_state)

    def last_reported_iter(self) -> int:
        return self.records[-1][0] if self.records else -1

    def report_metrics(self, train_iter: int, hyperparameter: BaguaHyperparameter, score: float) -> bool:
        """Records the score of the setting a rank ran iteration ``train_iter``
        with, unless an iteration as late was recorded already (the ranks
        run the same setting; one report per iteration is enough)."""
        if train_iter <= self.last_reported_iter():
            return False
        self.records.append((train_iter, hyperparameter, score))
        if self._best is None or score > self._best[0]:
            self._best = (score, hyperparameter)
        return True

    def latest_score_of(self, hyperparameter: BaguaHyperparameter) -> Optional[Tuple[int, float]]:
        """(train_iter, score) of the latest report made with this setting."""
        for train_iter, reported, score in reversed(self.records):
            if reported == hyperparameter:
                return train_iter, score
        return None

    def best_hyperparameter(self) -> Optional[BaguaHyperparameter]:
        return None if self._best is None else self._best[1]

    def tell(self, train_iter: int, hyperparameter: BaguaHyperparameter, score: float) -> None:
        """Gives the optimizer the setting's score. A bucket size that is not
        a power of two in range (e.g. the default 10 MiB) is not in its
        space; it only competes for the best."""
        params = {"bucket_size_2p": _bucket_size_2p(hyperparameter.bucket_size),
                  "is_hierarchical_reduce": bool(hyperparameter.is_hierarchical_reduce)}
        if params["bucket_size_2p"] is None:
            return
        self.bayesian_optimizer.tell(params, score)
        if self.autotune_logfile_path:
            self._append_log(params, train_iter, score)

    def recommend(self, current: BaguaHyperparameter,
                  tensor_partial_order: Optional[Dict[str, int]] = None) -> BaguaHyperparameter:
        """The optimizer's next setting, with ``current``'s tensors cut into
        its buckets (in ``tensor_partial_order``, name -> position, if given)."""
        params = self.bayesian_optimizer.ask()
        bucket_size = 2 ** params["bucket_size_2p"]
        tensors = [tensor for bucket in current.buckets for tensor in bucket]
        if tensor_partial_order:
            tensors.sort(key=lambda t: tensor_partial_order.get(t["name"], -1))
        return BaguaHyperparameter(buckets=split_bucket_by_bucket_size(tensors, bucket_size),
                                   bucket_size=bucket_size,
                                   is_hierarchical_reduce=bool(params["is_hierarchical_reduce"]))

    def _append_log(self, params: dict, train_iter: int, score: float) -> None:
        row = dict(params, train_iter=train_iter, score=score)
        with open(self.autotune_logfile_path, "a", newline="") as logfile:
            writer = csv.DictWriter(logfile, fieldnames=sorted(row))
            if logfile.tell() == 0:
                writer.writeheader()
            writer.writerow(row)
