"""graph.call makes the fake values of views and flat concatenations without the fake mode's dispatch
(graph._plain_fake_value, issue 21): each value, and every program built with them, is the one dispatching makes.

The reference is the dispatching path itself (``_plain_fake_value`` patched to decline every call)."""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests.models import batches, build
from zerocc import graph as g
from zerocc.fake_kernels import ZeroccFakeTensorMode

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _layout(value, source):
    return (type(value).__name__, tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
            value.device, value.requires_grad,
            value.untyped_storage()._cdata == source.untyped_storage()._cdata)


def _dispatched(mode, target, args):
    with mode:
        return target(*args)


def _cases(mode):
    with mode:
        flat = torch.empty(10_000)
        square = torch.empty(96, 96, dtype=torch.bfloat16)
        scalar = torch.empty(())
        halves = torch.empty(64, dtype=torch.float16)
    transposed = _dispatched(mode, aten.t.default, (square,))
    offset = _dispatched(mode, aten.slice.Tensor, (flat, 0, 17, 9233))
    return [
        (aten.slice.Tensor, (flat, 0, 10, 1000)),
        (aten.slice.Tensor, (offset, 0, 5, 6)),
        (aten.slice.Tensor, (square, 1, 3, 50)),
        (aten.slice.Tensor, (flat, 0, 9000, 20000)),          # clamped end
        (aten.view.default, (offset, [96, 96])),
        (aten.view.default, (scalar, [1])),
        (aten.view.default, (_dispatched(mode, aten.slice.Tensor, (flat, 0, 3, 4)), [])),
        (aten.reshape.default, (square, [-1])),
        (aten.reshape.default, (transposed, [-1])),          # copies: a storage of its own
        (aten.reshape.default, (offset, [4, -1])),
        (aten.cat.default, ([flat, offset],)),
        (aten.cat.default, ([halves],)),
        (aten.cat.default, ([_dispatched(mode, aten.slice.Tensor, (halves, 0, 0, 0)), halves, halves],)),
        # new tensors from sizes alone: the collectives, waits and chunk sums of insert_collectives and
        # scatter_by_all_to_all
        (c10d.all_to_all_single.default, (flat, [5000, 5000], [5000, 5000], "0")),
        (c10d.all_to_all_single.default, (square, [24] * 4, [24] * 4, "0")),
        (c10d.wait_tensor.default, (flat,)),
        (c10d.wait_tensor.default, (transposed,)),           # keeps the input's strides
        (c10d.reduce_scatter_tensor.default, (flat, "sum", 2, "0")),
        (c10d.reduce_scatter_tensor.default, (square, "sum", 4, "0")),
        (c10d.all_gather_into_tensor.default, (offset, 3, "0")),
        (aten.sum.dim_IntList, (_dispatched(mode, aten.view.default, (flat, [2, 5000])), [0])),
        (aten.sum.dim_IntList, (transposed, [1])),
        (aten.sum.dim_IntList, (_dispatched(mode, aten.view.default, (square, [4, 24, 96])), [0])),
    ]


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_plain_values_are_the_dispatched_values(device):
    mode = ZeroccFakeTensorMode()
    with torch.device(device):
        cases = _cases(mode)
    for target, args in cases:
        plain = g._plain_fake_value(mode, target, args, {})
        assert plain is not None, target   # every case takes the plain path
        source = args[0][0] if target is aten.cat.default else args[0]
        dispatched = _dispatched(mode, target, args)
        assert _layout(plain, source) == _layout(dispatched, source), (target, args)
        assert _sharing(plain, args) == _sharing(dispatched, args), (target, args)


def _sharing(value, args):
    """Which of the call's tensor inputs the value is, and which it shares a storage with: what aliasing.py and
    lifetimes.py read (a wait's value is a new tensor of its own, dispatched or not; the analyses know a wait by
    its target)."""
    import torch.utils._pytree as pytree
    inputs = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    return [(value is a, value.untyped_storage()._cdata == a.untyped_storage()._cdata) for a in inputs]


def test_calls_the_plain_path_does_not_know_dispatch():
    mode = ZeroccFakeTensorMode()
    with mode:
        flat = torch.empty(16)
        trained = torch.empty(16, requires_grad=True)
        square = torch.empty(4, 4)
    other = ZeroccFakeTensorMode()
    with other:
        foreign = torch.empty(16)
    declined = [
        (aten.slice.Tensor, (trained, 0, 0, 4), {}),        # autograd would record it
        (aten.slice.Tensor, (foreign, 0, 0, 4), {}),        # another fake mode's tensor
        (aten.slice.Tensor, (torch.empty(16), 0, 0, 4), {}),   # a real tensor
        (aten.cat.default, ([square, square],), {}),       # not flat
        (aten.cat.default, ([flat, flat.to(torch.float64)],), {}),   # dtypes promoted
        (aten.cat.default, ([flat, flat],), {"dim": 0}),   # keyword arguments
        (aten.add.Tensor, (flat, flat), {}),               # not one of the ops
        (aten.sum.dim_IntList, (square, [0], True), {}),   # keepdim: a bool
        (aten.sum.dim_IntList, (square, [0]), {"dtype": torch.float64}),
        (c10d.wait_tensor.default, (trained,), {}),
    ]
    for target, args, kwargs in declined:
        assert g._plain_fake_value(mode, target, args, kwargs) is None, (target, args)


def _program(planned):
    """Every node of every pass's graph and of the final one, with its value's layout and storage (numbered)."""
    def described(graph):
        storages, rows = {}, []
        for node in graph.nodes:
            value = node.meta.get(g.VAL)
            layout = None
            if isinstance(value, torch.Tensor):
                layout = (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, str(value.device),
                          storages.setdefault(value.untyped_storage()._cdata, len(storages)))
            target = getattr(node.target, "__qualname__", str(node.target))
            rows.append((node.name, node.op, target, str(node.args), str(node.kwargs), layout))
        return rows
    return ([described(shot.graph) for shot in planned.history], described(planned.gm.graph), planned.gm.code,
            planned.memory_plan.to_dict() if planned.memory_plan is not None else None)


@pytest.mark.parametrize("name, stage, world_size, device", [
    ("gpt", 3, 1, "cpu"), ("gpt", 1, 2, "meta"), ("gpt", 3, 4, "meta"), ("cnn", 2, 1, "cpu"), ("cnn", 0, 2, "meta"),
    ("gpt", 3, 2, "cpu"),   # CPU at 2 ranks: scatter_by_all_to_all's all-to-alls, waits and sums
])
def test_programs_are_the_ones_dispatching_makes(monkeypatch, name, stage, world_size, device):
    with torch.device(device):
        model, _, loss_fn = build(name)
    inputs = tuple(t.to(device) for t in batches(name, 1, 4)[0])
    programs = []
    for dispatching in (False, True):
        with monkeypatch.context() as patch:
            if dispatching:
                patch.setattr(g, "_plain_fake_value", lambda *args: None)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            programs.append(_program(zerocc.plan(model, optimizer, stage=stage, world_size=world_size,
                                                 example_inputs=inputs, loss_fn=loss_fn)))
    assert programs[0] == programs[1]
