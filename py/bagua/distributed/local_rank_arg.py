"""``python -m bagua.distributed.local_rank_arg [--module] SCRIPT [ARGS...]``

Runs SCRIPT (a file, or a module with ``--module``) with
``--local_rank=$LOCAL_RANK`` added after it, as Bagua's launcher did with
``--set_additional_flag``; the launcher puts it in front of the script."""

import os
import runpy
import sys


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "--module"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m bagua.distributed.local_rank_arg [--module] SCRIPT [ARGS...]")
    script, args = argv[0], argv[1:]
    sys.argv = [script, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"] + args
    if as_module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
