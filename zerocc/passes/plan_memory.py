"""plan_memory: every tensor's lifetime on the final node order, placed at offsets in pools by role.

Requires: the last pass before the program is emitted (it plans the order
the graph has when it runs; any pass that moves nodes must come before it).
Establishes: ``ctx.memory_plan`` (a ``memory_plan.MemoryPlan``). The graph
is not changed: the plan is read off it.

A *buffer* is one storage: a node whose value is a fresh tensor (or output
``i`` of a multi-output op). Views do not allocate; they keep their base's
storage alive, so a buffer lives from the node that allocates it to the last
use of any view of it (alias analysis: ops whose schema returns an alias,
``getitem`` of ``split``-like ops, ``wait_tensor`` of its collective's
output; ``reshape`` and ``contiguous`` only when the value allows a view).
The outputs of a multi-output op live at least as long as the op's tuple,
which the program holds until its last ``getitem``. Slots read by the step
live across the whole step, except those ``release_slots`` marked: they live
to the release point or their last use, whichever is later; values that
replace slots (and the loss) live to the end. A collective's inputs live until its wait: it reads them while
the program runs on. Tensors sized by the data are listed as unplanned.

Pools group buffers by role (``memory_plan.POOLS``): persistent shards and
optimizer state, gathered parameters, activations and temporaries, gradient
buckets, communication buffers. Each pool is laid out by greedy best-fit in
four orders (``memory_plan.ORDERS``) improved by promotion (``memory_plan.place``),
keeping the smallest, and reports its lower
bound, the most bytes its buffers hold at once.
"""
from __future__ import annotations

import collections
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import is_concrete_int
import torch.utils._pytree as pytree

from .. import graph as g
from ..context import CompileContext
from ..memory_plan import (ALIGNMENT_BYTES, POOL_OF_ROLE, POOLS, Buffer, Lifetime, MemoryPlan, Pool, Unplanned, align,
                           lower_bound, megabytes, place)

aten = torch.ops.aten

# Ops whose result is a view of their input only when the input's layout allows one.
_VIEW_IF_POSSIBLE = {aten.reshape.default, aten.contiguous.default, aten.flatten.using_ints, aten.reshape_as.default}

# Ops returning views of their input whose schema declares no alias ("unsafe": autograd does not track the
# views). The GRU cell splits its gates with unsafe_split; seen as fresh storages, a view's bytes were
# reused while it was still read (the recurrent model of tests/architectures.py under memory pools).
_UNDECLARED_VIEWS = {aten.unsafe_split.Tensor, aten.unsafe_split_with_sizes.default, aten.unsafe_chunk.default}

_PLACEHOLDER_ROLES = {
    g.ROLE_PARAM: "parameters", g.ROLE_FROZEN: "parameters", g.ROLE_BUFFER: "buffers",
    g.ROLE_STATE: "optimizer state", g.ROLE_INPUT: "inputs",
}


def plan_memory(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Plan where every tensor of the step lives; record it on ``ctx.memory_plan``. The graph is unchanged."""
    ctx.memory_plan = memory_plan_of(gm)
    plan = ctx.memory_plan
    ratio = plan.planned_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0
    ctx.notes["plan_memory"] = (f"{sum(len(p.buffers) for p in plan.pools)} buffers in {len(plan.pools)} pools: "
                                f"{megabytes(plan.planned_bytes)} planned, lower bound "
                                f"{megabytes(plan.lower_bound_bytes)} ({ratio:.3f}x)")
    return gm


def memory_plan_of(gm: fx.GraphModule, *, placed: bool = True) -> MemoryPlan:
    """The plan for ``gm`` in its current node order (any FX graph with ``val`` meta; zerocc's tags refine roles).

    ``placed=False`` skips the layout (every offset 0, each pool at its lower bound): the lifetimes only.
    """
    nodes = list(gm.graph.nodes)
    buffers, unplanned = _lifetimes_and_unplanned(gm)
    pools = []
    for pool_name in POOLS:
        members = [b for b in buffers if POOL_OF_ROLE[b[1]] == pool_name]
        if not members:
            continue
        lifetimes = [Lifetime(name, size, s, e) for name, _, size, s, e, _ in members]
        if placed:
            offsets, size, order = place(lifetimes)
        else:
            offsets, size, order = collections.defaultdict(int), lower_bound(lifetimes), "not placed"
        placed = tuple(Buffer(name, role, pool_name, nbytes, offsets[name], s, e, names)
                       for name, role, nbytes, s, e, names in members)
        pools.append(Pool(pool_name, size, lower_bound(lifetimes), order, placed))
    phases = tuple(str(node.meta.get(g.PHASE, "")) for node in nodes)
    return MemoryPlan(tuple(pools), tuple(node.name for node in nodes), phases, ALIGNMENT_BYTES, tuple(unplanned))


def buffer_lifetimes(gm: fx.GraphModule) -> list[tuple[str, str, int, int, int, tuple[str, ...]]]:
    """Every storage of ``gm`` in its node order, unplaced: (name, role, aligned bytes, start, end, aliases)."""
    return _lifetimes_and_unplanned(gm)[0]


def _lifetimes_and_unplanned(gm: fx.GraphModule):
    """``buffer_lifetimes``, and the tensors whose size depends on the data (``Unplanned``, bytes None)."""
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last = len(nodes) - 1
    roots = _storage_roots(nodes)
    # released slots (passes/release_slots.py) live to the release point, then to their last use
    release = next((position[n] for n in nodes if n.meta.get(g.RELEASE_POINT)), None)

    # a storage is alive from its allocation to the last use of any of its views
    start: dict[object, int] = {}
    end: dict[object, int] = {}
    aliases: dict[object, list[str]] = {}
    for node in nodes:
        for key in roots.get(node, ()):
            start.setdefault(key, 0 if node.op == "placeholder" else position[node])
            if node.op == "placeholder":
                end[key] = release if release is not None and node.meta.get(g.RELEASED) else last
            reach = max((_released_at(user, position) for user in node.users), default=position[node])
            end[key] = max(end.get(key, position[node]), reach)
            if key[0] is not node:
                aliases.setdefault(key, []).append(node.name)
    outputs = pytree.tree_leaves(g.output_node(gm).args[0])   # [loss, *values that replace slots]
    output_slots = gm.meta.get(g.OUTPUT_SLOTS, ())
    updated = set()
    for index, value in enumerate(outputs):
        for key in roots.get(value, ()) if isinstance(value, fx.Node) else ():
            end[key] = last
            if index > 0 and index - 1 < len(output_slots):
                updated.add(key)

    buffers, unplanned = [], []
    for key in start:
        node, index = key
        value = _value_of(node, index)
        role = _role(node, index, key in updated)
        name = node.name if index is None else f"{node.name}[{index}]"
        if _data_dependent(value):
            size = "x".join(str(s) for s in value.shape) or "1"
            unplanned.append(Unplanned(name, role, None, start[key], end[key],
                                       f"size depends on the data ({size} elements)"))
            continue
        size = _storage_bytes(value)
        buffers.append((name, role, align(size), start[key], end[key], tuple(aliases.get(key, ()))))
    return buffers, unplanned


def _released_at(user: fx.Node, position: dict[fx.Node, int]) -> int:
    """Where ``user`` is done reading its inputs: a collective reads them until its wait, as it runs meanwhile."""
    if g.is_collective(user):
        return max((position[w] for w in user.users if g.is_wait(w)), default=position[user])
    return position[user]


def _storage_roots(nodes: list[fx.Node]) -> dict[fx.Node, tuple]:
    """For each node with a tensor value: the storages it keeps alive, as (allocating node, output index or None)."""
    roots: dict[fx.Node, tuple] = {}
    for node in nodes:
        if node.op == "output":
            continue
        value = node.meta.get(g.VAL)
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            if isinstance(source, fx.Node) and _returns_alias(source):
                roots[node] = roots.get(_aliased_input(source), ())
            elif isinstance(value, torch.Tensor):
                roots[node] = ((source, index),)
            continue
        if isinstance(value, (tuple, list)):
            if not _returns_alias(node):
                # every tensor output is a storage, alive at least while the tuple is
                roots[node] = tuple((node, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if node.op == "call_function" and _is_view(node):
            roots[node] = roots.get(_aliased_input(node), ())
        else:
            roots[node] = ((node, None),)
    return roots


def _returns_alias(node: fx.Node) -> bool:
    """Does the node return views of an input: its schema says so, or its fake value shares an input's storage?"""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    if node.target in _UNDECLARED_VIEWS or bool(returns) and returns[0].alias_info is not None:
        return True
    return _input_sharing_storage(node) is not None


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
    storage = _storage_id(value)
    if storage is None:
        return None
    return next((i for i in node.all_input_nodes
                 if i.meta.get(g.VAL) is not value and _storage_id(i.meta.get(g.VAL)) == storage), None)


def _storage_id(value) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # a tensor without storage (sparse, nested)
        return None


def _aliased_input(node: fx.Node) -> fx.Node | None:
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


def _is_view(node: fx.Node) -> bool:
    """Does the node's value share storage with an input (a view, an in-place result, a wait)?"""
    if g.is_wait(node) or node.target is aten._unsafe_view.default:
        return True
    if not _returns_alias(node):
        return False
    if node.target in _VIEW_IF_POSSIBLE:
        source = node.args[0].meta.get(g.VAL) if isinstance(node.args[0], fx.Node) else None
        value = node.meta.get(g.VAL)
        if not isinstance(source, torch.Tensor) or not isinstance(value, torch.Tensor):
            return False
        try:
            source.view(value.shape)
        except (RuntimeError, ValueError):   # fake tensors raise ValueError
            return False   # the layout allows no view: the op copies
    return True


def _value_of(node: fx.Node, index: int | None):
    value = node.meta.get(g.VAL)
    if index is not None:
        value = value[index] if isinstance(value, (tuple, list)) and index < len(value) else None
    return value


def _data_dependent(value) -> bool:
    """Is ``value`` a tensor whose size depends on the data (boolean-mask indexing, ``nonzero``)?

    Such a tensor cannot be placed ahead of time: the plan lists it as unplanned.
    """
    return isinstance(value, torch.Tensor) and not all(is_concrete_int(x) for x in (*value.shape, *value.stride()))


def _storage_bytes(value) -> int:
    """Bytes of the storage a fresh ``value`` needs (its strides may skip elements); 0 if it is no tensor."""
    if not isinstance(value, torch.Tensor) or _data_dependent(value):
        return 0
    if value.numel() == 0:
        return 0
    span = 1 + sum((int(size) - 1) * abs(int(stride)) for size, stride in zip(value.shape, value.stride()))
    return span * value.element_size()


def _role(node: fx.Node, index: int | None, updated: bool) -> str:
    if node.op == "placeholder":
        return _PLACEHOLDER_ROLES.get(node.meta.get(g.ROLE), "inputs")
    if updated:
        return "updated state"
    if g.is_all_gather(node):
        return "gathered parameters"
    if g.is_reduce_scatter(node) or g.is_all_reduce(node):
        return "gradient buckets"
    phase = node.meta.get(g.PHASE)
    if g.BUCKET in node.meta and node.target in (aten.cat.default, aten.empty.memory_format) and phase == g.BACKWARD:
        return "gradient buckets"   # the flat gradient of one bucket (written in place: passes/gradients_into_buckets.py)
    if phase == g.COMMUNICATION:
        # the average of a reduced gradient is part of the bucket; other collective outputs are comm buffers
        if any(g.is_reduce_scatter(a) or g.is_all_reduce(a) or g.is_wait(a) and _reduces(a) for a in node.all_input_nodes):
            return "gradient buckets"
        return "communication"
    return "activations"


def _reduces(wait: fx.Node) -> bool:
    source = wait.args[0]
    return isinstance(source, fx.Node) and (g.is_reduce_scatter(source) or g.is_all_reduce(source))
