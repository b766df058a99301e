"""schedule: issue collectives early and wait for them late, so communication overlaps compute.

Requires: ``insert_collectives`` (each collective directly followed by its
``wait_tensor``; each reduction followed by its division by N).
Establishes: a ``Schedule`` on ``ctx``, and a node order in which

  - every wait (and the division that averages a reduction) sits just before
    the first use of its result, so the collective runs while the compute
    between its issue and that use runs;
  - stage 3's gathers of parameters are prefetched: gather k+1, k+2, ... are
    issued as soon as gather k is waited, as long as the gathered bytes issued
    and not yet waited stay within ``prefetch_bytes`` (one gather is always
    allowed, so the step progresses whatever the bound);
  - a reduce-scatter is issued as soon as its bucket's gradients are final
    (``shard`` puts it there) and waited where its shard is used, or earlier
    where waiting later would keep more than ``prefetch_bytes`` of unreduced
    gradient buckets alive: an in-flight collective holds its full-size input
    (then the wait comes before the next bucket is made, its concatenation:
    not between that and the next issue, where both buckets were alive);
  - at stage 3, backward reads forward's gather of a bucket instead of
    gathering it again when forward's copy is still alive where the second
    gather would be issued (it costs no memory: the two copies overlapped),
    or dies shortly before, as long as the bytes kept beyond forward's last
    use, with the gathers in flight meanwhile, stay within ``prefetch_bytes``.
    That is the turn of the step: the buckets forward uses last (and the
    embedding a tied output layer reads) are needed first by backward, and
    their second gather could not be hidden behind compute (the loss is
    short), so it was the longest wait of the step.

Under a memory budget, ``place_remat`` may decide that the budget
bounds the step's peak instead of ``prefetch_bytes``
(``ctx.remat_plan.unbounded_schedule``): then every gather and
reduction is issued and kept without a byte bound, and backward gathers
nothing. Or it may let kept copies hold ``ctx.remat_plan.keep_extra_bytes``
more than ``prefetch_bytes`` (prefetch and reductions keep their bound):
more buckets, in the order backward gathers them, are gathered once.

Only collectives, waits and the averaging divisions move; compute keeps its
traced order, so random ops run in eager's order. Every decision is a function
of the forward and backward part of the graph, which is the same on every rank
(only the optimizer's pieces differ by rank, and no collective moves across
them), so every rank issues the same collectives in the same order.

On CPU, gloo runs a functional collective on its own worker threads between
its issue and ``wait_tensor``. On CUDA, NCCL runs it on its own stream and
``wait_tensor`` makes the compute stream wait on the collective's event: the
same graph overlaps on both, the runtime adds nothing.
"""
from __future__ import annotations

import operator

import numpy
import torch
import torch.fx as fx

from .. import graph as g
from ..context import CompileContext
from ..graph import wait_of
from ..decisions import UNBOUNDED_PREFETCH, Schedule, ScheduledCollective

KIND = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
        "all_to_all_single": "reduce_scatter",   # a reduce-scatter on gloo (passes/scatter_by_all_to_all.py)
        "all_gather_by_send_recv": "all_gather",  # an all-gather on gloo (passes/gather_by_send_recv.py)
        "all_reduce": "all_reduce", "broadcast": "broadcast"}


def schedule(gm: fx.GraphModule, ctx: CompileContext, *, prefetch_bytes: int,
             unbounded: bool | None = None) -> fx.GraphModule:
    """Move waits to the first use of their result and prefetch parameter gathers within ``prefetch_bytes``.

    ``unbounded`` (default: what ``ctx.remat_plan`` decided, else False) lifts the ``prefetch_bytes``
    bound: a memory budget bounds the peak instead.
    """
    if unbounded is None:
        unbounded = ctx.remat_plan is not None and ctx.remat_plan.unbounded_schedule
    if unbounded:
        prefetch_bytes = UNBOUNDED_PREFETCH   # a memory budget bounds the peak instead
    keep_bytes = prefetch_bytes + (ctx.remat_plan.keep_extra_bytes if ctx.remat_plan is not None and not unbounded
                                   else 0)
    graph = gm.graph
    collectives = [n for n in graph.nodes if g.is_collective(n)]
    if not collectives:
        ctx.schedule = Schedule(prefetch_bytes, (), 0, 0)
        ctx.notes["schedule"] = "no collectives"
        return gm
    original_order = {node: i for i, node in enumerate(collectives)}
    sunk = _sink_waits(graph)
    prefetched = _prefetch_parameter_gathers(graph, prefetch_bytes)
    kept = _keep_forward_gathers(graph, keep_bytes)
    prefetched &= set(graph.nodes)   # less the backward gathers just dropped
    bounded = _bound_reductions_in_flight(graph, prefetch_bytes)
    graph.lint()
    gm.recompile()

    issued = [n for n in graph.nodes if g.is_collective(n)]
    ctx.schedule = Schedule(
        prefetch_bytes,
        tuple(ScheduledCollective(KIND[g.short_name(n.target)], n.meta.get(g.BUCKET), held_bytes(n), n in prefetched)
              for n in issued),
        max_in_flight(gm, is_parameter_gather),
        max_in_flight(gm, g.is_reduce_scatter),
        tuple(kept),
    )
    moved = sum(1 for a, b in zip(issued, sorted(issued, key=original_order.get)) if a is not b)
    ctx.notes["schedule"] = (f"{sunk} waits moved to first use, {len(prefetched)} gathers prefetched "
                             f"({moved} collectives reordered), {len(kept)} kept from forward into backward "
                             f"(-{len(kept)} all_gather), {bounded} reduce-scatter waits moved earlier "
                             + ("(no bound: under a memory budget)" if unbounded
                                else f"to keep <= {prefetch_bytes:,} bytes in flight"))
    return gm


def is_parameter_gather(node: fx.Node) -> bool:
    """A stage 3 gather of a parameter shard (a placeholder, or its mixed-precision cast): free to move
    anywhere before its wait, the cast with it."""
    return g.is_all_gather(node) and g.is_parameter_shard(node.args[0])


def held_bytes(collective: fx.Node) -> int:
    """The full-size buffer an in-flight collective holds: the gathered output, or the unreduced input."""
    return g.nbytes(collective.args[0]) if g.is_reduce_scatter(collective) else g.nbytes(collective)


def _is_shard_cast(node: fx.Node) -> bool:
    """A shard's cast to param_dtype (mixed precision): it goes with its gather."""
    return node.op == "call_function" and g.is_parameter_shard(node)


def _movable(node: fx.Node) -> bool:
    """A wait, or communication bookkeeping after one (the division that averages a reduction)."""
    if node.op != "call_function" or g.is_collective(node):
        return False
    return g.is_wait(node) or node.meta.get(g.PHASE) == g.COMMUNICATION


def _sink_waits(graph: fx.Graph) -> int:
    """Move each wait (and what averages its result) to just before the first user of its result."""
    moved = 0
    for node in reversed(list(graph.nodes)):
        if not _movable(node) or not node.users:
            continue
        # nodes compare by their place in the graph: the first user without walking to it (a walk from each wait
        # to its first use grew with the square of the depth: a gradient's wait is read by the update at the end)
        first = min(node.users)
        if first is not node.next:
            first.prepend(node)
            moved += 1
    return moved


def _prefetch_parameter_gathers(graph: fx.Graph, prefetch_bytes: int) -> set[fx.Node]:
    """Issue parameter gathers in the order they are needed, each after the wait that makes room for it.

    Walking the gathers in need order (the order of their waits), gather j is
    issued right after the wait of the last gather i < j such that, once i is
    waited, the gathers i+1..j fit in ``prefetch_bytes``, or before any compute
    when they fit from the start.
    """
    position = {node: i for i, node in enumerate(graph.nodes)}
    gathers = sorted((n for n in graph.nodes if is_parameter_gather(n)), key=lambda n: position[wait_of(n)])
    if not gathers:
        return set()
    start = next(n for n in graph.nodes if n.op != "placeholder")
    anchors: list[fx.Node | None] = [None] * len(gathers)   # None: before the first compute node
    in_flight, issued = 0, 0
    for waited in range(-1, len(gathers)):
        if waited >= 0:
            in_flight -= held_bytes(gathers[waited])
        while issued < len(gathers) and (in_flight == 0 or in_flight + held_bytes(gathers[issued]) <= prefetch_bytes):
            anchors[issued] = None if waited < 0 else wait_of(gathers[waited])
            in_flight += held_bytes(gathers[issued])
            issued += 1
    prefetched = set()
    # nodes compare by their place in the graph (fx keeps that order as nodes move): no positions to recount
    for gather, anchor in zip(gathers, anchors):
        # after the anchor and after any gather already placed there, so issue order is need order
        target = start if anchor is None else anchor.next
        while target is not wait_of(gather) and (is_parameter_gather(target) or _is_shard_cast(target)):
            target = target.next
        if target is not gather:
            earlier = target < gather
            shard = gather.args[0]
            if shard.op != "placeholder" and shard > target:
                target.prepend(shard)   # the cast of the shard to param_dtype moves with its gather
            target.prepend(gather)
            if earlier:
                prefetched.add(gather)
    return prefetched


def _keep_forward_gathers(graph: fx.Graph, keep_bytes: int) -> list[int]:
    """Drop the backward gather of a bucket whose forward copy can serve backward; returns the buckets.

    A bucket's forward copy is kept when it is still alive where its backward
    gather is issued (free), or when the bytes of kept copies beyond their
    last forward use plus the gathers in flight stay within ``keep_bytes``
    (``prefetch_bytes``, plus what ``place_remat`` allows) over that gap.
    Buckets are taken in the order backward gathers them.
    """
    twice: dict[int, list[fx.Node]] = {}
    gathers: dict[fx.Node, tuple[fx.Node, int]] = {}   # every parameter gather: its wait and bytes
    for node in graph.nodes:
        if is_parameter_gather(node):
            gathers[node] = (wait_of(node), held_bytes(node))
            if node.meta.get(g.BUCKET) is not None:
                twice.setdefault(node.meta[g.BUCKET], []).append(node)
    pairs = [nodes for nodes in twice.values() if len(nodes) == 2]   # graph order: (forward, backward)
    pairs.sort(key=lambda nodes: nodes[1])   # nodes compare by their place in the graph
    kept = []
    held = _HeldBytes(graph, gathers)
    for forward, backward in pairs:
        forward_wait, backward_wait = wait_of(forward), wait_of(backward)
        last_forward_use = _last_use(forward_wait)
        if backward > last_forward_use:
            if held.most_between(last_forward_use, backward) + held_bytes(forward) > keep_bytes:
                continue
            held.keep(last_forward_use, min(backward_wait.users), held_bytes(forward))   # until backward's first use
        shard = backward.args[0]
        backward_wait.replace_all_uses_with(forward_wait)
        held.drop_gather(backward, *gathers.pop(backward))
        held.erase(graph, backward_wait)
        held.erase(graph, backward)
        if shard.op != "placeholder" and not shard.users:
            held.erase(graph, shard)   # the shard's cast to param_dtype went with the gather
        kept.append(forward.meta[g.BUCKET])
    return kept


def _last_use(value: fx.Node) -> fx.Node:
    """The last node that reads ``value`` or a view of it (through ops whose schema returns an alias)."""
    last, seen, stack = value, {value}, [value]
    while stack:
        for user in stack.pop().users:
            if user > last:
                last = user
            if user not in seen and _is_alias(user):
                seen.add(user)
                stack.append(user)
    return last


def _is_alias(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return node.op == "call_function" and node.target is operator.getitem
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class _HeldBytes:
    """The bytes held (parameter gathers issued, not waited, and forward copies kept for backward) from each node
    of the graph on, as a running sum over its order: ``_keep_forward_gathers`` asks the most held between a
    bucket's last forward use and its backward gather, once per bucket.

    The bytes change only where a gather is issued or waited and where a kept span begins or ends. Rebuilding
    and sorting those changes for every bucket (the sweep this replaces) grew with the square of the depth
    (the 96-layer GPT at 1024 ranks: 577 buckets, 1000 gathers each time); here they sit at the nodes' places
    in the graph as it was when the pass began (it only erases nodes, so the order holds), and each question
    is a prefix sum and a maximum over a slice. A kept span begins at the node after the last forward use, as
    the graph is when asked: when that node is erased, its change moves to the next one (and the span is
    dropped once it would begin at or after its end), so the sums are those of the live nodes alone.
    """

    def __init__(self, graph: fx.Graph, gathers: dict[fx.Node, tuple[fx.Node, int]]):
        self.place = {node: i for i, node in enumerate(graph.nodes)}
        self.changes = numpy.zeros(len(self.place), dtype=numpy.int64)   # from this node on, the bytes change by
        for gather, (wait, nbytes) in gathers.items():
            self.changes[self.place[gather]] += nbytes   # in flight from its issue until its wait
            self.changes[self.place[wait]] -= nbytes
        self.spans: dict[fx.Node, list[tuple[fx.Node, int]]] = {}   # node -> (end, bytes) of the spans beginning there
        self.sums: numpy.ndarray | None = None

    def most_between(self, start: fx.Node, stop: fx.Node) -> int:
        """The most bytes held strictly between ``start`` and ``stop`` (0 when nothing is between them)."""
        first = start.next
        if not first < stop:
            return 0
        if self.sums is None:
            self.sums = numpy.cumsum(self.changes)
        low, high = self.place[first], self.place[stop]
        return int(max(0, self.sums[low:high].max()))

    def keep(self, last_use: fx.Node, end: fx.Node, nbytes: int) -> None:
        """Hold ``nbytes`` after ``last_use`` until ``end``."""
        self._begin(last_use.next, end, nbytes)

    def drop_gather(self, gather: fx.Node, wait: fx.Node, nbytes: int) -> None:
        self._change(gather, -nbytes)
        self._change(wait, nbytes)

    def erase(self, graph: fx.Graph, node: fx.Node) -> None:
        """Erase ``node`` from ``graph``; the spans beginning there begin at the node after it."""
        after = node.next
        for end, nbytes in self.spans.pop(node, ()):
            self._change(node, -nbytes)
            self._change(end, nbytes)
            self._begin(after, end, nbytes)
        graph.erase_node(node)

    def _begin(self, begin: fx.Node, end: fx.Node, nbytes: int) -> None:
        if begin < end:
            self._change(begin, nbytes)
            self._change(end, -nbytes)
            self.spans.setdefault(begin, []).append((end, nbytes))

    def _change(self, node: fx.Node, nbytes: int) -> None:
        self.changes[self.place[node]] += nbytes
        self.sums = None


def _bound_reductions_in_flight(graph: fx.Graph, prefetch_bytes: int) -> int:
    """Wait for reduce-scatter i before making (or issuing) one that would hold more than ``prefetch_bytes`` of inputs."""
    reductions = [n for n in graph.nodes if g.is_reduce_scatter(n)]
    moved = 0
    for index, reduction in enumerate(reductions):
        wait = wait_of(reduction)
        held = held_bytes(reduction)
        for later in reductions[index + 1:]:
            if later > wait:   # nodes compare by their place in the graph
                break
            held += held_bytes(later)
            if held > prefetch_bytes:
                # before the later bucket is made, not just before its issue: the bucket held by reduction i is
                # alive until this wait, and with the wait after the concatenation that makes the next one, both
                # full buckets were alive at once there, at backward's peak (the examples' 5M GPT at stage 2 on
                # 2 CPU ranks: 3.2 MB more in its arena than waiting one copy earlier; the copy hides little)
                made = later.args[0]
                first = made if isinstance(made, fx.Node) and made.op == "call_function" and made > reduction else later
                first.prepend(wait)   # the division stays at the first use; it only needs the wait before it
                moved += 1
                break
    return moved


def max_in_flight(gm: fx.GraphModule, which) -> int:
    """The most full-size bytes held at once by collectives ``which`` selects that are issued and not waited."""
    in_flight, peak = 0, 0
    waits = {}
    for node in gm.graph.nodes:
        if g.is_collective(node) and which(node):
            in_flight += held_bytes(node)
            waits[wait_of(node)] = held_bytes(node)
            peak = max(peak, in_flight)
        elif node in waits:
            in_flight -= waits.pop(node)
    return peak
