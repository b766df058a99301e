"""What every pass receives besides the graph: the inputs of compilation and the decisions made so far."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .capture import Captured
from .memory_plan import MemoryPlan
from .decisions import RematPlan, Schedule, ShardPlan, UpdateOrder
from .precision import Precision


@dataclasses.dataclass
class CompileContext:
    """Shared, plain-data state of one compilation.

    Inputs (set before the pipeline runs) come first; each pass fills in the
    plan it decides and leaves the others alone.
    """
    stage: int
    world_size: int
    rank: int
    group_name: str | None          # process group of the collectives (None at world size 1)
    optimizer: torch.optim.Optimizer
    captured: Captured
    fake_mode: Any
    bucket_bytes: int
    previous_plan: ShardPlan | None = None   # buckets of an earlier compilation, kept so slots stay valid
    traces: dict | None = None      # optimizer subgraphs traced so far, reused across plans (zerocc.plan)
    planning: bool = False          # zerocc.plan: fake tensors only, the graph is never run, no real group
    precision: Precision | None = None   # mixed precision settings (zerocc/precision.py); None: the model's dtype
    gather_per_micro_batch: bool = True  # stage 3, grad_accumulation > 1: gather again for every micro-batch
    # decided by passes
    shard_plan: ShardPlan | None = None
    remat_plan: RematPlan | None = None   # place_remat: forward values recomputed in backward
    schedule: Schedule | None = None
    update_order: UpdateOrder | None = None   # overlap_updates: bucket updates moved before the last reduction's wait
    memory_plan: MemoryPlan | None = None   # plan_memory: every buffer's pool, offset and live range
    notes: dict[str, Any] = dataclasses.field(default_factory=dict)   # one line of counts per pass
    # set by the runner (pipeline.run_pipeline) while a pass runs: the passes after it as one (gm, ctx) -> gm,
    # for a pass that measures what the rest of the pipeline makes of a candidate (place_remat)
    rest_of_pipeline: Callable[[Any, "CompileContext"], Any] | None = None
    # set by such a pass when it chose a candidate whose rest it ran recorded (pipeline.LaterRun): the runner takes
    # that run as the rest of the compile
    later_run: Any = None

    def from_every_rank(self, value: Any) -> list:
        """``value`` from every rank of the group, by rank (one ``all_gather_object``): for a pass whose
        choice depends on a rank's own numbers while every rank must issue the same collectives. Just
        ``[value]`` where there are no peers to ask: world size 1, a plan, a program built without a group."""
        import torch.distributed as dist
        if self.world_size == 1 or self.planning or self.group_name is None or not dist.is_initialized():
            return [value]
        from torch.distributed.distributed_c10d import _resolve_process_group
        every: list = [None] * self.world_size
        dist.all_gather_object(every, value, group=_resolve_process_group(self.group_name))
        return every
