"""The compile driver: a captured step and its options in, the pipeline's graph and decisions out.

One function for both entry points: ``zerocc.compile`` runs it for every
new batch signature (``CompiledStep``, then builds a ``Program`` of the
graph), ``zerocc.plan`` for every stage and world size it plans (on a copy
of one capture, fake tensors only). Capture happens before it, in the
caller: a step traces with its live optimizer state, a plan once with fake
state.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .capture import Captured
from .compile_stats import CompileStats
from .context import CompileContext
from .decisions import ShardPlan
from .device_budget import DeviceBudget
from .errors import MemoryBudgetError
from .options import CompileOptions
from .pipeline import GraphSnapshot, copy_graph, dump_dir_of, run_pipeline


# Under a memory budget that recomputation cannot meet, buckets are halved down to this size (see run_passes).
MIN_BUDGET_BUCKET_BYTES = 512 * 1024

# Allocations between young-generation collections while compiling (Python's default: 700).
COMPILE_GC_THRESHOLD = 50_000


@contextlib.contextmanager
def fewer_collections():
    """Python's cycle collector runs rarely while a step compiles or a plan is made; as it was after.

    Tracing and the passes allocate millions of small objects (fx nodes, meta
    dicts, fake tensors) that mostly live until the compile ends, and the
    collector, started every 700 allocations, kept scanning them: 2.1 of
    15.5 s of the 7.5B plan, about a tenth of a small model's compile. At
    50,000 it took 0.3 s of that plan and the same peak RSS
    (docs/performance.md). Collection still happens, less often; the
    thresholds the user set come back when the compile ends or fails.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], COMPILE_GC_THRESHOLD), *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@dataclasses.dataclass
class Compiled:
    """What the pipeline made of one capture: the final graph, the decisions on ``ctx``, every pass's snapshot."""
    gm: fx.GraphModule
    ctx: CompileContext
    history: list[GraphSnapshot]
    stats: CompileStats   # seconds per phase: capture's parts, then each pass (zerocc/compile_stats.py)


def run_passes(captured: Captured, fake_mode: Any, options: CompileOptions, optimizer: torch.optim.Optimizer, *,
               world_size: int, rank: int, group_name: str | None, previous_plan: ShardPlan | None = None,
               planning: bool = False, traces: dict | None = None,
               progress: Callable[[str], None] | None = None, keep_capture: bool = False) -> Compiled:
    """Set up the ``CompileContext`` of ``captured`` and run ``options``' pipeline over its graph.

    The passes rewrite the graph they are given: ``keep_capture`` (a Planner reuses one capture for every
    plan) runs them on a copy and leaves ``captured.gm`` as it was.

    Under a ``memory_budget`` that no recomputation meets with buckets of ``options.bucket_bytes``,
    the pipeline runs again on a fresh copy of the capture with buckets (and ``prefetch_bytes``) half the size, down to
    ``MIN_BUDGET_BUCKET_BYTES``, as long as the smallest reachable peak keeps falling: at stage 3 the
    step's floor holds a few gathered buckets and a few gradient buckets besides the model states
    (the 5M benchmark GPT on 2 ranks: 67.1 MB with 4 MiB buckets, 57.4 MB with 1 MiB), so smaller
    buckets reach budgets recomputation alone cannot. A budget that fits at the user's size keeps it
    (smaller buckets mean more collectives); the size chosen is ``ShardPlan.bucket_bytes``. On one rank
    the buckets are not shrunk: nothing is gathered there. A later
    program of the step (``previous_plan``) keeps the first one's buckets. Every rank raises the same
    ``MemoryBudgetError`` (place_remat decides on the highest peak over ranks), so every rank retries.

    Without a ``memory_budget``, the device's (``options.device_budget``, ``zerocc/device_budget.py``):
    ``place_remat`` takes the fastest plan unmeasured, and when the final plan's peak (the highest over
    ranks) does not fit the device, the pipeline runs again with the device's bytes as ``memory_budget``. On CPU
    the budget is the default plan's peak (``device_budget.DEFAULT_PLAN_PEAK``): ``place_remat`` measures that
    plan and searches under it in the one run.
    """
    creates_state = any(set(new) - set(old) for old, new in zip(captured.state_keys, captured.new_state_keys))
    stats = CompileStats("plan" if planning else "first step" if creates_state else "steady state",
                         dict(captured.stats.seconds))
    # on one rank nothing is gathered and the floor does not fall with the buckets (the test GPT: equal)
    device = options.device_budget if options.memory_budget is None else None
    # the bytes the final plan is checked against: the device's, or (at the default plan's peak) another rank's
    device_bytes = None if device is None else device.bytes if device.bytes is not None else device.also_under
    shrinkable = options.memory_budget is not None and previous_plan is None and world_size > 1
    attempt, refused = options, []
    while True:   # a retry needs the capture as it was, so shrinkable compiles run on copies too
        # the default plan's peak as the budget (device.bytes None, CPU) is searched in place_remat: no retry
        retries = shrinkable or (device is not None and device_bytes is not None and attempt.memory_budget is None)
        working = dataclasses.replace(captured, gm=copy_graph_module(captured.gm)) \
            if retries or keep_capture else captured
        ctx = CompileContext(attempt.stage, world_size, rank, group_name, optimizer, working, fake_mode,
                             attempt.bucket_bytes, previous_plan=previous_plan, traces=traces, planning=planning,
                             precision=attempt.precision, gather_per_micro_batch=attempt.gather_per_micro_batch)
        try:
            dumps = dump_dir_of(attempt.dump_dir, rank, 1 if planning else world_size)   # a plan is one process
            gm, history = run_pipeline(working.gm, ctx, attempt.passes(), verify=attempt.verify, dump_dir=dumps,
                                       progress=progress, stats=stats)
            if device is not None and ctx.memory_plan is not None:   # (plan_memory disabled: nothing to check)
                peak = max(ctx.from_every_rank(final_peak(ctx, attempt.memory_pools)))
                if attempt.memory_budget is None and device_bytes is not None and peak > device_bytes:
                    if progress:
                        progress(f"the plan's peak ({peak / 1e6:.2f} MB) does not fit the device "
                                 f"({device_bytes / 1e6:.2f} MB, {device.source}): planning against it")
                    attempt = dataclasses.replace(attempt, memory_budget=device_bytes)
                    shrinkable = previous_plan is None and world_size > 1
                    continue
                _record_device_budget(ctx, device, peak)
            return Compiled(gm, ctx, history, stats)
        except MemoryBudgetError as error:
            if device is not None:
                error = MemoryBudgetError(
                    f"the step does not fit what the device offers ({device.source}), with no memory_budget "
                    f"given: {error}", budget_bytes=error.budget_bytes, smallest_peak_bytes=error.smallest_peak_bytes)
            refused.append((attempt.bucket_bytes, error))
            falling = len(refused) < 2 or error.smallest_peak_bytes < refused[-2][1].smallest_peak_bytes
            if not shrinkable or not falling or attempt.bucket_bytes // 2 < MIN_BUDGET_BUCKET_BYTES:
                raise _lowest_floor(refused) from None
            if progress:
                progress(f"memory_budget not met with buckets of {size_text(attempt.bucket_bytes)} (smallest "
                         f"peak {error.smallest_peak_bytes / 1e6:.2f} MB): compiling again with buckets and "
                         f"prefetch half as large")
            # the prefetch bound halves with the buckets: it counts bytes, so it would otherwise keep
            # twice as many of the smaller buckets in flight, and the floor would not fall
            attempt = dataclasses.replace(attempt, bucket_bytes=attempt.bucket_bytes // 2,
                                          prefetch_bytes=attempt.prefetch_bytes // 2)


def final_peak(ctx: CompileContext, memory_pools: bool) -> int:
    """The final memory plan's peak: the pooled layout's with memory pools, else the live peak (as place_remat
    measures a plan)."""
    plan = ctx.memory_plan
    return plan.planned_peak_bytes if memory_pools else plan.live_peak_bytes


def _record_device_budget(ctx: CompileContext, device: DeviceBudget, peak: int) -> None:
    """Say on the remat plan that the device's budget was planned against, with the final peak."""
    plan = ctx.remat_plan
    if plan is None:
        return
    if plan.evaluations == 0 and not plan.recomputed:   # unmeasured: the fastest plan, nothing recomputed
        plan = dataclasses.replace(plan, peak_before_bytes=peak, peak_bytes=peak)
    ctx.remat_plan = dataclasses.replace(plan, budget_source=device.source)


def _lowest_floor(refused: list[tuple[int, MemoryBudgetError]]) -> MemoryBudgetError:
    """The refusal whose smallest reachable peak is the lowest, saying which bucket sizes were tried."""
    size, best = min(refused, key=lambda item: item[1].smallest_peak_bytes)
    if len(refused) == 1:
        return best
    tried = ", ".join(f"{size_text(b)}: {e.smallest_peak_bytes:,} bytes" for b, e in refused)
    return MemoryBudgetError(f"{best}\n  with buckets of {size_text(size)}; the smallest peak per bucket size "
                             f"tried: {tried}", budget_bytes=best.budget_bytes,
                             smallest_peak_bytes=best.smallest_peak_bytes)


def size_text(nbytes: int) -> str:
    """A bucket size as people write it: '4 MiB', '512 KiB'."""
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new graph module with the same nodes and meta, so a pipeline can rewrite it and keep ``gm`` intact."""
    new = _LazyGraphModule(gm, copy_graph(gm.graph))   # its Python is made only if read (pipeline.deferring_codegen)
    new.meta = {key: copy.copy(value) for key, value in gm.meta.items()}
    return new
