"""Lifetimes: every storage of a step in the graph's current node order, from its allocation to its last use.

An analysis that passes read (``plan_memory`` places these lifetimes in
pools; ``analysis/live_bytes.py`` sums them per position for the passes
that weigh a rewrite against the peak); it changes no graph. ``memory_plan_of``
groups them into the pools by role (``memory_plan.POOLS``), laid out or not:
the plan ``plan_memory`` records, and the one ``overlap_updates`` reads, unlaid,
to weigh an order as ``place_buffers`` will lay it out (``analysis/arena.py``).

A *buffer* is one storage: a node whose value is a fresh tensor (or output
``i`` of a multi-output op). Views do not allocate; they keep their base's
storage alive (``analysis/aliasing.py``), so a buffer lives from the node
that allocates it to the last use of any view of it. The outputs of a
multi-output op live at least as long as the op's tuple. Slots read by the
step live across the whole step, except those ``release_slots`` marked
(``analysis/releases.py``): they live to the release point or their last
use, whichever is later; values that replace slots (and the loss) live to
the end. A collective's inputs live until its wait (but an all_reduce's or a broadcast's: it
clones them when called). Tensors sized by the
data are listed apart, as ``memory_plan.Unplanned``.
"""
from __future__ import annotations

import collections
import dataclasses
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import graph as g
from ..memory_plan import (ALIGNMENT_BYTES, POOL_OF_ROLE, POOLS, Buffer, Lifetime, MemoryPlan, Pool, Unplanned, align,
                           lower_bound, place)
from .aliasing import aliased_input, is_view, returns_alias
from .kernels import SCRATCH_OUT, reduces_in_its_scratch

aten = torch.ops.aten

_PLACEHOLDER_ROLES = {
    g.ROLE_PARAM: "parameters", g.ROLE_FROZEN: "parameters", g.ROLE_BUFFER: "buffers",
    g.ROLE_STATE: "optimizer state", g.ROLE_INPUT: "inputs",
}

# why a buffer whose size a boolean mask, ``nonzero`` or ``.tolist()`` decides is left out of the memory plan
DATA_DEPENDENT_SIZE = "size depends on the data (a boolean mask, nonzero or .tolist() decides it as the step runs)"


def buffer_lifetimes(gm: fx.GraphModule, storages: Storages | None = None
                     ) -> list[tuple[str, str, int, int, int, tuple[str, ...]]]:
    """Every storage of ``gm`` in its node order, unplaced: (name, role, aligned bytes, start, end, aliases)."""
    return lifetimes_and_unplanned(gm, storages)[0]


@dataclasses.dataclass(frozen=True)
class Storages:
    """What the lifetime analysis finds that does not depend on the node order: which storages each node keeps
    alive, and each storage's name, role and bytes.

    Half the analysis. A pass that only reorders nodes and weighs the order against the peak
    (``overlap_updates``: before and after its move) takes it once and the lifetimes of each order from it
    (``lifetimes_and_unplanned(gm, storages)``); the nodes must be the same, with the same arguments and values.
    """
    roots: dict[fx.Node, tuple]   # node -> the storages it keeps alive, as (allocating node, output index or None)
    facts: dict[tuple, tuple]     # storage -> (name, role, aligned bytes or None where sized by the data)
    outputs: tuple                # the storages the step returns (alive to the end)


def storages_of(gm: fx.GraphModule) -> Storages:
    """The order-independent half of ``lifetimes_and_unplanned`` (see ``Storages``)."""
    nodes = list(gm.graph.nodes)
    roots = _storage_roots(nodes, gm)
    outputs = pytree.tree_leaves(g.output_node(gm).args[0])   # [loss, *values that replace slots]
    output_slots = gm.meta.get(g.OUTPUT_SLOTS, ())
    returned, updated = [], set()
    for index, value in enumerate(outputs):
        for key in roots.get(value, ()) if isinstance(value, fx.Node) else ():
            returned.append(key)
            if index > 0 and index - 1 < len(output_slots):
                updated.add(key)
    facts = {}
    for keys in roots.values():
        for key in keys:
            if key in facts:
                continue
            node, index = key
            value = _value_of(node, index)
            role = _role(node, index, key in updated)
            name = node.name if index is None else f"{node.name}[{index}]"
            if g.is_data_dependent(value):
                facts[key] = (name, role, None)
                continue
            size = _scratch_bytes(node) if index is None else None
            size = _storage_bytes(value) if size is None else size
            facts[key] = (name, role, align(size))
    return Storages(roots, facts, tuple(returned))


def lifetimes_and_unplanned(gm: fx.GraphModule, storages: Storages | None = None):
    """``buffer_lifetimes``, and the tensors whose size depends on the data (``Unplanned``, bytes None).

    ``storages``: ``storages_of(gm)``, taken before the nodes were reordered (None: found here)."""
    storages = storages_of(gm) if storages is None else storages
    nodes = list(gm.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last = len(nodes) - 1
    roots = storages.roots
    # released slots (passes/release_slots.py) live to the release point, then to their last use
    release = next((position[n] for n in nodes if n.meta.get(g.RELEASE_POINT)), None)

    # a storage is alive from its allocation to the last use of any of its views
    start: dict[object, int] = {}
    end: dict[object, int] = {}
    aliases: dict[object, list[str]] = {}
    done = {node: _released_at(node, position) for node in nodes}   # where a reader is done reading its inputs
    for node in nodes:
        keys = roots.get(node, ())
        if not keys:
            continue
        here = position[node]
        reach = max([done[user] for user in node.users], default=here)
        for key in keys:
            start.setdefault(key, 0 if node.op in ("placeholder", "get_attr") else here)
            if node.op == "placeholder":
                end[key] = release if release is not None and node.meta.get(g.RELEASED) else last
            elif node.op == "get_attr":   # a tensor the model holds (a table forward reads, not a buffer): alive
                end[key] = last           # all along, where planned to its last use the plan missed it afterwards
            end[key] = max(end.get(key, here), reach)
            if key[0] is not node:
                aliases.setdefault(key, []).append(node.name)
    for key in storages.outputs:
        end[key] = last

    buffers, unplanned = [], []
    for key in start:
        name, role, size = storages.facts[key]
        if size is None:   # its shape holds torch's symbols for sizes read at run time (u0, u7): internal names a
            # reader cannot place, and one reason per shape would split the summary's counts
            unplanned.append(Unplanned(name, role, None, start[key], end[key], DATA_DEPENDENT_SIZE))
            continue
        buffers.append((name, role, size, start[key], end[key], tuple(aliases.get(key, ()))))
    return buffers, unplanned


def memory_plan_of(gm: fx.GraphModule, *, placed: bool = True, storages: Storages | None = None) -> MemoryPlan:
    """The plan for ``gm`` in its current node order (any FX graph with ``val`` meta; zerocc's tags refine roles).

    ``placed=False`` skips the layout (every offset 0, each pool at its lower bound): the lifetimes only.
    ``storages``: ``lifetimes.storages_of(gm)`` taken before a reordering (a pass weighing orders reuses it).
    """
    nodes = list(gm.graph.nodes)
    buffers, unplanned = lifetimes_and_unplanned(gm, storages)
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
        laid_out = tuple(Buffer(name, role, pool_name, nbytes, offsets[name], s, e, names)
                         for name, role, nbytes, s, e, names in members)
        pools.append(Pool(pool_name, size, lower_bound(lifetimes), order, laid_out))
    phases = tuple(str(node.meta.get(g.PHASE, "")) for node in nodes)
    return MemoryPlan(tuple(pools), tuple(node.name for node in nodes), phases, ALIGNMENT_BYTES, tuple(unplanned))


def _released_at(user: fx.Node, position: dict[fx.Node, int]) -> int:
    """Where ``user`` is done reading its inputs: a collective reads them until its wait, as it runs meanwhile
    (but for those that read them once, when called: ``g.reads_inputs_until_wait``)."""
    if g.reads_inputs_until_wait(user):
        return max((position[w] for w in user.users if g.is_wait(w)), default=position[user])
    return position[user]


def _storage_roots(nodes: list[fx.Node], gm: fx.GraphModule) -> dict[fx.Node, tuple]:
    """For each node with a tensor value: the storages it keeps alive, as (allocating node, output index or None).

    Constants (``get_attr``) reading one tensor of the model's are one storage: each micro-batch of
    ``grad_accumulation`` reads a table the model holds through a constant of its own."""
    roots: dict[fx.Node, tuple] = {}
    constants: dict[int, fx.Node] = {}
    for node in nodes:
        if node.op == "output":
            continue
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.Tensor):
                first = constants.setdefault(value.untyped_storage()._cdata, node)
                roots[node] = ((first, None),)
                continue
        value = node.meta.get(g.VAL)
        if node.op == "call_function" and node.target is operator.getitem:
            source, index = node.args
            if isinstance(source, fx.Node) and returns_alias(source):
                roots[node] = roots.get(aliased_input(source), ())
            elif isinstance(value, torch.Tensor):
                roots[node] = ((source, index),)
            continue
        if isinstance(value, (tuple, list)):
            if not returns_alias(node):
                # every tensor output is a storage, alive at least while the tuple is
                roots[node] = tuple((node, i) for i, v in enumerate(value) if isinstance(v, torch.Tensor))
            continue
        if not isinstance(value, torch.Tensor):
            continue
        if node.op == "call_function" and is_view(node):
            roots[node] = roots.get(aliased_input(node), ())
        else:
            roots[node] = ((node, None),)
    return roots


def _value_of(node: fx.Node, index: int | None):
    value = node.meta.get(g.VAL)
    if index is not None:
        value = value[index] if isinstance(value, (tuple, list)) and index < len(value) else None
    return value


def _storage_bytes(value) -> int:
    """Bytes of the storage a fresh ``value`` needs (its strides may skip elements); 0 if it is no tensor."""
    if not isinstance(value, torch.Tensor) or g.is_data_dependent(value):
        return 0
    return g.span_bytes(value)


def _scratch_bytes(node: fx.Node) -> int | None:
    """The bytes of a loss that keeps its elementwise scratch (``kernels.reduces_in_its_scratch``: CPU's
    ``mse_loss``), or None: counted as its 0-dim value, the plan fell short of what ran by the batch's size."""
    if node.op != "call_function" or node.target not in SCRATCH_OUT:
        return None
    names = [a.name for a in node.target._schema.arguments]
    reduction = node.kwargs.get("reduction", node.args[names.index("reduction")]
                                if len(node.args) > names.index("reduction") else 1)
    value, source = node.meta.get(g.VAL), node.args[0].meta.get(g.VAL)
    if reduction == 0 or not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor) \
            or g.is_data_dependent(source) or not reduces_in_its_scratch(node.target, value.device.type):
        return None
    return int(source.numel()) * value.element_size()


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
    if phase == g.OPTIMIZER:
        # not "activations": an error saying activations are alive at a peak inside the update misled users into
        # expecting recomputation (memory_budget) to shrink it
        return "optimizer temporaries"
    return "activations"


def _reduces(wait: fx.Node) -> bool:
    source = wait.args[0]
    return isinstance(source, fx.Node) and (g.is_reduce_scatter(source) or g.is_all_reduce(source))
