"""The launcher's environment, read the way torchrun writes it.

Variables (all documented in docs/environment.md):
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from
the launcher; BAGUA_* for the runtime's own settings.
"""

import os


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def get_rank() -> int:
    return _int("RANK", 0)


def get_world_size() -> int:
    return _int("WORLD_SIZE", 1)


def get_local_rank() -> int:
    return _int("LOCAL_RANK", 0)


def get_local_size() -> int:
    return _int("LOCAL_WORLD_SIZE", get_world_size())


def get_master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")


def get_default_bucket_size() -> int:
    """Bucket size target in bytes (BAGUA_DEFAULT_BUCKET_SIZE, default 10 MiB)."""
    return _int("BAGUA_DEFAULT_BUCKET_SIZE", 10 * 1024 * 1024)


def get_comm_timeout_s() -> float:
    """Seconds before a communication wait fails (BAGUA_COMM_TIMEOUT_S, default 300)."""
    value = os.environ.get("BAGUA_COMM_TIMEOUT_S")
    return float(value) if value else 300.0


def get_backend() -> str:
    """The communication backend (BAGUA_BACKEND): "gloo" (default; CPU tensors,
    CUDA tensors of user calls staged through host memory) or "nccl" (CUDA
    tensors, one rank per GPU)."""
    import os

    backend = os.environ.get("BAGUA_BACKEND", "gloo").lower()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"BAGUA_BACKEND={backend!r}: expected 'gloo' or 'nccl'")
    return backend


def check_collectives() -> bool:
    """Whether user-level collectives first check that every rank passed the same
    sizes (BAGUA_CHECK_COLLECTIVES, default on): a mismatch is then an error on
    every rank rather than a hang."""
    return os.environ.get("BAGUA_CHECK_COLLECTIVES", "1") not in ("0", "false", "False")
