"""``python -m bagua.distributed.launch [options] script.py [args]``

A thin layer over ``torchrun`` (``torch.distributed.run``): the same options,
with ``--nproc_per_node`` defaulting to the number of GPUs, or to the number
of CPU cores this process may use when there is no GPU, plus bagua's own:

  --autotune_level N   0: no autotuning (default); 1: tune the bucket size
                       during training (sets BAGUA_AUTOTUNE=1 for the workers)

Plain ``torchrun`` works just as well (set BAGUA_AUTOTUNE yourself).
"""

import os
import sys
from typing import List, Optional


def default_nproc_per_node() -> int:
    try:
        import bagua_core

        gpus = bagua_core.cuda_device_count()
    except ImportError:
        gpus = 0
    if gpus > 0:
        return gpus
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _has_option(argv: List[str], option: str) -> bool:
    """True if ``option`` appears among the launcher's own options (before the
    training script)."""
    spellings = {option, option.replace("_", "-")}
    for arg in argv:
        if not arg.startswith("-"):
            return False  # the script: what follows belongs to it
        if arg.split("=", 1)[0] in spellings:
            return True
    return False


def take_bagua_options(argv: List[str]) -> List[str]:
    """Removes bagua's own launcher options from `argv` (before the script),
    applying them to the environment the workers inherit."""
    args, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            return args + [arg] + rest
        name, _, value = arg.partition("=")
        if name in ("--autotune_level", "--autotune-level"):
            value = value or (rest.pop(0) if rest else "")
            if value not in ("0", "1"):
                raise SystemExit(f"--autotune_level must be 0 or 1, got {value!r}")
            os.environ["BAGUA_AUTOTUNE"] = value
            continue
        args.append(arg)
    return args


def build_torchrun_args(argv: List[str]) -> List[str]:
    args = take_bagua_options(argv)
    if not _has_option(args, "--nproc_per_node"):
        args = [f"--nproc_per_node={default_nproc_per_node()}"] + args
    return args


def _repair_std_parsing() -> None:
    """PyTorch 1.13's torchrun on Python >= 3.11 parses ``--redirects 0`` (its
    default) as None instead of Std.NONE, because iterating an IntFlag no
    longer yields its zero member, and then crashes. Map None back to NONE."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.Std.from_str
    if getattr(original, "_bagua_repaired", False):
        return

    def from_str(vm):
        parsed = original(vm)
        if parsed is None:
            return api.Std.NONE
        if isinstance(parsed, dict):
            return {k: api.Std.NONE if v is None else v for k, v in parsed.items()}
        return parsed

    from_str._bagua_repaired = True
    api.Std.from_str = from_str


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.run import main as torchrun_main

    _repair_std_parsing()
    args = build_torchrun_args(sys.argv[1:] if argv is None else argv)
    torchrun_main(args)


if __name__ == "__main__":
    main()
