"""Run a function on N gloo ranks (processes on this machine) and collect what each returns."""
from __future__ import annotations

import faulthandler
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, folder, fn, args):
    faulthandler.enable()   # a crash in a rank (SIGSEGV in C++) prints that rank's Python stack
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
        dist.barrier()   # no rank tears gloo down while a peer may still be talking to it
    finally:
        dist.destroy_process_group()


def run(fn, world_size: int, *args):
    """``fn(rank, world_size, *args)`` on every rank; returns the list of results, by rank."""
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_entry, args=(world_size, free_port(), folder, fn, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
