"""scatter_by_all_to_all: on CPU every reduce-scatter runs as an all-to-all and a sum, bit for bit the same result."""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build
from tests.test_overlap_updates import compile_graph
from zerocc import graph as g
from zerocc.passes.overlap_updates import live_peaks
from zerocc.planning import Planner
from zerocc.passes.schedule import wait_of
from zerocc.runtime.comm_counter import CountCollectives

c10d = torch.ops._c10d_functional


@pytest.mark.parametrize("stage, world_size", [(1, 2), (2, 2), (3, 2), (3, 4)])
def test_each_reduce_scatter_becomes_an_all_to_all_and_one_sum_over_the_ranks(stage, world_size):
    gm, ctx, _ = compile_graph(stage, world_size=world_size)
    without, _, _ = compile_graph(stage, world_size=world_size, disable=("scatter_by_all_to_all",))
    exchanges = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.all_to_all_single.default]
    kept = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.reduce_scatter_tensor.default]
    assert exchanges and all(g.is_reduce_scatter(n) for n in exchanges)
    # the same reductions, in the same order; those kept are the ones the note names
    assert [n.meta[g.BUCKET] for n in gm.graph.nodes if g.is_reduce_scatter(n)] == \
        [n.meta[g.BUCKET] for n in without.graph.nodes if g.is_reduce_scatter(n)]
    note = ctx.notes["scatter_by_all_to_all"]
    assert note.startswith(f"{len(exchanges)} reduce_scatter -> all_to_all_single")
    if kept:
        assert f"{len(kept)} kept (bucket {', '.join(str(n.meta[g.BUCKET]) for n in kept)})" in note
    # a replacement is kept only if the planned live peak does not grow
    assert all(a <= b for a, b in zip(live_peaks(gm, ctx), live_peaks(without, ctx)))
    for exchange in exchanges:
        flat = exchange.args[0]
        rows = flat.meta[g.VAL].shape[0] // world_size
        assert exchange.args[1] == exchange.args[2] == [rows] * world_size
        # the wait's only reader is its view as [N, rows], summed over the ranks in one node
        (by_rank,) = wait_of(exchange).users
        assert (by_rank.target, by_rank.args[1]) == (torch.ops.aten.view.default, [world_size, rows])
        (total,) = by_rank.users
        assert (total.target, total.args[1]) == (torch.ops.aten.sum.dim_IntList, [0])
        assert total.meta[g.VAL].shape == (rows, *flat.meta[g.VAL].shape[1:])
        # what read the reduce-scatter (the averaging division) reads the sum
        assert [u.target for u in total.users] == [torch.ops.aten.div.Tensor]


def test_an_estimate_that_would_raise_the_peak_is_caught_and_decided_again(monkeypatch):
    """The choice is made on one lifetime analysis and confirmed on the rewritten program; were the estimate ever
    short (here: told to replace everything), the pass undoes it and decides one replacement at a time."""
    from zerocc.passes import scatter_by_all_to_all as module
    model, _, _ = build("gpt")
    planner = Planner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), example_inputs=batches("gpt", 1, 2)[0],
                      bucket_bytes=16 * 1024)
    chosen = planner.plan(3, 64)
    assert "1 kept" in chosen.graph("scatter_by_all_to_all").note   # on 64 ranks one reduce-scatter stays
    monkeypatch.setattr(module, "_choose", lambda gm, scatters, peak: (scatters, []))
    fallback = planner.plan(3, 64)
    assert fallback.graph("scatter_by_all_to_all").note == chosen.graph("scatter_by_all_to_all").note
    # the same program but for the names of the nodes made again
    assert [(n.op, n.target) for n in fallback.graph("scatter_by_all_to_all").graph.nodes] == \
        [(n.op, n.target) for n in chosen.graph("scatter_by_all_to_all").graph.nodes]


def test_the_plan_counts_the_same_communication_with_and_without_the_pass():
    with_pass, ctx, _ = compile_graph(3)
    without, ctx_without, _ = compile_graph(3, disable=("scatter_by_all_to_all",))
    assert any(n.target is c10d.reduce_scatter_tensor.default for n in without.graph.nodes)
    assert [n.meta.get(g.BUCKET) for n in with_pass.graph.nodes if g.is_reduce_scatter(n)] == \
        [n.meta.get(g.BUCKET) for n in without.graph.nodes if g.is_reduce_scatter(n)]
    assert sum(g.nbytes(n.args[0]) for n in with_pass.graph.nodes if g.is_reduce_scatter(n)) == \
        sum(g.nbytes(n.args[0]) for n in without.graph.nodes if g.is_reduce_scatter(n))


def train_gpt(rank, world_size, stage, disable, options=None):
    """Rank ``rank``'s 3 steps of the tiny GPT (16 KiB buckets): losses, full state, the last step's collectives."""
    torch.manual_seed(0)
    model, _, loss_fn = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, bucket_bytes=16 * 1024, disable=disable,
                          **(options or {}))
    losses = []
    for batch in batches("gpt", 3, 4 * world_size):
        with CountCollectives() as counted:
            losses.append(step(*(t[rank * 4:(rank + 1) * 4] for t in batch)))
    return torch.stack(losses), step.full_state_dict(), dict(counted.calls), dict(counted.bytes)


def assert_two_ranks_train_the_same(stage, without_pass, options=None):
    """2 ranks of ``train_gpt`` with every pass and with ``without_pass`` disabled: equal losses and state, the
    same collectives counted (calls and volume); returns the calls."""
    new = distributed.run(train_gpt, 2, stage, (), options)
    old = distributed.run(train_gpt, 2, stage, (without_pass,), options)
    for (losses, state, calls, volume), (old_losses, old_state, old_calls, old_volume) in zip(new, old):
        assert torch.equal(losses, old_losses)
        assert state.keys() == old_state.keys()
        for key, value in old_state.items():
            assert torch.equal(state[key], value), key
        assert calls == old_calls and volume == old_volume
    return calls


@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_train_bit_for_bit_as_with_reduce_scatter(stage):
    """At 2 ranks a + b is what gloo's all-reduce computes: losses and state are equal, not close. The counter
    sees the all-to-all as the reduce-scatter it stands for: same calls, same volume."""
    assert_two_ranks_train_the_same(stage, "scatter_by_all_to_all")
