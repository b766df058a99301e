"""shard: parameters, gradients and optimizer state become flat buckets, 1/N per rank.

Requires: the captured graph (per-parameter placeholders, ``graph.GRAD_OF`` on
gradient nodes, phases tagged).
Establishes: a ``ShardPlan`` on ``ctx``; one ``ROLE_PARAM`` placeholder per
bucket (the full flat bucket at stages 0-2, this rank's shard at stage 3);
parameters read as views of the bucket's full value (``ops.unshard`` of the
shard at stage 3); each bucket's gradients concatenated and reduced with
``ops.reduce_gradient``; the optimizer's own ``step()`` re-traced over the
pieces of parameters this rank owns, with one state placeholder per piece;
the new bucket written back (``ops.unshard`` of the new shard at stages 1-2).
The collectives themselves are left to ``insert_collectives``.

Stage by stage (N ranks, a bucket of B elements):
  stage 0: every rank updates all of B; gradients all-reduced.
  stage 1: every rank keeps all gradients until backward ends, then reduce-scatters
           them and updates its B/N; new parameters all-gathered.
  stage 2: as stage 1, but each bucket's gradients are reduce-scattered as soon
           as they are final, so only B/N of them outlive backward.
  stage 3: as stage 2, and parameters are kept as B/N shards, gathered for use.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops, decisions
from ..context import CompileContext
from ..optimizer_step import elementwise_offenders, splice_update

aten = torch.ops.aten


# a gradient's last steps in the capture, pure: its cast to the master dtype, the sum over micro-batches
FINISHING_STEPS = (aten._to_copy.default, aten.add.Tensor)


def finish_gradients_where_computed(graph: fx.Graph, grads) -> None:
    """Move each gradient's finishing steps (``FINISHING_STEPS``) right after what they read.

    Capture takes the gradients of ``param_dtype`` casts (``autograd.grad``) and casts them to the master dtype
    after backward returns, and sums micro-batches after each one's backward: every gradient was final only at
    the end, so each bucket's ``cat`` and reduction, placed after its last gradient, waited there, every bucket's
    gradient alive at once (a bf16 Llama's whole model, 13.5 GB at 7B) and no reduction beside backward.
    Moving a pure op earlier, still after its inputs, changes no value.
    """
    order = {node: float(i) for i, node in enumerate(graph.nodes)}
    steps = set()

    def collect(node: fx.Node) -> None:
        if node.op == "call_function" and node.target in FINISHING_STEPS and node not in steps:
            steps.add(node)
            for source in node.all_input_nodes:
                if len(source.users) == 1:
                    collect(source)

    for grad in grads:
        collect(grad)
    for node in sorted(steps, key=order.get):
        latest = max(node.all_input_nodes, key=order.get)
        after = latest.next
        if after is not node:
            latest.append(node)
            order[node] = (order[latest] + order[after]) / 2


def shard(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Lay out parameters, gradients and optimizer state in flat per-rank buckets."""
    graph = gm.graph
    old_params = g.placeholders(gm, g.ROLE_PARAM)
    trained = [p for p in old_params if not p.meta.get(g.UNUSED)]
    plan = choose_buckets(gm, ctx, trained)
    ctx.shard_plan = plan
    # at stage 0 an update that is not elementwise (Muon's matrix products) sees each parameter, gradient and state
    # in its shape, and is traced over all of them at once; an elementwise one reads them flat, as at every stage
    # (views of each would cost the host four more ops per parameter per step: 3,519 -> 4,041 on
    # benchmarks/host_ops.py's GPT), traced once per class of look-alike pieces
    shaped = ctx.stage == 0 and bool(elementwise_offenders([n for n in graph.nodes
                                                            if n.meta.get(g.PHASE) == g.OPTIMIZER]))
    param_node = {p.meta[g.INDEX]: p for p in old_params}
    grad_node = {i: n for n in graph.nodes for i in n.meta.get(g.GRAD_OF, ())}
    finish_gradients_where_computed(graph, grad_node.values())
    old_state = {}
    for node in g.placeholders(gm, g.ROLE_STATE):
        old_state.setdefault(node.meta[g.INDEX], {})[node.meta[g.STATE_KEY]] = node
    lr_nodes = g.placeholders(gm, g.ROLE_HYPER)
    order = g.topological_index(gm)
    output = g.output_node(gm)
    new_outputs: list[tuple[str, fx.Node]] = []
    device = trained[0].meta[g.VAL].device

    piece_inputs = []   # (bucket, piece number, piece, param piece node, grad piece node)
    for bucket in plan.buckets:
        local_numel = bucket.shard_numel if ctx.stage == 3 else bucket.numel
        placeholder = _bucket_placeholder(gm, ctx, bucket, local_numel, device)

        # parameters: views of the bucket's full value, made just before the first use
        users = [u for i in bucket.params for u in param_node[i].users]
        first_user = min(users, key=order.get)
        with graph.inserting_before(first_user):
            if ctx.stage == 3:
                full = graph.call_function(ops.unshard, (placeholder, plan.world_size))
                full.meta[g.VAL] = _empty(ctx, bucket.numel, bucket.dtype, device)
                full.meta[g.PHASE] = g.COMMUNICATION
                full.meta[g.BUCKET] = bucket.index
            else:
                full = placeholder
            for segment in bucket.segments:
                old = param_node[segment.param]
                flat = g.call(graph, ctx.fake_mode, aten.slice.Tensor, full, 0, segment.offset, segment.offset + segment.numel)
                view = g.call(graph, ctx.fake_mode, aten.view.default, flat, list(old.meta[g.VAL].shape))
                for node in (flat, view):
                    node.meta[g.PHASE] = first_user.meta.get(g.PHASE, g.FORWARD)
                    node.meta[g.BUCKET] = bucket.index
                old.replace_all_uses_with(view)

        # gradients: one flat tensor per bucket, reduced where they are final
        grads = [grad_node[i] for i in bucket.params]
        last_grad = max(grads, key=order.get)
        with graph.inserting_before(last_grad.next):
            parts, cursor = [], 0
            for segment in bucket.segments:
                if segment.offset > cursor:
                    parts.append(_zeros(graph, ctx, segment.offset - cursor, bucket.dtype, device))
                parts.append(g.call(graph, ctx.fake_mode, aten.reshape.default, grad_node[segment.param], [-1]))
                cursor = segment.offset + segment.numel
            if bucket.numel > cursor:
                parts.append(_zeros(graph, ctx, bucket.numel - cursor, bucket.dtype, device))
            flat_grad = g.call(graph, ctx.fake_mode, aten.cat.default, parts)
            for node in [*parts, flat_grad]:
                node.meta[g.PHASE] = g.BACKWARD
                node.meta[g.BUCKET] = bucket.index
        # stage 1 holds every full gradient until backward ends (the old update, still
        # in the graph before the output, is dead code); the others reduce at once
        scatter = ctx.stage >= 1
        with graph.inserting_before(output) if ctx.stage == 1 else graph.inserting_after(flat_grad):
            reduced = graph.call_function(ops.reduce_gradient, (flat_grad, plan.world_size, scatter))
            reduced.meta[g.VAL] = _empty(ctx, bucket.shard_numel if scatter else bucket.numel, bucket.dtype, device)
            reduced.meta[g.PHASE] = g.COMMUNICATION
            reduced.meta[g.BUCKET] = bucket.index

        # this rank's pieces, as inputs of the optimizer update
        base = 0 if ctx.stage == 3 else plan.rank * bucket.shard_numel if bucket.shards > 1 else 0
        grad_base = 0 if scatter else base
        with graph.inserting_before(output):
            for number, piece in enumerate(bucket.pieces(plan.rank if bucket.shards > 1 else 0)):
                start = piece.shard_offset
                param_piece = g.call(graph, ctx.fake_mode, aten.slice.Tensor, placeholder, 0, base + start, base + start + piece.numel)
                grad_piece = g.call(graph, ctx.fake_mode, aten.slice.Tensor, reduced, 0, grad_base + start, grad_base + start + piece.numel)
                added = [param_piece, grad_piece]
                shape = _update_shape(ctx, piece, shaped)
                if shape is not None:
                    # the optimizer sees the parameter as eager does: a 0-dim one with 0-dim state (a 1-element piece
                    # would meet 0-dim state, which every scalar state also is); at stage 0 each whole parameter in
                    # its shape, as an update that is not elementwise (Muon's matrix products) needs it
                    param_piece = g.call(graph, ctx.fake_mode, aten.view.default, param_piece, shape)
                    grad_piece = g.call(graph, ctx.fake_mode, aten.view.default, grad_piece, shape)
                    added += [param_piece, grad_piece]
                for node in added:
                    node.meta[g.PHASE] = g.OPTIMIZER
                piece_inputs.append((bucket, number, piece, param_piece, grad_piece))

    # one trace of the real optimizer over every piece this rank owns
    state_nodes = []
    last = _last_placeholder(gm)   # each state placeholder goes after the one before
    for bucket, number, piece, _, _ in piece_inputs:
        states = {}
        for key, old in sorted(old_state.get(piece.param, {}).items()):
            value = old.meta[g.VAL]
            shape = [] if value.dim() == 0 else [piece.numel]
            states[key] = last = _state_placeholder(
                gm, ctx, last, decisions.state_slot(decisions.piece_owner(bucket.index, number), key),
                key, shape, value.dtype, value.device)
            if shaped and value.dim() > 0:   # the slot is flat; the update reads it in its own shape
                with graph.inserting_before(output):
                    states[key] = g.call(graph, ctx.fake_mode, aten.view.default, states[key], list(value.shape))
                states[key].meta[g.PHASE] = g.OPTIMIZER
        state_nodes.append(states)
    new_pieces, new_states = _inline_optimizer(gm, ctx, piece_inputs, state_nodes, lr_nodes, replicate=not shaped)
    if shaped:   # new state in its slot's flat shape
        with graph.inserting_before(output):
            for states in new_states:
                for key, node in states.items():
                    if node.meta[g.VAL].dim() > 1:
                        states[key] = g.call(graph, ctx.fake_mode, aten.reshape.default, node, [-1])
                        states[key].meta[g.PHASE] = g.OPTIMIZER

    # new buckets from the new pieces
    with graph.inserting_before(output):
        for bucket in plan.buckets:
            parts, cursor = [], 0
            for (b, number, piece, _, _), new in zip(piece_inputs, new_pieces):
                if b is not bucket:
                    continue
                if piece.shard_offset > cursor:
                    parts.append(_zeros(graph, ctx, piece.shard_offset - cursor, bucket.dtype, device))
                if _update_shape(ctx, piece, shaped) is not None:
                    new = g.call(graph, ctx.fake_mode, aten.reshape.default, new, [piece.numel])
                parts.append(new)
                cursor = piece.shard_offset + piece.numel
            if bucket.shard_numel > cursor and ctx.stage != 0:
                parts.append(_zeros(graph, ctx, bucket.shard_numel - cursor, bucket.dtype, device))
            if ctx.stage == 0 and bucket.numel > cursor:
                parts.append(_zeros(graph, ctx, bucket.numel - cursor, bucket.dtype, device))
            new_shard = g.call(graph, ctx.fake_mode, aten.cat.default, parts)
            for node in [*parts, new_shard]:
                node.meta[g.PHASE] = g.OPTIMIZER
            new_value = new_shard
            if ctx.stage in (1, 2):
                new_value = graph.call_function(ops.unshard, (new_shard, plan.world_size))
                new_value.meta[g.VAL] = _empty(ctx, bucket.numel, bucket.dtype, device)
                new_value.meta[g.PHASE] = g.COMMUNICATION
                new_value.meta[g.BUCKET] = bucket.index
            new_outputs.append((decisions.bucket_slot(bucket.index), new_value))
    for (bucket, number, piece, _, _), states in zip(piece_inputs, new_states):
        for key, node in sorted(states.items()):
            new_outputs.append((decisions.state_slot(decisions.piece_owner(bucket.index, number), key), node))

    # keep outputs of slots the pass did not take over (buffers); drop the per-parameter ones
    trained_names = {ctx.captured.params[p.meta[g.INDEX]].name for p in trained}
    loss, *old_outputs = output.args[0]
    for slot, node in zip(gm.meta[g.OUTPUT_SLOTS], old_outputs):
        kind, owner = slot.split(":")[:2]
        if kind in ("param", "state") and owner in trained_names:
            continue
        if node.op == "placeholder" and node.meta.get(g.SLOT) == slot:
            continue   # unchanged
        new_outputs.append((slot, node))
    output.args = ([loss, *[node for _, node in new_outputs]],)
    gm.meta[g.OUTPUT_SLOTS] = [slot for slot, _ in new_outputs]

    g.eliminate_dead_code(gm)
    for node in [*trained, *[n for states in old_state.values() for n in states.values()]]:
        if not node.users:
            graph.erase_node(node)
    g.drop_unread_constants(gm)   # capture's optimizer trace, replaced by the per-piece one
    graph.lint()
    gm.recompile()
    ctx.notes["shard"] = (f"{len(plan.buckets)} buckets for {len(trained)} params, "
                          f"{sum(1 for _ in plan.owned_pieces())} pieces on rank {plan.rank}, "
                          f"{plan.padding_elements} padding elements")
    return gm


def choose_buckets(gm: fx.GraphModule, ctx: CompileContext, trained: list[fx.Node]) -> decisions.ShardPlan:
    """Group parameters into buckets in order of first use, up to ``ctx.bucket_bytes`` each.

    A bucket never mixes optimizer param groups or dtypes. Parameter offsets are
    aligned (``decisions.ALIGNMENT_BYTES``); the bucket is padded to a multiple of
    the number of shards.
    """
    if ctx.previous_plan is not None:
        return dataclasses.replace(ctx.previous_plan, rank=ctx.rank)
    order = g.topological_index(gm)
    first_use = {p: min((order[u] for u in p.users), default=len(order)) for p in trained}
    ordered = sorted(trained, key=lambda p: (first_use[p], p.meta[g.INDEX]))
    shards = 1 if ctx.stage == 0 else ctx.world_size
    # one open bucket per (param group, dtype): parameters of different groups interleave
    # in first-use order (weights decayed, biases not), and each group fills its own
    # buckets instead of closing one at every switch
    closed: list[tuple[int, tuple, list[decisions.Segment], int]] = []   # (first use, key, segments, numel)
    open_buckets: dict[tuple, tuple[int, list[decisions.Segment], int]] = {}

    def close(key):
        first, segments, cursor = open_buckets.pop(key)
        closed.append((first, key, segments, -(-max(cursor, 1) // shards) * shards))

    for node in ordered:
        info = ctx.captured.params[node.meta[g.INDEX]]
        key = (info.group, info.dtype)
        if key in open_buckets:
            first, segments, cursor = open_buckets[key]
            start = decisions.aligned(cursor, info.dtype)
            if (start + info.numel) * info.dtype.itemsize > ctx.bucket_bytes:
                close(key)
        if key not in open_buckets:
            open_buckets[key] = (first_use[node], [], 0)
            start = 0
        first, segments, _ = open_buckets[key]
        segments.append(decisions.Segment(node.meta[g.INDEX], start, info.numel))
        open_buckets[key] = (first, segments, start + info.numel)
    for key in list(open_buckets):
        close(key)
    closed.sort(key=lambda bucket: bucket[0])     # buckets in order of their first use
    buckets = [decisions.Bucket(index, key[0], key[1], tuple(segments), numel, shards)
               for index, (_, key, segments, numel) in enumerate(closed)]
    param_dtype = ctx.precision.param_dtype if ctx.precision is not None else None
    return decisions.ShardPlan(ctx.stage, ctx.world_size, ctx.rank, tuple(buckets), ctx.bucket_bytes, param_dtype)


def _update_shape(ctx: CompileContext, piece: decisions.Piece, shaped: bool) -> list[int] | None:
    """The shape the optimizer sees ``piece`` in, where not flat: a whole 0-dim parameter (CLIP's ``logit_scale``),
    and where ``shaped`` (stage 0, where every piece is a whole parameter, with an update that is not elementwise)
    any parameter of more than one dimension."""
    shape = list(ctx.captured.params[piece.param].shape)
    return shape if len(shape) == 0 or (shaped and len(shape) > 1) else None


def _empty(ctx: CompileContext, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    return g.empty_fake(ctx.fake_mode, (numel,), (1,), dtype, device)   # torch.empty's under the fake mode, for less


def _zeros(graph: fx.Graph, ctx: CompileContext, numel: int, dtype, device) -> fx.Node:
    return g.call(graph, ctx.fake_mode, aten.zeros.default, [numel], dtype=dtype, device=device)


def _bucket_placeholder(gm, ctx, bucket, numel, device) -> fx.Node:
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")   # placeholders lead: no walk over the graph
    with gm.graph.inserting_before(first):
        node = gm.graph.placeholder(f"bucket{bucket.index}")
    node.meta.update({g.ROLE: g.ROLE_PARAM, g.INDEX: bucket.index, g.BUCKET: bucket.index,
                      g.SLOT: decisions.bucket_slot(bucket.index), g.VAL: _empty(ctx, numel, bucket.dtype, device)})
    return node


def _last_placeholder(gm: fx.GraphModule) -> fx.Node:
    last = next(iter(gm.graph.nodes))
    while last.next.op == "placeholder":   # the placeholders lead the graph: no walk over all of it
        last = last.next
    return last


def _state_placeholder(gm, ctx, last, slot, key, shape, dtype, device) -> fx.Node:
    with gm.graph.inserting_after(last):
        node = gm.graph.placeholder(slot.replace(":", "_").replace(".", "_"))
    value = g.empty_fake(ctx.fake_mode, shape, (1,) if shape else (), dtype, device)
    node.meta.update({g.ROLE: g.ROLE_STATE, g.SLOT: slot, g.STATE_KEY: key, g.VAL: value})
    return node


def _inline_optimizer(gm, ctx, piece_inputs, state_nodes, lr_nodes, replicate: bool):
    """Trace ``optimizer.step()`` over the pieces and splice it in before the output.

    An elementwise update (at stages 1-3 capture checked it; at stage 0, which takes any optimizer, ``shard``
    read it off the captured update) is traced once per class of look-alike pieces and copied for the others
    (``replicate``); one that is not, over all of them at once. A foreach update is traced
    over each bucket's pieces across ranks (a bucket's update can then follow its reduction), over all of
    them at world size 1, as eager launches it.
    """
    units = [bucket.index for bucket, *_ in piece_inputs] if ctx.world_size > 1 else None
    new_pieces, new_states, added = splice_update(
        gm, ctx.fake_mode, ctx.optimizer,
        [p for *_, p, _ in piece_inputs], [gr for *_, gr in piece_inputs], state_nodes, lr_nodes,
        [bucket.group for bucket, *_ in piece_inputs], replicate=replicate,
        cache=ctx.traces, units=units)
    for node in added:
        node.meta[g.PHASE] = g.OPTIMIZER
    return new_pieces, new_states
