"""The script tests/test_launch.py starts as two torchrun "nodes" whose OUT_DIR/local is each node's own disk.

Run as ``torchrun ... tests/launched_node_local.py OUT_DIR``, node 1 in its own mount namespace where
OUT_DIR/local is another folder (a node-local disk at the same path, as /scratch on a cluster). Each rank
saves to the node-local path, saves again where node 1 holds a stale folder of the version's name, saves to
OUT_DIR/shared, and loads a copy only node 0 holds; what each call raised goes to OUT_DIR/rank<RANK>.pt. The script never calls
destroy_process_group: OUT_DIR/exit<RANK>.txt says whether zerocc destroyed the group it made, at exit.
"""
from __future__ import annotations

import atexit
import os
import shutil
import sys

import torch


def main(out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import zerocc
    from tests.distributed import record_group_at_exit
    from tests.models import batches, build
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # registered before zerocc.compile, so it runs after zerocc's own exit handler (atexit runs the last first)
    atexit.register(record_group_at_exit, os.path.join(out, f"exit{rank}.txt"))
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn, timeout=60)
    for batch in batches("mlp", 1, 4 * world_size):
        step(*[t[rank * 4:(rank + 1) * 4] for t in batch])
    local = os.path.join(out, "local")
    results = {}

    def attempt(name, call, *args):
        try:
            results[name] = call(*args)
        except zerocc.ConfigError as error:
            results[name] = error

    attempt("node_local", zerocc.save_checkpoint, step, os.path.join(local, "ckpt"))
    if rank == 1:   # a folder an earlier save left on node 1's own disk, named as the next version
        os.makedirs(os.path.join(local, "stale.v1"))
    attempt("stale", zerocc.save_checkpoint, step, os.path.join(local, "stale"))
    attempt("shared", zerocc.save_checkpoint, step, os.path.join(out, "shared", "ckpt"))
    if rank == 0:   # the checkpoint copied to node 0's disk only
        shutil.copytree(os.path.join(out, "shared", "ckpt"), os.path.join(local, "copy"))
    attempt("load", zerocc.load_checkpoint, step, os.path.join(local, "copy"))
    results["listing"] = sorted(os.listdir(local))
    torch.save({name: str(value) for name, value in results.items()} | {"listing": results["listing"]},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
