"""release_slots: let the old parameters and optimizer state die at their last use, as eager's in-place update does.

Requires: the final node order (after ``schedule``), the shard plan.
Establishes: placeholders whose slot the runtime may drop during the step
tagged ``graph.RELEASED``; one node tagged ``graph.RELEASE_POINT``; the
graph generated with ``runtime/release.py``'s ``ReleasingCodeGen``
(``forward(self, arguments, release_slots)``). ``plan_memory`` reads the
tags: a released slot lives to its last use or the release point, whichever
is later, instead of to the end of the step. Nothing else changes.

Why: the step is functional, so without this the optimizer phase holds the
old and the new state (AdamW: parameters, exp_avg, exp_avg_sq) at once, at
the end of the step, usually its peak once activations are checkpointed.

Nothing lost on failure: a step that raises leaves every slot as it was,
because the runtime rebinds slots only after the call returns. Releasing an
old value early would break that if what follows could fail, so the release
point is the last node that can realistically fail: the later of the step's
last collective wait (a dead or slow rank) and its last forward or backward
node (the user's code on the user's data: an index out of range). After it
only the optimizer's update runs: local, elementwise compute on shapes
known at compile time. Should that still fail (out of memory), the runtime
says which slots were lost (``runtime/program.py``).

Released: optimizer state, and parameter buckets no module parameter views
(stage 3, and the masters of mixed precision at stages 1-2; at stages 0-2 the
user's module views the full buckets between steps, so those stay alive
anyway and are not marked). Slots read but not replaced (frozen parameters,
the learning rate, the loss scale) are never released.
"""
from __future__ import annotations

import torch.fx as fx

from .. import graph as g
from .. import decisions
from ..context import CompileContext
from ..runtime.release import ReleasingCodeGen


def release_slots(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Mark the slots the runtime may drop once the step can no longer fail, and where; generate the program so."""
    released, point = mark_releases(gm, ctx)
    if not released:
        ctx.notes["release_slots"] = "no slot replaced by the step can be released early"
        return gm
    gm.graph.set_codegen(ReleasingCodeGen())
    gm.recompile()
    nbytes = sum(g.nbytes(node) for node in released)
    ctx.notes["release_slots"] = (f"{len(released)} slots ({nbytes / 1e6:.1f} MB) die at their last use after "
                                  f"{point.name} (the last node that can fail), not at the end of the step")
    return gm


def mark_releases(gm: fx.GraphModule, ctx: CompileContext) -> tuple[list[fx.Node], fx.Node | None]:
    """Tag the releasable placeholders and the release point (see the module docstring); returns both."""
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta.pop(g.RELEASED, None)
        node.meta.pop(g.RELEASE_POINT, None)
    replaced = set(gm.meta.get(g.OUTPUT_SLOTS, ()))
    sharded = _buckets_only_the_step_holds(ctx)
    released = [node for node in g.placeholders(gm) if node.meta.get(g.SLOT) in replaced and (
                node.meta.get(g.ROLE) == g.ROLE_STATE or node.meta.get(g.ROLE) == g.ROLE_PARAM
                and node.meta.get(g.SLOT) in sharded)]
    point = release_point(nodes)
    if not released or point is None:
        return [], None
    for node in released:
        node.meta[g.RELEASED] = True
    point.meta[g.RELEASE_POINT] = True
    return released, point


def release_point(nodes: list[fx.Node]) -> fx.Node | None:
    """The last collective wait or forward/backward node: the last node that can realistically fail."""
    last = None
    for node in nodes:
        if node.op == "call_function" and (g.is_wait(node) or node.meta.get(g.PHASE) in (g.FORWARD, g.BACKWARD)):
            last = node
    return last


def _buckets_only_the_step_holds(ctx: CompileContext) -> set[str]:
    """Bucket slots no module parameter views between steps (a full bucket is viewed at stages 0-2: api._after_step;
    a parameter outside every bucket keeps the tensor it was built from)."""
    plan = ctx.shard_plan
    if plan is None:
        return set()
    return {decisions.bucket_slot(b.index) for b in plan.buckets if plan.holds_shard(b)}
