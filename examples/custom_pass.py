"""A user pass: at stage 3, keep the last bucket gathered from forward into backward.

    python examples/custom_pass.py                 # plans a GPT at 8 ranks with and without the pass

Backward starts where forward ends, so the bucket forward gathered last is
gathered again almost at once. This pass, registered right after
``insert_collectives``, makes backward read the forward copy instead and
drops the second all_gather: one bucket more stays alive through the turn
of the step, one all_gather less goes over the wire. It reads the shard
plan the passes before it decided (``ctx.shard_plan``) and writes its
count note on ``ctx.notes`` like every built-in pass.

The built-in ``schedule`` pass now does this itself where it fits in
``prefetch_bytes`` (``ctx.schedule.kept_buckets``); this pass does it
unconditionally, and shows its effect best with ``disable=["schedule"]``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.fx as fx

import zerocc
from zerocc import graph as g


def keep_last_bucket_gathered(gm: fx.GraphModule, ctx) -> fx.GraphModule:
    """Backward reuses forward's gather of the last bucket forward gathers (stage 3, world size > 1)."""
    if ctx.stage != 3 or ctx.world_size == 1:
        ctx.notes["keep_last_bucket_gathered"] = "nothing to do: parameters are gathered only at stage 3"
        return gm
    gathers: dict[int, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if g.is_all_gather(node) and node.meta.get(g.BUCKET) is not None:
            gathers.setdefault(node.meta[g.BUCKET], []).append(node)
    twice = {bucket: nodes for bucket, nodes in gathers.items() if len(nodes) == 2}
    if not twice:
        return gm
    order = g.topological_index(gm)
    bucket = max(twice, key=lambda b: order[twice[b][0]])   # the forward gather that comes last
    forward, backward = sorted(twice[bucket], key=order.get)
    forward_wait = next(u for u in forward.users if g.is_wait(u))
    backward_wait = next(u for u in backward.users if g.is_wait(u))
    backward_wait.replace_all_uses_with(forward_wait)
    gm.graph.erase_node(backward_wait)
    gm.graph.erase_node(backward)
    gm.graph.lint()
    gm.recompile()
    size = ctx.shard_plan.buckets[bucket].nbytes
    ctx.notes["keep_last_bucket_gathered"] = f"bucket {bucket} kept from forward into backward: -1 all_gather ({size:,} bytes)"
    return gm


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gpt import GPT
    with torch.device("meta"):
        model = GPT(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = (torch.zeros(2, 128, dtype=torch.long, device="meta"),) * 2
    before = zerocc.plan(model, optimizer, stage=3, world_size=8, example_inputs=batch, disable=["schedule"])
    zerocc.register_pass(keep_last_bucket_gathered, after="insert_collectives")
    try:
        after = zerocc.plan(model, optimizer, stage=3, world_size=8, example_inputs=batch, disable=["schedule"])
    finally:
        zerocc.unregister_pass("keep_last_bucket_gathered")
    print("passes:", ", ".join(after.passes))
    print(after.graph("keep_last_bucket_gathered").note)
    for name, plan in (("without", before), ("with", after)):
        report = plan.report()
        print(f"{name:>7} the pass: {report['collectives_per_step']}, "
              f"{report['comm_bytes_per_step']['all_gather']:,} bytes all-gathered per step")


if __name__ == "__main__":
    main()
