"""``python -m bagua.distributed.launch [options] script.py [args]``

A thin layer over ``torchrun`` (``torch.distributed.run``): the same options
(``--nnodes``, ``--node_rank``, ``--master_addr``, ``--master_port``,
``-m``, ``--no_python``...), with ``--nproc_per_node`` defaulting to the
number of GPUs, or to the number of CPU cores this process may use when there
is no GPU, plus the options of Bagua's launcher:

  --autotune_level N        0: no autotuning (default); 1: tune the bucket size
                            during training (BAGUA_AUTOTUNE=1 for the workers);
                            2 and 3 (Bagua's system-level tuning over ssh) run
                            level 1, with a warning: the system tuner is
                            bagua.service.autotune_system_hyperparameters,
                            run before launching
  --default_bucket_size B   BAGUA_DEFAULT_BUCKET_SIZE=B (bytes)
  --autotune_log_file PATH  BAGUA_AUTOTUNE_OUTPUT=PATH (the tuned plan)
  --autotune_max_samples N  BAGUA_AUTOTUNE_MAX_TRIALS=N
  --is_output_autotune_log  accepted: the plan is always written
  --set_additional_flag     pass --local_rank=N to the script
  --logdir DIR              each rank's stdout and stderr into files under DIR
                            (torchrun's --log_dir layout)
  --bagua_service_port, --report_metrics, --host_list, --ssh_port,
  --autotune_sampling_confidence_time, --autotune_warmup_time,
  --enable_bagua_net        accepted with a one-line warning: they configured
                            Bagua's HTTP autotune service, its ssh-based system
                            tuning and Bagua-Net, which the launcher does not
                            start (the bucket size is tuned inside the job;
                            bagua.service has the service and the system tuner)

Plain ``torchrun`` works just as well (set the BAGUA_* variables yourself).
``python -m bagua.distributed.run`` is the same launcher under the name of
Bagua's elastic one.
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
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            return False  # the script: what follows belongs to it
        name, has_value, _ = arg.partition("=")
        if _canonical(name) == option:
            return True
        if _canonical(name) in TORCHRUN_VALUE_OPTIONS and not has_value and rest:
            rest.pop(0)
    return False


def _set_env(variable: str, integer: bool = False):
    def apply(option: str, value: str) -> None:
        if integer and not (value.isdigit() and int(value) >= 1):
            raise SystemExit(f"{option} must be an integer >= 1, got {value!r}")
        os.environ[variable] = value
    return apply


def _autotune_level(option: str, value: str) -> None:
    if value not in ("0", "1", "2", "3"):
        raise SystemExit(f"{option} must be 0, 1, 2 or 3, got {value!r}")
    if value in ("2", "3"):
        _warn(f"{option} {value}: the launcher does not run the system tuner (run "
              "bagua.service.autotune_system_hyperparameters(hosts, nproc_per_node, ssh_port) before "
              "launching and export the setting it returns); tuning the bucket size during training (level 1)")
    os.environ["BAGUA_AUTOTUNE"] = "0" if value == "0" else "1"


def _ignored(why: str):
    def apply(option: str, value: Optional[str]) -> None:
        _warn(f"{option} has no effect here: {why}")
    return apply


def _warn(message: str) -> None:
    print(f"bagua.distributed.launch: {message}", file=sys.stderr)


_SERVICE = "it configured Bagua's HTTP autotune service; tuning runs inside the job (BAGUA_AUTOTUNE_*)"
_SSH = ("it served Bagua's ssh-based system tuning (--autotune_level 2), which the launcher does not run: "
        "bagua.service.autotune_system_hyperparameters takes the hosts and the ssh port")

# Bagua's launcher options: (takes a value, what it does).
BAGUA_OPTIONS = {
    "--autotune_level": (True, _autotune_level),
    "--default_bucket_size": (True, _set_env("BAGUA_DEFAULT_BUCKET_SIZE", integer=True)),
    "--autotune_log_file": (True, _set_env("BAGUA_AUTOTUNE_OUTPUT")),
    "--autotune_max_samples": (True, _set_env("BAGUA_AUTOTUNE_MAX_TRIALS", integer=True)),
    "--is_output_autotune_log": (False, lambda option, value: None),  # the plan is always written
    "--bagua_service_port": (True, _ignored(_SERVICE)),
    "--report_metrics": (False, _ignored(_SERVICE)),
    "--autotune_sampling_confidence_time": (True, _ignored(_SERVICE)),
    "--autotune_warmup_time": (True, _ignored(_SERVICE + "; BAGUA_AUTOTUNE_WARMUP_STEPS counts steps")),
    "--host_list": (True, _ignored(_SSH)),
    "--ssh_port": (True, _ignored(_SSH)),
    "--enable_bagua_net": (False, _ignored("Bagua-Net was a TCP plugin for NCCL; Gloo and NCCL run as they are")),
}


# torchrun's options that take a value (the rest are flags), so that a value
# given as the next argument is not taken for the training script.
TORCHRUN_VALUE_OPTIONS = {
    "--nnodes", "--nproc_per_node", "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--rdzv_conf",
    "--max_restarts", "--monitor_interval", "--start_method", "--role", "--log_dir", "-r", "--redirects",
    "-t", "--tee", "--node_rank", "--master_addr", "--master_port", "--local_addr", "--logs_specs",
}


def _canonical(name: str) -> str:
    return name.replace("-", "_").replace("__", "--", 1) if name.startswith("--") else name


def take_bagua_options(argv: List[str]) -> List[str]:
    """Removes bagua's own launcher options from `argv` (before the script),
    applying them to the environment the workers inherit; rewrites
    ``--logdir`` and ``--set_additional_flag`` into torchrun's terms."""
    args, rest = [], list(argv)
    additional_flag = False
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("-"):
            script = [arg] + rest
            if additional_flag:
                script = _with_local_rank_flag(args, script)  # may drop -m from args
            return args + script
        name, has_value, value = arg.partition("=")
        name = _canonical(name)
        if name in BAGUA_OPTIONS:
            takes_value, apply = BAGUA_OPTIONS[name]
            if takes_value and not has_value:
                if not rest:
                    raise SystemExit(f"{name} needs a value")
                value = rest.pop(0)
            apply(name, value if takes_value else None)
            continue
        if name == "--set_additional_flag":
            additional_flag = True
            continue
        if name == "--logdir":
            directory = value if has_value else (rest.pop(0) if rest else "")
            if not directory:
                raise SystemExit("--logdir needs a directory")
            args += ["--log_dir", directory, "--redirects", "3"]
            continue
        args.append(arg)
        if name in TORCHRUN_VALUE_OPTIONS and not has_value and rest:
            args.append(rest.pop(0))
    return args


def _with_local_rank_flag(launcher_args: List[str], script: List[str]) -> List[str]:
    """The script and its arguments run through bagua.distributed.local_rank_arg,
    which adds --local_rank=LOCAL_RANK as Bagua's launcher did."""
    if any(_canonical(a) == "--no_python" for a in launcher_args):
        raise SystemExit("--set_additional_flag cannot be combined with --no_python")
    as_module = any(_canonical(a) in ("-m", "--module") for a in launcher_args)
    if as_module:
        launcher_args[:] = [a for a in launcher_args if _canonical(a) not in ("-m", "--module")]
    return ["-m", "bagua.distributed.local_rank_arg"] + (["--module"] if as_module else []) + script


def build_torchrun_args(argv: List[str]) -> List[str]:
    args = take_bagua_options(argv)
    if not _has_option(args, "--nproc_per_node"):
        args = [f"--nproc_per_node={default_nproc_per_node()}"] + args
    return args


def with_prompt_monitoring(args: List[str]) -> List[str]:
    """torchrun's agent looks at its workers every 0.1 s, torch 2.x's default
    (torch 1.13's agent looked every 5 s, so each run outlived its workers by
    2.5 s on average), unless --monitor_interval or PET_MONITOR_INTERVAL says."""
    if _has_option(args, "--monitor_interval") or "PET_MONITOR_INTERVAL" in os.environ:
        return args
    return ["--monitor_interval=0.1"] + args


def _repair_std_parsing() -> None:
    """PyTorch 1.13's torchrun on Python >= 3.11 parses ``--redirects``/``--tee``
    values 0 and 3 (none, both streams) as None, because membership tests of
    an IntFlag no longer accept its zero and multi-bit members, and then
    crashes or drops the redirection. Parse the values here instead: a digit
    0-3 for every rank, or ``rank:digit,...``."""
    import re

    from torch.distributed.elastic.multiprocessing import api

    original = api.Std.from_str
    if getattr(original, "_bagua_repaired", False):
        return

    def from_str(vm):
        if re.fullmatch(r"[0-3]", vm):
            return api.Std(int(vm))
        if re.fullmatch(r"(\d+:[0-3],)*\d+:[0-3]", vm):
            return {int(rank): api.Std(int(value)) for rank, value in (p.split(":") for p in vm.split(","))}
        return original(vm)

    from_str._bagua_repaired = True
    api.Std.from_str = from_str


def main(argv: Optional[List[str]] = None) -> None:
    from torch.distributed.run import main as torchrun_main

    _repair_std_parsing()
    argv = sys.argv[1:] if argv is None else argv
    if _has_option(argv, "-h") or _has_option(argv, "--help"):
        print(__doc__)  # Bagua's options; torchrun's help follows
    args = with_prompt_monitoring(build_torchrun_args(argv))
    torchrun_main(args)


if __name__ == "__main__":
    main()
