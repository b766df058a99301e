"""The training script tests/test_launch.py starts with torchrun: a few ZeRO-3 steps, each rank's results saved.

Run as ``torchrun ... tests/launched.py OUT_DIR``. zerocc.compile creates the
process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); each rank trains on its own slice of a global batch (chosen by
RANK) and saves its losses, its full state dict and the environment torchrun
gave it to OUT_DIR/rank<RANK>.pt.
"""
from __future__ import annotations

import os
import sys

import torch

ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def main(out: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import zerocc
    from tests.models import batches, build
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn,
                          timeout=120)
    losses = []
    for batch in batches("mlp", 3, 4 * world_size):
        losses.append(step(*[t[rank * 4:(rank + 1) * 4] for t in batch]))
    torch.save({"losses": losses, "state": step.full_state_dict(),
                "environment": {key: os.environ.get(key) for key in ENVIRONMENT}},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
