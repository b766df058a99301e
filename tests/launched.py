"""The training script tests/test_launch.py starts with torchrun: a few ZeRO-3 steps, each rank's results saved.

Run as ``torchrun ... tests/launched.py OUT_DIR [CRASH_AT]``. zerocc.compile creates the
process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); each rank trains on its own slice of a global batch (chosen by
RANK) and saves its losses, its full state dict and the environment torchrun
gave it to OUT_DIR/rank<RANK>.pt. The script never calls destroy_process_group:
OUT_DIR/exit<RANK>.txt says whether zerocc destroyed the group it made at exit.

With CRASH_AT, the script checkpoints after every step (OUT_DIR/ckpt) and
resumes from that checkpoint when there is one; in torchrun's first attempt
(TORCHELASTIC_RESTART_COUNT=0) the last rank dies before step CRASH_AT, as a
crashed worker does, for ``torchrun --max-restarts 1`` to restart the job.
"""
from __future__ import annotations

import atexit
import os
import sys

import torch

ENVIRONMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "TORCHELASTIC_RESTART_COUNT")
STEPS = 3


def main(out: str, crash_at: int | None = None) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import zerocc
    from tests.distributed import record_group_at_exit
    from tests.models import batches, build
    torch.set_num_threads(1)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # registered before zerocc.compile, so it runs after zerocc's own exit handler (atexit runs the last first)
    atexit.register(record_group_at_exit, os.path.join(out, f"exit{rank}.txt"))
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    model, _, loss_fn = build("mlp")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn,
                          timeout=120)
    checkpoint = os.path.join(out, "ckpt")
    if crash_at is not None and os.path.lexists(checkpoint):
        zerocc.load_checkpoint(step, checkpoint)
    losses = []
    for number, batch in enumerate(batches("mlp", STEPS, 4 * world_size)):
        if number < step.steps:   # trained before the restart
            continue
        if number == crash_at and first_attempt and rank == world_size - 1:
            os._exit(3)
        losses.append(step(*[t[rank * 4:(rank + 1) * 4] for t in batch]))
        if crash_at is not None:
            zerocc.save_checkpoint(step, checkpoint)
    torch.save({"losses": losses, "state": step.full_state_dict(),
                "environment": {key: os.environ.get(key) for key in ENVIRONMENT}},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
