"""insert_collectives: the communication the shard plan needs, as functional collectives.

Requires: ``shard`` (its ``ops.unshard`` / ``ops.reduce_gradient`` markers).
Establishes: no markers left. At world size N > 1 each marker becomes a
``torch.ops._c10d_functional`` collective and its ``wait_tensor``:

  unshard          -> all_gather_into_tensor. At stage 3 a bucket is gathered
                      twice: before its first forward use and again before its
                      first backward use, and views of the parameter that
                      backward reads are re-derived from the second gather, so
                      nothing keeps the forward copy alive through backward;
                      with grad_accumulation=K, twice per micro-batch (unless
                      compile(gather_per_micro_batch=False)).
  reduce_gradient  -> reduce_scatter_tensor (or all_reduce at stage 0) of the
                      sum, divided by N: gradients are averaged as DDP does.
  buffers the step updates (BatchNorm statistics) are broadcast from rank 0 at
  the start of the step, as DDP does before every forward.

At world size 1 every marker is replaced by its input: there is nothing to
communicate. Collectives are waited right away here; ``schedule`` moves waits.

A complex tensor (the bucket of complex parameters, a complex buffer) travels
as its real view: gloo and NCCL reduce and gather no complex dtype, and
``_c10d_functional``'s ops do not convert (``torch.distributed``'s own do, the
same way). A flat bucket is viewed as a flat real bucket twice as long
(``view.dtype``, one alias on each side, tagged ``COMPLEX_AS_REAL``), so the
passes after this one see the pattern of a real bucket; summing the real and
imaginary parts separately is summing the complex numbers.
"""
from __future__ import annotations

import bisect
import operator

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops
from ..context import CompileContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def insert_collectives(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Replace the shard pass's markers with collectives and waits (nothing at world size 1)."""
    graph = gm.graph
    markers = [n for n in graph.nodes if n.op == "call_function" and n.target in (ops.unshard, ops.reduce_gradient)]
    if ctx.world_size == 1:
        for node in markers:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        gm.recompile()
        ctx.notes["insert_collectives"] = "world size 1: no collectives"
        return gm

    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
    segments = _phase_segments(gm, ctx)
    for node in markers:
        if node.target is ops.reduce_gradient:
            _lower_reduce(gm, ctx, node)
            counts["reduce_scatter" if node.args[2] else "all_reduce"] += 1
        elif ctx.stage == 3 and g.is_parameter_shard(node.args[0]):
            counts["all_gather"] += _lower_parameter_gather(gm, ctx, node, segments)
        else:
            _replace_with_gather(gm, ctx, node)
            counts["all_gather"] += 1
    counts["broadcast"] = _broadcast_updated_buffers(gm, ctx)
    g.eliminate_dead_code(gm)   # forward views whose backward uses now read the second gather
    graph.lint()
    gm.recompile()
    ctx.notes["insert_collectives"] = ", ".join(f"+{v} {k}" for k, v in counts.items() if v)
    return gm


def _collective(graph, ctx, target, args, value, bucket) -> fx.Node:
    """A collective and its wait, inserted at the current point; returns the wait (a complex ``value``: its view
    as complex, the collective run on the real view of ``args[0]``)."""
    if value.is_complex():
        return _complex_collective(graph, ctx, target, args, value, bucket)
    started = graph.call_function(target, args)
    started.meta.update({g.VAL: value, g.PHASE: g.COMMUNICATION, g.BUCKET: bucket})
    waited = graph.call_function(c10d.wait_tensor.default, (started,))
    waited.meta.update({g.VAL: value, g.PHASE: g.COMMUNICATION, g.BUCKET: bucket})
    return waited


def _complex_collective(graph, ctx, target, args, value, bucket) -> fx.Node:
    """The collective on the real view of a complex tensor, its result viewed back as complex.

    A flat (1-d) tensor is viewed as ``value.real.dtype`` twice as long, a flat real bucket to the passes
    after this one; another shape (a complex buffer broadcast, 0-d included) through ``view_as_real``."""
    tensor = args[0]
    flat = g.tensor_meta(tensor).dim() == 1 and value.dim() == 1
    real_dtype = value.real.dtype
    tags = {g.PHASE: g.COMMUNICATION, g.BUCKET: bucket, g.COMPLEX_AS_REAL: True}
    if flat:
        real = g.call(graph, ctx.fake_mode, aten.view.dtype, tensor, real_dtype)
    else:
        real = g.call(graph, ctx.fake_mode, aten.view_as_real.default, tensor)
    real.meta.update(tags)
    with ctx.fake_mode:
        real_value = value.view(real_dtype) if flat else torch.view_as_real(value)
    waited = _collective(graph, ctx, target, (real, *args[1:]), real_value, bucket)
    if flat:
        back = g.call(graph, ctx.fake_mode, aten.view.dtype, waited, value.dtype)
    else:
        back = g.call(graph, ctx.fake_mode, aten.view_as_complex.default, waited)
    back.meta.update(tags)
    return back


def _gather(graph, ctx, shard: fx.Node, value, bucket) -> fx.Node:
    return _collective(graph, ctx, c10d.all_gather_into_tensor.default,
                       (shard, ctx.world_size, ctx.group_name), value, bucket)


def _replace_with_gather(gm, ctx, marker) -> None:
    with gm.graph.inserting_before(marker):
        waited = _gather(gm.graph, ctx, marker.args[0], marker.meta[g.VAL], marker.meta.get(g.BUCKET))
    marker.replace_all_uses_with(waited)
    gm.graph.erase_node(marker)


def _lower_reduce(gm, ctx, marker) -> None:
    graph = gm.graph
    flat, world_size, scatter = marker.args
    bucket = marker.meta.get(g.BUCKET)
    with graph.inserting_before(marker):
        if scatter:
            waited = _collective(graph, ctx, c10d.reduce_scatter_tensor.default,
                                 (flat, "sum", world_size, ctx.group_name), marker.meta[g.VAL], bucket)
        else:
            waited = _collective(graph, ctx, c10d.all_reduce.default,
                                 (flat, "sum", ctx.group_name), marker.meta[g.VAL], bucket)
        average = g.call(graph, ctx.fake_mode, aten.div.Tensor, waited, world_size)
        average.meta.update({g.PHASE: g.COMMUNICATION, g.BUCKET: bucket})
    marker.replace_all_uses_with(average)
    graph.erase_node(marker)


def _is_alias(node: fx.Node) -> bool:
    """Does the node's output share storage with its input (a view, a detach, a getitem of split)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if node.target is aten._unsafe_view.default:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        returns = node.target._schema.returns
        return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
    return False


def _phase_segments(gm, ctx) -> dict[fx.Node, tuple[int, int]]:
    """Which gathered copy of a bucket each node reads: stage 3 gathers once per segment that uses the bucket.

    A segment is (micro-batch, forward or not): one forward and one backward
    for a single batch. With ``grad_accumulation=K`` capture traces the
    micro-batches in turn and adds each micro-batch's loss to the running
    total (``total + loss.detach()``) right after its backward: those running
    totals, the chain of adds under the returned loss, end the micro-batches.
    So each micro-batch gathers again and no gathered copy outlives its
    micro-batch. With ``ctx.gather_per_micro_batch`` off every node is in
    micro-batch 0: both copies stay alive across the micro-batches (K times
    fewer gathers, a higher peak). Nodes of backward that forward computes
    (a norm's saved statistics) count as backward, as with one batch.
    """
    order = g.topological_index(gm)
    ends, node = [], g.output_node(gm).args[0][0]
    while ctx.gather_per_micro_batch and node.op == "call_function" and node.target is aten.add.Tensor \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
        ends.append(order[node])
    ends.sort()
    return {node: (bisect.bisect_left(ends, order[node]), 0 if node.meta.get(g.PHASE) in (g.FORWARD, None) else 1)
            for node in gm.graph.nodes}


def _lower_parameter_gather(gm, ctx, marker, segments: dict[fx.Node, tuple[int, int]]) -> int:
    """Stage 3: gather for the first segment that reads the bucket (forward), again for each later one.

    Returns how many gathers. Views of the parameter that later segments
    read are re-derived from their own gather, so nothing keeps an earlier
    copy alive (``_phase_segments`` says what a segment is).
    """
    graph = gm.graph
    shard, bucket = marker.args[0], marker.meta.get(g.BUCKET)
    # views of the gathered bucket: everything reachable from it through aliasing ops, in the order found
    # (a dict, not a set: a set's order follows object ids, which differ between compiles and between ranks)
    views, stack = {marker: None}, [marker]
    while stack:
        for user in stack.pop().users:
            if user not in views and _is_alias(user):
                views[user] = None
                stack.append(user)
    first_segment = min(segments[user] for view in views for user in view.users if user not in views)
    later_uses: dict[tuple[int, int], list[tuple[fx.Node, fx.Node]]] = {}
    for view in views:
        for user in view.users:
            if user not in views and user.op != "output" and segments[user] != first_segment:
                later_uses.setdefault(segments[user], []).append((user, view))

    with graph.inserting_before(marker):
        forward = _gather(graph, ctx, shard, marker.meta[g.VAL], bucket)
    marker.replace_all_uses_with(forward)
    graph.erase_node(marker)
    del views[marker]
    for segment, uses in sorted(later_uses.items()):
        first = min(user for user, _ in uses)   # fx nodes compare by graph position, O(1)
        copies: dict[fx.Node, fx.Node] = {}
        phase = first.meta.get(g.PHASE, g.BACKWARD)

        def copy_of(node: fx.Node) -> fx.Node:
            if node is forward:
                return gathered
            if node not in views:
                return node
            if node not in copies:
                for source in node.all_input_nodes:
                    copy_of(source)
                copied = g.copy_node(graph, node, copy_of)
                copied.meta[g.PHASE] = phase
                copies[node] = copied
            return copies[node]

        with graph.inserting_before(first):
            gathered = _gather(graph, ctx, shard, forward.meta[g.VAL], bucket)
            for user, view in uses:
                user.replace_input_with(view, copy_of(view))
    return 1 + len(later_uses)


def _broadcast_updated_buffers(gm, ctx) -> int:
    """DDP semantics for buffers: every rank starts the step with rank 0's values."""
    graph = gm.graph
    updated = set(gm.meta[g.OUTPUT_SLOTS])
    buffers = [n for n in g.placeholders(gm, g.ROLE_BUFFER) if n.meta[g.SLOT] in updated]
    if not buffers:
        return 0
    first_compute = next(n for n in graph.nodes if n.op != "placeholder")
    for node in buffers:
        readers = list(node.users)   # not the broadcast (or the real view of a complex buffer) that sends it
        with graph.inserting_before(first_compute):
            synced = _collective(graph, ctx, c10d.broadcast.default, (node, 0, ctx.group_name), node.meta[g.VAL], None)
        for user in readers:
            user.replace_input_with(node, synced)
    return len(buffers)

