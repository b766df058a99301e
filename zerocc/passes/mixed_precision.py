"""mixed_precision: compute in param_dtype from fp32 master buckets, reduce in reduce_dtype, scale the loss.

Requires: ``shard`` (bucket placeholders, their ``ops.unshard`` and
``ops.reduce_gradient`` markers), and a capture traced with a ``Precision``
(``zerocc/precision.py``): each trained parameter is read through a cast to
``param_dtype`` tagged ``PRECISION_CAST``; gradients are in the master dtype.
Establishes, before ``insert_collectives`` lowers the markers:

  - parameters: each bucket is cast once to ``param_dtype``: the local shard
    before its ``unshard`` at stage 3 (so the all_gather moves half the bytes
    of fp32), the full bucket at stages 0-2; the parameters forward and
    backward read are views of that cast. The per-parameter casts go.
    At stages 1-2 (as DeepSpeed's bf16 ZeRO-1/2) the fp32 masters become
    this rank's shard (slot ``bucket:<i>``, beside the optimizer state) and
    the full bucket is kept in ``param_dtype`` (slot ``compute:<i>``), which
    forward and backward read; the update casts the new master shard to
    ``param_dtype`` and gathers that, so gathers move ``param_dtype`` bytes.
  - gradients: when ``reduce_dtype`` differs from the master dtype, each
    bucket's flat gradient is built in ``reduce_dtype`` and cast back to the
    master dtype after its ``reduce_gradient``. A gradient computed in
    ``reduce_dtype`` (the backward of a parameter's cast) goes into the
    bucket as it is, without its cast to the master dtype: so the bucket a
    rank holds until it is reduced (all of it at stages 0-1, through
    backward) is in ``reduce_dtype``, 2 bytes per parameter in bf16 as in
    the ZeRO paper, where it used to be an fp32 bucket cast at the
    reduction. The bits are the same: bf16 -> fp32 -> bf16 is exact.
  - loss scaling: the reduced gradients are checked for inf/nan and
    unscaled (``* (1 / scale)``, the reciprocal taken in float64 as
    ``GradScaler`` does); at stages 1-3 the found-inf flag is all-reduced
    (ranks check different shards); every updated parameter bucket and
    optimizer state is ``where(found_inf, old, new)``, so a skipped step
    leaves them, the step counter included, exactly unchanged while the graph
    stays static; the scale and its growth tracker are updated by
    ``aten._amp_update_scale``, GradScaler's own kernel. State the first
    step creates has no old value: the runtime drops it when that step
    overflowed (``api.CompiledStep``).
"""
from __future__ import annotations

import collections
import math
import operator

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops, decisions
from .. import precision as mixed
from ..context import CompileContext

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def mixed_precision(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Cast buckets to the compute dtype, gradients to the reduce dtype; scale the loss dynamically."""
    precision = ctx.precision
    if precision is None:
        ctx.notes["mixed_precision"] = "full precision: nothing to do"
        return gm
    counts: collections.Counter = collections.Counter()
    for bucket in ctx.shard_plan.buckets:
        counts["bucket casts"] += _cast_parameters(gm, ctx, bucket)
    reduced = []
    for marker in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.reduce_gradient]:
        node, cast = _reduce_in(gm, ctx, marker, precision)
        reduced.append(node)
        counts["gradient casts"] += cast
    if precision.loss_scale is not None:
        counts["guarded outputs"] += _scale_loss(gm, ctx, reduced, precision.loss_scale)
    g.eliminate_dead_code(gm)
    gm.graph.lint()
    gm.recompile()
    ctx.notes["mixed_precision"] = f"{precision.describe()}: " + ", ".join(f"{v} {k}" for k, v in counts.items())
    return gm


def _cast_parameters(gm: fx.GraphModule, ctx: CompileContext, bucket: decisions.Bucket) -> int:
    """Read the bucket's parameters as views of one cast of the bucket (of its shard, before the gather)."""
    graph = gm.graph
    casts = [n for n in graph.nodes if n.meta.get(g.PRECISION_CAST) == "param"
             and n.args[0].meta.get(g.BUCKET) == bucket.index and n.args[0].target is aten.view.default]
    if not casts:
        return 0   # param_dtype is the bucket's dtype, or nothing reads the bucket
    dtype = casts[0].meta[g.VAL].dtype
    order = g.topological_index(gm)
    first_slice = min((cast.args[0].args[0] for cast in casts), key=order.get)
    full = first_slice.args[0]
    if full.op == "call_function" and full.target is ops.unshard:   # stage 3: cast the shard, gather the cast
        shard = full.args[0]
        with graph.inserting_before(full):
            low = g.call(graph, ctx.fake_mode, aten._to_copy.default, shard, dtype=dtype)
        full.args = (low, *full.args[1:])
        with ctx.fake_mode:
            full.meta[g.VAL] = torch.empty(bucket.numel, dtype=dtype, device=full.meta[g.VAL].device)
        source = full
    elif ctx.shard_plan.has_compute_copy(bucket):                    # stages 1-2: read the kept param_dtype copy
        low = source = _shard_masters(gm, ctx, bucket, full, dtype)
    else:                                                            # stages 0-2: cast the full bucket
        with graph.inserting_before(first_slice):
            low = g.call(graph, ctx.fake_mode, aten._to_copy.default, full, dtype=dtype)
        source = low
    if low.op != "placeholder":
        low.meta.update({g.PRECISION_CAST: "param", g.PHASE: first_slice.meta.get(g.PHASE, g.FORWARD),
                         g.BUCKET: bucket.index})
    for cast in casts:
        view = cast.args[0]
        old_slice = view.args[0]
        with graph.inserting_before(old_slice):
            flat = g.call(graph, ctx.fake_mode, aten.slice.Tensor, source, *old_slice.args[1:])
            low_view = g.call(graph, ctx.fake_mode, aten.view.default, flat, *view.args[1:])
        for new, old in ((flat, old_slice), (low_view, view)):
            new.meta.update({g.PHASE: old.meta.get(g.PHASE), g.BUCKET: bucket.index})
        cast.replace_all_uses_with(low_view)
        graph.erase_node(cast)
        for node in (view, old_slice):   # the master's views: dead now, and a sharded master has no such range
            if not node.users:
                graph.erase_node(node)
    if low.op == "placeholder":
        readers = [u for u in full.users if u.meta.get(g.PHASE) != g.OPTIMIZER]
        assert not readers, f"bucket {bucket.index}: the sharded master is still read outside the update: {readers}"
    return 1


def _shard_masters(gm: fx.GraphModule, ctx: CompileContext, bucket: decisions.Bucket, full: fx.Node,
                   dtype: torch.dtype) -> fx.Node:
    """Stages 1-2: keep the fp32 masters as this rank's shard and the full bucket in ``dtype``; returns the latter.

    As DeepSpeed's bf16 ZeRO-1/2: the slot ``bucket:<i>`` becomes this rank's
    shard of the masters (the optimizer reads its pieces from it), a new slot
    ``compute:<i>`` holds the whole bucket in ``dtype`` (forward and backward
    read it), and the update casts the new master shard to ``dtype`` before
    the ``unshard`` that gathers it into the new ``compute:<i>``: the gather
    moves ``dtype`` bytes, and no rank holds the full fp32 bucket.
    """
    graph = gm.graph
    plan = ctx.shard_plan
    device = full.meta[g.VAL].device
    with graph.inserting_after(full):
        compute = graph.placeholder(f"compute{bucket.index}")
    with ctx.fake_mode:
        compute_value = torch.empty(bucket.numel, dtype=dtype, device=device)
        full.meta[g.VAL] = torch.empty(bucket.shard_numel, dtype=bucket.dtype, device=device)
    compute.meta.update({g.ROLE: g.ROLE_PARAM, g.INDEX: bucket.index, g.BUCKET: bucket.index,
                         g.SLOT: decisions.compute_slot(bucket.index), g.VAL: compute_value})
    # the update's pieces were sliced from the full bucket at this rank's offset; the shard starts at 0
    base = plan.rank * bucket.shard_numel if bucket.shards > 1 else 0
    for user in list(full.users):
        if user.meta.get(g.PHASE) == g.OPTIMIZER and user.target is aten.slice.Tensor:
            _, dim, start, stop = user.args
            user.args = (full, dim, start - base, stop - base)
    # the update: new master shard -> bucket:<i>; its cast, gathered -> compute:<i>
    output = g.output_node(gm)
    loss, *values = output.args[0]
    slots = list(gm.meta[g.OUTPUT_SLOTS])
    position = slots.index(decisions.bucket_slot(bucket.index))
    gathered = values[position]
    assert gathered.target is ops.unshard, f"bucket {bucket.index}: the update is not gathered by an unshard"
    new_shard = gathered.args[0]
    with graph.inserting_before(gathered):
        low = g.call(graph, ctx.fake_mode, aten._to_copy.default, new_shard, dtype=dtype)
    low.meta.update({g.PHASE: g.OPTIMIZER, g.BUCKET: bucket.index})
    gathered.args = (low, *gathered.args[1:])
    with ctx.fake_mode:
        gathered.meta[g.VAL] = torch.empty(bucket.numel, dtype=dtype, device=device)
    values[position] = new_shard
    output.args = ([loss, *values, gathered],)
    gm.meta[g.OUTPUT_SLOTS] = [*slots, decisions.compute_slot(bucket.index)]
    return compute


def _reduce_in(gm: fx.GraphModule, ctx: CompileContext, marker: fx.Node, precision: mixed.Precision):
    """Reduce the bucket's gradient in the reduce dtype; returns the master-dtype result and casts added."""
    graph = gm.graph
    flat = marker.args[0]
    master = flat.meta[g.VAL].dtype
    dtype = precision.reduction_dtype(master)
    if dtype == master:
        return marker, 0
    bucket = marker.meta.get(g.BUCKET)
    if flat.op == "call_function" and flat.target is aten.cat.default:
        low = _cat_in(gm, ctx, flat, dtype)
    else:
        with graph.inserting_before(marker):
            low = g.call(graph, ctx.fake_mode, aten._to_copy.default, flat, dtype=dtype)
        low.meta.update({g.PHASE: g.BACKWARD, g.BUCKET: bucket})
    marker.args = (low, *marker.args[1:])
    value = marker.meta[g.VAL]
    with ctx.fake_mode:
        marker.meta[g.VAL] = torch.empty(value.shape, dtype=dtype, device=value.device)
    with graph.inserting_after(marker):
        back = g.call(graph, ctx.fake_mode, aten._to_copy.default, marker, dtype=master)
    # communication bookkeeping, like the averaging division: schedule moves it to its first use
    back.meta.update({g.PHASE: g.COMMUNICATION, g.BUCKET: bucket})
    marker.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
    return back, 2


def _cat_in(gm: fx.GraphModule, ctx: CompileContext, flat: fx.Node, dtype: torch.dtype) -> fx.Node:
    """The shard pass's flat gradient ``cat`` rebuilt in ``dtype``, where it stood; returns the new cat.

    A part that is the master-dtype cast of a ``dtype`` gradient is read
    before its cast; padding is made in ``dtype``; any other part (a
    gradient summed in the master dtype over micro-batches) is cast. Casting
    the parts is casting the cat: the same bits.
    """
    graph = gm.graph
    parts = []
    with graph.inserting_before(flat):
        for part in flat.args[0]:
            source = part.args[0] if part.target is aten.reshape.default else None
            if part.target is aten.zeros.default:
                part = g.call(graph, ctx.fake_mode, aten.zeros.default, *part.args, **{**part.kwargs, "dtype": dtype})
            elif (source is not None and source.op == "call_function" and source.target is aten._to_copy.default
                  and g.tensor_meta(source.args[0]) is not None and g.tensor_meta(source.args[0]).dtype == dtype):
                part = g.call(graph, ctx.fake_mode, aten.reshape.default, source.args[0], *part.args[1:])
            else:
                part = g.call(graph, ctx.fake_mode, aten._to_copy.default, part, dtype=dtype)
            parts.append(part)
        low = g.call(graph, ctx.fake_mode, aten.cat.default, parts)
    for node in [*parts, low]:
        node.meta.update({g.PHASE: flat.meta.get(g.PHASE, g.BACKWARD), g.BUCKET: flat.meta.get(g.BUCKET)})
    return low


def _scale_loss(gm: fx.GraphModule, ctx: CompileContext, reduced: list[fx.Node], scaling: mixed.DynamicLossScale) -> int:
    """Unscale and check the reduced gradients; skip the update on inf/nan; update the scale."""
    graph = gm.graph
    fake = ctx.fake_mode
    (scale,) = [n for n in g.placeholders(gm, g.ROLE_LOSS_SCALE) if n.meta[g.SLOT] == mixed.SCALE_SLOT]
    with graph.inserting_after(scale):
        tracker = graph.placeholder("loss_scale_growth_tracker")
    with fake:
        tracker_value = torch.zeros((), dtype=torch.int32, device=scale.meta[g.VAL].device)
    tracker.meta.update({g.ROLE: g.ROLE_LOSS_SCALE, g.SLOT: mixed.GROWTH_TRACKER_SLOT, g.VAL: tracker_value})

    output = g.output_node(gm)
    order = g.topological_index(gm)
    used = [n for n in reduced if n.users]   # a rank owning no piece of a bucket reads none of it
    if not used:
        raise AssertionError("loss scaling: no reduced gradient is read by the optimizer")
    first_use = min((u for n in used for u in n.users), key=order.get)
    with graph.inserting_before(first_use):
        # GradScaler.unscale_: inv_scale = scale.double().reciprocal().float()
        double = g.call(graph, fake, aten._to_copy.default, scale, dtype=torch.float64)
        reciprocal = g.call(graph, fake, aten.reciprocal.default, double)
        inverse = g.call(graph, fake, aten._to_copy.default, reciprocal, dtype=torch.float32)
    new_nodes = [double, reciprocal, inverse]
    # Every gradient is checked where the first is read (each is reduced by then: backward's reductions come before
    # the update in the traced order), so the found-inf flag is known before any update runs and each updated value
    # is selected just after it is made: the old one then dies there (release_slots) and the new one is no longer
    # held to the end beside it. Selecting at the end held the old and the new state of every parameter at once,
    # twice the optimizer state at the step's peak (an fp16 AMSGrad MLP: 108 kB against 68 kB for the first step,
    # whose created state has no old value to keep).
    checked_first = all(order[n] < order[first_use] for n in used)
    flags = []
    for node in used:
        users = list(node.users)
        with graph.inserting_before(first_use if checked_first else min(users, key=order.get)):
            # aten.isfinite as its composite kernel computes it, (x == x) * (|x| != inf), one op per node: the
            # single op ran them unseen by the memory plan, whose peak then missed a bucket-sized |x| and three
            # bucket-sized masks (18% of a small MLP's step under memory pools)
            magnitude = g.call(graph, fake, aten.abs.default, node)
            bounded = g.call(graph, fake, aten.ne.Scalar, magnitude, math.inf)
            number = g.call(graph, fake, aten.eq.Tensor, node, node)
            finite = g.call(graph, fake, aten.mul.Tensor, number, bounded)
            every = g.call(graph, fake, aten.all.default, finite)
            bad = g.call(graph, fake, aten.logical_not.default, every)
        with graph.inserting_before(min(users, key=order.get)):
            unscaled = g.call(graph, fake, aten.mul.Tensor, node, inverse)
        new_nodes += [magnitude, bounded, number, finite, every, bad, unscaled]
        flags.append(bad)
        for user in users:
            user.replace_input_with(node, unscaled)

    order = g.topological_index(gm)
    with graph.inserting_before(max(flags, key=order.get).next):   # just after the last flag
        found = flags[0]
        for flag in flags[1:]:
            found = g.call(graph, fake, aten.logical_or.default, found, flag)
            new_nodes.append(found)
        found_inf = g.call(graph, fake, aten._to_copy.default, found, dtype=torch.float32)
        new_nodes.append(found_inf)
        if ctx.world_size > 1 and ctx.stage >= 1:   # each rank checked its own shards
            started = graph.call_function(c10d.all_reduce.default, (found_inf, "max", ctx.group_name))
            waited = graph.call_function(c10d.wait_tensor.default, (started,))
            for node in (started, waited):
                node.meta.update({g.VAL: found_inf.meta[g.VAL], g.PHASE: g.COMMUNICATION, g.BUCKET: None})
            found_inf = waited
        skip = g.call(graph, fake, aten.gt.Scalar, found_inf, 0)
        new_nodes.append(skip)
    order = g.topological_index(gm)
    old_of = {n.meta[g.SLOT]: n for n in g.placeholders(gm) if n.meta.get(g.SLOT)}
    loss, *values = output.args[0]
    guarded = 0
    for position, (slot, value) in enumerate(zip(gm.meta[g.OUTPUT_SLOTS], values)):
        kind = slot.split(":")[0]
        if kind in ("bucket", "compute", "param", "state") and slot in old_of and value is not old_of[slot]:
            # just after the new value is made (or the flag known, if later): old and new die here, not at the end
            with graph.inserting_before(max(value, skip, key=order.get).next):
                condition = skip
                device = g.tensor_meta(value).device
                if device != g.tensor_meta(skip).device:   # Adam's step count lives on the CPU
                    condition = g.call(graph, fake, aten._to_copy.default, skip, device=device)
                    new_nodes.append(condition)
                values[position] = g.call(graph, fake, aten.where.self, condition, old_of[slot], value)
            new_nodes.append(values[position])
            guarded += 1
    with graph.inserting_before(output):
        new_scale = g.call(graph, fake, aten._amp_update_scale.default, scale, tracker, found_inf,
                           float(scaling.growth_factor), float(scaling.backoff_factor), int(scaling.growth_interval))
        scale_out = g.call(graph, fake, operator.getitem, new_scale, 0)
        tracker_out = g.call(graph, fake, operator.getitem, new_scale, 1)
        new_nodes += [new_scale, scale_out, tracker_out]
    for node in new_nodes:
        node.meta.setdefault(g.PHASE, g.OPTIMIZER)
    output.args = ([loss, *values, scale_out, tracker_out, found_inf],)
    gm.meta[g.OUTPUT_SLOTS] = [*gm.meta[g.OUTPUT_SLOTS], mixed.SCALE_SLOT, mixed.GROWTH_TRACKER_SLOT,
                               mixed.FOUND_INF_SLOT]
    return guarded
