"""plan_memory: every tensor's lifetime on the final node order, placed at offsets in pools by role.

Requires: the last pass before the program is emitted (it plans the order
the graph has when it runs; any pass that moves nodes must come before it).
Establishes: ``ctx.memory_plan`` (a ``memory_plan.MemoryPlan``). The graph
is not changed: the plan is read off it.

Lifetimes, and the plan made of them (``memory_plan_of``), come from
``analysis/lifetimes.py``. A *buffer* is one storage: a
node whose value is a fresh tensor (or output ``i`` of a multi-output op). Views do not allocate; they keep their base's
storage alive, so a buffer lives from the node that allocates it to the last
use of any view of it (alias analysis: ops whose schema returns an alias,
``getitem`` of ``split``-like ops, ``wait_tensor`` of its collective's
output; ``reshape`` and ``contiguous`` only when the value allows a view).
The outputs of a multi-output op live at least as long as the op's tuple,
which the program holds until its last ``getitem``. Slots read by the step
live across the whole step, except those ``release_slots`` marked: they live
to the release point or their last use, whichever is later; values that
replace slots (and the loss) live to the end. A collective's inputs live until its wait: it reads them while
the program runs on (an all_reduce or a broadcast clones its input when called: that dies there). Tensors
sized by the data are listed as unplanned.

Pools group buffers by role (``memory_plan.POOLS``): persistent shards and
optimizer state, gathered parameters, activations and temporaries, gradient
buckets, communication buffers. Each pool is laid out by greedy best-fit in
four orders (``memory_plan.ORDERS``) improved by promotion (``memory_plan.place``),
keeping the smallest, and reports its lower
bound, the most bytes its buffers hold at once. Under memory pools
(``placed=False``, as the pipeline runs it then) the layout is left to
``place_buffers``, which lays out the persistent pool and the arenas again
anyway: each pool reports its lower bound, and no time goes into offsets
nobody reads (at the 98M GPT, 1.2 s of a 16 s compile).
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.lifetimes import memory_plan_of
from ..context import CompileContext
from ..memory_plan import megabytes


def plan_memory(gm: fx.GraphModule, ctx: CompileContext, *, placed: bool = True) -> fx.GraphModule:
    """Plan where every tensor of the step lives; record it on ``ctx.memory_plan``. The graph is unchanged.

    ``placed=False``: lifetimes only, for a later pass that lays the pools out itself (``place_buffers``).
    """
    ctx.memory_plan = memory_plan_of(gm, placed=placed)
    plan = ctx.memory_plan
    count = f"{sum(len(p.buffers) for p in plan.pools)} buffers in {len(plan.pools)} pools"
    if not placed:
        ctx.notes["plan_memory"] = (f"{count}, lower bound {megabytes(plan.lower_bound_bytes)}; "
                                    "not laid out (place_buffers lays out the arenas)")
        return gm
    ratio = plan.planned_bytes / plan.lower_bound_bytes if plan.lower_bound_bytes else 1.0
    ctx.notes["plan_memory"] = (f"{count}: {megabytes(plan.planned_bytes)} planned, lower bound "
                                f"{megabytes(plan.lower_bound_bytes)} ({ratio:.3f}x)")
    return gm
