"""Live bytes: how many bytes of planned buffers are alive at each position of a graph's current order.

An analysis over ``analysis/lifetimes.py`` that the passes moving or
rewriting nodes under the peak read (``overlap_updates``,
``scatter_by_all_to_all``, ``gradients_into_buckets``): each keeps a
rewrite only if the peak does not grow.
"""
from __future__ import annotations

import torch.fx as fx

from .. import graph as g
from ..memory_plan import POOL_OF_ROLE
from ..context import CompileContext
from .lifetimes import Storages, buffer_lifetimes
from .releases import mark_releases


def live_peaks(gm: fx.GraphModule, ctx: CompileContext, storages: Storages | None = None) -> tuple[int, int]:
    """The planned live peak with old slot values kept to the end, and with ``release_slots``' releases.

    Moving an update before the last wait also moves its old state's last
    use before ``release_slots``' release point (the last wait), so those
    values can no longer die at their last use: with releases, the optimizer
    phase can become the peak (under a ``memory_budget``). The move is kept
    only if neither peak grows, so it is safe with the pass and without it.
    ``storages``: ``lifetimes.storages_of(gm)`` before a reordering (None: found here).
    """
    return live_peaks_and_bytes(gm, ctx, storages)[0]


def live_peaks_and_bytes(gm: fx.GraphModule, ctx: CompileContext,
                         storages: Storages | None = None) -> tuple[tuple[int, int], list[int]]:
    """``live_peaks`` and ``live_bytes`` from one lifetime analysis (the passes that weigh rewrites read both)."""
    released, _ = mark_releases(gm, ctx)
    try:
        lifetimes = buffer_lifetimes(gm, storages)
    finally:
        for node in gm.graph.nodes:
            node.meta.pop(g.RELEASED, None)
            node.meta.pop(g.RELEASE_POINT, None)
    # one analysis for both: without the marks, a released slot lives to the end like every other slot
    names, last = {node.name for node in released}, len(gm.graph.nodes) - 1
    kept = [(size, start, last if name in names else end) for name, _, size, start, end, _ in lifetimes]
    peaks = peak_bytes(kept), peak_bytes((size, start, end) for _, _, size, start, end, _ in lifetimes)
    return peaks, _by_position(kept, len(gm.graph.nodes))


def live_bytes(gm: fx.GraphModule, *, persistent: bool = True) -> list[int]:
    """Bytes of planned buffers alive at each position of ``gm``'s current order (old slot values kept to the end).

    Passes that weigh several rewrites against the peak (scatter_by_all_to_all,
    gradients_into_buckets) take this once and add each chosen rewrite's
    change to it, instead of analysing lifetimes again per rewrite.
    ``persistent=False``: the buffers of the other pools only (``memory_plan.POOLS``), what ``place_buffers``'
    arena holds at most (storages with no ``out=`` form are among them, left to the allocator).
    """
    return _by_position([(size, start, end) for _, role, size, start, end, _ in buffer_lifetimes(gm)
                         if persistent or POOL_OF_ROLE[role] != "persistent"], len(gm.graph.nodes))


def _by_position(lifetimes, length: int) -> list[int]:
    """Bytes alive at each of ``length`` positions, of (bytes, start, end) lifetimes."""
    change = [0] * (length + 1)
    for size, start, end in lifetimes:
        change[start] += size
        change[end + 1] -= size
    live, total = [], 0
    for delta in change[:length]:
        total += delta
        live.append(total)
    return live


def peak_bytes(lifetimes) -> int:
    """The most bytes alive at one position, of (bytes, start, end) lifetimes."""
    change: dict[int, int] = {}
    for size, start, end in lifetimes:
        change[start] = change.get(start, 0) + size
        change[end + 1] = change.get(end + 1, 0) - size
    live, peak = 0, 0
    for index in sorted(change):
        live += change[index]
        peak = max(peak, live)
    return peak
