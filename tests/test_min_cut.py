"""analysis/min_cut.py: the remat planner's minimum cuts, against networkx's, cold and warm-started."""
from __future__ import annotations

import random

import networkx as nx
import pytest

from zerocc.analysis import min_cut


def _random_network(seed: int, size: int = 30):
    """A layered network like the planner's: source -> in (priced), in -> out (bytes), out -> users' in, -> sink."""
    rng = random.Random(seed)
    network, reference = min_cut.Network(), nx.DiGraph()
    network.vertex("source")
    network.vertex("sink")
    priced = {}
    for i in range(size):
        inside, outside = (i, "in"), (i, "out")
        stored = rng.choice([min_cut.INFINITE, 0, *range(1, 50)])
        network.add_arc(inside, outside, stored)
        reference.add_edge(inside, outside, **({} if stored == min_cut.INFINITE else {"capacity": stored}))
        if rng.random() < 0.2:
            network.add_arc("source", inside)
            reference.add_edge("source", inside)
        else:
            priced[i] = network.add_arc("source", inside, 0)
        for user in rng.sample(range(i + 1, size), min(rng.randint(0, 3), size - i - 1)):
            network.add_arc(outside, (user, "in"))
            reference.add_edge(outside, (user, "in"))
        if rng.random() < 0.3:
            network.add_arc(outside, "sink")
            reference.add_edge(outside, "sink")
    return network, reference, priced, rng


def _reference_sink_side(reference, priced, capacities):
    graph = reference.copy()
    for i, arc in priced.items():
        if capacities[arc] == min_cut.INFINITE:
            graph.add_edge("source", (i, "in"))
        else:
            graph.add_edge("source", (i, "in"), capacity=capacities[arc])
    try:
        value, (_, sink_side) = nx.minimum_cut(graph, "source", "sink")
    except nx.NetworkXUnbounded:
        return None
    return sink_side


@pytest.mark.parametrize("seed", range(40))
def test_cuts_equal_networkx_cold_and_warm_started(seed):
    network, reference, priced, rng = _random_network(seed)
    solver = min_cut.Solver(network, "source", "sink")
    costs = {arc: rng.randint(1, 9) for arc in priced.values()}
    prices = [rng.choice([0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(8)]
    for price in prices:   # in no order: each solve starts from the flow of the highest price below it
        capacities = {arc: price * cost for arc, cost in costs.items()}
        expected = _reference_sink_side(reference, priced, capacities)
        if expected is None:
            with pytest.raises(min_cut.UnboundedFlow):
                min_cut.Solver(network, "source", "sink").solve(capacities)
            return
        assert solver.solve(capacities, family="sweep", key=price) == expected
        assert min_cut.Solver(network, "source", "sink").solve(capacities) == expected   # cold


def test_a_family_whose_capacities_fall_as_its_key_grows_is_refused():
    network = min_cut.Network()
    arc = network.add_arc("source", "a", 0)
    network.add_arc("a", "sink", 5)
    solver = min_cut.Solver(network, "source", "sink")
    assert solver.solve({arc: 3}, family="sweep", key=1.0) == {"a", "sink"}   # the source arc is cut: a still reaches the sink
    with pytest.raises(ValueError, match="must not fall"):
        solver.solve({arc: 2}, family="sweep", key=2.0)
