"""gather_by_send_recv: on CPU (gloo), each all-gather becomes sends and receives straight into the result.

Requires: ``insert_collectives`` (all_gather_into_tensor + wait pairs); runs
after ``schedule`` and ``overlap_updates``, whose placement of collectives
and waits it keeps. Establishes: no ``all_gather_into_tensor`` of CPU tensors
left; in its place ``zerocc::all_gather_by_send_recv`` (``zerocc/ops.py``) on
the same shard, issued at the same point, waited by the same
``wait_tensor``, with the same result. Each gather gets its own tag (its
index in the program, from ``TAG_BASE``), so the messages of gathers in
flight together never match each other's receives.

Why: ``ProcessGroupGloo``'s all_gather_into_tensor gathers into a fresh flat
staging buffer and then copies every chunk out into the result, so a bucket
is written twice and its staging buffer faulted in afresh each step. The
replacement copies this rank's shard into place and posts one send and one
receive per peer, receiving into the result's own slice. Measured on this
machine's gloo, 2 ranks, a 3 MiB bucket (``benchmarks/gloo_collectives.py``):
about half the CPU time per rank and per call (docs/guide/stages.md, "Overlap").

Numerics: a gather copies bytes; the result is the same bit for bit. Bytes
sent and received are the same as the ring all-gather's ((N-1)/N of the
bucket per rank); the bytes alive are the same (the result), one staging
buffer fewer in gloo.

Not done: on CUDA tensors (NCCL's all-gather writes in place); under
``memory_pools`` (``place_buffers`` has gloo's all-gather write into its
arena through ``all_gather_into_tensor_out``; this op has no ``out=`` form).
The eval program and checkpoint gathers keep torch.distributed's own
all-gather.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import graph as g
from .. import ops
from ..context import CompileContext

c10d = torch.ops._c10d_functional

# Tags of the program's gathers start here: far from the small tags user code sends with.
TAG_BASE = 0x5A0000


def gather_by_send_recv(gm: fx.GraphModule, ctx: CompileContext, *, memory_pools: bool = False) -> fx.GraphModule:
    """Point each CPU all_gather_into_tensor at ``zerocc::all_gather_by_send_recv``, with a tag of its own."""
    if memory_pools:
        ctx.notes["gather_by_send_recv"] = "off under memory_pools (place_buffers gathers into its arena)"
        return gm
    gathers = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is c10d.all_gather_into_tensor.default
               and g.tensor_meta(n) is not None and g.tensor_meta(n).device.type == "cpu"]
    if not gathers:
        ctx.notes["gather_by_send_recv"] = "no all-gather of CPU tensors"
        return gm
    for index, gather in enumerate(gathers):
        shard, group_size, group_name = gather.args
        gather.target = ops.all_gather_by_send_recv
        gather.args = (shard, group_size, group_name, TAG_BASE + index)
    gm.graph.lint()
    gm.recompile()
    ctx.notes["gather_by_send_recv"] = (f"{len(gathers)} all_gather_into_tensor -> all_gather_by_send_recv "
                                        f"({ctx.world_size - 1} sends and receives each, tags {TAG_BASE:#x}+)")
    return gm
