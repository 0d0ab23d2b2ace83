"""Worker of test_cached_dataset.py: two processes share the Redis server
that local rank 0 bootstraps. Usage: cache_workers.py cache_shared OUT_DIR;
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch

import bagua.torch_api as bagua
from bagua.torch_api.contrib import CacheLoader


def scenario_cache_shared(out_dir):
    bagua.init_process_group()
    rank = bagua.get_rank()
    loader = CacheLoader(key_prefix="shared", writer_buffer_size=1)
    if rank == 0:
        loader.store.clear()
        loader.store.set("note", b"written by rank 0")
    bagua.barrier()
    seen = loader.store.get("note").decode()
    loads = []

    def load(index):
        loads.append(index)
        return index * index

    for i in range(rank, 30, 2):  # each rank computes its half
        loader.get(i, load)
    bagua.barrier()
    values = [loader.get(i, load) for i in range(30)]  # the other half comes from Redis
    assert values == [i * i for i in range(30)], values
    torch.save({"host": loader.store.hosts, "seen_from_rank0": seen, "loads": len(loads)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    bagua.barrier()  # rank 0 shuts the server down at exit: after everyone is done


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"](sys.argv[2], *sys.argv[3:])
