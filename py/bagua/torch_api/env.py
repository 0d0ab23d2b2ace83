"""The launcher's environment, read the way torchrun writes it: RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR (docs/environment.md);
and :func:`find_free_network_port`, for a script that sets MASTER_PORT
itself.

The BAGUA_* variables are not read here: they are declared once in the C++
runtime (include/bagua/core/env.h) and read through ``core.env()``.
"""

import os
import socket


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


def find_free_network_port() -> int:
    """A TCP port free on every interface of this host right now (Bagua's
    helper for single-node jobs that must set MASTER_PORT themselves).

    The operating system picks it (bind to port 0); the socket is closed
    before returning, so another program may still take the port before it
    is used: use it at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
