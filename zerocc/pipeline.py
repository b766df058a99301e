"""The pipeline, top to bottom. Capture produces the graph; each pass rewrites it.

    capture              zerocc/capture.py       whole step -> one functional aten graph, nodes tagged
    shard                passes/shard.py         flat buckets, 1/N per rank; optimizer re-traced on the shards
    insert_collectives   passes/insert_collectives.py   all_gather / reduce_scatter / all_reduce + waits
    schedule             passes/schedule.py      issue collectives early, wait late: prefetch and overlap
    plan_memory          passes/plan_memory.py   lifetimes on the final order -> offsets in pools (graph unchanged)

Every pass is ``(gm, ctx) -> gm`` and writes its decisions onto ``ctx``.
The runner keeps the program after every pass so users can read it
(``step.graph(name)``) and re-raises a failure naming the pass.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import torch.fx as fx

from . import graph as g
from .context import CompileContext
from .errors import PassError
from .passes.insert_collectives import insert_collectives
from .passes.plan_memory import plan_memory
from .passes.schedule import schedule
from .passes.shard import shard

PassFn = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: PassFn


# Gathered (or unreduced) bytes a step may have in flight: one 4 MiB bucket ahead. Measured with
# benchmarks/compare.py's GPT on this machine's gloo (README, "Benchmark"): 8 MiB was no faster
# (within noise) and peaked 3.5 MiB higher per rank (91.1 vs 87.6 MiB at stage 3).
DEFAULT_PREFETCH_BYTES = 4 * 1024 * 1024


def default_pipeline(stage: int, *, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES) -> list[Pass]:
    """The passes for ``stage``, in order. The same list for every stage: the plan differs, not the passes."""
    return [
        Pass("shard", shard),                              # parameters, gradients, optimizer state -> flat per-rank buckets
        Pass("insert_collectives", insert_collectives),    # the communication the buckets need
        Pass("schedule", functools.partial(schedule, prefetch_bytes=prefetch_bytes)),   # prefetch gathers, overlap reductions
        Pass("plan_memory", plan_memory),                  # lifetimes -> offsets in pools; must stay the last pass
    ]


@dataclasses.dataclass
class GraphSnapshot:
    """The program after one pass, printable as Python, with what the pass changed."""
    index: int
    name: str
    code: str
    node_counts: collections.Counter
    changes: dict[str, int]
    note: str = ""

    def __str__(self) -> str:
        changed = ", ".join(f"{'+' if v > 0 else ''}{v} {k}" for k, v in sorted(self.changes.items()))
        if self.index == 0:
            changed = "the whole step, traced"
        elif not changed:
            changed = "no node added or removed"
        header = f"# after pass {self.index:02d} '{self.name}': {changed}"
        if self.note:
            header += f"\n# {self.note}"
        return header + "\n" + self.code


def snapshot(index: int, name: str, gm: fx.GraphModule, before: collections.Counter | None, note: str = "") -> GraphSnapshot:
    counts = g.count_targets(gm)
    changes = {}
    if before is not None:
        for key in set(counts) | set(before):
            delta = counts[key] - before[key]
            if delta:
                changes[key] = delta
    gm.__class__.__name__ = "ZeroccStep"   # print_readable names the class; make_fx leaves '<lambda>'
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    return GraphSnapshot(index, name, code, counts, changes, note)


def run_pipeline(gm: fx.GraphModule, ctx: CompileContext, passes: list[Pass]) -> tuple[fx.GraphModule, list[GraphSnapshot]]:
    phases = collections.Counter(n.meta.get(g.PHASE) for n in gm.graph.nodes if n.op == "call_function")
    note = f"{len(gm.graph.nodes)} nodes: " + ", ".join(f"{phases[p]} {p}" for p in (g.FORWARD, g.BACKWARD, g.OPTIMIZER))
    history = [snapshot(0, "capture", gm, None, note)]
    for index, step in enumerate(passes, start=1):
        try:
            gm = step.run(gm, ctx)
        except Exception as error:
            done = ", ".join(p.name for p in passes[: index - 1]) or "none"
            raise PassError(f"pass '{step.name}' failed (passes run before it: capture, {done}): "
                            f"{type(error).__name__}: {error}") from error
        history.append(snapshot(index, step.name, gm, history[-1].node_counts, ctx.notes.get(step.name, "")))
    return gm, history
