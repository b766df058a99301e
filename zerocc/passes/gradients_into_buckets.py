"""gradients_into_buckets: each gradient is computed straight into its bucket; the bucket's ``cat`` is gone.

Requires: ``shard`` (a bucket's flat gradient is ``cat`` of its pieces'
gradients, flattened, tagged with the bucket); runs after every pass that
moves nodes (``schedule``, ``overlap_updates``) and before ``release_slots``
and ``plan_memory``, which account for what it allocates. Establishes: for
each gradient ``cat`` it rewrites,

    bucket = empty([n])                                   # before the first gradient written into it
    mm_3 = mm.out(a, b, out=view(slice(bucket, 0, o, o + k), [256, 1024]))  # the gradient's own op, out=
    ...
    copy_ = copy_(slice(bucket, 0, o2, o2 + k2), small)   # pieces no op can write (at the cat's place)
    flat = zerocc.bucket_written(bucket, [mm_3, ..., copy_])   # read where the cat was read

A piece is written by its op when that op has an ``out=`` overload with a
kernel of the device's backend (``analysis/kernels.py``' ``out_variant``: ``mm``,
``sum``, ``add``, ``embedding_dense_backward``...), one output, no reader
but the views that flatten it into the cat, and those views keep its
memory order (it and the flattened piece are contiguous, the same storage);
every other piece (a layer norm's weight gradient: an output of a
three-output op) is copied in where the cat stood. ``bucket_written`` takes
every write as an argument, so any order of the graph puts the bucket's
reduction after them.

Why: the ``cat`` copied every gradient once more, into a freshly allocated
bucket: on the benchmark GPT (5M parameters, 2 gloo ranks) about 10 ms of a
rank's 330 ms step (``benchmarks/profile_step.py``), against DDP's copy into
a bucket it keeps. Written in place, the weight gradients (nearly all the
bytes) are never copied.

Numerics: an ``out=`` overload runs the kernel of its functional overload,
into given memory; the bucket holds the same bytes bit for bit.

Memory: the bucket is allocated at its first write instead of at the cat,
while the pieces it holds are no longer separate buffers. A rewrite is made
only if the planned live peak does not grow (checked before rewriting, on
one lifetime analysis plus the changes of the rewrites chosen so far); the
note names the buckets left as ``cat``. Not done under ``memory_pools`` (``place_buffers`` places the
``cat`` in its arena; the bucket's ``empty`` would be a fresh allocation).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops
from ..context import CompileContext
from ..memory_plan import align
from ..analysis.aliasing import is_view, storage_id
from ..analysis.kernels import has_backend_kernel, out_variant
from ..analysis.live_bytes import live_peaks_and_bytes

aten = torch.ops.aten

def gradients_into_buckets(gm: fx.GraphModule, ctx: CompileContext, *, memory_pools: bool = False) -> fx.GraphModule:
    """Rewrite each gradient bucket's ``cat`` into writes into the bucket, where the peak allows."""
    if memory_pools:
        ctx.notes["gradients_into_buckets"] = "off under memory_pools (place_buffers puts the cat in its arena)"
        return gm
    cats = [n for n in gm.graph.nodes if _is_gradient_cat(n)]
    if not cats:
        ctx.notes["gradients_into_buckets"] = "no gradient bucket cat"
        return gm
    peaks, live = live_peaks_and_bytes(gm, ctx)   # live: by position in today's order; the chosen rewrites'
    peak = min(peaks)                              # changes are added in
    position = g.topological_index(gm)
    chosen, written, copied, kept = [], 0, 0, []
    for cat in cats:
        pieces = [_piece(cat, x) for x in cat.args[0]]
        if not any(p.writer is not None for p in pieces):
            kept.append(f"{cat.meta.get(g.BUCKET)} (no piece has an out= op)")
            continue
        change = _live_change(cat, pieces, position)
        if max(live[t] + delta for t, delta in change.items()) > peak:
            kept.append(f"{cat.meta.get(g.BUCKET)} (the planned peak would grow)")
            continue
        for t, delta in change.items():
            live[t] += delta
        chosen.append((cat, pieces))
        written += sum(p.writer is not None for p in pieces)
        copied += sum(p.writer is None for p in pieces)
    for cat, pieces in chosen:
        _rewrite(gm, ctx, cat, pieces)
    gm.graph.lint()
    gm.recompile()
    rewritten = len(cats) - len(kept)
    note = f"{rewritten} of {len(cats)} bucket cats gone: {written} gradients written in place, {copied} copied in"
    if kept:
        note += f"; kept: bucket {', '.join(kept)}"
    ctx.notes["gradients_into_buckets"] = note
    return gm


def _is_gradient_cat(node: fx.Node) -> bool:
    """A bucket's flat gradient: a 1-D backward ``cat`` (dim 0) tagged with its bucket."""
    value = g.tensor_meta(node)
    return (node.op == "call_function" and node.target is aten.cat.default and g.BUCKET in node.meta
            and node.meta.get(g.PHASE) == g.BACKWARD and value is not None and value.dim() == 1
            and (len(node.args) < 2 or node.args[1] == 0))


@dataclasses.dataclass
class _Piece:
    """One input of the cat: the flattened gradient, and the op that can write it into the bucket, if any."""
    flat: fx.Node                 # the cat's input (1-D)
    writer: fx.Node | None        # the op computing it, which gets out=; None: copied in
    views: list[fx.Node]          # writer -> ... -> flat: views that only reshape it, dropped with the cat


def _piece(cat: fx.Node, flat: fx.Node) -> _Piece:
    copied = _Piece(flat, None, [])
    if not isinstance(flat, fx.Node) or sum(a is flat for a in cat.args[0]) != 1 or len(flat.users) != 1:
        return copied
    views, node = [], flat
    while node.op == "call_function" and is_view(node) and not g.is_wait(node):
        views.append(node)
        node = node.args[0]
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return copied
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return copied
    found = out_variant(node.target)
    value, piece, bucket = g.tensor_meta(node), g.tensor_meta(flat), g.tensor_meta(cat)
    if found is None or len(found[1]) != 1 or value is None or piece is None:
        return copied
    if not has_backend_kernel(found[0], value.device):
        return copied   # an out= that calls the functional op and copies would allocate anyway
    same_memory = (value.is_contiguous() and piece.is_contiguous() and value.numel() == piece.numel()
                   and value.storage_offset() == piece.storage_offset() == 0
                   and (not views or storage_id(value) == storage_id(piece)))
    if not same_memory or value.dtype != bucket.dtype or value.device != bucket.device:
        return copied
    return _Piece(flat, node, views)


def _live_change(cat: fx.Node, pieces: list[_Piece], position: dict[fx.Node, int]) -> dict[int, int]:
    """How the rewrite changes the live bytes, by position: only from the first write to the cat.

    In that window the bucket is alive in full, and the written pieces are
    no longer buffers of their own. Outside it nothing changes, and the
    window (backward) comes before ``release_slots``' release point, where
    both of ``live_peaks``' accountings agree.
    """
    first = min(position[p.writer] for p in pieces if p.writer is not None)
    change = {t: align(g.nbytes(cat)) for t in range(first, position[cat])}
    for piece in pieces:
        if piece.writer is not None:
            for t in range(position[piece.writer], position[cat]):
                change[t] -= align(g.nbytes(piece.writer))
    return change


def _rewrite(gm: fx.GraphModule, ctx: CompileContext, cat: fx.Node, pieces: list[_Piece]) -> None:
    graph = gm.graph
    tags = {g.PHASE: g.BACKWARD, g.BUCKET: cat.meta.get(g.BUCKET)}
    value = g.tensor_meta(cat)
    position = g.topological_index(gm)
    first = min((p.writer for p in pieces if p.writer is not None), key=position.__getitem__)
    with graph.inserting_before(first):
        bucket = g.call(graph, ctx.fake_mode, aten.empty.memory_format, [value.numel()], dtype=value.dtype,
                        device=value.device, pin_memory=False)
    bucket.meta.update(tags)
    writes, offset = [], 0
    for piece in pieces:
        size = g.tensor_meta(piece.flat).numel()
        if piece.writer is not None:
            writer = piece.writer
            shape = [int(s) for s in g.tensor_meta(writer).shape]
            with graph.inserting_before(writer):
                part = g.call(graph, ctx.fake_mode, aten.slice.Tensor, bucket, 0, offset, offset + size)
                target = g.call(graph, ctx.fake_mode, aten.view.default, part, shape)
            out_op, (out_name,) = out_variant(writer.target)
            writer.target = out_op
            writer.kwargs = {**writer.kwargs, out_name: target}
            with ctx.fake_mode:
                fake_args, fake_kwargs = torch.utils._pytree.tree_map(
                    lambda a: a.meta[g.VAL] if isinstance(a, fx.Node) else a, (writer.args, writer.kwargs))
                writer.meta[g.VAL] = out_op(*fake_args, **fake_kwargs)
            new = [part, target]
            writes.append(writer)
        else:
            with graph.inserting_before(cat):
                part = g.call(graph, ctx.fake_mode, aten.slice.Tensor, bucket, 0, offset, offset + size)
                copy = g.call(graph, ctx.fake_mode, aten.copy_.default, part, piece.flat)
            new = [part, copy]
            writes.append(copy)
        for node in new:
            node.meta.update(tags)
        offset += size
    with graph.inserting_before(cat):
        written = g.call(graph, ctx.fake_mode, ops.bucket_written, bucket, writes)
    written.meta.update({**cat.meta, g.VAL: written.meta[g.VAL]})
    cat.replace_all_uses_with(written)
    graph.erase_node(cat)
    for piece in pieces:
        for view in piece.views:   # flat first, then towards the writer
            graph.erase_node(view)
