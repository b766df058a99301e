"""Arena members: which buffers ``place_buffers`` writes into its arenas, which stay outside them, and which
updates it writes into the slots (or the state a first step creates) that they replace.

An analysis, not a pass: two passes read it. ``place_buffers`` decides with it
what to place before laying the arenas out (``arena_layout``), and
``overlap_updates`` predicts with it where the optimizer's peak will be in an
order it weighs (an update written in place is not alive beside the old value).
Both must read the same rules, so they live here once; it changes no graph.

A buffer of the non-persistent pools is placeable (``placeable_outputs``) when
the node that allocates it has a backend ``out=`` overload taking the same
arguments and every tensor it returns is such a buffer; the rules and why are
in ``passes/place_buffers.py``'s docstring.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g
from ..memory_plan import Buffer, MemoryPlan, Unplanned
from .aliasing import storage_id
from .kernels import COLLECTIVE_OUT, has_backend, has_backend_kernel, out_variant
from .releases import last_computed_on_the_data

# Pools whose buffers the runtime holds between steps: never an arena.
PERSISTENT_POOL = "persistent"

# The arena each pool's placed buffers go to. One arena for all of them: the roles' peaks come at
# different times (gathered parameters and activations in forward, gradient buckets in backward), so one
# shared arena is smaller than one per role; measured on examples/gpt.py (2 layers, stage 3, one rank):
# 20.97 MB against 27.94 MB (docs/guide/memory-pools.md). Map a pool to its own name for an arena per role.
ARENA_OF_POOL = {"gathered parameters": "arena", "activations": "arena", "gradient buckets": "arena",
                 "communication": "arena"}

# Why a collective's output is left to the allocator in a plan of a model on the meta device. No compute op has
# a meta kernel writing into given memory, so an arena there would hold collectives' outputs alone, for the whole
# step, and no later op would reuse what they free: at stage 2 the gradient shards, alive from backward to their
# update and dead by the optimizer's peak, were added on top of it (the 98M GPT on 2 ranks: a 182.8 MB arena,
# 1487.9 MB planned, above stage 1's 1301.9). Without it the plan's peak is what is alive at once, as at world
# size 1. A collective that writes an updated slot in place (the end-of-step all-gather into its bucket) still does.
NO_ARENA_ON_META = "on the meta device: no arena for collectives alone"


@dataclasses.dataclass(frozen=True)
class ArenaMembers:
    """What ``place_buffers`` decides before laying anything out: which buffers go to which arena, which
    storages stay outside them, and which updates are written into the slots (or created state) they replace."""
    placed: dict[str, list[Buffer]]   # node name -> its buffers, one per tensor output, in output order
    unplanned: tuple[Unplanned, ...]  # every storage outside the arenas but the persistent pool's, ends as planned
    in_place: dict[str, fx.Node]      # root node name -> the slot (or created tensor) it is written into
    devices: dict[str, torch.device]  # arena -> its device
    # piece node name -> (the slot, element offset): a piece of an in-place ``cat`` written straight into its slice
    into_slots: dict[str, tuple[fx.Node, int]] = dataclasses.field(default_factory=dict)


def arena_members(gm: fx.GraphModule, plan: MemoryPlan) -> ArenaMembers:
    """``place_buffers.arena_layout`` without the layout: cheap enough for a pass that weighs a reordering against the peak
    (``overlap_updates``: the in-place writes decide where the optimizer's peak is)."""
    nodes = {node.name: node for node in gm.graph.nodes}
    last = len(plan.positions) - 1
    by_node: dict[str, list[Buffer]] = {}
    for buffer in plan.buffers():
        if buffer.pool != PERSISTENT_POOL:
            arena = ARENA_OF_POOL.get(buffer.pool, buffer.pool)
            by_node.setdefault(buffer.name.split("[")[0], []).append(dataclasses.replace(buffer, pool=arena))

    placed: dict[str, list[Buffer]] = {}   # node name -> its buffers, one per tensor output, in output order
    unplanned = list(plan.unplanned)
    for name, buffers in by_node.items():
        outputs = placeable_outputs(nodes[name], buffers, last)
        if isinstance(outputs, list) and not has_backend(output_values(nodes[name])[0].device):
            outputs = NO_ARENA_ON_META
        if isinstance(outputs, str):
            unplanned += [Unplanned(b.name, b.role, b.bytes, b.start, b.end, outputs) for b in buffers]
        else:
            placed[name] = outputs

    devices: dict[str, torch.device] = {}
    for name, buffers in list(placed.items()):
        device = output_values(nodes[name])[0].device
        pool = buffers[0].pool
        devices.setdefault(pool, device)
        if devices[pool] != device:
            unplanned += [Unplanned(b.name, b.role, b.bytes, b.start, b.end, f"on {device}, its arena on {devices[pool]}")
                          for b in buffers]
            del placed[name]

    in_place = _updates_in_place(gm, plan, nodes)   # root node name -> the placeholder of the slot it replaces
    # the first step creates its optimizer state (zeros, a step counter) in the step, outside the arenas: the
    # update writes into that tensor, which then holds the new state to the end, as a slot written in place does
    created = _created_state_in_place(gm, plan, nodes, unplanned, set(in_place))
    in_place.update(created)
    if created:
        kept = {old.name for old in created.values()}
        unplanned = [dataclasses.replace(u, end=last) if u.name in kept else u for u in unplanned]
    into_slots = _pieces_into_slots(gm, plan, nodes, in_place, placed)
    for name in into_slots:
        del placed[name]
    return ArenaMembers(placed, tuple(unplanned), in_place, devices, into_slots)


def _pieces_into_slots(gm: fx.GraphModule, plan: MemoryPlan, nodes: dict[str, fx.Node], in_place: dict[str, fx.Node],
                       placed: dict[str, list[Buffer]]) -> dict[str, tuple[fx.Node, int]]:
    """Pieces of an updated bucket written straight into their slice of the old slot: no ``cat`` at all.

    A bucket's new value is ``cat`` of its pieces' updates (the optimizer
    runs per parameter); written in place, the ``cat`` still copies every
    updated parameter once more, from the arena into the slot (on the 98M GPT
    about half of the step's extra ``cat`` time, issue 19), where eager's
    optimizer writes the parameter once. Each piece's op writes into the
    slot's slice instead when it has a backend ``out=`` kernel (it is placed),
    its result is contiguous, read only by the ``cat``, and nothing reads that
    slice of the old value after it (the slice a view covers is read off its
    value's storage offset and extent; a collective reads until its wait).
    An elementwise op may be the last reader itself when it reads exactly
    the slice it writes (SGD's ``add``). All of a ``cat``'s pieces or none:
    a piece left over would need the ``cat``, or a copy, anyway.
    """
    position = {name: i for i, name in enumerate(plan.positions)}
    persistent = {b.name: b for b in plan.pool(PERSISTENT_POOL).buffers} if any(
        p.name == PERSISTENT_POOL for p in plan.pools) else {}
    last = last_computed_on_the_data(list(gm.graph.nodes))   # no slot written before it (_updates_in_place)
    last_forward_or_backward = position.get(last.name, -1) if last is not None else -1
    chosen: dict[str, tuple[fx.Node, int]] = {}
    for root_name, old in in_place.items():
        cat = nodes[root_name]
        value, old_value = cat.meta.get(g.VAL), old.meta.get(g.VAL)
        if (cat.target is not torch.ops.aten.cat.default or (len(cat.args) > 1 and cat.args[1] != 0)
                or not isinstance(value, torch.Tensor) or value.dim() != 1 or old.op != "placeholder"):
            continue
        old_buffer = persistent.get(old.name)
        aliases = [old] + [nodes[a] for a in (old_buffer.aliases if old_buffer else ()) if a in nodes]
        spans = [(a, _span(a, old_value)) for a in aliases]
        pieces, offset, ok = {}, 0, True
        for piece in cat.args[0]:
            piece_value = piece.meta.get(g.VAL) if isinstance(piece, fx.Node) else None
            if (not isinstance(piece_value, torch.Tensor) or piece.name not in placed or len(placed[piece.name]) != 1
                    or len(piece.users) != 1 or sum(a is piece for a in cat.args[0]) != 1 or piece_value.dim() != 1
                    or not piece_value.is_contiguous() or piece_value.dtype != value.dtype or is_placeable_empty(piece)):
                ok = False
                break
            begin, end, here = offset, offset + piece_value.numel(), position[piece.name]
            if here < last_forward_or_backward:
                ok = False
                break
            elementwise = torch.Tag.pointwise in getattr(piece.target, "tags", ())
            for alias, (low, high) in spans:
                if high <= begin or low >= end:
                    continue
                for user in alias.users:
                    until = _read_until(user, position)
                    exact = (user is piece and elementwise and (low, high) == (begin, end)
                             and alias.meta[g.VAL].is_contiguous())
                    if until > here or (until == here and not exact):
                        ok = False
            if not ok:
                break
            pieces[piece.name] = (old, begin)
            offset = end
        if ok and pieces:
            chosen.update(pieces)
    return chosen


def _span(alias: fx.Node, old_value) -> tuple[float, float]:
    """The elements of the slot a view of it covers, ``[low, high)``; all of them when its value does not say."""
    value = alias.meta.get(g.VAL)
    if (not isinstance(value, torch.Tensor) or not isinstance(old_value, torch.Tensor)
            or storage_id(value) != storage_id(old_value)):
        return (float("-inf"), float("inf"))
    if value.numel() == 0:
        return (0, 0)
    low = value.storage_offset()
    return (low, low + 1 + sum((size - 1) * abs(stride) for size, stride in zip(value.shape, value.stride())))


def _updates_in_place(gm: fx.GraphModule, plan: MemoryPlan, nodes: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Updated slots that can be written into the storage of the slot they replace, as eager's optimizers do.

    The step is functional: the new parameters and optimizer state are fresh
    tensors, alive beside the old ones at the end of the step, the peak. The
    node allocating a new value writes into the old slot instead when it has
    a backend ``out=`` kernel, the two have the same size, stride and dtype,
    and nothing reads the old value after it (a collective reads until its
    wait); an elementwise op may be the last reader itself. Nor before the
    step's last forward or backward node: a buffer updated in forward
    (BatchNorm's ``num_batches_tracked += 1``) written into its slot there
    would stay changed when the user's code fails after it on the user's
    data, and a failed call changes nothing (``release_slots``' release point).
    """
    position = {name: i for i, name in enumerate(plan.positions)}
    # no slot written before the last forward or backward node that computes (analysis/releases.py)
    last = last_computed_on_the_data(list(gm.graph.nodes))
    last_forward_or_backward = position.get(last.name, -1) if last is not None else -1
    slots = {n.meta.get(g.SLOT): n for n in g.placeholders(gm) if n.meta.get(g.SLOT)}
    persistent = {b.name: b for b in plan.pool(PERSISTENT_POOL).buffers} if any(
        p.name == PERSISTENT_POOL for p in plan.pools) else {}
    root_of = {alias: b for b in persistent.values() for alias in (b.name, *b.aliases)}
    outputs = g.output_node(gm).args[0][1:]
    chosen: dict[str, fx.Node] = {}
    for slot_name, value in zip(gm.meta.get(g.OUTPUT_SLOTS, ()), outputs):
        old = slots.get(slot_name)
        root = root_of.get(value.name) if isinstance(value, fx.Node) else None
        if old is None or root is None or "[" in root.name or root.name in chosen or root.role != "updated state":
            continue
        node = nodes[root.name]
        old_value, new_value = old.meta.get(g.VAL), node.meta.get(g.VAL)
        if not (isinstance(old_value, torch.Tensor) and isinstance(new_value, torch.Tensor)
                and old_value.shape == new_value.shape and old_value.stride() == new_value.stride()
                and old_value.dtype == new_value.dtype and old_value.device == new_value.device):
            continue
        if not isinstance(placeable_outputs(node, [root], len(plan.positions)), list):
            continue
        old_buffer = persistent.get(old.name)
        readers = [u for name in (old.name, *(old_buffer.aliases if old_buffer else ())) for u in nodes[name].users]
        last_read = max((_read_until(u, position) for u in readers), default=-1)
        here = position[root.name]
        if here < last_forward_or_backward:
            continue
        elementwise = torch.Tag.pointwise in getattr(node.target, "tags", ())
        if last_read < here or (last_read == here and elementwise):
            chosen[root.name] = old
    return chosen


def _created_state_in_place(gm: fx.GraphModule, plan: MemoryPlan, nodes: dict[str, fx.Node],
                            unplanned: list[Unplanned], taken: set[str]) -> dict[str, fx.Node]:
    """On a first step: new optimizer state written into the tensor the step created as its initial value.

    A step with no state yet makes it (``zeros_like`` for Adam's moments, a
    copied constant for its step counter) and computes the new state from it
    into a fresh tensor: both alive at the end of the update. When the op
    making the new state has a backend ``out=`` kernel and reads, as its last
    reader, a tensor created in the step outside the arenas (unplanned, no
    view read after it, same size, stride, dtype and device), it writes into that tensor,
    as the steady state writes into the old slot.
    """
    position = {name: i for i, name in enumerate(plan.positions)}
    # an unplanned storage ends at the last read of any view of it (analysis/lifetimes.py)
    outside = {u.name: u.end for u in unplanned if u.bytes is not None and "[" not in u.name}
    persistent = plan.pool(PERSISTENT_POOL).buffers if any(p.name == PERSISTENT_POOL for p in plan.pools) else ()
    chosen: dict[str, fx.Node] = {}
    used: set[str] = set()
    for root in persistent:
        if root.role != "updated state" or "[" in root.name or root.name in taken or root.name not in nodes:
            continue
        node = nodes[root.name]
        new_value = node.meta.get(g.VAL)
        if node.op != "call_function" or not isinstance(new_value, torch.Tensor):
            continue
        if not isinstance(placeable_outputs(node, [root], len(plan.positions)), list):
            continue
        here = position[root.name]
        elementwise = torch.Tag.pointwise in getattr(node.target, "tags", ())
        for arg in node.all_input_nodes:
            old_value = arg.meta.get(g.VAL)
            if arg.name not in outside or arg.name in used or arg.op != "call_function":
                continue
            if not (isinstance(old_value, torch.Tensor) and old_value.shape == new_value.shape
                    and old_value.stride() == new_value.stride() and old_value.dtype == new_value.dtype
                    and old_value.device == new_value.device):
                continue
            last_read = outside[arg.name]
            if last_read < here or (last_read == here and elementwise):
                chosen[root.name] = arg
                used.add(arg.name)
                break
    return chosen


def _read_until(user: fx.Node, position: dict[str, int]) -> int:
    if g.reads_inputs_until_wait(user):
        return max((position[w.name] for w in user.users if g.is_wait(w)), default=position[user.name])
    return position[user.name]


def is_placeable_empty(node: fx.Node) -> bool:
    """An ``empty`` whose memory the arena can be: ``place_buffers`` replaces it by its arena view (no op at all).

    ``empty`` has no ``out=`` overload taking its arguments, but it computes
    nothing: a contiguous view of the arena is all it would return
    (``gradients_into_buckets``' bucket, which its gradients' ops write into).
    """
    value = node.meta.get(g.VAL)
    return (node.target is torch.ops.aten.empty.memory_format and isinstance(value, torch.Tensor)
            and value.is_contiguous() and not node.kwargs.get("pin_memory")
            and node.kwargs.get("memory_format") in (None, torch.contiguous_format))


def output_values(node: fx.Node) -> list:
    """What ``node`` returns (its ``val``), one entry per output, in output order."""
    return list(g.values_of(node.meta.get(g.VAL)))


def placeable_outputs(node: fx.Node, buffers: list[Buffer], last: int) -> list[Buffer] | str:
    """The node's buffers in output order if it can write them all into arenas, else why not."""
    if any(b.end >= last for b in buffers):
        return "a value of the step's result: it outlives the step"
    if any(b.bytes == 0 for b in buffers):
        return "empty"
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return "not an aten op"
    if is_placeable_empty(node):
        return buffers
    found = out_variant(node.target)
    if found is None:
        return "no out= variant"
    values = output_values(node)
    if not all(isinstance(v, torch.Tensor) for v in values) or len(values) != len(found[1]):
        return "returns more than tensors"
    if isinstance(node.meta.get(g.VAL), (tuple, list)):
        by_name = {b.name: b for b in buffers}
        ordered = [by_name.get(f"{node.name}[{i}]") for i in range(len(values))]
        if any(b is None for b in ordered):
            return "another output is not in an arena pool"
    else:
        ordered = buffers
    if node.target not in COLLECTIVE_OUT:
        if not has_backend_kernel(found[0], values[0].device):
            return "out= variant only copies"
    if len({v.device for v in values}) != 1:
        return "outputs on several devices"
    return ordered
