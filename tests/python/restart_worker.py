"""A training script as a user writes it for restarts: load the last
checkpoint, train, save every SAVE_EVERY steps. Run by torchrun (through
bagua.distributed.launch) with --max_restarts in test_checkpoint.py.

Usage: restart_worker.py CHECKPOINTS OUT_DIR ALGORITHM KILL_AT. On the first
attempt (TORCHELASTIC_RESTART_COUNT 0) rank 1 SIGKILLs itself after step
KILL_AT (0: never); each rank writes its final weights and the iteration it
resumed from to OUT_DIR/rank{RANK}.pt.
"""

import os
import signal
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.checkpoint import load_checkpoint, save_checkpoint
from checkpoint_workers import train, weights, wrapped

STEPS, SAVE_EVERY = 12, 4


def main(checkpoints, out_dir, name, kill_at):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt, scheduler = wrapped(name)
    resumed_from = load_checkpoint(checkpoints, model, opt, scheduler)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for step in range(resumed_from + 1, STEPS + 1):
        train(model, opt, scheduler, step, step)
        if step % SAVE_EVERY == 0:
            save_checkpoint(step, checkpoints, model, opt, scheduler)
        if rank == 1 and first_attempt and step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    torch.save({"weights": weights(model), "resumed_from": resumed_from,
                "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
