"""Which ranks take part: the default process group, one given by the user, or none (world size 1)."""
from __future__ import annotations

import atexit
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Ranks:
    world_size: int
    rank: int
    group: object | None           # a ProcessGroup, or None at world size 1 without one
    group_name: str | None


def resolve(group=None, device: torch.device | None = None) -> Ranks:
    """The ranks of ``group``; initializes the default group from torchrun's environment if needed."""
    if group is None:
        if not dist.is_initialized() and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
            if backend == "nccl":
                # NCCL binds a communicator to the current device: without this every rank would
                # claim cuda:0 ("Duplicate GPU detected") whatever device the model is on
                torch.cuda.set_device(_cuda_device(device))
            try:
                dist.init_process_group(backend=backend)
                atexit.register(_destroy_at_exit)
            except ValueError as error:   # env:// without MASTER_ADDR/MASTER_PORT/RANK: WORLD_SIZE set by hand
                raise ConfigError(
                    f"zerocc.compile: WORLD_SIZE={os.environ['WORLD_SIZE']} is set, so it initialized the default "
                    f"process group from the environment (env://), which failed: {error}\n  fix: launch with "
                    "torchrun (it sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT), call "
                    "dist.init_process_group yourself before zerocc.compile, or unset WORLD_SIZE to train in one "
                    "process") from error
            except (RuntimeError, dist.DistError) as error:
                if not _restarted_on_the_agents_store():
                    raise
                raise ConfigError(
                    f"zerocc.compile: torchrun restarted this job (TORCHELASTIC_RESTART_COUNT="
                    f"{os.environ['TORCHELASTIC_RESTART_COUNT']}) and creating the default process group failed: "
                    f"{str(error).splitlines()[0] if str(error) else type(error).__name__}\n  why: torchrun's c10d "
                    "rendezvous hands every attempt the same store (TORCHELASTIC_USE_AGENT_STORE=True), which still "
                    "holds the addresses the ranks of the failed attempt published: a rank connects to a process "
                    "that is gone (a torch issue, pytorch/pytorch#135712)\n  fix: start torchrun with "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (each attempt then gets a store of its "
                    "own), e.g. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts 1 ... "
                    "(zerocc's docs/launch.md)") from error
        if not dist.is_initialized():
            return Ranks(1, 0, None, None)
        group = dist.group.WORLD
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    return Ranks(world_size, rank, group, group.group_name)


def _destroy_at_exit() -> None:
    """Destroy the default process group zerocc created, at a normal exit, while the interpreter is still whole.

    A script that leaves the group to zerocc never calls ``dist.destroy_process_group()``: gloo's worker
    threads then outlived the interpreter's teardown, and a rank could abort at exit ("terminate called
    without an active exception", exit -6, a failed job to torchrun) after training well (seen once in this
    project's launch tests; pytorch/pytorch#190489). Not after an uncaught exception (``sys.last_value``):
    a rank leaving a failed step may have collectives in flight that a peer never completes, and
    destroying the group would wait for them.
    """
    if getattr(sys, "last_value", None) is None and dist.is_initialized():
        dist.destroy_process_group()


def _restarted_on_the_agents_store() -> bool:
    """Whether torchrun restarted this job with its c10d rendezvous's store shared with the workers."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" \
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index: the model's, or torchrun's LOCAL_RANK for a bare ``cuda``."""
    if device.index is not None:
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
