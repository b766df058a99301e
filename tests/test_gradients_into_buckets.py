"""gradients_into_buckets: gradients are computed into their bucket (out=) instead of copied into it by a cat."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_two_ranks_train_the_same, compile_graph
from zerocc import graph as g
from zerocc import ops
from zerocc.analysis.live_bytes import live_peaks

aten = torch.ops.aten


def _gradient_cats(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.cat.default
            and g.BUCKET in n.meta and n.meta.get(g.PHASE) == g.BACKWARD]


def _slice_of(view):
    """(bucket node, start, end) of a write's destination: ``view(slice(bucket, 0, start, end))`` or the slice."""
    if view.target is aten.view.default:
        view = view.args[0]
    assert view.target is aten.slice.Tensor and view.args[1] == 0, view
    return view.args[0], view.args[2], view.args[3]


@pytest.mark.parametrize("stage, world_size", [(0, 2), (1, 2), (3, 2), (3, 1)])
def test_each_bucket_is_written_once_in_full_by_the_gradients_ops(stage, world_size):
    gm, ctx, _ = compile_graph(stage, world_size=world_size)
    without, _, _ = compile_graph(stage, world_size=world_size, disable=("gradients_into_buckets",))
    before = {n.meta[g.BUCKET]: n for n in _gradient_cats(without)}
    written = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.bucket_written]
    assert written and len(written) + len(_gradient_cats(gm)) == len(before)
    position = g.topological_index(gm)
    copied, total = 0, 0
    for node in written:
        bucket, writes = node.args
        cat = before[node.meta[g.BUCKET]]
        assert bucket.target is aten.empty.memory_format
        assert bucket.meta[g.VAL].shape == cat.meta[g.VAL].shape and bucket.meta[g.VAL].dtype == cat.meta[g.VAL].dtype
        # every element of the bucket is written by exactly one write, in the cat's order
        spans = []
        for write in writes:
            if write.target is aten.copy_.default:
                destination = write.args[0]
            else:
                (destination,) = [v for k, v in write.kwargs.items() if k == "out"]
                assert write.target._schema.name == cat_input_op(without, cat, len(spans))
            source, start, end = _slice_of(destination)
            assert source is bucket
            spans.append((start, end))
            assert position[bucket] < position[write] < position[node]
        assert spans == [(a, b) for a, b in zip([0] + [b for _, b in spans[:-1]], [b for _, b in spans])]
        assert spans[-1][1] == cat.meta[g.VAL].numel()
        copied += sum(e - s for (s, e), w in zip(spans, writes) if w.target is aten.copy_.default)
        total += cat.meta[g.VAL].numel()
        # what read the cat reads the written bucket
        assert {u.name for u in node.users} == {u.name for u in cat.users}
    assert copied < total / 10   # most bytes are written by their own op (the weights' mm), not copied
    assert all(a <= b for a, b in zip(live_peaks(gm, ctx), live_peaks(without, ctx)))


def cat_input_op(gm, cat, index):
    """The name of the op computing the cat's ``index``-th input, under the views that flatten it."""
    node = cat.args[0][index]
    while node.target in (aten.reshape.default, aten.view.default, aten.t.default, aten._unsafe_view.default):
        node = node.args[0]
    return node.target._schema.name


def test_the_bucket_is_read_only_after_every_write():
    """``bucket_written`` takes every write as an input: no order of the graph can read the bucket before them."""
    gm, _, _ = compile_graph(3)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ops.bucket_written:
            bucket, writes = node.args
            assert set(writes) <= set(node.all_input_nodes)
            readers = {u for u in bucket.users if u.target is not aten.slice.Tensor}
            assert readers == {node}


@pytest.mark.multirank
def test_two_ranks_train_bit_for_bit_as_with_the_cat():
    """(One rank against eager, every stage: tests/test_numerics.py, which runs this pass.)"""
    assert_two_ranks_train_the_same(3, "gradients_into_buckets")
