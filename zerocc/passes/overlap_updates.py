"""overlap_updates: run each bucket's optimizer update while the reductions issued after its own are in flight.

Requires: ``insert_collectives`` (each collective has one wait); runs after
``schedule``, whose placement of collectives it keeps (it moves none). Establishes: an ``UpdateOrder`` on ``ctx`` and a node order
in which, after the step's last gradient reduction is issued, the update of
each bucket runs in the order its reduction was issued, each just after its
reduction's wait, and before the wait of the last reduction.

Why: backward issues the buckets' reductions last block first, but the
optimizer, traced in parameter order, updated the first bucket first, whose
reduction is issued last, so the step sat in that wait with every other
bucket's reduced gradient already there (about 15 ms of a 650 ms step on the
benchmark GPT, the longest wait of the step with the first gather). Now the
other buckets' updates run while it is in flight. They are not moved further
up, into backward, as each reduction arrives: backward's compute already
hides the reductions issued during it (their waits took under 1 ms each),
every update moved there would be one fewer to hide the last reduction,
and new optimizer state would be alive beside the old one through the
activations' peak.

What moves: after the last gradient reduction is issued (the anchor), a node
belongs to bucket i's update when it reads, directly or not, the wait of
reduction i and of no other reduction (the averaging division, the
optimizer's slices of the gradient shard, the update of every piece). It
moves with the nodes after the anchor it needs that read no reduction (the
step counters, the parameter pieces), and with reduction i's wait when that
came later. A node that needs every bucket (a global gradient norm under
``clip_grad_norm``, loss scaling's found-inf flag) depends on every reduction
and stays where it is, and so does everything after it. Nothing moves into
backward, so no tensor's lifetime grows into the step's peak; the pass checks
that the planned live peak did not grow, counted both with old slot values
kept to the end and with ``release_slots``' releases (a moved update reads
its old state before the release point, so that state can no longer die
early), and otherwise leaves the graph as it was. Moving a node earlier past nodes it does not read is exact (same ops,
same inputs), so the step is bit for bit the same; random ops do not move.

Ranks: the anchor and the reductions are a function of backward, the same on
every rank; the updates differ by rank (each owns other pieces), but only
compute and waits move, never a collective, so every rank issues the same
collectives in the same order.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph as g
from ..context import CompileContext
from ..decisions import UpdateOrder
from ..analysis.lifetimes import storages_of
from ..analysis.live_bytes import live_peaks
from ..graph import wait_of


def overlap_updates(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Move each bucket's optimizer update to just after its reduction's wait, in reduction issue order."""
    graph = gm.graph
    reductions = [n for n in graph.nodes if is_gradient_reduction(n)]
    if len(reductions) < 2:
        ctx.update_order = UpdateOrder((), 0)
        ctx.notes["overlap_updates"] = "fewer than 2 gradient reductions: nothing to overlap"
        return gm
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    anchor = reductions[-1]
    while anchor.next.op == "call_function" and g.is_collective(anchor.next):
        anchor = anchor.next    # collectives issued together stay together
    reads = _reductions_read(nodes, [wait_of(r) for r in reductions])
    tail = nodes[position[anchor] + 1:]
    inside = set(tail)
    roots: dict[int, list[fx.Node]] = {}   # by reduction: the tail nodes that read it and no other
    for node in tail:
        if len(reads[node]) == 1:
            roots.setdefault(next(iter(reads[node])), []).append(node)

    moved, buckets = [], []
    taken: set[fx.Node] = set()
    for index, reduction in enumerate(reductions[:-1]):
        group = _update_of(index, wait_of(reduction), roots.get(index, []), inside, reads, position, taken)
        if not any(n.meta.get(g.PHASE) == g.OPTIMIZER for n in group):
            continue
        group.sort(key=position.get)
        moved.extend(group)
        taken.update(group)
        buckets.append(reduction.meta.get(g.BUCKET))
    if not moved:
        ctx.update_order = UpdateOrder((), 0)
        ctx.notes["overlap_updates"] = "no update to move"
        return gm

    # the move changes the order only: which storages each node keeps alive is found once, for both counts
    storages = storages_of(gm)
    peaks_before = live_peaks(gm, ctx, storages)
    cursor = anchor
    for node in moved:
        cursor.append(node)
        cursor = node
    graph.lint()
    peaks_after = live_peaks(gm, ctx, storages)
    peak_before, peak_after = peaks_before[0], peaks_after[0]
    if any(after > before for before, after in zip(peaks_before, peaks_after)):
        _restore(graph, nodes)
        ctx.update_order = UpdateOrder((), 0)
        ctx.notes["overlap_updates"] = (f"not moved: the planned live peak would grow from {peaks_before[0]:,} to "
                                        f"{peaks_after[0]:,} bytes (old state kept to the end) or from "
                                        f"{peaks_before[1]:,} to {peaks_after[1]:,} (released by release_slots)")
        return gm
    gm.recompile()
    ctx.update_order = UpdateOrder(tuple(buckets), len(moved))
    ctx.notes["overlap_updates"] = (f"{len(buckets)} bucket updates ({len(moved)} nodes) moved before the wait "
                                    f"of the last reduction, in reduction issue order; planned live peak "
                                    f"{peak_before:,} -> {peak_after:,} bytes")
    return gm


def is_gradient_reduction(node: fx.Node) -> bool:
    """A bucket's gradient reduction (reduce-scatter, or all-reduce at stage 0), not a norm's or a flag's."""
    return (g.is_reduce_scatter(node) or g.is_all_reduce(node)) and node.meta.get(g.BUCKET) is not None


def _reductions_read(nodes: list[fx.Node], waits: list[fx.Node]) -> dict[fx.Node, frozenset[int]]:
    """For each node, the reductions (by issue order) whose waits it reads, directly or through other nodes."""
    index_of = {wait: i for i, wait in enumerate(waits)}
    reads: dict[fx.Node, frozenset[int]] = {}
    for node in nodes:
        found = frozenset().union(*(reads[a] for a in node.all_input_nodes))
        reads[node] = found | {index_of[node]} if node in index_of else found
    return reads


def _may_move(node: fx.Node) -> bool:
    """Compute: not a collective, not a wait, not a random op, not the output."""
    if node.op != "call_function" or g.is_collective(node) or g.is_wait(node):
        return False
    return torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


def _update_of(index: int, wait: fx.Node, roots: list[fx.Node], inside: set[fx.Node],
               reads: dict[fx.Node, frozenset[int]], position: dict[fx.Node, int],
               taken: set[fx.Node]) -> list[fx.Node]:
    """The tail nodes (``inside``) that read reduction ``index`` and no other, with the tail nodes they need.

    A tail node may move with the update when it reads no other reduction, may
    move (or is the reduction's own wait), and every tail node it reads may
    move too or has moved already (``taken``). ``roots`` are the tail nodes
    that read reduction ``index`` alone: only they and what they read are
    looked at, not the whole tail for every bucket (which grew with the
    square of the depth).
    """
    candidates, stack = set(), [n for n in roots if n not in taken]
    while stack:   # what the roots read in the tail, reading no other reduction: the only nodes that may move
        node = stack.pop()
        if node in candidates:
            continue
        candidates.add(node)
        stack.extend(a for a in node.all_input_nodes
                     if a in inside and a not in taken and a not in candidates and reads[a] <= {index})
    movable: set[fx.Node] = set()
    for node in sorted(candidates, key=position.__getitem__):   # graph order: a node's inputs are decided first
        if (node is wait or _may_move(node)) and all(a not in inside or a in taken or a in movable
                                                   for a in node.all_input_nodes):
            movable.add(node)
    group, stack = set(), [n for n in roots if n in movable]
    while stack:
        node = stack.pop()
        if node in group:
            continue
        group.add(node)
        stack.extend(a for a in node.all_input_nodes if a in movable)
    return list(group)


def _restore(graph: fx.Graph, order: list[fx.Node]) -> None:
    """Put the graph's nodes back in ``order``."""
    cursor = order[0]
    for node in order[1:]:
        cursor.append(node)
        cursor = node
