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
early), and otherwise leaves the graph as it was. The last
reduction's update runs after every moved one, its temporaries on top of every new value made: where that
grows the peak (the 98M GPT at stage 2 on meta: its embedding bucket, the largest, is reduced last), under
memory pools the updates issued just before it are left to run after it, one more at a time while the peak
falls, counted as ``place_buffers`` lays the order out: the updates it writes into the slots they replace
counted there, not beside them (``_peaks``; counted beside, the new parameter buckets made the end of the step
the peak and hid the optimizer's). Such an order is taken only where that count is strictly lower than the
reduction order's (or the unmoved one's) and neither live peak is higher: the live peaks are what a
``memory_budget``'s search reads first (``place_remat._measure`` lays out no plan whose live peak is over the
budget), and a version that chose by the pooled count alone moved updates whose live peak then grew past it,
where the pooled one did not (the 5M GPT's search at 0.85x its peak measured 11 plans instead of 5). Each order
is weighed from what the analyses find in every order, taken once (``_Orders``), not from a whole memory plan per order.
Moving a node earlier past nodes it does not read is exact (same ops,
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
from ..analysis.arena import PERSISTENT_POOL, arena_members, output_values, placeable_outputs
from ..analysis.lifetimes import Storages, memory_plan_of, storages_of
from ..analysis.live_bytes import live_peaks, peak_bytes
from ..analysis.releases import mark_releases, releasable
from ..graph import wait_of
from ..analysis.aliasing import is_view
from ..analysis.kernels import has_backend
from ..memory_plan import POOL_OF_ROLE, Buffer


def overlap_updates(gm: fx.GraphModule, ctx: CompileContext, *, memory_pools: bool = False) -> fx.GraphModule:
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

    groups, buckets = [], []   # each bucket's update, in reduction issue order; the last reduction's last
    taken: set[fx.Node] = set()
    for index, reduction in enumerate(reductions):
        group = _update_of(index, wait_of(reduction), roots.get(index, []), inside, reads, position, taken)
        if not any(n.meta.get(g.PHASE) == g.OPTIMIZER for n in group):
            continue
        group.sort(key=position.get)
        groups.append(group)
        taken.update(group)
        buckets.append(reduction.meta.get(g.BUCKET))
    last_moves = bool(groups) and wait_of(reductions[-1]) in groups[-1]
    early = len(groups) - 1 if last_moves else len(groups)   # the updates that may run before the last wait
    if early == 0:
        ctx.update_order = UpdateOrder((), 0)
        ctx.notes["overlap_updates"] = "no update to move"
        return gm

    # the move changes the order only: which storages each node keeps alive is found once, for every order weighed
    storages = storages_of(gm)
    weigh = _Orders(gm, ctx, storages, position[anchor] + 1, memory_pools)
    live_before, pooled_before = weigh.peaks(gm)
    # the reduction order (every update before the last wait) where the live peaks do not grow, else none moved
    _place(anchor, [node for group in groups[:early] for node in group])
    live_moved, pooled = weigh.peaks(gm)
    later, best = (0, (live_moved, pooled)) if _no_higher(live_moved, live_before) else (None, (live_before, pooled_before))
    if memory_pools and last_moves:
        # updates left to run after the last one's, fewest first, while the pooled count falls (see the docstring);
        # taken only where it is strictly lower than the choice above, and the live peaks not higher
        previous = pooled
        for more in range(1, early):
            order = [*groups[:early - more], *groups[early:], *groups[early - more:early]]
            _place(anchor, [node for group in order for node in group])
            live, pooled = weigh.peaks(gm)
            if not pooled[0] < previous[0]:
                break   # leaving one more update after the last one's no longer lowers the peak
            previous = pooled
            if _no_higher(live, best[0]) and _no_higher(pooled, best[1]) and pooled != best[1]:
                later, best = more, (live, pooled)
    if later is None:
        _restore(graph, nodes)
        ctx.update_order = UpdateOrder((), 0)
        ctx.notes["overlap_updates"] = (f"not moved: the planned live peak would grow from {live_before[0]:,} to "
                                        f"{live_moved[0]:,} bytes (old state kept to the end) or from "
                                        f"{live_before[1]:,} to {live_moved[1]:,} (released by release_slots)")
        return gm
    _restore(graph, nodes)   # the chosen order from the original one: the nodes of no group stay in their order
    if later == 0:
        _place(anchor, [node for group in groups[:early] for node in group])
    else:
        order = [*groups[:early - later], *groups[early:], *groups[early - later:early]]
        _place(anchor, [node for group in order for node in group])
    graph.lint()
    gm.recompile()
    moved = [node for group in groups[:early - later] for node in group]
    ctx.update_order = UpdateOrder(tuple(buckets[:early - later]), len(moved))
    after_last = f", {later} after the last one's" if later else ""
    ctx.notes["overlap_updates"] = (f"{early - later} bucket updates ({len(moved)} nodes) moved before the wait "
                                    f"of the last reduction, in reduction issue order{after_last}; planned live peak "
                                    f"{live_before[0]:,} -> {best[0][0]:,} bytes"
                                    + (f", counted as place_buffers lays it out {pooled_before[0]:,} -> {best[1][0]:,}"
                                       if memory_pools else ""))
    return gm


def _no_higher(peaks: tuple[int, int], than: tuple[int, int]) -> bool:
    return all(a <= b for a, b in zip(peaks, than))


def _peaks(gm: fx.GraphModule, ctx: CompileContext, storages: Storages, memory_pools: bool) -> tuple[int, int]:
    """``live_peaks``; under memory pools with the updates ``place_buffers`` will write into the slots they replace
    counted as it will: in the old slot's storage, not beside it.

    Why: without, the new parameter buckets (the end-of-step all-gathers, written into the old buckets) were
    counted beside the old ones, a peak at the end of the step no update's order changes, so any order passed;
    the plan's real peak is the optimizer's, where the last update to run adds its temporaries to every new
    value already made (the 98M GPT at stage 2 on 2 ranks, meta: 1305.0 MB planned, 1292.4 unmoved).
    """
    if not memory_pools:
        return live_peaks(gm, ctx, storages)
    released, _ = mark_releases(gm, ctx)
    try:
        plan = memory_plan_of(gm, placed=False, storages=storages)
    finally:
        for node in gm.graph.nodes:
            node.meta.pop(g.RELEASED, None)
            node.meta.pop(g.RELEASE_POINT, None)
    in_place = arena_members(gm, plan).in_place
    written, released_names = {old.name for old in in_place.values()}, {node.name for node in released}
    last = len(plan.positions) - 1
    alive = [(b.name, b.bytes, b.start, last if b.name in written else b.end)
             for b in plan.buffers() if b.name not in in_place]
    return (peak_bytes((size, start, last if name in released_names else end) for name, size, start, end in alive),
            peak_bytes((size, start, end) for _, size, start, end in alive))


class _Orders:
    """``_peaks`` of orders that differ from ``gm``'s current one only after position ``tail``, each from what
    the analyses find in every order, found once here (for ``overlap_updates``: tens of orders on the 98M GPT).

    Why: ``_peaks`` runs ``mark_releases``, the lifetime analysis and ``arena_members`` over the whole graph per
    order, about 0.2 s each on the 98M GPT, where the 7 orders weighed at stage 3 made the pass 5 times slower
    (1.3 s against 0.25 for the two ``live_peaks`` before). What does not depend on the order is taken once: each
    storage's name, role, bytes, the nodes that hold it and the positions that end its life (a reader, or the
    wait of a collective reading it; ``lifetimes_and_unplanned``), the release point's candidates
    (``releases.release_point``), and ``place_buffers``' checks on each update it might write in place but
    where it runs and where the old value is last read (``analysis/arena.py``'s ``_updates_in_place``,
    ``_created_state_in_place``).
    Each order then costs those positions. Where a rule's outcome could depend on the order in another way (an
    alias of two updated storages, arenas on several devices), every order is weighed by ``_peaks`` itself.
    """

    def __init__(self, gm: fx.GraphModule, ctx: CompileContext, storages: Storages, tail: int, memory_pools: bool):
        self.gm, self.ctx, self.storages, self.memory_pools = gm, ctx, storages, memory_pools
        nodes = list(gm.graph.nodes)
        self.last = len(nodes) - 1
        fixed = set(nodes[:tail])   # positions that every order weighed keeps
        position = {node: i for i, node in enumerate(nodes)}
        self.released = {node.name for node in releasable(gm, ctx)}   # none where no order has a release point

        def split(found: list[fx.Node]) -> tuple[int, list[fx.Node]]:   # latest fixed position, the others
            return max((position[n] for n in found if n in fixed), default=-1), [n for n in found if n not in fixed]

        # the release point (releases.release_point): the later of the last wait and the last forward or backward
        # node that computes, either found among the fixed nodes or the moving ones
        self.waits = split([n for n in nodes if n.op == "call_function" and g.is_wait(n)])
        self.computed = split([n for n in nodes if n.op == "call_function" and n.meta.get(g.PHASE) in (g.FORWARD, g.BACKWARD)
                               and not is_view(n)])

        def done(user: fx.Node) -> list[fx.Node]:   # lifetimes._released_at, as the nodes whose positions say it
            if g.reads_inputs_until_wait(user):
                return [w for w in user.users if g.is_wait(w)] or [user]
            return [user]

        holders: dict[tuple, list[fx.Node]] = {}
        for node in nodes:
            for key in storages.roots.get(node, ()):
                holders.setdefault(key, []).append(node)
        outputs = set(storages.outputs)
        self.keys = []   # (name, role, bytes, static start or None, start's moving holders, latest fixed end,
        # end's moving positions, released placeholder)
        aliases: dict[str, tuple[str, ...]] = {}
        for key, held in holders.items():
            name, role, size = storages.facts[key]
            aliases[name] = tuple(n.name for n in held if n is not key[0])
            if size is None:
                continue
            first = held[0]
            released_slot = first.op == "placeholder" and first.name in self.released
            ends = [n for holder in held for n in (holder, *(d for u in holder.users for d in done(u)))]
            fixed_end, moving_end = split(ends)
            if first.op in ("placeholder", "get_attr"):
                start, moving_start = 0, []
                if not released_slot:
                    fixed_end = self.last
            else:
                moving_start = [n for n in held if n not in fixed]
                start = min((position[n] for n in held if n in fixed), default=self.last + 1)
            if key in outputs:
                fixed_end = self.last
            self.keys.append((name, role, size, start, moving_start, fixed_end, moving_end, released_slot))
        self.fast = True
        if memory_pools:
            self._in_place_rules(gm, nodes, holders, aliases, done)

    def _in_place_rules(self, gm, nodes, holders, aliases, done) -> None:
        """``analysis/arena.py``'s ``_updates_in_place`` and ``_created_state_in_place``, less what depends on the order."""
        by_name = {node.name: node for node in nodes}
        roles = {name: (role, size) for name, role, size, *_ in self.keys}
        persistent = {name for name, (role, _) in roles.items() if POOL_OF_ROLE[role] == PERSISTENT_POOL}
        root_of: dict[str, str] = {}
        for name in persistent:
            for alias in (name, *aliases[name]):
                if root_of.setdefault(alias, name) != name:
                    self.fast = False   # which storage an alias names follows the order: weigh each one whole
        devices = {v.device for name in roles if name not in persistent
                   for v in output_values(by_name[name.split("[")[0]])[:1] if isinstance(v, torch.Tensor)}
        # (a node whose first output is None, a backward's unneeded gradient, is never placed: placeable_outputs)
        if len(devices) > 1:
            self.fast = False   # the first node's device names an arena's (arena_members): the order decides
        last = self.last
        sizes = {name: size for name, (_, size) in roles.items()}

        known: dict[str, bool] = {}

        def placeable(node: fx.Node, names: list[str]) -> bool:   # placeable_outputs but for a value's end
            if node.name not in known:
                found = [Buffer(n, roles[n][0], "", sizes[n], 0, 0, 0, ()) for n in names]
                known[node.name] = isinstance(placeable_outputs(node, found, last + 1), list)
            return known[node.name]

        slots = {n.meta.get(g.SLOT): n for n in g.placeholders(gm) if n.meta.get(g.SLOT)}
        self.updates = []   # (root, its node, the old slot, positions reading the old value, elementwise)
        for slot_name, value in zip(gm.meta.get(g.OUTPUT_SLOTS, ()), g.output_node(gm).args[0][1:]):
            old = slots.get(slot_name)
            root = root_of.get(value.name) if isinstance(value, fx.Node) else None
            if old is None or root is None or "[" in root or roles[root][0] != "updated state":
                continue
            node = by_name[root]
            if not (_same_layout(old.meta.get(g.VAL), node.meta.get(g.VAL)) and placeable(node, [root])):
                continue
            readers = [u for name in (old.name, *(aliases.get(old.name, ()) if old.name in persistent else ()))
                       for u in by_name[name].users]
            self.updates.append((root, node, old, [d for u in readers for d in done(u)],
                                 torch.Tag.pointwise in getattr(node.target, "tags", ())))
        # created state: an update writing into a temporary made in the step outside the arenas
        outputs_of: dict[str, list[str]] = {}
        for name in roles:
            if name not in persistent:
                outputs_of.setdefault(name.split("[")[0], []).append(name)
        self.backend = all(has_backend(d) for d in devices)
        self.created = []   # (root, its node, [(arg, arg placeable but for its end)], elementwise)
        for name, (role, _) in roles.items():
            if role != "updated state" or "[" in name or name not in by_name:
                continue
            node = by_name[name]
            if node.op != "call_function" or not isinstance(node.meta.get(g.VAL), torch.Tensor):
                continue
            args = [arg for arg in node.all_input_nodes if arg.op == "call_function" and arg.name in outputs_of
                    and arg.name in sizes and _same_layout(arg.meta.get(g.VAL), node.meta.get(g.VAL))]
            if args and placeable(node, [name]):   # an argument in an arena (on a backend) is not outside it
                args = [(arg, self.backend and placeable(arg, outputs_of[arg.name])) for arg in args]
                self.created.append((name, node, args, torch.Tag.pointwise in getattr(node.target, "tags", ())))

    def peaks(self, gm: fx.GraphModule) -> tuple[tuple[int, int], tuple[int, int]]:
        """``live_peaks(gm, ...)`` and ``_peaks(gm, ...)`` of ``gm``'s current order (the same without memory pools)."""
        if not self.fast:
            live = live_peaks(gm, self.ctx, self.storages)
            return live, _peaks(gm, self.ctx, self.storages, True) if self.memory_pools else live
        position = {node: i for i, node in enumerate(gm.graph.nodes)}

        def latest(found: tuple[int, list[fx.Node]]) -> int:
            return max(found[0], max((position[n] for n in found[1]), default=-1))

        last_wait, last_computed = latest(self.waits), latest(self.computed)
        release = max(last_wait, last_computed) if self.released and max(last_wait, last_computed) >= 0 else None
        released = self.released if release is not None else set()
        ends, alive = {}, []
        for name, role, size, start, moving_start, fixed_end, moving_end, released_slot in self.keys:
            if moving_start:
                start = min(start, min(position[n] for n in moving_start))
            end = max(fixed_end, max((position[n] for n in moving_end), default=-1))
            if released_slot:
                end = max(end, self.last if release is None else release)
            ends[name] = end
            alive.append((name, size, start, end))
        live = self._counted(alive, released)
        if not self.memory_pools:
            return live, live
        in_place = self._in_place(position, ends, last_computed)
        written = set(in_place.values())
        return live, self._counted([(name, size, start, self.last if name in written else end)
                                    for name, size, start, end in alive if name not in in_place], released)

    def _counted(self, alive: list[tuple[str, int, int, int]], released: set[str]) -> tuple[int, int]:
        """The peaks with old slot values kept to the end, and with ``release_slots``' releases."""
        return (peak_bytes((size, start, self.last if name in released else end) for name, size, start, end in alive),
                peak_bytes((size, start, end) for _, size, start, end in alive))

    def _in_place(self, position: dict[fx.Node, int], ends: dict[str, int], last_computed: int) -> dict[str, str]:
        """Root name -> the name of the value it is written into, as ``arena_members(...).in_place``."""
        chosen: dict[str, str] = {}
        for root, node, old, reads, elementwise in self.updates:
            if root in chosen:
                continue
            last_read = max((position[n] for n in reads), default=-1)
            here = position[node]
            if here < last_computed:
                continue
            if last_read < here or (last_read == here and elementwise):
                chosen[root] = old.name
        used: set[str] = set()
        for root, node, args, elementwise in sorted(self.created, key=lambda c: position[c[1]]):
            if root in chosen:
                continue
            here = position[node]
            for arg, placeable in args:
                if arg.name in used or placeable and ends[arg.name] < self.last:
                    continue   # not outside the arenas
                last_read = ends[arg.name]
                if last_read < here or (last_read == here and elementwise):
                    chosen[root] = arg.name
                    used.add(arg.name)
                    break
        return chosen


def _same_layout(old, new) -> bool:
    return (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.shape == new.shape
            and old.stride() == new.stride() and old.dtype == new.dtype and old.device == new.device)


def _place(anchor: fx.Node, order: list[fx.Node]) -> None:
    """Put ``order``'s nodes right after ``anchor``, in that order."""
    cursor = anchor
    for node in order:
        cursor.append(node)
        cursor = node


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
