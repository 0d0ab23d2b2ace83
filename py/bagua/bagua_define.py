"""Bagua's shared type definitions (``bagua.bagua_define``): the tensor
declarations, the hyperparameters and the tensor-readiness spans its
autotune service exchanged."""

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from typing import List, TypedDict

__all__ = ["TensorDtype", "TensorDeclaration", "BaguaCoreTelemetrySpan", "BaguaHyperparameter",
           "get_tensor_declaration_bytes"]


class TensorDtype(str, enum.Enum):
    F32 = "f32"
    F16 = "f16"
    U8 = "u8"


class TensorDeclaration(TypedDict):
    name: str
    num_elements: int
    dtype: TensorDtype


class BaguaCoreTelemetrySpan(TypedDict):
    """One traced event of a tensor during a step, as Bagua's core reported
    it to the autotune service: ``action`` (e.g. ``"tensor_ready"``) on
    ``tensor_name`` between ``start_time`` and ``end_time`` (one clock,
    any unit). The service orders tensors by their first span's start."""

    trace_id: int
    action: str
    tensor_name: str
    start_time: int
    end_time: int


_DTYPE_BYTES = {TensorDtype.F32: 4, TensorDtype.F16: 2, TensorDtype.U8: 1}


def get_tensor_declaration_bytes(declaration: TensorDeclaration) -> int:
    """Bytes of the declared tensor."""
    return declaration["num_elements"] * _DTYPE_BYTES[TensorDtype(declaration["dtype"])]


@dataclass
class BaguaHyperparameter:
    """The hyperparameters the autotuner chooses: the buckets (lists of
    tensor declarations), the bucket size in bytes they were cut with (0:
    not known) and whether reductions are hierarchical."""

    buckets: List[List[TensorDeclaration]] = field(default_factory=list)
    bucket_size: int = 0
    is_hierarchical_reduce: bool = False

    def update(self, param_dict: dict) -> "BaguaHyperparameter":
        """Sets the given fields (unknown names are a ValueError); returns self."""
        names = {f.name for f in fields(self)}
        unknown = set(param_dict) - names
        if unknown:
            raise ValueError(f"BaguaHyperparameter has no field(s) {sorted(unknown)}; fields: {sorted(names)}")
        for name, value in param_dict.items():
            setattr(self, name, value)
        return self

    def dict(self) -> dict:
        return asdict(self)

    def json(self) -> str:
        return json.dumps(self.dict())

    @classmethod
    def parse_obj(cls, obj: dict) -> "BaguaHyperparameter":
        return cls().update(dict(obj))
