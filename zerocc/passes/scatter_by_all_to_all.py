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
that could raise the planned live peak: decided in issue order on one
lifetime analysis with an upper bound of each replacement's change
(``_kept``; under memory pools, the arena's peak: below), and on several ranks a bucket any rank keeps is kept by all
(``_kept_on_any_rank``): the choice depends on a rank's own peak, and
every rank must issue the same collectives.

Under ``memory_pools`` (the default) the pass runs too, and ``place_buffers``
has the all-to-all receive into the arena through
``zerocc::all_to_all_single_out`` (``zerocc/ops.py``: the same
``ProcessGroup.alltoall_base`` call, given the output; _c10d_functional's
all-to-all has no ``out=`` form, and its full bucket, left to the allocator
beside the arena, was added on top of the arena's peak: the examples' 5M GPT
on 2 CPU ranks planned 74.2 MB at stage 2 against 72.0 at stage 1, issue 19).
There the planned peak is the arena plus the most bytes alive outside it at
once, which the bucket does not touch, so the choice is made against the
bytes of the non-persistent pools (``live_bytes(gm, persistent=False)``, an
upper bound of the arena's), not the live peak: the 5M GPT's live peak comes
in the optimizer (old and new state alive), where no bucket is in flight,
and a bucket in flight at backward's peak grew the arena by half a bucket
while the live peak allowed it. Checked in
``tests/test_planning.py::test_stage_2_plans_no_more_than_stage_1``.

Not done: on CUDA tensors (NCCL has a real reduce-scatter) and for
all-reduces (stage 0, DDP's own collective).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph as g
from ..context import CompileContext
from ..memory_plan import align
from ..analysis.live_bytes import live_bytes, live_peaks_and_bytes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def scatter_by_all_to_all(gm: fx.GraphModule, ctx: CompileContext, *, memory_pools: bool = False) -> fx.GraphModule:
    """Replace each CPU reduce_scatter_tensor + wait by all_to_all_single + wait + the sum of the chunks."""
    graph = gm.graph
    scatters = _cpu_reduce_scatters(gm)
    if not scatters:
        ctx.notes["scatter_by_all_to_all"] = "no reduce-scatter of CPU tensors"
        return gm
    if memory_pools:   # the bucket goes into the arena (place_buffers): weighed against the arena's bytes alone
        live = live_bytes(gm, persistent=False)
        peak = max(live, default=0)
    else:
        peaks, live = live_peaks_and_bytes(gm, ctx)
        peak = min(peaks)
    anywhere = _kept_on_any_rank(_kept(gm, scatters, peak, live), ctx)
    kept = [scatter.meta.get(g.BUCKET) for scatter in scatters if scatter.meta.get(g.BUCKET) in anywhere]
    chosen = [scatter for scatter in scatters if scatter.meta.get(g.BUCKET) not in anywhere]
    for scatter in chosen:
        _replace(gm, ctx, scatter)
    replaced = len(chosen)
    graph.lint()
    gm.recompile()
    note = f"{replaced} reduce_scatter -> all_to_all_single + sum of {ctx.world_size} chunks"
    if kept:
        note += (f"; {len(kept)} kept (bucket {', '.join(map(str, kept))}): its full-size output could raise "
                 f"the planned {'arena' if memory_pools else 'live peak'} (of this rank or another)")
    ctx.notes["scatter_by_all_to_all"] = note
    return gm


def _cpu_reduce_scatters(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.reduce_scatter_tensor.default
            and g.tensor_meta(n) is not None and g.tensor_meta(n).device.type == "cpu"]


def _kept(gm: fx.GraphModule, scatters: list[fx.Node], peak: int, live: list[int]) -> list:
    """The buckets whose reduce-scatter stays one: replacing it, in issue order, would take the live peak past ``peak``.

    From one lifetime analysis, with an upper bound of each replacement's
    change: from the issue to the wait, the all-to-all's full bucket is
    added (the reduce-scatter's shard it stands in for is not taken off, and
    where the wait was, the sum's shard is allocated while the bucket is
    read, so the bound is reached there). Other buffers keep their
    lifetimes. The window ends at a collective wait, before
    ``release_slots``' release point, where both of ``live_peaks``'
    accountings agree; so neither peak can grow.
    """
    position = g.topological_index(gm)
    live = list(live)   # live_bytes(gm): the bytes alive at each position, each replacement's bound added in
    kept = []
    for scatter in scatters:
        (wait,) = scatter.users
        window = range(position[scatter], position[wait] + 1)
        full = align(g.nbytes(scatter.args[0]))
        if max(live[t] for t in window) + full > peak:
            kept.append(scatter.meta.get(g.BUCKET))
            continue
        for t in window:
            live[t] += full
    return kept


def _kept_on_any_rank(kept: list, ctx: CompileContext) -> set:
    """The buckets any rank keeps as a reduce-scatter: every rank must issue the same collectives.

    Ranks own different optimizer pieces, so their peaks differ a little and
    so may their choices; a bucket another rank keeps is kept here too (one
    replacement fewer can only lower this rank's peak).
    """
    return {bucket for rank_kept in ctx.from_every_rank(kept) for bucket in rank_kept}


def _replace(gm: fx.GraphModule, ctx: CompileContext, scatter: fx.Node) -> None:
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
    wait.replace_all_uses_with(total)
    graph.erase_node(wait)
    graph.erase_node(scatter)
