"""Worker of test_kill.py: trains until killed or until a peer's death
makes a step fail.

Usage: kill_workers.py train OUT_DIR ALGORITHM. Each rank writes
OUT_DIR/started{RANK} once it has trained a few steps, and on failure prints
one line 'FAILED <seconds since start> <exception type>: <message>' and
exits with status 3 (the test tells a clean error from a crash by it).
"""

import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua.torch_api.algorithms.partial_allreduce import PartialAllReduceAlgorithm
from checkpoint_workers import ALGORITHMS, batch, sgd, wrapped

ALL = dict(ALGORITHMS, async_model_average=(sgd, lambda opt: AsyncModelAverageAlgorithm(sync_interval_ms=5)),
           partial_allreduce_smart=(sgd, lambda opt: PartialAllReduceAlgorithm(group_size=2)),
           partial_allreduce_static=(sgd, lambda opt: PartialAllReduceAlgorithm(group_generator="static")))


def scenario_train(out_dir, name):
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt, scheduler = wrapped(name, algorithms=ALL)
    start = time.monotonic()
    step = 0
    try:
        while time.monotonic() - start < 120:  # killed long before
            step += 1
            x, y = batch(rank, step % 50)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if step == 3:
                open(os.path.join(out_dir, f"started{rank}"), "w").close()
    except Exception as error:  # noqa: BLE001 - report whatever the peer's death raised
        print(f"FAILED {time.monotonic() - start:.2f} {type(error).__name__}: {error}", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.exit(3)  # through the exit handlers, as a user's script would
    print(f"NOT FAILED after {step} steps", flush=True)


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
