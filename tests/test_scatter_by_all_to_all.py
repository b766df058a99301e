"""scatter_by_all_to_all: on CPU every reduce-scatter runs as an all-to-all and a sum, bit for bit the same result."""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build
from tests.helpers import assert_two_ranks_train_the_same, compile_graph
from zerocc import graph as g
from zerocc.analysis import live_bytes as live_bytes_module
from zerocc.analysis.live_bytes import live_bytes, live_peaks
from zerocc.passes import gradients_into_buckets, scatter_by_all_to_all
from zerocc.graph import wait_of

c10d = torch.ops._c10d_functional


@pytest.mark.parametrize("stage", [1, 3])
def test_one_lifetime_analysis_gives_the_passes_both_peaks_and_the_bytes_by_position(stage, monkeypatch):
    # the passes weighing rewrites against the peak read the peaks and the bytes alive at each position from
    # one analysis: the bytes are those live_bytes finds (old slot values kept to the end) on the same graph
    checked = []

    def both(gm, ctx):
        expected = live_bytes(gm)
        peaks, by_position = live_bytes_module.live_peaks_and_bytes(gm, ctx)
        assert by_position == expected and peaks == live_peaks(gm, ctx) and max(expected) == peaks[0]
        checked.append(gm)
        return peaks, by_position
    for module in (scatter_by_all_to_all, gradients_into_buckets):
        monkeypatch.setattr(module, "live_peaks_and_bytes", both)
    compile_graph(stage)
    assert len(checked) == 2


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


def _compile_with_rank_0_keeping_the_first_bucket(rank, world_size):
    """As if rank 0's peak left no room for one replacement that rank 1 has room for."""
    from zerocc.passes import scatter_by_all_to_all as module
    chosen = module._kept
    module._kept = lambda gm, scatters, peak, live: (chosen(gm, scatters, peak, live) or []) + (
        [scatters[0].meta[g.BUCKET]] if rank == 0 else [])
    torch.manual_seed(0)
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, loss_fn=loss_fn,
                          bucket_bytes=16 * 1024, verify=True)
    step(*(t[rank * 4:(rank + 1) * 4] for t in batches("gpt", 1, 8)[0]))
    program = step.graph("scatter_by_all_to_all")
    return program.note, [(g.short_name(n.target), n.meta.get(g.BUCKET)) for n in program.graph.nodes
                          if g.is_collective(n)]


@pytest.mark.multirank
def test_a_bucket_one_rank_keeps_is_kept_by_every_rank():
    """Ranks' peaks differ a little (they own different optimizer pieces); a bucket kept as a reduce-scatter on
    one rank must be kept on all, or they would issue different collectives (verify=True compares them)."""
    (note_0, collectives_0), (note_1, collectives_1) = distributed.run(_compile_with_rank_0_keeping_the_first_bucket, 2)
    assert collectives_0 == collectives_1
    assert note_0 == note_1 and "kept" in note_0
    first = next(b for name, b in collectives_0 if name in ("reduce_scatter_tensor", "all_to_all_single"))
    assert ("reduce_scatter_tensor", first) in collectives_1   # rank 0's choice, on rank 1 too
    kept = [bucket for name, bucket in collectives_0 if name == "reduce_scatter_tensor"]
    assert kept and "kept (bucket " + ", ".join(map(str, kept)) + ")" in note_0


def test_the_plan_counts_the_same_communication_with_and_without_the_pass():
    with_pass, ctx, _ = compile_graph(3)
    without, ctx_without, _ = compile_graph(3, disable=("scatter_by_all_to_all",))
    assert any(n.target is c10d.reduce_scatter_tensor.default for n in without.graph.nodes)
    assert [n.meta.get(g.BUCKET) for n in with_pass.graph.nodes if g.is_reduce_scatter(n)] == \
        [n.meta.get(g.BUCKET) for n in without.graph.nodes if g.is_reduce_scatter(n)]
    assert sum(g.nbytes(n.args[0]) for n in with_pass.graph.nodes if g.is_reduce_scatter(n)) == \
        sum(g.nbytes(n.args[0]) for n in without.graph.nodes if g.is_reduce_scatter(n))


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 3])
def test_two_ranks_train_bit_for_bit_as_with_reduce_scatter(stage):
    """At 2 ranks a + b is what gloo's all-reduce computes: losses and state are equal, not close. The counter
    sees the all-to-all as the reduce-scatter it stands for: same calls, same volume."""
    assert_two_ranks_train_the_same(stage, "scatter_by_all_to_all")
