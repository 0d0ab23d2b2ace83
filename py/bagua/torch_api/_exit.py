"""A clean exit: what bagua started is stopped while the interpreter is
still whole.

At exit (``atexit``, registered by ``init_process_group``): every wrapped
module's engine is removed (the algorithm's background threads stopped, the
communication thread joined), bagua's process group is released, and the
``torch.distributed`` default group is destroyed, whether bagua created it or
joined one that torchrun's script, Accelerate, Lightning or Trainer set up.
Left to interpreter teardown, a background thread could still be averaging
weights whose memory is being freed, or lose its peer mid-round, and PyTorch
2.x with Gloo aborts a process whose default group was never destroyed now
and then ("terminate called without an active exception" after the script
ended: 2 of 10 five-rank runs of an all_gather and exit on torch 2.15; once
in CI, a Trainer run whose group Accelerate had made).
"""

import atexit
import os
import threading
import weakref

import torch.distributed as dist

from bagua.torch_api._core import log

_engines = weakref.WeakSet()
_installed = False
# Given by the process group module when it installs this handler (it sits
# above this module, which therefore never imports it).
_release_default_group = None
_store_connection_cutter = None


def track_engine(engine) -> None:
    """Stops ``engine`` (``engine.remove()``) at exit if it is still alive."""
    _engines.add(engine)


def install(release_default_group, store_connection_cutter) -> None:
    """Registers :func:`shutdown` at exit. ``release_default_group()``
    drops bagua's default process group; ``store_connection_cutter(address,
    port, seconds)`` is a context that cuts the connections to the store
    at ``address:port`` after ``seconds`` (see
    :func:`_destroy_torch_group_bounded`)."""
    global _installed, _release_default_group, _store_connection_cutter
    _release_default_group, _store_connection_cutter = release_default_group, store_connection_cutter
    if not _installed:
        atexit.register(shutdown)
        _installed = True


def shutdown() -> None:
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
    if _release_default_group is not None:
        _release_default_group()
    if dist.is_initialized():
        _destroy_torch_group_bounded()


# torch 2.x's destroy_process_group can block with no bound once rank 0,
# whose process hosts the store, has exited (seen about once in 20 runs of
# test_errors.py's retry test under load; faulthandler put the main thread
# here). The store's connections are cut after CUT_S, and past WAIT_S the
# process exits without waiting for it.
CUT_S, WAIT_S = 5.0, 10.0


def _destroy_torch_group_bounded() -> None:
    errors = []

    def destroy():
        try:
            address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if address and port and _store_connection_cutter is not None:
                with _store_connection_cutter(address, int(port), CUT_S):
                    dist.destroy_process_group()
            else:
                dist.destroy_process_group()
        except Exception as error:  # noqa: BLE001 - exiting: report it
            errors.append(error)

    thread = threading.Thread(target=destroy, name="bagua-exit-destroy", daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        log("warn", f"at exit, torch.distributed's destroy_process_group did not return within {WAIT_S:g} s "
                    "(rank 0's store is gone?): exiting without waiting for it")
    elif errors:
        log("warn", f"at exit, destroying torch.distributed's process group: {errors[0]}")


def _refuse_after_shutdown(module, inputs):
    raise RuntimeError(
        f"{type(module).__name__} was wrapped with with_bagua, and bagua shut down at exit: its forward "
        "would train without communicating. Run the training before the interpreter exits.")
