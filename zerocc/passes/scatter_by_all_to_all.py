"""scatter_by_all_to_all: on CPU (gloo), each reduce-scatter becomes an all-to-all and a local sum.

Requires: ``insert_collectives`` (reduce_scatter_tensor + wait pairs); runs
after ``schedule`` and ``overlap_updates``, whose placement of collectives
and waits it keeps. Establishes: no ``reduce_scatter_tensor`` of CPU tensors
left; in its place ``all_to_all_single`` of the same flat bucket, issued at
the same point, its wait at the same point, then, right after the wait, the
sum of the N received chunks, one ``sum`` over the rank dimension of the
received buffer seen as ``[N, rows]`` (one node whatever N: at 1024 ranks a
chain of additions made the program, and planning, 2N nodes per bucket
longer), which is the reduce-scatter's result, read by what read it (the
averaging division).

Why: gloo has no reduce-scatter. ``ProcessGroupGloo`` runs one as an
all-reduce of the whole bucket followed by a copy of this rank's chunk, so
every rank sends and receives the full bucket (2 (N-1)/N of it, as DDP's
all-reduce does) where a reduce-scatter needs (N-1)/N, and on a 2-core box
gloo's transfer threads take those cycles from compute. An all-to-all moves
exactly the (N-1)/N a reduce-scatter needs: measured on this machine's gloo,
2 ranks, one 4 MiB bucket (benchmarks/gloo_collectives.py), about half
the CPU time per rank of ``reduce_scatter_tensor`` (3.9 against 7.9 ms), the
chunk sums included.

Numerics: every rank sums the same N chunks the same way. At 2 ranks that
is ``a + b``, which is what gloo's all-reduce computes (float addition is
commutative), so the result is bit for bit the same; up to 4 ranks the sum
kernel adds in rank order (checked on this machine); beyond, it may group
the additions differently, as gloo's ring does: a rounding-level difference
of the kind DDP's own all-reduce has. The bytes alive while the collective
is in flight grow from the shard (N-1)/N of a bucket smaller to a full
bucket (the all-to-all's output), the same size as the buffer gloo's
all-reduce works in; plan_memory counts it. A reduce-scatter stays one if
that would raise the planned live peak: decided in issue order on one
lifetime analysis (``_choose``), confirmed on the rewritten program (one
at a time, as a fallback, if the estimate were ever short).

Not done: on CUDA tensors (NCCL has a real reduce-scatter), for all-reduces
(stage 0, DDP's own collective) and under ``memory_pools`` (place_buffers
writes the reduce-scatter's output into its arena slot; the all-to-all has
no ``out=`` form there).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g
from ..context import CompileContext
from ..memory_plan import align
from .overlap_updates import live_bytes, live_peaks

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def scatter_by_all_to_all(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Replace each CPU reduce_scatter_tensor + wait by all_to_all_single + wait + the sum of the chunks."""
    graph = gm.graph
    scatters = _cpu_reduce_scatters(gm)
    if not scatters:
        ctx.notes["scatter_by_all_to_all"] = "no reduce-scatter of CPU tensors"
        return gm
    peaks = live_peaks(gm, ctx)
    chosen, kept = _choose(gm, scatters, min(peaks))
    replacements = [_replace(gm, ctx, scatter) for scatter in chosen]
    if any(after > before for before, after in zip(peaks, live_peaks(gm, ctx))):
        # the estimate missed (positions shift as nodes are added): decide again, one replacement at a time
        for replacement in reversed(replacements):
            _restore(gm, replacement)
        chosen, kept = [], []
        for scatter in _cpu_reduce_scatters(gm):   # restored: new nodes
            replacement = _replace(gm, ctx, scatter)
            if any(after > before for before, after in zip(peaks, live_peaks(gm, ctx))):
                _restore(gm, replacement)
                kept.append(scatter.meta.get(g.BUCKET))
            else:
                chosen.append(scatter)
    replaced = len(chosen)
    graph.lint()
    gm.recompile()
    note = f"{replaced} reduce_scatter -> all_to_all_single + sum of {ctx.world_size} chunks"
    if kept:
        note += (f"; {len(kept)} kept (bucket {', '.join(map(str, kept))}): its full-size output would raise "
                 f"the planned live peak")
    ctx.notes["scatter_by_all_to_all"] = note
    return gm


def _cpu_reduce_scatters(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.reduce_scatter_tensor.default
            and g.tensor_meta(n) is not None and g.tensor_meta(n).device.type == "cpu"]


def _choose(gm: fx.GraphModule, scatters: list[fx.Node], peak: int) -> tuple[list[fx.Node], list]:
    """The reduce-scatters to replace (in order) without the planned live peak passing ``peak``, and the buckets kept.

    From one lifetime analysis: from the issue to the wait, the all-to-all's
    full bucket is alive instead of the reduce-scatter's shard; where the
    wait was, the full bucket is read by the sum while the sum's shard is
    allocated, so both. Elsewhere nothing changes. The window ends at a
    collective wait, before ``release_slots``' release point, where both of
    ``live_peaks``' accountings agree.
    """
    position = g.topological_index(gm)
    live = live_bytes(gm)
    chosen, kept = [], []
    for scatter in scatters:
        (wait,) = scatter.users
        full, shard = align(g.nbytes(scatter.args[0])), align(g.nbytes(scatter))
        change = {t: full - shard for t in range(position[scatter], position[wait])}
        change[position[wait]] = full
        if max(live[t] + delta for t, delta in change.items()) > peak:
            kept.append(scatter.meta.get(g.BUCKET))
            continue
        for t, delta in change.items():
            live[t] += delta
        chosen.append(scatter)
    return chosen, kept


@dataclasses.dataclass
class _Replacement:
    """What ``_replace`` did to one reduce-scatter, enough for ``_restore`` to undo it."""
    scatter: tuple[str, tuple, dict]   # name, args, meta of the reduce-scatter
    wait: tuple[str, dict]             # name, meta of its wait
    added: list[fx.Node]               # the all-to-all, its wait, the [N, rows] view and the sum, in graph order
    total: fx.Node                     # the sum, read where the wait was read


def _replace(gm: fx.GraphModule, ctx: CompileContext, scatter: fx.Node) -> _Replacement:
    """Rewrite one reduce-scatter and its wait in place."""
    graph = gm.graph
    flat, reduce_op, world_size, group = scatter.args
    assert reduce_op == "sum", reduce_op    # insert_collectives sums, then divides
    (wait,) = scatter.users
    assert g.is_wait(wait), wait
    rows = g.tensor_meta(flat).shape[0] // world_size
    splits = [rows] * world_size
    tags = {g.PHASE: g.COMMUNICATION, g.BUCKET: scatter.meta.get(g.BUCKET)}
    with graph.inserting_before(scatter):
        exchanged = g.call(graph, ctx.fake_mode, c10d.all_to_all_single.default, flat, splits, splits, group)
    added = [exchanged]
    shape = list(g.tensor_meta(flat).shape)
    with graph.inserting_before(wait):
        received = g.call(graph, ctx.fake_mode, c10d.wait_tensor.default, exchanged)
        by_rank = g.call(graph, ctx.fake_mode, aten.view.default, received, [world_size, rows, *shape[1:]])
        total = g.call(graph, ctx.fake_mode, aten.sum.dim_IntList, by_rank, [0])
        added.extend([received, by_rank, total])
    for node in added:
        node.meta.update(tags)
    replacement = _Replacement((scatter.name, scatter.args, dict(scatter.meta)), (wait.name, dict(wait.meta)),
                               added, total)
    wait.replace_all_uses_with(total)
    graph.erase_node(wait)
    graph.erase_node(scatter)
    return replacement


def _restore(gm: fx.GraphModule, replacement: _Replacement) -> None:
    """Undo ``_replace``: the reduce-scatter and its wait back where they were, the new nodes gone."""
    graph = gm.graph
    exchanged, received = replacement.added[:2]
    (name, args, meta), (wait_name, wait_meta) = replacement.scatter, replacement.wait
    with graph.inserting_before(exchanged):
        scatter = graph.call_function(c10d.reduce_scatter_tensor.default, args, name=name)
    with graph.inserting_before(received):
        wait = graph.call_function(c10d.wait_tensor.default, (scatter,), name=wait_name)
    scatter.meta.update(meta)
    wait.meta.update(wait_meta)
    replacement.total.replace_all_uses_with(wait)
    for node in reversed(replacement.added):
        graph.erase_node(node)
