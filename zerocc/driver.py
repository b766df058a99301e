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
import dataclasses
import gc
from typing import Any, Callable

import torch
import torch.fx as fx

from .capture import Captured
from .compile_stats import CompileStats
from .context import CompileContext
from .decisions import ShardPlan
from .options import CompileOptions
from .pipeline import GraphSnapshot, dump_dir_of, run_pipeline


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
               progress: Callable[[str], None] | None = None) -> Compiled:
    """Set up the ``CompileContext`` of ``captured`` and run ``options``' pipeline over its graph."""
    creates_state = any(set(new) - set(old) for old, new in zip(captured.state_keys, captured.new_state_keys))
    stats = CompileStats("plan" if planning else "first step" if creates_state else "steady state",
                         dict(captured.stats.seconds))
    ctx = CompileContext(options.stage, world_size, rank, group_name, optimizer, captured, fake_mode,
                         options.bucket_bytes, previous_plan=previous_plan, traces=traces, planning=planning,
                         precision=options.precision, gather_per_micro_batch=options.gather_per_micro_batch)
    gm, history = run_pipeline(captured.gm, ctx, options.passes(), verify=options.verify,
                               dump_dir=dump_dir_of(options.dump_dir), progress=progress, stats=stats)
    return Compiled(gm, ctx, history, stats)
