"""A clean exit: what bagua started is stopped while the interpreter is
still whole.

At exit (``atexit``, registered by ``init_process_group``): every wrapped
module's engine is removed (the algorithm's background threads stopped, the
communication thread joined), bagua's process group is released, and the
``torch.distributed`` process group is destroyed if bagua created it. Left to
interpreter teardown, a background thread could still be averaging weights
whose memory is being freed, or lose its peer mid-round, and PyTorch 2.x can
abort a process whose default process group was never destroyed.
"""

import atexit
import weakref

import torch.distributed as dist

_engines = weakref.WeakSet()
_created_torch_group = False
_installed = False


def track_engine(engine) -> None:
    """Stops ``engine`` (``engine.remove()``) at exit if it is still alive."""
    _engines.add(engine)


def created_torch_group() -> None:
    """bagua initialized ``torch.distributed`` itself: destroy it at exit."""
    global _created_torch_group
    _created_torch_group = True


def install() -> None:
    global _installed
    if not _installed:
        atexit.register(shutdown)
        _installed = True


def shutdown() -> None:
    global _created_torch_group
    from bagua.torch_api import process_group
    from bagua.torch_api._core import log

    for engine in list(_engines):
        try:
            engine.remove()
            # A training step run later (from an exit handler registered
            # before init_process_group) would no longer communicate: the
            # ranks would drift apart without a word. Refuse it instead.
            engine.module.register_forward_pre_hook(_refuse_after_shutdown)
        except Exception as error:  # noqa: BLE001 - exiting: report, stop the rest
            log("warn", f"at exit, stopping {getattr(engine, 'bagua_module_name', 'a module')}: {error}")
    _engines.clear()
    process_group._default_group = None
    if _created_torch_group and dist.is_initialized():
        _created_torch_group = False
        try:
            dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001
            log("warn", f"at exit, destroying torch.distributed's process group: {error}")


def _refuse_after_shutdown(module, inputs):
    raise RuntimeError(
        f"{type(module).__name__} was wrapped with with_bagua, and bagua shut down at exit: its forward "
        "would train without communicating. Run the training before the interpreter exits.")
