"""Access to the C++ runtime (the ``bagua_core`` extension) and the conversion
of torch tensors into the runtime's non-owning tensor views.

Every tensor handed to the runtime passes through :func:`tensor_view`, which is
where bad input becomes a clear exception instead of a crash or wrong numbers.
"""

import contextlib
import threading

import torch

try:
    import bagua_core as core
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "bagua's C++ extension 'bagua_core' was not found. Install the package "
        "(pip install --no-build-isolation .) or, for development, build it with "
        "'meson setup build && ninja -C build' and put both 'py' and 'build' on PYTHONPATH."
    ) from error

BaguaError = core.BaguaError
InvalidArgumentError = core.InvalidArgumentError
CommTimeoutError = core.CommTimeoutError
BackendError = core.BackendError
StoreError = core.StoreError

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}

SUPPORTED_DTYPES = tuple(_DTYPE_NAMES)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in _DTYPE_NAMES)
        raise InvalidArgumentError(
            f"unsupported dtype {dtype}; bagua communicates {supported}"
        ) from None


def device_name(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else 0}"
    raise InvalidArgumentError(f"unsupported device {device}; bagua communicates cpu and cuda tensors")


def is_dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill one block of memory, each once, in
    some order of its dimensions (row-major, channels_last, a transpose...):
    ``numel`` elements from ``data_ptr``, as PyTorch's "non-overlapping and
    dense"."""
    if tensor.is_contiguous():
        return True
    order = sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))
    return tensor.permute(order).is_contiguous()


def check_tensor(tensor, what: str = "tensor", any_dense_order: bool = False) -> None:
    """Raises a clear error for anything the runtime cannot communicate.
    ``any_dense_order``: a tensor dense in another order of its dimensions
    is accepted too (what only element-wise ops read, such as a bucket's
    gradients: every rank lays them out alike)."""
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise InvalidArgumentError(f"{what}: {tensor.layout} tensors are not supported, use a dense tensor")
    dtype_name(tensor.dtype)
    device_name(tensor.device)
    if any_dense_order and not is_dense(tensor):
        raise InvalidArgumentError(
            f"{what} is a strided view (shape {tuple(tensor.shape)}, stride {tensor.stride()}): its elements "
            "do not fill one block of memory in any order of its dimensions (row-major and channels_last "
            "are accepted); make it a tensor of its own, e.g. with .contiguous()")
    if not any_dense_order and not tensor.is_contiguous():
        raise InvalidArgumentError(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
            "call .contiguous() first"
        )


def tensor_view(tensor, what: str = "tensor", allow_cuda: bool = False, any_dense_order: bool = False):
    """A ``bagua_core.TensorView`` of a contiguous tensor (or, with
    ``any_dense_order``, one dense in another order: its memory block): host
    memory, or CUDA memory when ``allow_cuda`` (for consumers that can
    reach it)."""
    check_tensor(tensor, what, any_dense_order)
    if tensor.device.type != "cpu" and not allow_cuda:
        raise InvalidArgumentError(
            f"{what} is on {tensor.device}: this view needs host memory (CUDA tensors are staged "
            "by the caller)"
        )
    return core.TensorView(tensor.data_ptr(), tensor.numel(), dtype_name(tensor.dtype),
                           device_name(tensor.device))


@contextlib.contextmanager
def thread_setting(local: threading.local, name: str, value):
    """Sets ``local.name`` to ``value`` on this thread while the block runs,
    then puts back what was there (None when nothing was)."""
    previous = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, previous)


def log(level: str, message: str) -> None:
    core.log(level, message)
