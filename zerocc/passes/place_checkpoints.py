"""place_checkpoints: under a memory budget, recompute forward values in backward instead of keeping them.

Requires: ``shard`` (parameters are views of buckets behind ``ops.unshard``
markers, not yet lowered to gathers). Runs before ``insert_collectives``.
Establishes: ``ctx.checkpoint_plan`` (a ``plans.CheckpointPlan``), and a
graph whose step peaks at most ``memory_budget`` bytes once the later passes
(collectives, schedule) have run. Without a budget it does nothing.

The graph is the joint step, so checkpointing is a rewrite: a forward value
that backward reads is either kept (it lives from forward into backward) or
recomputed: the forward nodes that produce it are copied into backward just
before its first backward use, backward reads the copies, and the forward
value dies at its last forward use. Copies are tagged ``PHASE`` backward and
``RECOMPUTED``; at stage 3 a copy that reads a parameter reads a view of the
bucket like any backward node, so ``insert_collectives`` re-derives it from
the backward gather: the forward gather is not kept alive by a recomputation.

What may be recomputed: forward ops that are pure and deterministic. Never a
random op (dropout's ``bernoulli``: its output is kept, and what is computed
from it can be recomputed exactly), a collective or marker, a mutating op,
or a scalar read. Views of parameters are never copied (the collectives pass
owns them); other views cost nothing and follow their base.

How it chooses (a greedy knapsack checked against the true peak):

  1. candidates are the forward storages backward reads; each has bytes (what
     recomputing it stops keeping) and a marginal cost: the FLOPs of the nodes
     that recomputing it adds to the copies, given what is recomputed already
     (a forward-only intermediate on the way is recomputed too; a kept value
     stops the copying). Candidates are ordered greedily by bytes per FLOP,
     costs updated lazily as the set grows: pointwise ops and norms first,
     matmuls and attention last, residual streams (whose recomputation would
     chain back through layers) after everything inside a layer;
  2. the peak of a prefix of that order is *measured*: the rewrite applied to
     a copy, then ``insert_collectives`` and ``schedule``, then the lifetime
     analysis ``plan_memory`` uses. A binary search finds the shortest prefix
     whose peak fits the budget (the plan with nothing recomputed first);
  3. when even the whole order does not fit, ``MemoryBudgetError`` says the
     smallest peak measured and what it is made of (model states against
     activations).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import operator
import time

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from .. import graph as g
from .. import ops
from ..context import CompileContext
from ..errors import MemoryBudgetError, user_line_of_node
from ..memory_plan import POOL_OF_ROLE, ROLES
from ..plans import CheckpointPlan, RecomputedTensor
from .insert_collectives import insert_collectives
from .plan_memory import buffer_lifetimes
from .schedule import schedule

aten = torch.ops.aten

# Attention kernels whose FLOPs the flop counter's registry does not know by this name.
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default}


def place_checkpoints(gm: fx.GraphModule, ctx: CompileContext, *, memory_budget: int | None,
                      prefetch_bytes: int) -> fx.GraphModule:
    """Recompute in backward the forward values that cost least per byte, until the step's peak fits the budget."""
    if memory_budget is None:
        ctx.notes["place_checkpoints"] = "no memory budget: every forward value backward reads is kept"
        return gm
    started = time.perf_counter()
    analysis = _Analysis(gm)
    order = analysis.greedy_order()
    peaks: dict[int, _Peak] = {}

    def peak_of(count: int) -> _Peak:
        if count not in peaks:
            measured = _measure(gm, ctx, analysis.recompute_set(order[:count]) if count >= 0 else None,
                                prefetch_bytes)
            peaks[count] = _highest_over_ranks(measured, ctx)
        return peaks[count]

    before = peak_of(-1)   # the graph as it is
    clones: dict[fx.Node, fx.Node] = {}
    if before.bytes <= memory_budget:
        chosen: list[fx.Node] = []
        peak = before
    else:
        # the peak is not monotone in the prefix (a long chain of copies can outlive what it saves): when
        # the whole order does not fit, sample it and search below the first sample that does
        low, high = 0, len(order)
        if peak_of(high).bytes > memory_budget:
            samples = _spread(len(order))
            fitting = [k for k in samples if peak_of(k).bytes <= memory_budget]
            if not fitting:
                _refuse(memory_budget, before, min(peak_of(k) for k in samples), len(analysis.candidates))
            high = fitting[0]
            low = max([k for k in samples if k < high], default=-1) + 1
        while low < high:   # invariant: the prefix of length high fits
            middle = (low + high) // 2
            if peak_of(middle).bytes <= memory_budget:
                high = middle
            else:
                low = middle + 1
        chosen = order[:high]
        peak = peak_of(high)
        clones = _recompute(gm, analysis.recompute_set(chosen))
        g.eliminate_dead_code(gm)
        gm.graph.lint()
        gm.recompile()
    cloned = sorted(clones, key=analysis.position.get)
    chosen_set = set(chosen)
    recomputed = tuple(RecomputedTensor(node.name, g.short_name(node.target),
                                        analysis.bytes[node] if node in chosen_set else 0,
                                        analysis.flops(node), user_line_of_node(node) or "") for node in cloned)
    ctx.checkpoint_plan = CheckpointPlan(
        budget_bytes=memory_budget, peak_before_bytes=before.bytes, peak_bytes=peak.bytes, recomputed=recomputed,
        saved_bytes=sum(analysis.bytes[n] for n in chosen), extra_flops=sum(r.flops for r in recomputed),
        forward_flops=analysis.forward_flops, candidates=len(analysis.candidates), evaluations=len(peaks))
    ctx.notes["place_checkpoints"] = (f"{len(chosen)} of {len(analysis.candidates)} stored tensors recomputed "
                                      f"({len(recomputed)} nodes copied into backward): peak "
                                      f"{megabytes(before.bytes)} -> {megabytes(peak.bytes)}, budget "
                                      f"{megabytes(memory_budget)}; {len(peaks)} plans measured in "
                                      f"{time.perf_counter() - started:.1f} s")
    return gm


# -- what can be recomputed, and at what cost ------------------------------------------------

def _is_alias(node: fx.Node) -> bool:
    """Does the node's value share its input's storage (a view, a getitem; a reshape is counted as one)?"""
    if node.op != "call_function":
        return False
    if node.target in (operator.getitem, aten._unsafe_view.default, aten.reshape.default):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return False


def _is_random(node: fx.Node) -> bool:
    """An op that draws random numbers: recomputing it would draw different ones."""
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    # attention kernels are tagged for their dropout; without dropout they are deterministic
    for argument, value in zip(node.target._schema.arguments, node.args):
        if argument.name == "dropout_p":
            return value != 0
    return "dropout_p" not in node.kwargs or node.kwargs["dropout_p"] != 0


def _is_tensor_value(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value) and all(
        v is None or isinstance(v, torch.Tensor) for v in value)


def _storage_bytes(value) -> int:
    values = value if isinstance(value, (tuple, list)) else (value,)
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class _Analysis:
    """The forward nodes of one graph: which may be recomputed, their storages, costs, and a greedy order."""

    def __init__(self, gm: fx.GraphModule):
        self.nodes = list(gm.graph.nodes)
        self.position = {node: i for i, node in enumerate(self.nodes)}
        self.parameter_views = self._parameter_views()
        self.recomputable = {n for n in self.nodes if self._may_recompute(n)}
        # the storage each forward value lives in: its own, or its base's for a view
        self.owner: dict[fx.Node, fx.Node] = {}
        for node in self.nodes:
            if node in self.recomputable:
                source = node.args[0] if _is_alias(node) and isinstance(node.args[0], fx.Node) else None
                self.owner[node] = self.owner.get(source, node) if source is not None else node
        used_by_backward = {self.owner[n] for n in self.recomputable if any(_is_backward(u) for u in n.users)}
        self.candidates = [n for n in self.nodes if n in used_by_backward and not _is_alias(n)]
        self.bytes = {n: _storage_bytes(n.meta.get(g.VAL)) for n in self.candidates}
        # recomputed unless chosen to be kept: views (free) and forward-only intermediates (kept by no one)
        self.always = self.recomputable - used_by_backward | {n for n in self.recomputable if _is_alias(n)}
        self._flops: dict[fx.Node, int] = {}
        self.forward_flops = sum(self.flops(n) for n in self.nodes
                                 if n.meta.get(g.PHASE) == g.FORWARD and n.op == "call_function")

    def _parameter_views(self) -> set[fx.Node]:
        """Placeholders, the shard pass's markers and views of them: alive anyway, and owned by insert_collectives."""
        found = set()
        for node in self.nodes:
            if node.op == "placeholder":
                found.add(node)
            elif node.op == "call_function" and node.all_input_nodes and node.all_input_nodes[0] in found and (
                    node.target in (ops.unshard, ops.reduce_gradient) or _is_alias(node)):
                found.add(node)
        return found

    def _may_recompute(self, node: fx.Node) -> bool:
        if node.op != "call_function" or node.meta.get(g.PHASE) != g.FORWARD or node in self.parameter_views:
            return False
        if node.target is not operator.getitem and not isinstance(node.target, torch._ops.OpOverload):
            return False   # Python arithmetic on symbolic scalars, custom callables
        if g.is_communication(node) or node.target in (ops.unshard, ops.reduce_gradient) or _is_random(node):
            return False
        if isinstance(node.target, torch._ops.OpOverload) and (node.target._schema.is_mutable or node.is_impure()):
            return False
        return _is_tensor_value(node.meta.get(g.VAL))

    def flops(self, node: fx.Node) -> int:
        """FLOPs of matmuls, convolutions and attention (the flop counter's formulas); elements written otherwise."""
        if node not in self._flops:
            self._flops[node] = _flops(node)
        return self._flops[node]

    def closure(self, recompute: set[fx.Node], roots) -> set[fx.Node]:
        """The nodes to copy so that ``roots`` can be recomputed: through inputs that are recomputed too."""
        found: set[fx.Node] = set()
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node in found:
                continue
            found.add(node)
            stack.extend(i for i in node.all_input_nodes if i in recompute and i not in found)
        return found

    def recompute_set(self, chosen) -> set[fx.Node]:
        return set(self.always) | set(chosen)

    def greedy_order(self) -> list[fx.Node]:
        """Candidates by bytes freed per FLOP of recomputing them, given those before them (lazy greedy).

        The bytes freed are the candidate's storage less the storages its
        recomputation newly keeps (the input of a copy that is not recomputed:
        a random op's output, say). Candidates that would free nothing are left out.
        """
        recompute = set(self.always)
        copied = self.closure(recompute, [n for n in recompute if any(_is_backward(u) for u in n.users)])
        kept = set(self.candidates) | self._inputs_kept(copied, recompute)

        def marginal(candidate):
            added = self.closure(recompute | {candidate}, [candidate]) - copied
            newly_kept = self._inputs_kept(added, recompute | {candidate}) - kept
            freed = self.bytes[candidate] - sum(_storage_bytes(n.meta.get(g.VAL)) for n in newly_kept)
            return added, newly_kept, freed, sum(self.flops(n) for n in added)

        heap = []
        for candidate in self.candidates:
            _, _, freed, cost = marginal(candidate)
            heap.append((-freed / (cost + 1.0), self.position[candidate], candidate))
        heapq.heapify(heap)
        order = []
        while heap:
            _, index, candidate = heapq.heappop(heap)
            added, newly_kept, freed, cost = marginal(candidate)
            score = -freed / (cost + 1.0)
            if heap and score > heap[0][0]:   # it got worse than the next one: put it back
                heapq.heappush(heap, (score, index, candidate))
                continue
            if freed <= 0:
                break   # the best left frees nothing
            order.append(candidate)
            recompute.add(candidate)
            copied |= added
            kept = (kept - {candidate}) | newly_kept
        return order

    def _inputs_kept(self, copies: set[fx.Node], recompute: set[fx.Node]) -> set[fx.Node]:
        """The storages the copies read from forward (parameters aside: they are there anyway)."""
        return {self.owner.get(i, i) for n in copies for i in n.all_input_nodes
                if i not in recompute and i not in self.parameter_views}


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get(g.PHASE) == g.BACKWARD and g.RECOMPUTED not in node.meta


def _flops(node: fx.Node) -> int:
    if node.op != "call_function" or _is_alias(node):
        return 0
    value = node.meta.get(g.VAL)

    def fake(argument):
        return argument.meta.get(g.VAL) if isinstance(argument, fx.Node) else argument
    args = [fake(a) for a in node.args]
    kwargs = {k: fake(v) for k, v in node.kwargs.items()}
    target = node.target
    try:
        if target in _ATTENTION:
            query, key, value_ = args[:3]
            return int(sdpa_flop_count(query.shape, key.shape, value_.shape))
        if isinstance(target, torch._ops.OpOverload) and target.overloadpacket in flop_registry:
            return int(flop_registry[target.overloadpacket](*args, **kwargs, out_val=value))
    except Exception:   # a formula that does not take these arguments: count elements instead
        pass
    values = value if isinstance(value, (tuple, list)) else (value,)
    return sum(int(v.numel()) for v in values if isinstance(v, torch.Tensor))


# -- the rewrite ---------------------------------------------------------------------------------

def _recompute(gm: fx.GraphModule, recompute: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Copy what backward needs of ``recompute`` into backward, before its first use; returns original -> copy."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    roots = [n for n in recompute if any(_is_backward(u) for u in n.users)]
    copied: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in copied:
            copied.add(node)
            stack.extend(i for i in node.all_input_nodes if i in recompute)
    # where each copy is needed: its first backward use, or that of a copy that reads it
    need: dict[fx.Node, int] = {}
    for node in sorted(copied, key=position.get, reverse=True):
        uses = [position[u] for u in node.users if _is_backward(u)] + [need[u] for u in node.users if u in copied]
        need[node] = min(uses)
    clones: dict[fx.Node, fx.Node] = {}
    for node in sorted(copied, key=lambda n: (need[n], position[n])):
        with graph.inserting_before(nodes[need[node]]):
            clone = graph.node_copy(node, lambda argument: clones.get(argument, argument))
        clone.meta[g.PHASE] = g.BACKWARD
        clone.meta[g.RECOMPUTED] = node.name
        clones[node] = clone
    for node, clone in clones.items():
        for user in list(node.users):
            if _is_backward(user):
                user.replace_input_with(node, clone)
    return clones


# -- measuring a plan: the remaining passes on a copy, then the lifetimes plan_memory sees ------------

@dataclasses.dataclass(frozen=True, order=True)
class _Peak:
    bytes: int
    by_role: tuple[tuple[str, int], ...] = ()


class _Scratch:
    """A graph and its meta standing in for a GraphModule: the passes run on it without generating code."""

    def __init__(self, graph: fx.Graph, meta: dict):
        self.graph, self.meta = graph, meta

    def recompile(self) -> None:
        pass


def _measure(gm: fx.GraphModule, ctx: CompileContext, recompute: set[fx.Node] | None, prefetch_bytes: int) -> _Peak:
    """The most bytes alive at once in the step once ``recompute`` is recomputed (None: as it is) and scheduled."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    copy = _Scratch(graph, dict(gm.meta))
    if recompute is not None:
        _recompute(copy, {env[n] for n in recompute})
        g.eliminate_dead_code(copy)
    scratch = dataclasses.replace(ctx, notes={})
    copy = insert_collectives(copy, scratch)
    copy = schedule(copy, scratch, prefetch_bytes=prefetch_bytes)
    positions = len(copy.graph.nodes)
    deltas = {role: [0] * (positions + 1) for role in ROLES}
    for _, role, nbytes, start, end, _ in buffer_lifetimes(copy):
        deltas[role][start] += nbytes
        deltas[role][end + 1] -= nbytes
    running = {role: list(itertools.accumulate(values)) for role, values in deltas.items()}
    totals = [sum(column) for column in zip(*running.values())]
    at = max(range(positions), key=totals.__getitem__)
    return _Peak(totals[at], tuple((role, values[at]) for role, values in running.items() if values[at]))


def megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB"


def _highest_over_ranks(peak: _Peak, ctx: CompileContext) -> _Peak:
    """The highest of every rank's peak: ranks own different optimizer pieces, so their peaks differ a little,
    and every rank must make the same decision (the collectives' order depends on it) and fit the budget."""
    if ctx.world_size == 1 or ctx.planning or ctx.group_name is None:
        return peak
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    peaks: list = [None] * ctx.world_size
    dist.all_gather_object(peaks, peak, group=_resolve_process_group(ctx.group_name))
    return max(peaks)


def _spread(count: int, samples: int = 8) -> list[int]:
    return sorted({round(count * i / samples) for i in range(samples + 1)})


def _refuse(budget: int, before: _Peak, best: _Peak, candidates: int) -> None:
    by_pool: dict[str, int] = {}
    for role, nbytes in best.by_role:
        by_pool[POOL_OF_ROLE[role]] = by_pool.get(POOL_OF_ROLE[role], 0) + nbytes
    states = sum(v for k, v in by_pool.items() if k in ("persistent", "gathered parameters", "gradient buckets"))
    activations = by_pool.get("activations", 0)
    parts = ", ".join(f"{role} {megabytes(nbytes)}" for role, nbytes in sorted(best.by_role, key=lambda r: -r[1]))
    if states >= activations:
        why = ("model states dominate it: a higher ZeRO stage or more ranks shrink them; "
               "recomputing activations cannot")
    else:
        why = ("activations dominate it even with every recomputable value recomputed: a smaller batch or "
               "sequence shrinks them")
    raise MemoryBudgetError(
        f"memory_budget={budget:,} bytes ({megabytes(budget)}) cannot be met: the smallest peak the checkpoint "
        f"planner reaches is {best.bytes:,} bytes ({megabytes(best.bytes)}; {megabytes(before.bytes)} with nothing "
        f"recomputed, {candidates} stored tensors considered).\n"
        f"  at that peak: model states {megabytes(states)}, activations {megabytes(activations)} ({parts})\n"
        f"  {why}; or raise memory_budget to at least {best.bytes:,}.")
