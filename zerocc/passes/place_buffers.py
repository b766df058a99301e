"""place_buffers: make the memory plan real. Placed ops write into arenas through their ``out=`` variants.

Requires: ``plan_memory`` (``ctx.memory_plan``), and that nothing moves
nodes afterwards. Establishes: one placeholder per arena (role
``graph.ROLE_ARENA``, slot ``arena:<pool>``, a fake ``uint8`` value of the
arena's size) that the runtime fills with a tensor it allocates once
(``runtime/arenas.py``); every placed node calls its ``out=`` overload with
``out=arena_view(arena, offset, size, stride, dtype)``; ``ctx.memory_plan``
replaced by a plan whose non-persistent pools become arenas
(``ARENA_OF_POOL``: one arena for all of them) holding only placed buffers
(laid out again, so no arena reserves room for what it does not hold) and whose
``unplanned`` list names every other storage of the step, with its bytes
and the reason.

A buffer of the non-persistent pools (gathered parameters, activations,
gradient buckets, communication) is placed when the node that allocates it
has an ``out=`` overload taking the same arguments, implemented by a kernel
of the device's backend (an ``out=`` that only calls the functional op and
copies, as PyTorch generates for some, would allocate anyway), and every
tensor it returns is such a buffer. Not placed: values that outlive the step
(the loss), ops without such an overload (flash attention, layer norm, ops
that create tensors), outputs sized by the data (already unplanned by
``plan_memory``). The persistent pool (slots, and the values that replace
them) is not an arena: the runtime keeps those tensors between steps; but a
value that replaces a slot is written into the old slot's storage when
nothing reads the old value after it; when that value is a ``cat`` of a
bucket's updated pieces, each piece's op writes straight into its slice of
the old slot instead and the ``cat`` is gone (``analysis/arena.py``'s
``_pieces_into_slots``). An ``empty`` placed in an arena (a gradient
bucket of ``gradients_into_buckets``) is replaced by its arena view.

Which buffers go into an arena and which updates are written in place is
decided by ``analysis/arena.py`` (``arena_members``), which ``overlap_updates``
reads too, to weigh its orders as this pass will lay them out; this pass lays
the arenas out and rewrites the graph.

The computation is unchanged: an ``out=`` overload runs the kernel its
functional overload runs, into memory given instead of allocated
(``tests/test_memory_pools.py`` checks bit equality with eager).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops
from ..analysis.arena import ARENA_OF_POOL, PERSISTENT_POOL, arena_members, is_placeable_empty, output_values
from ..analysis.kernels import out_variant
from ..context import CompileContext
from ..memory_plan import Buffer, Lifetime, MemoryPlan, Pool, lower_bound, megabytes, place
from ..runtime.arenas import arena_slot, arena_view

c10d = torch.ops._c10d_functional

def place_buffers(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Allocate the plan's pools as arenas and point every op that can write into one at its offset."""
    plan = ctx.memory_plan
    if plan is None:
        return gm
    layout = arena_layout(gm, plan)
    ctx.memory_plan = layout.plan
    placed, offsets, in_place = layout.placed, layout.offsets, layout.in_place
    nodes = {node.name: node for node in gm.graph.nodes}
    arenas = [p for p in layout.plan.pools if p.name in layout.plan.arenas]
    arena_nodes = _add_arena_placeholders(gm, ctx, arenas, layout.devices)
    for name, buffers in placed.items():
        node = nodes[name]
        out_op, out_names = out_variant(node.target) or (None, ("out",))
        views = []
        with gm.graph.inserting_before(node):
            for buffer, value in zip(buffers, output_values(node)):
                view = g.add_node(gm.graph, "call_function", arena_view,
                                  (arena_nodes[buffer.pool], offsets[buffer.name], tuple(int(s) for s in value.shape),
                                   tuple(int(s) for s in value.stride()), value.dtype))
                view.meta.update({g.VAL: value, g.PHASE: node.meta.get(g.PHASE)})
                views.append(view)
        if is_placeable_empty(node):   # nothing to compute: its value is the view
            if node.meta.get(g.RELEASE_POINT):   # the view stands where it stood
                views[0].meta[g.RELEASE_POINT] = True
            node.replace_all_uses_with(views[0])
            gm.graph.erase_node(node)
            continue
        node.target = out_op
        node.kwargs = {**node.kwargs, **dict(zip(out_names, views))}
    by_cat: dict[str, list[fx.Node]] = {}
    for name, (slot, offset) in layout.into_slots.items():
        node = nodes[name]
        by_cat.setdefault(next(iter(node.users)).name, []).append(node)
        with gm.graph.inserting_before(node):
            part = g.call(gm.graph, ctx.fake_mode, torch.ops.aten.slice.Tensor, slot, 0, offset,
                          offset + node.meta[g.VAL].numel())
        part.meta[g.PHASE] = node.meta.get(g.PHASE)
        out_op, (out_name,) = out_variant(node.target)
        node.target = out_op
        node.kwargs = {**node.kwargs, out_name: part}
    for name, pieces in by_cat.items():   # the cat's value is the slot, once every piece is written into it
        cat = nodes[name]
        with gm.graph.inserting_before(cat):
            written = g.call(gm.graph, ctx.fake_mode, ops.bucket_written, in_place[name], pieces)
        written.meta.update({**cat.meta, g.VAL: written.meta[g.VAL]})
        cat.replace_all_uses_with(written)
        gm.graph.erase_node(cat)
    for name, slot in in_place.items():
        if name in by_cat:
            continue
        node = nodes[name]
        out_op, (out_name,) = out_variant(node.target)
        node.target = out_op
        node.kwargs = {**node.kwargs, out_name: slot}
    gm.graph.lint()
    gm.recompile()

    new = ctx.memory_plan
    ctx.notes["place_buffers"] = (f"{sum(len(b) for b in placed.values())} buffers placed in {len(arenas)} arenas "
                                  f"({megabytes(new.arena_bytes)}); {len(new.unplanned)} unplanned "
                                  f"({megabytes(new.unplanned_bytes)}); {len(in_place)} updates written into the "
                                  f"slots they replace ({len(layout.into_slots)} updated pieces written straight into their slot's slice, "
                                  f"{len(by_cat)} cats gone); planned peak {megabytes(new.planned_peak_bytes)}")
    return gm


@dataclasses.dataclass(frozen=True)
class ArenaLayout:
    """Where place_buffers puts what: the new plan, each placed node's buffers, their offsets, in-place updates."""
    plan: MemoryPlan
    placed: dict[str, list[Buffer]]   # node name -> its buffers, one per tensor output, in output order
    offsets: dict[str, int]           # buffer name -> offset in its arena
    in_place: dict[str, fx.Node]      # root node name -> the placeholder of the slot it is written into
    devices: dict[str, torch.device]  # arena -> its device
    into_slots: dict[str, tuple[fx.Node, int]]   # piece node name -> (slot, offset): written into the slot's slice


def arena_layout(gm: fx.GraphModule, plan: MemoryPlan) -> ArenaLayout:
    """The arenas ``place_buffers`` would make for ``plan`` on ``gm``, decided without touching the graph.

    ``place_remat`` reads ``layout.plan.planned_peak_bytes`` to check a budget with memory pools on.
    """
    members = arena_members(gm, plan)
    placed, unplanned, in_place, devices = members.placed, list(members.unplanned), members.in_place, members.devices
    last = len(plan.positions) - 1
    pools, offsets = [], {}
    for pool in plan.pools:
        if pool.name == PERSISTENT_POOL:
            # a slot written in place holds the new value to the end, even if release_slots released the old one
            written = {old.name for old in in_place.values()}
            kept = [dataclasses.replace(b, end=last) if b.name in written else b
                    for b in pool.buffers if b.name not in in_place]
            lifetimes = [Lifetime(b.name, b.bytes, b.start, b.end) for b in kept]
            persistent_offsets, size, order = place(lifetimes)
            pools.append(Pool(pool.name, size, lower_bound(lifetimes), order,
                              tuple(dataclasses.replace(b, offset=persistent_offsets[b.name]) for b in kept)))
    for arena in dict.fromkeys(ARENA_OF_POOL.get(p.name, p.name) for p in plan.pools if p.name != PERSISTENT_POOL):
        in_arena = [b for buffers in placed.values() for b in buffers if b.pool == arena]
        if not in_arena:
            continue
        lifetimes = [Lifetime(b.name, b.bytes, b.start, b.end) for b in in_arena]
        arena_offsets, size, order = place(lifetimes)
        offsets.update(arena_offsets)
        pools.append(Pool(arena, size, lower_bound(lifetimes), order,
                          tuple(dataclasses.replace(b, offset=arena_offsets[b.name]) for b in in_arena)))
    arenas = tuple(p.name for p in pools if p.name != PERSISTENT_POOL)
    unplanned.sort(key=lambda u: (u.start, u.name))
    new = dataclasses.replace(plan, pools=tuple(pools), unplanned=tuple(unplanned), arenas=arenas,
                              placed=True)
    return ArenaLayout(new, placed, offsets, in_place, devices, members.into_slots)


def _add_arena_placeholders(gm: fx.GraphModule, ctx: CompileContext, pools: list[Pool],
                            devices: dict[str, torch.device]) -> dict[str, fx.Node]:
    """One placeholder per arena, after the others: the runtime passes each arena's tensor in."""
    placeholders = g.placeholders(gm)
    arena_nodes = {}
    anchor = placeholders[-1]
    for pool in pools:
        with gm.graph.inserting_after(anchor):
            node = gm.graph.placeholder("arena_" + pool.name.replace(" ", "_"))
        with ctx.fake_mode:
            value = torch.empty(pool.bytes, dtype=torch.uint8, device=devices[pool.name])
        node.meta.update({g.ROLE: g.ROLE_ARENA, g.SLOT: arena_slot(pool.name), g.VAL: value})
        arena_nodes[pool.name] = anchor = node
    return arena_nodes
