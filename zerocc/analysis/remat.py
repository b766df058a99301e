"""What the remat planner may recompute, at what cost, and the min-cuts that choose it.

Used by ``passes/place_remat.py`` (the pass: it rewrites the graph and
measures each plan's true peak); this module only reads a graph.

A plan is the set of forward nodes copied into backward. It comes from a
split-node minimum cut (what PyTorch's min-cut partitioner does): every
forward node ``n`` is two vertices ``n.in -> n.out`` joined by an edge whose
capacity is the bytes of ``n``'s storage; ``n.out -> u.in`` for each forward
user (unbounded), ``n.out -> sink`` when backward reads ``n`` (unbounded).
A cut separates what forward keeps (the ``in -> out`` edges cut: saved
storages) from what backward recomputes (nodes whose ``in`` is on the sink
side). Nodes that must not be recomputed (random ops, collectives and the
shard pass's markers, mutating ops, scalar reads) hang from the source by an
unbounded edge, so a cut cannot pass through them: their outputs are saved.
Parameters hang from the source with a free ``in -> out`` edge: at stage 3 a
copy that reads one reads the backward gather (``insert_collectives``).

Recomputing has a price: ``source -> n.in`` carries ``price * cost(n)`` and
is cut exactly when ``n`` is recomputed, so the cut minimises bytes kept plus
the priced recomputation. Costs are FLOPs for expensive ops (matmuls,
convolutions, attention) and elements written for the rest, each scaled by a
small factor growing with forward position so that identical layers do not
switch at the same price (earlier layers are recomputed first: the last
layer's copies are alive at the start of backward, usually the peak). The
plans are the breakpoints of two parametric sweeps (Eisner-Severance: a new
cut is solved only where two known plans' lines cross): first the price of
cheap ops falls from prohibitive to near zero with expensive ops banned,
then the price of expensive ops falls likewise. This orders plans from least
to most recomputation, each the fewest bytes kept for its recompute cost: the
knapsack over expensive ops by FLOPs per byte, solved exactly for the bytes
the cut sees.

Each cut is a maximum flow on one network built once (``analysis/min_cut.py``:
integer capacities, Dinic's algorithm, each solve of a sweep starting from
the flow of the one below its price): listing the 98M GPT's 88 plans takes
0.2 s (0.55 s with levels counted from the source), where networkx's Boykov-Kolmogorov, rebuilding its residual network
per cut, took 9.9-16 s for the same plans.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from .. import graph as g
from .. import ops
from . import min_cut

aten = torch.ops.aten

# Capacities are integers (exact flows: analysis/min_cut.py): bytes and priced costs in this many units per byte,
# fine enough that NEGLIGIBLE times one element written is still a unit.
_UNITS_PER_BYTE = 2**20

# Attention kernels whose FLOPs the flop counter's registry does not know by this name.
_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu.default}

# Prices, in bytes kept per unit of cost: above PROHIBITIVE nothing of that kind is worth recomputing, at
# NEGLIGIBLE everything that saves a byte is. A cheap op's cost is elements written; an expensive one's FLOPs.
PROHIBITIVE = 1e3
NEGLIGIBLE = 1e-6
_SPREAD = 0.05   # identical layers' costs differ by up to 5% with position


def is_alias(node: fx.Node) -> bool:
    """Does the node's value share its input's storage (a view; a reshape is counted as one)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:   # an element of a tuple of views is a view
        return isinstance(node.args[0], fx.Node) and is_alias(node.args[0])
    if node.target in (aten._unsafe_view.default, aten.reshape.default):
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return False


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers: recomputing it would draw different ones."""
    return draws_random_numbers(node.target, node.args, node.kwargs)


def draws_random_numbers(target, args, kwargs) -> bool:
    """A call of ``target`` that takes numbers from a generator (capture's replay asks it of ops as they run)."""
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    # attention kernels are tagged for their dropout; without dropout they are deterministic
    for argument, value in zip(target._schema.arguments, args):
        if argument.name == "dropout_p":
            return value != 0
    return kwargs.get("dropout_p", 1) != 0


def forward_region(nodes) -> set[fx.Node]:
    """The forward nodes, and the backward views of them that autograd places next to the forward op (the
    getitems of a saved mean, the detach of a saved output): reading those is not yet backward."""
    region: set[fx.Node] = set()
    for node in nodes:
        if node.op != "call_function" or g.RECOMPUTED in node.meta:
            continue
        phase = node.meta.get(g.PHASE)
        if phase == g.FORWARD or phase == g.BACKWARD and (node.target is operator.getitem or is_alias(node)) and all(
                i in region or i.op == "placeholder" for i in node.all_input_nodes):
            region.add(node)
    return region


def is_backward(node: fx.Node, region: set[fx.Node]) -> bool:
    """Does backward proper compute the node (not a view of forward's, not a recomputed copy)?"""
    return node.meta.get(g.PHASE) == g.BACKWARD and node not in region and g.RECOMPUTED not in node.meta


def storage_bytes(value) -> int:
    return g.known_bytes(value)


def _is_tensor_value(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value) and all(
        v is None or isinstance(v, torch.Tensor) for v in value)


@dataclasses.dataclass(frozen=True)
class Cut:
    """One plan: the forward nodes recomputed, and what the cut counted (bytes kept, costs of the recomputed)."""
    recompute: frozenset
    kept_bytes: float
    cheap_cost: float      # elements written by recomputed cheap ops (position-scaled)
    expensive_cost: float  # FLOPs of recomputed expensive ops (position-scaled)


class Recomputation:
    """The forward nodes of one graph: which may be recomputed, their bytes and costs, and plans by min-cut."""

    def __init__(self, gm: fx.GraphModule):
        self.nodes = list(gm.graph.nodes)
        self.position = {node: i for i, node in enumerate(self.nodes)}
        self.region = forward_region(self.nodes)
        self.parameter_views = self._parameter_views()
        self.recomputable = {n for n in self.nodes if self._may_recompute(n)}
        self.forward = [n for n in self.nodes if n.op == "placeholder" or self._in_forward(n)]
        self.read_by_backward = {n for n in self.forward if any(self.is_backward(u) for u in n.users)}
        self._flops: dict[fx.Node, int] = {}
        self.forward_flops = sum(self.flops(n) for n in self.forward if n.op == "call_function")
        self.candidates = [n for n in self.read_by_backward if n in self.recomputable and not is_alias(n)]
        self._cuts: min_cut.Solver | None = None   # built at the first cut: a search under the default plan's peak
        # that stops at its floor (place_remat) cuts nothing

    def _in_forward(self, node: fx.Node) -> bool:
        return node in self.region

    def is_backward(self, node: fx.Node) -> bool:
        return is_backward(node, self.region)

    def _parameter_views(self) -> set[fx.Node]:
        """Placeholders, the shard pass's markers and views of them: alive anyway, and owned by insert_collectives."""
        found = set()
        for node in self.nodes:
            if node.op == "placeholder":
                found.add(node)
            elif node.op == "call_function" and node.all_input_nodes and node.all_input_nodes[0] in found and (
                    node.target in (ops.unshard, ops.reduce_gradient) or is_alias(node)):
                found.add(node)
        return found

    def _may_recompute(self, node: fx.Node) -> bool:
        if not self._in_forward(node) or node in self.parameter_views:
            return False
        if node.target is operator.getitem:   # an element of a tuple: recomputed with the tuple
            return isinstance(node.args[0], fx.Node) and self._may_recompute(node.args[0])
        if not isinstance(node.target, torch._ops.OpOverload):
            return False   # Python arithmetic on symbolic scalars, custom callables
        if g.is_communication(node) or node.target in (ops.unshard, ops.reduce_gradient) or is_random(node):
            return False
        if node.target._schema.is_mutable or node.is_impure():
            return False
        value = node.meta.get(g.VAL)
        if any(g.is_data_dependent(v) for v in g.values_of(value)):
            return False   # sized by the data: unplanned, so recomputing it frees nothing the plan sees
        return _is_tensor_value(value)

    def flops(self, node: fx.Node) -> int:
        """FLOPs of matmuls, convolutions and attention (the flop counter's formulas); elements written otherwise."""
        if node not in self._flops:
            self._flops[node] = flops_of(node)
        return self._flops[node]

    def is_expensive(self, node: fx.Node) -> bool:
        return is_expensive_op(node)

    def bytes_of(self, node: fx.Node) -> int:
        return storage_bytes(node.meta.get(g.VAL))

    # -- the network and its cuts --------------------------------------------------------------

    def _build_network(self) -> min_cut.Solver:
        """The split-node network, prices left out (``cut`` sets the ``source -> in`` arcs' capacities), and the
        solver of its cuts."""
        network = min_cut.Network()
        network.vertex("source")
        network.vertex("sink")
        # the spread is over the order of forward's ops, the same on every rank: positions in the whole graph
        # count the placeholders and the optimizer region, whose pieces differ by rank, and the different
        # costs gave ranks different plans (then different collectives)
        order = {n: i for i, n in enumerate(n for n in self.forward if n.op != "placeholder")}
        count = max(len(order), 1)
        self._costs: dict[fx.Node, tuple[bool, float]] = {}   # node -> (expensive, position-scaled cost)
        self._priced: dict[fx.Node, int] = {}                  # node -> its source -> in arc
        self._stored: dict[fx.Node, int] = {}                  # node -> bytes its in -> out arc carries
        for node in self.forward:
            inside, outside = (node, "in"), (node, "out")
            if node in self.parameter_views:
                network.add_arc("source", inside)
                network.add_arc(inside, outside, 0)
            elif node not in self.recomputable:
                network.add_arc("source", inside)   # unbounded: never recomputed; kept whole if backward reads it
                self._stored[node] = self.bytes_of(node)
                network.add_arc(inside, outside, self._stored[node] * _UNITS_PER_BYTE)
            else:
                tuple_valued = isinstance(node.meta.get(g.VAL), (tuple, list))
                if not (is_alias(node) or tuple_valued):   # a view or a tuple is kept as its storages
                    self._stored[node] = self.bytes_of(node)
                    network.add_arc(inside, outside, self._stored[node] * _UNITS_PER_BYTE)
                else:
                    network.add_arc(inside, outside)
                if not is_alias(node):
                    scale = 1.0 + _SPREAD * order[node] / count
                    self._costs[node] = (self.is_expensive(node), float(self.flops(node)) * scale)
                    self._priced[node] = network.add_arc("source", inside, 0)
            for user in node.users:
                if self._in_forward(user):
                    network.add_arc(outside, (user, "in"))
            if node in self.read_by_backward:
                network.add_arc(outside, "sink")
        return min_cut.Solver(network, "source", "sink")

    def cut(self, cheap_price: float, expensive_price: float | None) -> Cut:
        """The plan keeping the fewest bytes plus priced recomputation (expensive ops banned when its price is None).

        The two sweeps of ``plans`` are the solver's two families: the cheap ops' price rising with expensive
        ops banned, and the expensive ops' price rising with cheap ops at ``NEGLIGIBLE``.
        """
        if self._cuts is None:
            self._cuts = self._build_network()
        capacities = {}
        for node, (expensive, cost) in self._costs.items():
            if expensive and expensive_price is None:
                capacities[self._priced[node]] = min_cut.INFINITE
            else:
                price = expensive_price if expensive else cheap_price
                capacities[self._priced[node]] = round(price * cost * _UNITS_PER_BYTE)
        if expensive_price is None:
            sink_side = self._cuts.solve(capacities, family="expensive banned", key=cheap_price)
        else:
            sink_side = self._cuts.solve(capacities, family=("cheap at", cheap_price), key=expensive_price)
        recompute = frozenset(n for n in self.recomputable if (n, "in") in sink_side)
        kept = sum(float(nbytes) for node, nbytes in self._stored.items()
                   if (node, "in") not in sink_side and (node, "out") in sink_side)
        cheap = sum(c for n, (e, c) in self._costs.items() if n in recompute and not e)
        expensive = sum(c for n, (e, c) in self._costs.items() if n in recompute and e)
        return Cut(recompute, kept, cheap, expensive)

    def plans(self, cheap_only: bool = False) -> list[frozenset]:
        """Plans from least to most recomputation: the breakpoints of the two parametric sweeps.

        ``cheap_only``: the cheap ops' sweep alone, which bans expensive ops, so the plans recomputing none of
        them: what ``place_remat`` searches under the default plan's peak, without solving the expensive ops'
        sweep (its first cut is the cheap sweep's last; the rest recompute an expensive op).
        """
        cuts = self._sweep(lambda price: self.cut(price, None), "cheap_cost")
        if not cheap_only:
            cuts += self._sweep(lambda price: self.cut(NEGLIGIBLE, price), "expensive_cost")[1:]
        plans: list[frozenset] = []
        for cut in cuts:
            if (cut.cheap_cost or cut.expensive_cost) and cut.recompute not in plans:   # not views alone
                plans.append(cut.recompute)
        return plans

    @staticmethod
    def _sweep(solve, priced: str) -> list[Cut]:
        """Every plan optimal for some price between PROHIBITIVE and NEGLIGIBLE, by least priced cost."""
        def fixed(cut):   # what the cut pays besides the priced cost
            return cut.kept_bytes + (0.0 if priced == "cheap_cost" else NEGLIGIBLE * cut.cheap_cost)

        high, low = solve(PROHIBITIVE), solve(NEGLIGIBLE)
        found = {id(high): high, id(low): low}
        pending = [(high, low)]
        while pending:
            left, right = pending.pop()   # left recomputes less and keeps more
            more, less = getattr(right, priced) - getattr(left, priced), fixed(left) - fixed(right)
            if more <= 0 or less <= 0:
                continue
            price = less / more   # where both lines cross
            middle = solve(price)
            value = fixed(middle) + price * getattr(middle, priced)
            if value < fixed(left) + price * getattr(left, priced) - 1e-6 * max(1.0, abs(value)) and \
                    middle.recompute not in (left.recompute, right.recompute):
                found[id(middle)] = middle
                pending += [(left, middle), (middle, right)]
        return sorted(found.values(), key=lambda c: (getattr(c, priced), -fixed(c)))

    def kept_bytes(self, recompute) -> int:
        """Bytes of the forward storages backward (or a copy) reads under ``recompute``, parameters aside."""
        copies = self.closure(recompute)
        read = {i for n in copies for i in n.all_input_nodes if i not in recompute}
        read |= {n for n in self.read_by_backward if n not in recompute}
        return sum(self.bytes_of(self._storage(n)) for n in {self._storage(n) for n in read}
                   if n not in self.parameter_views and not isinstance(n.meta.get(g.VAL), (tuple, list)))

    def _storage(self, node: fx.Node) -> fx.Node:
        while is_alias(node) and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    def closure(self, recompute) -> set[fx.Node]:
        """The nodes copied into backward: the recomputed ones backward reads, and the recomputed ones they read."""
        found: set[fx.Node] = set()
        stack = [n for n in recompute if n in self.read_by_backward]
        while stack:
            node = stack.pop()
            if node not in found:
                found.add(node)
                stack.extend(i for i in node.all_input_nodes if i in recompute and i not in found)
        return found


def is_expensive_op(node: fx.Node) -> bool:
    """A matmul, convolution or attention: an op the flop counter has a formula for."""
    return node.target in _ATTENTION or (isinstance(node.target, torch._ops.OpOverload)
                                         and node.target.overloadpacket in flop_registry)


def flops_of(node: fx.Node) -> int:
    """FLOPs of matmuls, convolutions and attention (the flop counter's formulas); elements written otherwise."""
    if node.op != "call_function" or is_alias(node):
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
    if target is operator.getitem:
        return 0
    # a size the data decides (a boolean mask's rows, an expert's tokens) is unknown here: counted as no work
    return sum(int(v.numel()) for v in g.values_of(value) if isinstance(v, torch.Tensor) and not g.is_data_dependent(v))
