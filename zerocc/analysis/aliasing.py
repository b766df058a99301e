"""Aliasing: which FX nodes return views of an input, and which storage a value lives in.

An analysis that passes read (``plan_memory``'s lifetimes through
``analysis/lifetimes.py``, ``gradients_into_buckets``); it changes no graph.
A node's value is a view when the op's schema declares an alias, when the op
is one of the undeclared-view ops, or when its fake value shares an input's
storage; ``reshape``-like ops only when the value's layout allows a view.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .. import graph as g

aten = torch.ops.aten

# Ops whose result is a view of their input only when the input's layout allows one.
_VIEW_IF_POSSIBLE = {aten.reshape.default, aten.contiguous.default, aten.flatten.using_ints, aten.reshape_as.default}

# Ops returning views of their input whose schema declares no alias ("unsafe": autograd does not track the
# views). The GRU cell splits its gates with unsafe_split; seen as fresh storages, a view's bytes were
# reused while it was still read (the recurrent model of tests/architectures.py under memory pools).
_UNDECLARED_VIEWS = {aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default, aten.unsafe_chunk.default}


def returns_alias(node: fx.Node) -> bool:
    """Does the node return views of an input: its schema says so, or its fake value shares an input's storage?"""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if _declares_alias(node.target):
        return True
    return _input_sharing_storage(node) is not None


# target -> whether its schema says it writes into one of its arguments (an ``out=`` or in-place op)
_WRITES: dict[torch._ops.OpOverload, bool] = {}


def writes_an_argument(node: fx.Node) -> bool:
    """Does the node write into one of its arguments (``mm.out``, ``copy_``): it computes, whatever it returns?"""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    writes = _WRITES.get(node.target)
    if writes is None:
        writes = _WRITES[node.target] = any(a.alias_info is not None and a.alias_info.is_write
                                            for a in node.target._schema.arguments)
    return writes


# target -> whether its schema declares that its first output aliases an input (or it is an undeclared view).
# A fact of the op, asked for every node of every lifetime analysis (several per pass, per plan place_remat
# measures): reading ``_schema.returns`` builds new Python objects on each call (issue 19).
_DECLARED_ALIAS: dict[torch._ops.OpOverload, bool] = {}


def _declares_alias(target: torch._ops.OpOverload) -> bool:
    declared = _DECLARED_ALIAS.get(target)
    if declared is None:
        returns = target._schema.returns
        declared = _DECLARED_ALIAS[target] = (target in _UNDECLARED_VIEWS
                                              or bool(returns) and returns[0].alias_info is not None)
    return declared


def _input_sharing_storage(node: fx.Node) -> fx.Node | None:
    """The input whose fake value has the storage of the node's value (or of its first tensor output), if any.

    A safety net under the schemas: fake tensors track storages, so an op
    that returns a view without declaring it is still seen as one. A value
    that *is* its input's value object says nothing: passes give a node it
    builds its input's value when only the shape matters (a broadcast's
    result is a fresh tensor).
    """
    value = node.meta.get(g.VAL)
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    storage = storage_id(value)
    if storage is None:
        return None
    return next((i for i in node.all_input_nodes
                 if i.meta.get(g.VAL) is not value and storage_id(i.meta.get(g.VAL)) == storage), None)


def storage_id(value) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # a tensor without storage (sparse, nested)
        return None


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The argument whose storage the node's result shares (the schema says which)."""
    schema = node.target._schema if isinstance(node.target, torch._ops.OpOverload) else None
    if schema is not None and schema.returns and schema.returns[0].alias_info is not None:
        wanted = schema.returns[0].alias_info.before_set
        for index, argument in enumerate(schema.arguments):
            value = node.args[index] if index < len(node.args) else node.kwargs.get(argument.name)   # out= too
            if argument.alias_info is not None and argument.alias_info.before_set & wanted:
                return value if isinstance(value, fx.Node) else None
    sharing = _input_sharing_storage(node)
    if sharing is not None:
        return sharing
    first = node.args[0] if node.args else None
    return first if isinstance(first, fx.Node) else None


def is_view(node: fx.Node) -> bool:
    """Does the node's value share storage with an input (a view, an in-place result, a wait)?"""
    if g.is_wait(node) or node.target is aten._unsafe_view.default:
        return True
    if not returns_alias(node):
        return False
    if node.target in _VIEW_IF_POSSIBLE:
        source = node.args[0].meta.get(g.VAL) if isinstance(node.args[0], fx.Node) else None
        value = node.meta.get(g.VAL)
        if not isinstance(source, torch.Tensor) or not isinstance(value, torch.Tensor):
            return False
        return _viewable(source, value.shape)   # else the layout allows no view: the op copies
    return True


def _viewable(source: torch.Tensor, shape) -> bool:
    """Can ``source`` be viewed as ``shape`` (without a copy)?"""
    sizes, strides, wanted = tuple(source.shape), tuple(source.stride()), tuple(shape)
    if all(type(n) is int for n in sizes + strides + wanted):
        return _viewable_layout(sizes, strides, wanted)
    try:   # symbolic sizes: ask the fake tensor itself
        source.view(shape)
    except (RuntimeError, ValueError):   # fake tensors raise ValueError
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _viewable_layout(sizes: tuple[int, ...], strides: tuple[int, ...], wanted: tuple[int, ...]) -> bool:
    """Whether a tensor of this layout views as ``wanted``: it depends on sizes and strides only, and a deep
    model asks for the same few layouts in every block, where a fake tensor's view costs half a millisecond."""
    try:
        torch.empty_strided(sizes, strides, device="meta").view(wanted)
    except (RuntimeError, ValueError):
        return False
    return True
