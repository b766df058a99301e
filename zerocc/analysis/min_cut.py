"""Minimum s-t cuts of one network solved many times, its source arcs' capacities rising between solves.

The remat planner's parametric sweeps (``analysis/remat.py``) cut the same
split-node network 50-200 times, only the ``source -> n.in`` capacities
(a price times a recompute cost) changing. networkx rebuilt its residual
network for every cut and took most of a budgeted compile (the 98M GPT:
178 cuts, 21 of the 37 s ``place_remat`` took). Here the network is built
once, as arrays, and each cut is a maximum flow by Dinic's algorithm
(breadth-first levels, distances to the sink, then blocking flows along them).

Warm starts (Gallo, Grigoriadis and Tarjan's observation for parametric
flows): a flow feasible at some capacities stays feasible when only source
arcs' capacities rise, so a solve starts from the flow of the solve with the
highest capacities not above its own (``Solver.solve``'s ``family``: a sweep
whose capacities all rise with its price) and only augments it.

Capacities are integers (Python ints, exact), or ``INFINITE``: with floats,
flows pushed and pushed back leave residues like 1e-13 that decide which
side of the cut a node reaches, and different algorithms would return
different cuts. The cut returned is the sink side of the minimum cut closest
to the sink: the vertices from which the sink is still reachable in the
residual network, the same for every maximum flow, so it does not depend on
the algorithm or on where the flow started.
"""
from __future__ import annotations

import bisect
from typing import Hashable

INFINITE = float("inf")


class UnboundedFlow(ValueError):
    """A path from source to sink of unbounded arcs only: no finite cut separates them."""


class Network:
    """A directed network with integer capacities, built once; ``Solver`` cuts it."""

    def __init__(self) -> None:
        self.index: dict[Hashable, int] = {}
        self.keys: list[Hashable] = []
        self.arcs_of: list[list[int]] = []   # per vertex: its arcs out, forward and reverse (arc ^ 1 is the pair)
        self.head: list[int] = []            # per arc: the vertex it enters
        self.capacity: list[float] = []      # per arc: its capacity (reverse arcs 0)

    def vertex(self, key: Hashable) -> int:
        if key not in self.index:
            self.index[key] = len(self.keys)
            self.keys.append(key)
            self.arcs_of.append([])
        return self.index[key]

    def add_arc(self, tail: Hashable, head: Hashable, capacity: float = INFINITE) -> int:
        """An arc ``tail -> head`` (``INFINITE``: unbounded); returns its index, for ``Solver.solve``."""
        u, v = self.vertex(tail), self.vertex(head)
        arc = len(self.head)
        self.head += [v, u]
        self.capacity += [capacity, 0]
        self.arcs_of[u].append(arc)
        self.arcs_of[v].append(arc + 1)
        return arc


class Solver:
    """Minimum cuts of one ``Network`` between ``source`` and ``sink``, with some arcs' capacities set per solve."""

    def __init__(self, network: Network, source: Hashable, sink: Hashable) -> None:
        self.network = network
        self.source, self.sink = network.index[source], network.index[sink]
        # per family: (key, residual capacities, the set capacities) of each solve, by key
        self._solved: dict[Hashable, list[tuple[float, list[float], dict[int, float]]]] = {}

    def solve(self, capacities: dict[int, float], family: Hashable = None, key: float = 0.0) -> set[Hashable]:
        """The sink side of the minimum cut with ``capacities`` (arc -> capacity) on those arcs, the
        network's own elsewhere: the keys of the vertices that can still reach the sink.

        Solves of one ``family`` must have capacities that do not fall as ``key`` grows (a sweep's price):
        each starts from the flow of the solve with the largest key not above its own.
        """
        network = self.network
        solved = self._solved.setdefault(family, [])
        at = bisect.bisect_right([k for k, _, _ in solved], key)
        if at:
            _, start, before = solved[at - 1]
            residual = list(start)
        else:
            residual, before = list(network.capacity), {}
        for arc, capacity in capacities.items():
            if capacity < before.get(arc, network.capacity[arc]):
                raise ValueError(f"arc {arc}: capacity {capacity} below the {before.get(arc)} of the solve it "
                                 "starts from (a family's capacities must not fall as its key grows)")
            residual[arc] = capacity - residual[arc ^ 1]   # less the flow it carries
        sink_side = self._augment(residual)
        solved.insert(at, (key, residual, dict(capacities)))
        keys = network.keys
        return {keys[v] for v in sink_side}

    def _augment(self, residual: list[float]) -> list[int]:
        """Push flow along shortest augmenting paths until none is left (Dinic); returns the vertices that can
        still reach the sink (the sink side of the cut).

        Levels are distances *to the sink* (breadth first from the sink over residual arcs reversed), and the
        depth-first search from the source only steps to a vertex one closer to the sink. Levels counted from
        the source, as the textbook does, let the search wander into every vertex the source reaches, most of
        which never lead to the sink: on the 98M GPT's network (2,420 vertices) that was some 3,200 dead ends
        per solve against 27 augmenting paths, most of a budgeted compile's 0.55 s of ``Recomputation.plans``.
        The last search, which no longer reaches the source, has found exactly the sink side.
        Any maximum flow gives the same sink side (module docstring), so the cuts are the same as before.
        """
        arcs_of, head, source, sink = self.network.arcs_of, self.network.head, self.source, self.sink
        count = len(arcs_of)
        while True:
            distance = [-1] * count
            distance[sink] = 0
            queue = [sink]
            for v in queue:   # breadth first: the list grows as it is read
                closer = distance[v] + 1
                for arc in arcs_of[v]:   # arc ^ 1 enters v from head[arc]
                    u = head[arc]
                    if distance[u] < 0 and residual[arc ^ 1] > 0:
                        distance[u] = closer
                        queue.append(u)
                if distance[source] >= 0:
                    break   # every vertex closer to the sink than the source has its distance
            if distance[source] < 0:
                return queue
            following = [0] * count   # per vertex: the next of its arcs to try in this phase
            path: list[int] = []
            u = source
            while True:
                if u == sink:
                    pushed = min(residual[arc] for arc in path)
                    if pushed == INFINITE:
                        raise UnboundedFlow("a path from source to sink of unbounded arcs: no finite cut")
                    for arc in path:
                        residual[arc] -= pushed
                        residual[arc ^ 1] += pushed
                    path.clear()
                    u = source
                    continue
                arcs = arcs_of[u]
                step = distance[u] - 1
                i, end = following[u], len(arcs)
                while i < end:
                    arc = arcs[i]
                    if residual[arc] > 0 and distance[head[arc]] == step:
                        break
                    i += 1
                following[u] = i
                if i < end:
                    path.append(arc)
                    u = head[arc]
                elif path:   # a dead end: leave it out of this phase and step back
                    distance[u] = -1
                    u = head[path.pop() ^ 1]
                    following[u] += 1
                else:
                    break
