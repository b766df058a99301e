"""Run a function on N gloo ranks (processes on this machine) and collect what each returns.

Ranks are forked from one server process that has already imported torch and
zerocc (multiprocessing's "forkserver" with a preload): a rank starts in a
tenth of a second, where a spawned one re-imports torch (5-15 s on a busy
2-core machine, for each of the suite's ~60 multi-rank tests). Each rank is
given the caller's environment as it is at the call, as spawn would.

Ranks meet through a file store in the run's own temporary folder, not a TCP
port: a port found free by one pytest worker could be taken by the other
before rank 0 binds it.

Every run has a deadline (``timeout``, 600 s unless the call says otherwise;
gloo's own is 30 minutes). Past it, each rank still running dumps its Python
stack into a file (``faulthandler`` on SIGUSR1, which works while the rank
waits inside C++), is killed, and the run fails naming the ranks that were
stuck and where. A rank that raises fails the run with its traceback; a rank
that exits without a result fails it too.
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import socket
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

PRELOAD = ["torch", "torch.distributed", "zerocc", "tests.models", "tests.architectures"]

DEFAULT_TIMEOUT = 600.0   # seconds; the slowest multi-rank test takes about 2 minutes on a quiet 2-core machine
STACK_DUMP_WAIT = 5.0     # seconds a stuck rank is given to write its stack before it is killed
FAILURE_GRACE = 10.0      # seconds the other ranks are given to finish (or fail too) after one rank fails


# multi-rank runs started in this process (world size 2 or more): tests/conftest.py checks that a test which
# starts one is marked multirank
multirank_runs = 0


class RanksFailed(AssertionError):
    """A rank raised, died, or missed the deadline: the message says which rank and where."""


def free_port() -> int:
    """A port free now (for tests that need a TCP rendezvous, e.g. NCCL across spawned processes)."""
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


def init_process_group(rank: int, world_size: int, folder: str) -> None:
    """Join the run's gloo group through a file store in ``folder`` (shared by the ranks, new per run)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method="file://" + os.path.join(folder, "rendezvous"),
                            rank=rank, world_size=world_size)


def _paths(folder, rank):
    return {kind: os.path.join(folder, f"rank{rank}.{kind}") for kind in ("pt", "error", "stack")}


def _rank(rank, world_size, folder, fn, args):
    paths = _paths(folder, rank)
    stack_file = open(paths["stack"], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)   # the parent asks at the deadline
    torch.set_num_threads(1)
    try:
        init_process_group(rank, world_size, folder)
        result = fn(rank, world_size, *args)
        torch.save(result, paths["pt"])
        dist.barrier()   # no rank tears gloo down while a peer may still be talking to it
    except BaseException:
        with open(paths["error"], "w") as file:
            file.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stack_summary(path: str, lines: int = 30) -> str:
    """The top of a rank's dumped stack: each Python thread's frames, innermost first, as faulthandler writes them."""
    text = open(path).read().strip() if os.path.exists(path) else ""
    if not text:
        return "      (no stack written: the rank did not answer SIGUSR1)"
    frames = [line.strip() for line in text.splitlines()
              if "/multiprocessing/" not in line and '"<string>"' not in line]   # how every rank starts
    return "\n".join("      " + line for line in frames[:lines])


def _wait(processes, deadline):
    """Wait until every process ended, one failed (then briefly for the rest), or the deadline passed."""
    failed_at = None
    while any(p.is_alive() for p in processes):
        now = time.monotonic()
        if now >= deadline or (failed_at is not None and now >= failed_at + FAILURE_GRACE):
            return
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = now
        time.sleep(0.05)


def _stop(processes, folder):
    """Dump the stacks of the ranks still running, kill them; returns their ranks."""
    stuck = [rank for rank, p in enumerate(processes) if p.is_alive()]
    for rank in stuck:
        os.kill(processes[rank].pid, signal.SIGUSR1)
    stacks = [_paths(folder, rank)["stack"] for rank in stuck]
    end = time.monotonic() + STACK_DUMP_WAIT
    while time.monotonic() < end and not all(os.path.exists(path) and os.path.getsize(path) > 0 for path in stacks):
        time.sleep(0.05)
    time.sleep(0.2)   # let the last lines of a dump reach the file
    for rank in stuck:
        processes[rank].kill()
        processes[rank].join()
    return stuck


def _count(world_size):
    global multirank_runs
    multirank_runs += world_size > 1


def run(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT):
    """``fn(rank, world_size, *args)`` on every rank; returns the list of results, by rank.

    Raises ``RanksFailed`` when a rank raises, exits without a result, or is
    still running ``timeout`` seconds after the start (its stack in the message).
    """
    _count(world_size)
    context()
    with tempfile.TemporaryDirectory() as folder:
        processes = [process(_rank, rank, world_size, folder, fn, args) for rank in range(world_size)]
        try:
            for p in processes:
                p.start()
            started = time.monotonic()
            _wait(processes, started + timeout)
            elapsed = time.monotonic() - started
            stuck = _stop(processes, folder)
        finally:   # interrupted (Ctrl-C, pytest-timeout): no rank outlives the test
            for p in processes:
                if p.is_alive():
                    p.kill()
                    p.join()
        problems = []
        for rank, p in enumerate(processes):
            paths = _paths(folder, rank)
            if rank in stuck:
                problems.append(f"rank {rank} was still running {elapsed:.0f} s after the start "
                                f"(deadline {timeout:g} s; killed); its stack:\n"
                                + _stack_summary(paths["stack"]))
            elif os.path.exists(paths["error"]):
                with open(paths["error"]) as file:
                    problems.append(f"rank {rank} raised:\n" + file.read().rstrip())
            elif p.exitcode != 0 or not os.path.exists(paths["pt"]):
                problems.append(f"rank {rank} exited with code {p.exitcode} and returned no result")
        if problems:
            raise RanksFailed(f"{fn.__name__} on {world_size} ranks failed:\n" + "\n".join(problems))
        return [torch.load(_paths(folder, rank)["pt"], weights_only=False) for rank in range(world_size)]


def _tolerant_entry(rank, world_size, folder, fn, args):
    """A rank of ``run_tolerant``: its result saved, then out at once."""
    torch.set_num_threads(1)
    init_process_group(rank, world_size, folder)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    os._exit(0)   # no destroy_process_group: its peers may be gone


def run_tolerant(fn, world_size, *args, limit=180):
    """Like ``run``, but a rank may exit early (no barrier, no teardown): returns (results or None, exit codes), by rank."""
    _count(world_size)
    with tempfile.TemporaryDirectory() as folder:
        processes = [process(_tolerant_entry, r, world_size, folder, fn, args)
                     for r in range(world_size)]
        for p in processes:
            p.start()
        deadline = time.monotonic() + limit
        for p in processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in processes:
            if p.is_alive():    # hung: the failure a tolerant run exists to rule out
                p.kill()
                p.join()
        results = []
        for rank in range(world_size):
            file = os.path.join(folder, f"rank{rank}.pt")
            results.append(torch.load(file, weights_only=False) if os.path.exists(file) else None)
        return results, [p.exitcode for p in processes]


def record_group_at_exit(path: str) -> None:
    """Whether the default process group (zerocc.compile made it) is still there as the interpreter exits: what the
    torchrun-launched scripts (tests/launched*.py, which never destroy it) register with ``atexit``."""
    with open(path, "w") as file:
        file.write("initialized" if dist.is_initialized() else "destroyed")
