"""The memory budget a rank has when the user gives none: what its device offers.

``zerocc.compile(..., memory_budget=None)`` (the default) does not mean "no
limit": the step's peak is planned against what the device has, read at each
compile, so the compiler makes the memory/time trade itself:

- **CUDA**: the device's free memory at compile time less ``CUDA_MARGIN``
  (the CUDA context, NCCL's buffers, what the allocator cannot reuse), plus
  the bytes this step takes over: the model's parameters and buffers and the
  optimizer's state before the first step (the plan's slots replace them),
  the step's own slots and arenas at later compiles.
- **CPU**: the peak of the default plan (the default schedule, nothing
  recomputed; ``DEFAULT_PLAN_PEAK``). Host memory is shared with every other
  process on the machine and the page cache, so what is free says little;
  the default plan's peak is what zerocc took before budgets existed, and
  within it the trade is still made: at stage 3 across ranks a plan that
  keeps every forward gather for backward and recomputes a few cheap ops
  can peak lower and run faster (the 5M benchmark GPT on 2 gloo ranks: 14
  instead of 19 collectives, a lower peak, about 7% faster: 0.93x the
  default's step time in
  ``benchmarks/results/frontier_cpu-gloo-2rank_2026-12-07.md``), and
  ``place_remat`` takes it when the cost model does not predict it slower.
- **``$ZEROCC_DEVICE_MEMORY``** (bytes per rank) overrides both: on CPU it
  is how a user gives the compiler room to spend.

With a device budget in bytes the step is planned for speed first (``place_remat``):
at stage 3 across ranks every bucket's forward gather is kept for backward,
which then gathers nothing; if that plan does not fit, the default schedule;
if that does not fit either, recomputation, exactly as under a
``memory_budget`` the user gave (``driver.run_passes`` decides from the
final plan's peak, the highest over ranks). With the default plan's peak
as the budget (CPU), ``place_remat`` measures the default plan first (the
highest peak over ranks) and searches under it (its module docstring);
nothing is compiled again.
"""
from __future__ import annotations

import os
from typing import Iterable, NamedTuple

import torch

from .errors import ConfigError

# The share of a CUDA device's free memory left unplanned.
CUDA_MARGIN = 0.10

ENVIRONMENT = "ZEROCC_DEVICE_MEMORY"


class DeviceBudget(NamedTuple):
    """Bytes per rank the step's peak may reach, and where the number comes from (said in reports and errors).
    ``bytes`` None: the default plan's peak, which only ``place_remat`` measures (CPU); ``also_under``: with it, a
    number another rank's device offers (``$ZEROCC_DEVICE_MEMORY`` set on some ranks only), which the final plan
    must meet as well: the smallest of what the ranks offer is the smaller of the two, known only once the default
    plan's peak is."""
    bytes: int | None
    source: str
    also_under: int | None = None


# CPU's budget: the default plan's peak, measured by place_remat (module docstring)
DEFAULT_PLAN_PEAK = DeviceBudget(None, "CPU: the default plan's peak (host memory is shared; zerocc/device_budget.py)")


def device_budget(device: torch.device, held: Iterable[torch.Tensor] = (), free_bytes: int | None = None
                  ) -> DeviceBudget:
    """What ``device`` offers this rank's step (CPU: ``DEFAULT_PLAN_PEAK``).

    ``held`` are tensors on the device that the step's own tensors replace or are (counted once per
    storage); ``free_bytes`` stands in for the device's report (tests).
    """
    given = os.environ.get(ENVIRONMENT)
    if given:
        try:
            value = int(given)
        except ValueError:
            value = 0
        if value <= 0:
            raise ConfigError(f"${ENVIRONMENT}={given!r}: give the bytes per rank the device offers, as a positive "
                              f"int (e.g. {8 * 2**30} for 8 GiB), or unset it")
        return DeviceBudget(value, f"${ENVIRONMENT}")
    if device.type != "cuda":
        return DEFAULT_PLAN_PEAK
    if free_bytes is None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
    taken_over = held_bytes(held, device)
    return DeviceBudget(int(free_bytes * (1 - CUDA_MARGIN)) + taken_over,
                        f"free memory of {device} at compile time less {CUDA_MARGIN:.0%}, plus the "
                        f"{taken_over / 1e6:.1f} MB the step takes over")


def held_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` on ``device``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.device.type == device.type and not tensor.is_meta \
                and (device.index is None or tensor.device.index == device.index):
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
