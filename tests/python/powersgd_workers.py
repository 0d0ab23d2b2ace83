"""Worker scenarios of test_powersgd.py, run on several processes by
launcher.run_workers. Usage: powersgd_workers.py SCENARIO OUT_DIR [ARGS...];
each rank saves its results to OUT_DIR/rank{RANK}.pt."""

import os
import sys

import torch
import torch.nn.functional as F

import bagua.torch_api as bagua
from bagua.torch_api.algorithms.powersgd import PowerSGDAlgorithm

from workers import batches, fresh_model_and_optimizer


def scenario_training(out_dir, rank_r="2", start_iter="2", error_feedback="1", warm_start="1", flatten="1"):
    """Five SGD steps of workers.Net with PowerSGD; saves the parameters
    after every step, the bagua names of the parameters and the bytes."""
    bagua.init_process_group()
    rank = bagua.get_rank()
    model, opt = fresh_model_and_optimizer("sgd")
    algorithm = PowerSGDAlgorithm(rank=int(rank_r), start_iter=int(start_iter),
                                  error_feedback=error_feedback == "1", warm_start=warm_start == "1")
    model = model.with_bagua([opt], algorithm, do_flatten=flatten == "1")
    params = []
    for x, y in batches(rank, steps=5):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    impl = model.bagua_ddp.bagua_algorithm_impl
    state = model.bagua_ddp.state_dict()["algorithm_state"]
    restored = PowerSGDAlgorithm().reify(None)
    restored.load_state_dict(model.bagua_ddp, state)
    round_trip = all(torch.equal(restored._q[k], impl._q[k]) for k in impl._q) and \
        all(torch.equal(restored._error[k], impl._error[k]) for k in impl._error)
    torch.save({"params": params, "state_q": sorted(state["q"]), "state_error": sorted(state["error"]),
                "round_trip": round_trip, "names": [p.bagua_tensor_name for p in model.parameters()],
                "bytes_sent": impl.bytes_sent, "bytes_uncompressed": impl.bytes_uncompressed},
               os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    scenario, out_dir = sys.argv[1], sys.argv[2]
    globals()[f"scenario_{scenario}"](out_dir, *sys.argv[3:])
