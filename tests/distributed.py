"""Run a function on N gloo ranks (processes on this machine) and collect what each returns.

Ranks are forked from one server process that has already imported torch and
zerocc (multiprocessing's "forkserver" with a preload): a rank starts in a
tenth of a second, where a spawned one re-imports torch (5-15 s on a busy
2-core machine, for each of the suite's ~60 multi-rank tests). Each rank is
given the caller's environment as it is at the call, as spawn would.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "zerocc", "tests.models", "tests.architectures"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def context():
    """The multiprocessing context every test process starts from (forked from the preloaded server)."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)   # read when the server first starts; later calls do nothing
    return forkserver


def _with_environment(environment, target, *args):
    os.environ.clear()
    os.environ.update(environment)
    faulthandler.enable()   # a crash in a rank (SIGSEGV in C++) prints that rank's Python stack
    return target(*args)


def process(target, *args):
    """An unstarted process that runs ``target(*args)`` with this process's environment as it is now."""
    return context().Process(target=_with_environment, args=(dict(os.environ), target, *args))


def _entry(rank, environment, world_size, port, folder, fn, args):
    _with_environment(environment, _rank, rank, world_size, port, folder, fn, args)


def _rank(rank, world_size, port, folder, fn, args):
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
    context()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_entry, args=(dict(os.environ), world_size, free_port(), folder, fn, args),
                           nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
