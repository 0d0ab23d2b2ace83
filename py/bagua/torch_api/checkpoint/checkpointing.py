"""Save and resume training: Bagua's checkpoint layout, written atomically,
with each rank's algorithm state.

Layout under ``checkpoints_path`` (Bagua's, so its tools and scripts read it):

    latest_checkpointed_iteration.txt        the last complete iteration
    iter_0000100/mp_rank_00_model_states.pt  rank 0: iteration, model,
                                             optimizer, lr_scheduler
    iter_0000100/bagua_rank_00001_states.pt  ours, per rank: the engine's
                                             step count and bucket plan, the
                                             algorithm's own state, and where
                                             ranks' weights differ
                                             (decentralized, asynchronous)
                                             that rank's model and optimizer

Every file is written to a temporary name, flushed and renamed, and rank 0
points the tracker file at the iteration only after every rank's files are
in place (a barrier): a crash at any moment of a save leaves the previous
checkpoint the one that loads.

Call both functions on every rank, between steps. ``load_checkpoint`` takes
the wrapped module (``with_bagua`` first), as Bagua's does; a plain module
gets its weights (and the optimizer its state), without engine state.
"""

import contextlib
import logging
import numbers
import os
from typing import Optional

import torch

from bagua.torch_api._core import InvalidArgumentError
from bagua.torch_api.communication import barrier
from bagua.torch_api.process_group import get_rank, get_world_size, is_initialized

__all__ = ["save_checkpoint", "load_checkpoint"]

TRACKER = "latest_checkpointed_iteration.txt"

#: Called between writing a file and renaming it into place, with the two
#: names: a test injects a crash there. None in normal use.
_before_rename = None


def _iteration_dir(checkpoints_path: str, iteration: int, release: bool = False) -> str:
    return os.path.join(checkpoints_path, "release" if release else f"iter_{iteration:07d}")


def _model_file(directory: str) -> str:
    return os.path.join(directory, "mp_rank_00_model_states.pt")


def _rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f"bagua_rank_{rank:05d}_states.pt")


def _fsync_directory(directory: str) -> None:
    # The rename itself must reach the disk, not only the file's bytes.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(filename: str, write) -> None:
    """``write(file)`` into a temporary file beside ``filename``, flushed to
    disk, then renamed over it: readers see the old file or the whole new
    one, never a part."""
    tmp = f"{filename}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if _before_rename is not None:
            _before_rename(tmp, filename)
        os.replace(tmp, filename)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_directory(os.path.dirname(filename) or ".")


def _engine(model):
    return getattr(model, "bagua_ddp", None)


def _weights_held(model):
    """No background work touches the weights inside (asynchronous model
    average applies its averages between steps otherwise)."""
    engine = _engine(model)
    return engine.bagua_algorithm_impl.hold_weights(engine) if engine is not None else contextlib.nullcontext()


def _ranks_share_weights(model) -> bool:
    engine = _engine(model)
    return engine is None or engine.bagua_algorithm_impl.ranks_share_weights()


def _has_rank_local_parameters(model) -> bool:
    """Parameters each rank keeps for itself (``allreduce = False``: the
    experts of ``bagua.torch_api.moe``) differ across ranks whatever the
    algorithm."""
    return any(getattr(p, "allreduce", True) is False for p in model.parameters())


def _rank_states(iteration: int, model, optimizer) -> dict:
    """This rank's file: the engine's state, and where ranks' weights differ
    (and this is not rank 0, whose are in Bagua's file) the rank's own."""
    engine = _engine(model)
    # Plain ints: torch.load (weights_only, PyTorch >= 2.6) refuses other classes.
    state = {"iteration": int(iteration), "rank": int(get_rank()), "world_size": int(get_world_size()),
             "engine": engine.state_dict() if engine is not None else None}
    if get_rank() != 0 and (not _ranks_share_weights(model) or _has_rank_local_parameters(model)):
        state["model"] = model.state_dict()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
    return state


def _barrier() -> None:
    if is_initialized():
        barrier()


def _write_files(directory: str, iteration: int, model, optimizer, lr_scheduler) -> None:
    """Bagua's file (rank 0) and this rank's own, each atomically."""
    if get_rank() == 0:
        state = {"iteration": int(iteration), "model": model.state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        if lr_scheduler is not None:
            state["lr_scheduler"] = lr_scheduler.state_dict()
        _atomic_write(_model_file(directory), lambda f: torch.save(state, f))
    if is_initialized():
        rank_state = _rank_states(iteration, model, optimizer)
        _atomic_write(_rank_file(directory, get_rank()), lambda f: torch.save(rank_state, f))


def save_checkpoint(iteration: int, checkpoints_path: str, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None,
                    lr_scheduler=None) -> None:
    """Saves a checkpoint of ``iteration`` (collective: every rank calls it).

    Args:
        iteration: the training iteration, returned by ``load_checkpoint``.
        checkpoints_path: the checkpoints' directory (created if missing).
        model: the module (wrapped with ``with_bagua``, or plain).
        optimizer: the optimizer to save. Default: ``None``.
        lr_scheduler: the learning rate scheduler to save. Default: ``None``.
    """
    if not isinstance(iteration, numbers.Integral) or isinstance(iteration, bool) or iteration < 0:
        raise InvalidArgumentError(f"save_checkpoint: iteration must be an integer >= 0, got {iteration!r}")
    logging.info("saving checkpoint at iteration %7d to %s", iteration, checkpoints_path)
    directory = _iteration_dir(checkpoints_path, iteration)
    os.makedirs(directory, exist_ok=True)
    with _weights_held(model):  # until the tensors are written, not only referenced
        _write_files(directory, iteration, model, optimizer, lr_scheduler)
    _barrier()  # every rank's files are in place before the tracker names them
    if get_rank() == 0:
        tracker = os.path.join(checkpoints_path, TRACKER)
        _atomic_write(tracker, lambda f: f.write(str(iteration).encode()))
    _barrier()
    logging.info("successfully saved checkpoint at iteration %7d to %s", iteration, checkpoints_path)


def _read_tracker(tracker: str):
    """(iteration, release) from the tracker file; a value that is neither
    an iteration nor "release" is an error naming the file (Bagua exited)."""
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise InvalidArgumentError(
            f"load_checkpoint: {tracker} must hold an iteration >= 0 or 'release', got {text!r}")
    return iteration, False


def load_checkpoint(checkpoints_path: str, model: torch.nn.Module,
                    optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler=None,
                    strict: bool = True) -> int:
    """Loads the last complete checkpoint and returns its iteration (0, with
    a warning, when there is none). Collective: every rank calls it.

    Args:
        checkpoints_path: the checkpoints' directory.
        model: the module to load into (wrapped with ``with_bagua`` to also
            restore the engine's and the algorithm's state).
        optimizer: the optimizer to load into. Default: ``None``.
        lr_scheduler: the learning rate scheduler to load into. Default: ``None``.
        strict: whether the model's keys must match the checkpoint's exactly.
    """
    tracker = os.path.join(checkpoints_path, TRACKER)
    if not os.path.isfile(tracker):
        logging.warning("could not find checkpoint metadata file %s", tracker)
        return 0
    iteration, release = _read_tracker(tracker)
    logging.info("loading checkpoint from %s at iteration %d", checkpoints_path, iteration)
    directory = _iteration_dir(checkpoints_path, iteration, release)
    _load_files(directory, model, optimizer, lr_scheduler, strict)
    _barrier()
    logging.info("successfully loaded checkpoint from %s at %d", checkpoints_path, iteration)
    return iteration


def _load_rank_file(directory: str, model):
    """This rank's file, or None where it cannot apply (a Bagua checkpoint,
    another world size, a plain module)."""
    if not is_initialized():
        return None
    filename = _rank_file(directory, get_rank())
    if not os.path.isfile(filename):
        if _engine(model) is not None:
            logging.warning("%s is missing (a checkpoint of Bagua?): weights are rank 0's, the "
                            "algorithm's state starts afresh", filename)
        return None
    state = torch.load(filename, map_location="cpu")
    if state["world_size"] != get_world_size():
        logging.warning("the checkpoint in %s was saved by %d ranks, this run has %d: weights are "
                        "rank 0's, the algorithm's state starts afresh", directory, state["world_size"],
                        get_world_size())
        return None
    return state


def _load_files(directory: str, model, optimizer, lr_scheduler, strict: bool) -> None:
    """Bagua's file (rank 0's model and optimizer), overlaid with this rank's
    own where it has one, then the engine's state."""
    common = torch.load(_model_file(directory), map_location="cpu")
    mine = _load_rank_file(directory, model)
    own = mine if mine is not None and "model" in mine else common
    with _weights_held(model):
        model.load_state_dict(own["model"], strict=strict)
        if optimizer is not None:
            optimizer.load_state_dict(own["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(common["lr_scheduler"])
    engine = _engine(model)
    if engine is not None and mine is not None and mine["engine"] is not None:
        engine.load_state_dict(mine["engine"])
    elif engine is not None:
        engine.request_rebuild()
