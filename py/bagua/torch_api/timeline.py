"""The timeline: Chrome-trace JSON of what each rank did, when.

Set ``BAGUA_TIMELINE=dir`` and every rank writes ``dir/rank{R}.json`` when
the process exits (or on ``write()``): tensor-ready instants, each bucket's
ops with start, end and bytes (recorded by the C++ backend on its
communication thread), and the forward, backward and optimizer-step phases.
Open one file in chrome://tracing or https://ui.perfetto.dev, or merge the
ranks into one:

    python3 -m bagua.torch_api.timeline merge dir -o merged.json

With ``BAGUA_TIMELINE`` unset nothing is recorded: the hooks check one
attribute for None.
"""

import argparse
import atexit
import json
from pathlib import Path
from typing import List, Optional

from bagua.torch_api._core import core, log

_timeline = None
_directory: Optional[Path] = None


def get(rank: int):
    """This process's Timeline, or None when BAGUA_TIMELINE is unset."""
    global _timeline, _directory
    directory = core.env().timeline
    if not directory:
        return None
    if _timeline is None:
        _directory = Path(directory)
        _directory.mkdir(parents=True, exist_ok=True)
        _timeline = core.Timeline(rank)
        atexit.register(write)
    return _timeline


def write() -> Optional[Path]:
    """Writes this rank's trace to BAGUA_TIMELINE/rank{R}.json."""
    if _timeline is None or _directory is None:
        return None
    data = _timeline.to_json()
    rank = json.loads(data)["otherData"]["rank"]
    path = _directory / f"rank{rank}.json"
    path.write_text(data)
    log("info", f"timeline written to {path} ({len(_timeline)} events)")
    return path


def merge(paths: List[Path], output: Path) -> dict:
    """One trace with every rank's events (each rank is its own process row)."""
    events, dropped = [], {}
    for path in sorted(paths):
        trace = json.loads(Path(path).read_text())
        events.extend(trace["traceEvents"])
        dropped[trace["otherData"]["rank"]] = trace["otherData"]["dropped_events"]
    merged = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"dropped_events": dropped}}
    Path(output).write_text(json.dumps(merged))
    return merged


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m bagua.torch_api.timeline",
                                     description="Merge the ranks' timeline files into one trace.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge_parser = sub.add_parser("merge", help="merge DIR/rank*.json into one file")
    merge_parser.add_argument("directory")
    merge_parser.add_argument("-o", "--output", default="timeline.json")
    args = parser.parse_args(argv)
    paths = sorted(Path(args.directory).glob("rank*.json"))
    if not paths:
        raise SystemExit(f"no rank*.json files in {args.directory}")
    merged = merge(paths, Path(args.output))
    print(f"merged {len(paths)} ranks, {len(merged['traceEvents'])} events into {args.output}")


if __name__ == "__main__":
    main()
