"""Hardware profiles: what a rank's device and link do per second, measured or named.

``zerocc.measure_hardware()`` (every rank of the group calls it, as a
collective) times this machine: a square matmul, a large elementwise add,
a loop of tiny ops, and all-gathers of two sizes on the group. The profile
is kept per machine, device, thread count and group size under
``<cache>/hardware/`` (``$ZEROCC_CACHE_DIR``, else ``~/.cache/zerocc``), so
later runs read it instead of measuring; ``refresh=True`` measures again.

``NAMED`` holds profiles of hardware one cannot measure from here, for
``zerocc.plan`` of a job one has not rented: datasheet peaks, which no
program reaches, so what they predict is a lower bound.

The cost model that plays a step's graph against a profile is
``zerocc/analysis/step_time.py``; ``step.predicted_step_time(profile)`` and
``plan.predicted_step_time(profile)`` call it.
"""
from __future__ import annotations

import json
import os
import platform
import time

import torch
import torch.distributed as dist

from .analysis.step_time import HardwareProfile
from .errors import ConfigError
from .runtime.failures import every_rank_has
from .runtime.process_group import Ranks

# datasheet peaks (dense), for planning jobs on hardware that is not here
NAMED = {
    "h100-sxm-bf16": HardwareProfile(
        name="h100-sxm-bf16 (datasheet: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 4 450 GB/s per direction)",
        matmul_flops_per_s=989e12, memory_bytes_per_s=3.35e12, op_overhead_s=5e-6, link_latency_s=10e-6,
        link_bytes_per_s=450e9, overlap=1.0),
    "h100-sxm-tf32": HardwareProfile(
        name="h100-sxm-tf32 (datasheet: 495 TFLOP/s tf32, 3.35 TB/s HBM3, NVLink 4 450 GB/s per direction)",
        matmul_flops_per_s=495e12, memory_bytes_per_s=3.35e12, op_overhead_s=5e-6, link_latency_s=10e-6,
        link_bytes_per_s=450e9, overlap=1.0),
    "a100-sxm-bf16": HardwareProfile(
        name="a100-sxm-bf16 (datasheet: 312 TFLOP/s bf16, 2.0 TB/s HBM2e, NVLink 3 300 GB/s per direction)",
        matmul_flops_per_s=312e12, memory_bytes_per_s=2.0e12, op_overhead_s=5e-6, link_latency_s=10e-6,
        link_bytes_per_s=300e9, overlap=1.0),
}


def profile_of(profile: HardwareProfile | str) -> HardwareProfile:
    """``profile`` itself, or the named profile it names."""
    return named_profile(profile) if isinstance(profile, str) else profile


def named_profile(name: str) -> HardwareProfile:
    if name not in NAMED:
        raise ConfigError(f"no hardware profile named {name!r}; the named ones are {', '.join(NAMED)}, or measure "
                          "this machine's with zerocc.measure_hardware()")
    return NAMED[name]


# torch 2.13 renamed it, and the old name warns (FutureWarning) in the middle of a user's compile under a budget
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def measure_hardware(group=None, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                     refresh: bool = False) -> HardwareProfile:
    """This machine's profile for ``dtype`` on ``device`` (default: CUDA's current device if any, else CPU) and
    ``group`` (default: the default group, if one is initialized). Every rank of the group must call it; every
    rank gets the group's first rank's measurement."""
    device = torch.device(device) if device is not None else \
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    world = dist.get_world_size(group) if group is not None else 1
    path = _cached_path(device, dtype, world)
    found = None
    if not refresh and os.path.exists(path):
        try:
            with open(path) as handle:
                found = HardwareProfile(**json.load(handle))
        except (OSError, ValueError, TypeError):
            found = None
    if group is not None and world > 1:   # every rank reads, or every rank measures (the link is measured together)
        ranks = Ranks(world, dist.get_rank(group), group, group.group_name)
        if not every_rank_has(ranks, found is not None):
            found = None
    if found is not None:
        return found
    profile = _measure(device, dtype, group, world)
    if group is not None and world > 1:   # one profile for every rank (the planner's choices must agree): the first's
        shared = [profile]
        dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0), group=group)
        profile = shared[0]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as handle:
        json.dump(profile.to_dict(), handle, indent=1)
    os.replace(temporary, path)
    return profile


def _cached_path(device: torch.device, dtype: torch.dtype, world: int) -> str:
    root = os.path.expanduser(os.environ.get("ZEROCC_CACHE_DIR") or "~/.cache/zerocc")
    what = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else \
        f"cpu{torch.get_num_threads()}threads"
    name = f"{platform.node()}-{what}-{str(dtype).replace('torch.', '')}-world{world}-torch{torch.__version__}.json"
    return os.path.join(root, "hardware", name)


def _seconds(run, device: torch.device, least: float = 0.05) -> float:
    """Seconds per call of ``run``, repeated until ``least`` seconds have passed (after one warm-up)."""
    run()
    _synchronize(device)
    calls, started = 0, time.perf_counter()
    while True:
        run()
        calls += 1
        _synchronize(device)
        elapsed = time.perf_counter() - started
        if elapsed >= least:
            return elapsed / calls


def _collective_seconds(run, device: torch.device, calls: int) -> float:
    """Seconds per call of the collective ``run``: a count every rank agrees on (a time limit would not be), the
    median of ``calls`` after one warm-up."""
    run()
    _synchronize(device)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(device: torch.device, dtype: torch.dtype, group, world: int) -> HardwareProfile:
    side = 2048 if device.type == "cuda" else 512
    # a generator of its own: the global one is the user's (a compile measuring mid-trace must not move dropout's)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(side, side, device=device, generator=generator).to(dtype)
    b = torch.randn(side, side, device=device, generator=generator).to(dtype)
    matmul = 2 * side ** 3 / _seconds(lambda: torch.mm(a, b), device)
    elements = (64 if device.type == "cuda" else 8) * 2 ** 20
    x, y = torch.ones(elements, device=device, dtype=dtype), torch.ones(elements, device=device, dtype=dtype)
    out = torch.empty_like(x)
    memory = 3 * x.numel() * x.element_size() / _seconds(lambda: torch.add(x, y, out=out), device)
    tiny = torch.ones(1, device=device, dtype=dtype)

    def hundred_tiny_ops():
        for _ in range(100):
            torch.ops.aten.add.Tensor(tiny, tiny)
    overhead = _seconds(hundred_tiny_ops, device) / 100
    latency, bandwidth, overlap = 0.0, float("inf"), 1.0
    if group is not None and world > 1:
        small, large = 256, 2 ** 20   # elements per rank: 1 KiB and 4 MiB of fp32
        times = {}
        for count, calls in ((small, 20), (large, 5)):
            shard = torch.ones(count, device=device)
            full = torch.empty(count * world, device=device)
            times[count] = _collective_seconds(lambda: _all_gather(full, shard, group=group), device,
                                               calls)
        share = (world - 1) / world * 4
        latency = times[small]
        bandwidth = share * (large - small) * world / max(times[large] - times[small], 1e-9)
        if device.type != "cuda":
            overlap = _overlap(a, b, shard, full, group, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"
    return HardwareProfile(
        name=f"measured: {where}, {str(dtype).replace('torch.', '')}, {world} rank(s)"
             f"{' over ' + dist.get_backend(group) if group is not None and world > 1 else ''}",
        matmul_flops_per_s=matmul, memory_bytes_per_s=memory, op_overhead_s=overhead, link_latency_s=latency,
        link_bytes_per_s=bandwidth, overlap=overlap)


def _overlap(a: torch.Tensor, b: torch.Tensor, shard: torch.Tensor, full: torch.Tensor, group,
             device: torch.device, gathers: int = 8, trials: int = 5) -> float:
    """The share of all-gathers' time a matmul loop goes on beside them: 1 when running both takes as long as the
    longer alone, 0 when it takes their sum. ``gathers`` and ``trials`` are the same on every rank (collective
    counts). The median of ``trials`` estimates, each from its three timings taken one after the other: on a
    shared CPU one estimate ranged from 0 to 0.57 across five measurements in a row, and the planner's choice
    between plans that differ in communication turns on it."""
    def compute():
        for _ in range(4 * gathers):
            torch.mm(a, b)

    def communicate():
        return [_all_gather(full, shard, group=group, async_op=True) for _ in range(gathers)]

    def both():
        works = communicate()
        compute()
        for work in works:
            work.wait()
    estimates = []
    for _ in range(trials):
        alone_compute = _seconds(compute, device, 0.1)
        alone_link = _collective_seconds(lambda: [w.wait() for w in communicate()], device, 3)
        together = _collective_seconds(both, device, 3)
        hidden = alone_compute + alone_link - together
        estimates.append(min(1.0, max(0.0, hidden / max(min(alone_compute, alone_link), 1e-9))))
    return sorted(estimates)[len(estimates) // 2]
