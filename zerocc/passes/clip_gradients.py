"""clip_gradients: global-norm gradient clipping between the reduction and the optimizer.

Requires: ``shard`` (its ``ops.reduce_gradient`` markers, and the slices of
their results, one per parameter piece this rank owns, that the optimizer
reads). Runs before ``insert_collectives``, which lowers the markers.
Establishes: every piece the optimizer reads is multiplied by
``clamp(max_norm / (total + 1e-6), max=1)``, where ``total`` is the norm of
all gradients of the model, as ``torch.nn.utils.clip_grad_norm_`` computes
it; ``total`` (before clipping) is an extra graph output, written to the slot
``GRAD_NORM_SLOT`` (``step.last_grad_norm``).

Where every rank holds every (averaged) gradient (stage 0, or world size 1)
the pass traces torch's own ``get_total_norm`` and the lines of
``clip_grads_with_norm_`` over the parameters' gradients in the user's parameter order: the same ops in
the same order as eager code, so the result is bit for bit eager's. At stages
1-3 over N ranks the shards of a bucket are disjoint and its padding is zero,
so each rank takes the norm of the pieces it owns, raises it to the power p,
and one ``all_reduce`` (sum; max for the inf-norm) over the ranks gives
total ** p. That reorders the sum, so it matches unsharded clipping within
float rounding, not bit for bit. The ``all_reduce`` is communication: dead
code elimination keeps it even on a rank that owns no piece (it then adds
zero), and every rank issues it at the same point of the same program.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops
from ..context import CompileContext
from ..tracing import trace_functional

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

GRAD_NORM_SLOT = "metric:grad_norm"   # the runtime slot holding the last step's total norm, before clipping


def clip_gradients(gm: fx.GraphModule, ctx: CompileContext, *, max_norm: float, norm_type: float) -> fx.GraphModule:
    """Scale the gradients the optimizer reads so that their global ``norm_type``-norm is at most ``max_norm``."""
    graph = gm.graph
    plan = ctx.shard_plan
    markers = {n.meta[g.BUCKET]: n for n in graph.nodes
               if n.op == "call_function" and n.target is ops.reduce_gradient}
    # the optimizer's gradient pieces: slices of a reduced bucket, keyed by their start in it
    slices = {(_reduced_bucket(node, markers), node.args[2]): node for node in graph.nodes
              if node.op == "call_function" and node.target is aten.slice.Tensor
              and node.meta.get(g.PHASE) == g.OPTIMIZER and _reduced_bucket(node, markers) is not None}
    pieces = []   # (param, offset in param, node the optimizer reads, shape to view it as)
    for bucket, _, piece in plan.owned_pieces():
        node = slices[(bucket.index, piece.shard_offset)]
        info = ctx.captured.params[piece.param]
        if [user.target for user in node.users] == [aten.view.default]:
            # the optimizer reads shard's view of the slice in the parameter's shape (a 0-dim parameter; at stage
            # 0 every parameter of more than one dimension)
            (node,) = node.users
        shape = list(info.shape) if piece.numel == info.numel else [piece.numel]
        pieces.append((piece.param, piece.param_offset, node, shape))
    pieces.sort(key=lambda item: item[:2])   # the user's parameter order, as clip_grad_norm_(model.parameters())
    across_ranks = ctx.stage != 0 and ctx.world_size > 1
    read_as = [node.meta[g.VAL] for _, _, node, _ in pieces]   # each clipped piece replaces a node of its shape
    dtypes = [info.dtype for info in ctx.captured.params]
    params_dtype = functools.reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()

    def clip(grads):
        grads = [grad.view(shape) for grad, (*_, shape) in zip(grads, pieces)]
        # a rank that owns no piece (a model smaller than the world size) adds a zero norm, made by a traced op:
        # get_total_norm's torch.tensor(0.0) is a constant, and the trace runs an op on constants for real, so that
        # rank ran the all_reduce below while tracing, unmatched by the others (hang)
        total = torch.nn.utils.get_total_norm(grads, norm_type) if grads else torch.zeros((), dtype=params_dtype)
        if across_ranks:
            finite = not math.isinf(norm_type)
            local = (total ** norm_type if finite else total).reshape(1)
            summed = c10d.wait_tensor(c10d.all_reduce(local, "sum" if finite else "max", ctx.group_name))
            total = (summed ** (1.0 / norm_type) if finite else summed).reshape(())
        # torch.nn.utils.clip_grads_with_norm_, line for line (it reads p.grad, which these pieces are)
        clip_coef = max_norm / (total + 1e-6)
        clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
        return total, [(grad * clip_coef_clamped).reshape(read.shape) for grad, read in zip(grads, read_as)]

    with ctx.fake_mode:
        fakes = [torch.empty_like(value) for value in read_as]
    sub, _ = trace_functional(lambda grads: clip(grads), (fakes,), ctx.fake_mode)

    # after every piece this rank clips and every bucket's reduction, on every rank: at stage 1 the reductions are
    # interleaved with the pieces before the output, and a rank owning no piece of the last bucket (a 1-element
    # bias at the end of the model, small buckets) would otherwise issue the norm's all_reduce before that
    # bucket's reduce-scatter, where the other ranks issue it after (RankMismatchError)
    anchor = max([*(node for _, _, node, _ in pieces), *markers.values()], key=g.topological_index(gm).get,
                 default=None)
    added = []
    env = dict(zip(g.placeholders(sub), [node for _, _, node, _ in pieces]))
    with graph.inserting_before(anchor.next if anchor is not None else g.output_node(gm)):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                total, *clipped = [env[n] for n in node.args[0]]
                break
            if node.op == "get_attr":   # a constant tensor the trace folded
                name = g.unique_attribute(gm, "clip_" + node.target)
                gm.register_buffer(name, getattr(sub, node.target))
                copied = graph.get_attr(name)
                copied.meta.update(node.meta)
            else:
                copied = graph.node_copy(node, lambda n: env[n])
            copied.meta[g.PHASE] = g.COMMUNICATION if g.is_communication(copied) else g.OPTIMIZER
            added.append(copied)
            env[node] = copied
    ours = set(added)
    for (_, _, node, _), new in zip(pieces, clipped):
        node.replace_all_uses_with(new, delete_user_cb=lambda user: user not in ours)

    output = g.output_node(gm)
    output.args = ([*output.args[0], total],)
    gm.meta[g.OUTPUT_SLOTS] = [*gm.meta[g.OUTPUT_SLOTS], GRAD_NORM_SLOT]
    graph.lint()
    gm.recompile()
    reductions = sum(1 for n in added if g.is_all_reduce(n))
    ctx.notes["clip_gradients"] = (f"max_norm={max_norm}, norm_type={norm_type}: {len(pieces)} pieces clipped, "
                                   f"+{reductions} all_reduce of the local norm")
    return gm


# what mixed_precision puts between a reduction and the optimizer's slices: the cast back from
# reduce_dtype, and loss scaling's unscale (``* (1 / scale)``)
_PASS_THROUGH = (aten._to_copy.default, aten.mul.Tensor)


def _reduced_bucket(piece: fx.Node, markers: dict[int, fx.Node]) -> int | None:
    """The bucket whose reduced gradient ``piece`` slices (through mixed precision's casts), or None."""
    source = piece.args[0]
    while source.op == "call_function" and source.target in _PASS_THROUGH:
        source = source.args[0]
    bucket = source.meta.get(g.BUCKET)
    return bucket if markers.get(bucket) is source else None
