"""BlueFog's timeline: each BlueFog call as a span of the Chrome trace.

``BLUEFOG_TIMELINE=prefix`` writes ``prefix<rank>.json`` at exit. With
``BAGUA_TIMELINE`` set, BlueFog's spans go into bagua's trace instead (one
trace for both APIs, see ``bagua.torch_api.timeline``). Spans are named
"<ACTIVITY> <name>" (NEIGHBOR_ALLREDUCE, ALLREDUCE...), category "bluefog".
Without either variable nothing is recorded.
"""

import atexit
import contextlib
import os
import threading
from pathlib import Path
from typing import Optional

from bagua.torch_api import timeline as bagua_timeline
from bagua.torch_api._core import core, log

_timeline = None
_path: Optional[Path] = None
_open = {}  # tensor name -> (activity, start in microseconds)
_lock = threading.Lock()


def setup(rank: int) -> None:
    """Called by bf.init once the rank is known."""
    global _timeline, _path
    if _timeline is not None:
        return
    shared = bagua_timeline.get(rank)
    if shared is not None:
        _timeline = shared
        return
    prefix = os.environ.get("BLUEFOG_TIMELINE")
    if prefix:
        _timeline = core.Timeline(rank)
        _path = Path(f"{prefix}{rank}.json")
        atexit.register(write)


def write() -> Optional[Path]:
    """Writes the BLUEFOG_TIMELINE trace now (also done at exit)."""
    if _timeline is None or _path is None:
        return None
    _path.parent.mkdir(parents=True, exist_ok=True)
    _path.write_text(_timeline.to_json())
    log("info", f"bluefog timeline written to {_path}")
    return _path


def traced(fn, activity: str, name: Optional[str]):
    """``fn`` recording its run as a span when the timeline is on."""
    if _timeline is None:
        return fn

    def run():
        start = _timeline.now_us()
        try:
            return fn()
        finally:
            _timeline.span(f"{activity} {name or ''}".rstrip(), "bluefog", start,
                           _timeline.now_us())
    return run


def spans(labels, fn):
    """Runs ``fn``, recording one span per label over its whole run when the
    timeline is on: the calls of a fused op each keep a span under their own
    name, and the fused op has one of its own."""
    if _timeline is None:
        return fn()
    start = _timeline.now_us()
    try:
        return fn()
    finally:
        end = _timeline.now_us()
        for label in labels:
            _timeline.span(label.rstrip(), "bluefog", start, end)


def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Starts a user activity on ``tensor_name``; False when the timeline is
    off or an activity of that name is already open."""
    if _timeline is None:
        return False
    with _lock:
        if tensor_name in _open:
            return False
        _open[tensor_name] = (activity_name, _timeline.now_us())
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    """Ends the activity open on ``tensor_name``; False if none is."""
    if _timeline is None:
        return False
    with _lock:
        if tensor_name not in _open:
            return False
        activity, start = _open.pop(tensor_name)
    _timeline.span(f"{activity} {tensor_name}", "bluefog", start, _timeline.now_us())
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str):
    started = timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        if started:
            timeline_end_activity(tensor_name)
