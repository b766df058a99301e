"""Releases: which slots the step may drop before it ends, and after which node (``release_slots``' marks).

A slot whose value the step replaces (optimizer state, and a parameter
bucket no module parameter views between steps) is not needed once the
step can no longer fail: its old value may die at its last use after the
*release point*, the last collective wait or forward/backward node.
``mark_releases`` tags those placeholders ``graph.RELEASED`` and the point
``graph.RELEASE_POINT``; ``analysis/lifetimes.py`` reads the tags. The
``release_slots`` pass marks the final graph; passes that weigh a rewrite
against the peak with releases (``analysis/live_bytes.py``) mark, measure
and unmark.
"""
from __future__ import annotations

import torch.fx as fx

from .. import graph as g
from .. import decisions
from .aliasing import is_view, writes_an_argument
from ..context import CompileContext


def mark_releases(gm: fx.GraphModule, ctx: CompileContext) -> tuple[list[fx.Node], fx.Node | None]:
    """Tag the releasable placeholders and the release point (see the module docstring); returns both."""
    nodes = list(gm.graph.nodes)
    for node in nodes:
        node.meta.pop(g.RELEASED, None)
        node.meta.pop(g.RELEASE_POINT, None)
    released = releasable(gm, ctx)
    point = release_point(nodes) if released else None
    if not released or point is None:
        return [], None
    for node in released:
        node.meta[g.RELEASED] = True
    point.meta[g.RELEASE_POINT] = True
    return released, point


def releasable(gm: fx.GraphModule, ctx: CompileContext) -> list[fx.Node]:
    """The placeholders ``mark_releases`` tags, where there is a release point: they do not depend on the node order
    (``overlap_updates`` weighs orders and finds them once)."""
    replaced = set(gm.meta.get(g.OUTPUT_SLOTS, ()))
    sharded = _buckets_only_the_step_holds(ctx)
    return [node for node in g.placeholders(gm) if node.meta.get(g.SLOT) in replaced and (
            node.meta.get(g.ROLE) == g.ROLE_STATE or node.meta.get(g.ROLE) == g.ROLE_PARAM
            and node.meta.get(g.SLOT) in sharded)]


def release_point(nodes: list[fx.Node]) -> fx.Node | None:
    """The last collective wait or forward/backward node: the last node that can realistically fail."""
    last = last_computed_on_the_data(nodes)
    waits = [node for node in nodes if node.op == "call_function" and g.is_wait(node)]
    if not waits:
        return last
    position = {node: i for i, node in enumerate(nodes)}
    return waits[-1] if last is None or position[waits[-1]] > position[last] else last


def last_computed_on_the_data(nodes: list[fx.Node]) -> fx.Node | None:
    """The last forward or backward node that computes: after it the user's code on the user's data cannot fail.

    A view (``detach``, ``view``, ``alias``) computes nothing and cannot fail: the loss's ``detach`` that the
    step returns is a forward node the schedule puts at the end of the graph, and counted, it put the release
    point after the optimizer's updates, so every old value lived to the end and ``place_buffers`` wrote no
    update in place (the 5M benchmark GPT's stage-3 plan on 2 ranks: 106.7 MiB where it was 91.1). An op that
    writes into an argument (``mm.out`` into a gradient bucket's slice, ``copy_`` into it) computes, though its
    result aliases what it wrote: counted as a view, the release point fell before the gradients' writes."""
    last = None
    for node in nodes:
        if (node.op == "call_function" and node.meta.get(g.PHASE) in (g.FORWARD, g.BACKWARD)
                and (not is_view(node) or writes_an_argument(node) and not g.is_wait(node))):
            last = node
    return last


def _buckets_only_the_step_holds(ctx: CompileContext) -> set[str]:
    """Bucket slots no module parameter views between steps (a full bucket is viewed at stages 0-2: api._after_step;
    a parameter outside every bucket keeps the tensor it was built from)."""
    plan = ctx.shard_plan
    if plan is None:
        return set()
    return {decisions.bucket_slot(b.index) for b in plan.buckets if plan.holds_shard(b)}
