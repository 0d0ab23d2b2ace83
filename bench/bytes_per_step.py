"""Bytes each rank sends per step, by primitive, as the world grows.

Ranks are threads of this process over an in-memory store (Gloo's HashStore),
so world sizes 2 to 8 run on any machine. Each rank communicates one bucket
of 1 M fp32 weights (4 MB) once per "step" with:
  - allreduce (C_FP_S, what gradient allreduce sends),
  - decentralized all / shift_one / ring (D_FP_S),
  - low-precision decentralized (D_LP_S, ring, MinMaxUInt8),
and the bytes come from the ops' own counters.

    /usr/bin/python3 bench/bytes_per_step.py [--sizes 2,3,4,5,6,7,8]

Prints per-rank MB per step and writes bench/results/bytes_per_step.json.
"""

import argparse
import json
import threading
from pathlib import Path

import torch

import bagua_core as core
from bagua.torch_api._core import tensor_view

NUMEL = 1 << 20


def one_rank(store, rank, world, results, errors):
    try:
        comm = core.gloo_communicator(store, rank, world, prefix="bytes")
        out = {}
        kinds = ["allreduce", "decentralized_all", "decentralized_shift_one", "decentralized_ring",
                 "low_precision_decentralized"]
        for kind in kinds:
            bucket_comm = comm.new_group(list(range(world)))
            x = torch.randn(NUMEL)
            bucket = core.Bucket(kind, [("x", tensor_view(x))])
            keep = []
            if kind == "allreduce":
                bucket.append_centralized_synchronous_op(bucket_comm, None,
                                                        core.CentralizedSynchronousOptions(hierarchical=False))
            elif kind.startswith("decentralized_"):
                peer = torch.zeros(NUMEL)
                keep.append(peer)
                options = core.DecentralizedSynchronousOptions(
                    hierarchical=False, peer_selection=core.parse_peer_selection(kind.split("_", 1)[1]))
                bucket.append_decentralized_synchronous_op(bucket_comm, None, tensor_view(peer), options)
            else:
                copies = [x.clone() for _ in range(3)]
                keep.extend(copies)
                bucket.append_low_precision_decentralized_op(
                    bucket_comm, None, *[tensor_view(c) for c in copies],
                    core.LowPrecisionDecentralizedOptions(hierarchical=False))
            steps = 4
            for _ in range(steps):
                core._testing.execute_ops(bucket)
            out[kind] = bucket.op_bytes_sent[0] / steps
        results[rank] = out
    except Exception as error:  # noqa: BLE001 - reported by the main thread
        errors.append((rank, error))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,3,4,5,6,7,8")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bytes_per_step.json"))
    args = parser.parse_args()
    table = {}
    for world in [int(s) for s in args.sizes.split(",")]:
        store = core._testing.hash_store()
        results, errors = [None] * world, []
        threads = [threading.Thread(target=one_rank, args=(store, r, world, results, errors))
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise SystemExit(f"world {world}: {errors}")
        # per-rank maximum (shift_one: a resting rank sends nothing that step)
        table[world] = {kind: max(r[kind] for r in results) for kind in results[0]}
    kinds = list(next(iter(table.values())))
    print(f"bytes sent per rank per step, MB (bucket of {NUMEL * 4 / 1e6:.1f} MB fp32)")
    print(f"{'world':>5} " + " ".join(f"{k:>28}" for k in kinds))
    for world, row in table.items():
        print(f"{world:>5} " + " ".join(f"{row[k] / 1e6:28.3f}" for k in kinds))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bucket_bytes": NUMEL * 4, "per_rank_bytes_per_step": table},
                                         indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
