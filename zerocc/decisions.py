"""The decisions passes make, as plain frozen data.

Passes write these onto the ``CompileContext``; the runtime and the reports
read them. Nothing here touches tensors.
"""
from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

# Each parameter starts at a multiple of this many bytes inside its flat
# bucket, so its view is aligned as a fresh allocation is and vectorized
# kernels walk it exactly as they walk the eager parameter.
ALIGNMENT_BYTES = 64


@dataclasses.dataclass(frozen=True)
class Segment:
    """Where one parameter lies inside its bucket."""
    param: int      # index into Captured.params
    offset: int     # first element inside the bucket
    numel: int


@dataclasses.dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls in one rank's shard of a bucket."""
    param: int
    param_offset: int   # first element inside the (flattened) parameter
    shard_offset: int   # first element inside the shard
    numel: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Parameters that are gathered, reduced and updated together as one flat tensor."""
    index: int
    group: int                       # optimizer param group
    dtype: torch.dtype
    segments: tuple[Segment, ...]
    numel: int                       # padded: a multiple of the world size
    shards: int                      # how many ranks own a slice (1 at stage 0)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.shards

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def params(self) -> list[int]:
        return [s.param for s in self.segments]

    def pieces(self, rank: int) -> list[Piece]:
        """The parameter pieces inside shard ``rank``, in shard order."""
        start, stop = rank * self.shard_numel, (rank + 1) * self.shard_numel
        result = []
        for segment in self.segments:
            lo, hi = max(start, segment.offset), min(stop, segment.offset + segment.numel)
            if lo < hi:
                result.append(Piece(segment.param, lo - segment.offset, lo - start, hi - lo))
        return result


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    """How parameters, gradients and optimizer state are laid out on each rank."""
    stage: int
    world_size: int
    rank: int
    buckets: tuple[Bucket, ...]
    bucket_bytes: int                # the target size buckets were filled to
    # mixed precision (compile(param_dtype=...)): the dtype forward and backward compute in. At stages
    # 1-2 a bucket of another dtype keeps its masters as this rank's shard (slot bucket:<i>, with the
    # optimizer state) and the full bucket in param_dtype (slot compute:<i>), which the update gathers.
    param_dtype: torch.dtype | None = None

    def bucket_of(self, param: int) -> Bucket:
        for bucket in self.buckets:
            if param in bucket.params:
                return bucket
        raise KeyError(param)

    def holds_shard(self, bucket: Bucket) -> bool:
        """Does this rank's ``bucket:<i>`` slot hold only its shard (stage 3; fp32 masters under mixed precision)?"""
        return self.stage == 3 or self.has_compute_copy(bucket)

    def has_compute_copy(self, bucket: Bucket) -> bool:
        """Stages 1-2 with a ``param_dtype``: the full bucket is kept in it (slot ``compute:<i>``), the masters sharded.

        Not a complex bucket: complex parameters compute in their own dtype (as ``model.bfloat16()`` keeps them)."""
        return (self.stage in (1, 2) and self.param_dtype is not None and bucket.dtype.is_floating_point
                and self.param_dtype != bucket.dtype)

    def owned_pieces(self) -> Iterator[tuple[Bucket, int, Piece]]:
        """(bucket, piece number, piece) for every piece whose optimizer state lives on this rank."""
        for bucket in self.buckets:
            for number, piece in enumerate(bucket.pieces(0 if bucket.shards == 1 else self.rank)):
                yield bucket, number, piece

    @property
    def padding_elements(self) -> int:
        return sum(b.numel - sum(s.numel for s in b.segments) for b in self.buckets)


def aligned(offset: int, dtype: torch.dtype) -> int:
    step = max(1, ALIGNMENT_BYTES // dtype.itemsize)
    return (offset + step - 1) // step * step


# Names of the runtime's persistent tensors ("slots"). Placeholders carry the
# slot they read; the graph's outputs list the slots they replace.
def param_slot(name: str) -> str:
    return f"param:{name}"


def frozen_slot(name: str) -> str:
    return f"frozen:{name}"


def buffer_slot(name: str) -> str:
    return f"buffer:{name}"


def state_slot(owner: str, key: str) -> str:
    return f"state:{owner}:{key}"


def bucket_slot(index: int) -> str:
    return f"bucket:{index}"


def compute_slot(index: int) -> str:
    """Stages 1-2 under mixed precision: the full bucket in ``param_dtype``, what forward and backward read."""
    return f"compute:{index}"


def piece_owner(bucket: int, number: int) -> str:
    return f"bucket{bucket}.piece{number}"


def setting_slot(group: int, name: str) -> str:
    """The slot of a setting a param group's update reads each step (``optimizer_step.live_layout``)."""
    return f"{name}:{group}"


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the step, as the schedule pass ordered it."""
    kind: str                # all_gather / reduce_scatter / all_reduce / broadcast
    bucket: int | None
    nbytes: int              # the full-size buffer it holds while in flight (gathered output, unreduced input)
    prefetched: bool         # issued earlier than insert_collectives placed it


# Schedule.prefetch_bytes when a memory budget, not prefetch_bytes, bounds the schedule (no real bound reaches it)
UNBOUNDED_PREFETCH = 2**62


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each collective is issued and waited; the issue order is the same on every rank."""
    prefetch_bytes: int                          # the bound on gathered (or unreduced) bytes in flight
    collectives: tuple[ScheduledCollective, ...]  # in issue order
    max_gather_bytes_in_flight: int
    max_reduce_bytes_in_flight: int
    kept_buckets: tuple[int, ...] = ()           # stage 3: backward reads forward's gather, not a second one

    def summary(self) -> str:
        """One line: how many collectives of each kind, how many issued early, the most bytes in flight."""
        kinds: dict[str, list[int]] = {}
        for collective in self.collectives:
            counts = kinds.setdefault(collective.kind, [0, 0])
            counts[0] += 1
            counts[1] += collective.prefetched
        issued = ", ".join(f"{count} {kind} ({early} issued early)" if early else f"{count} {kind}"
                           for kind, (count, early) in kinds.items())
        bound = ("no prefetch bound: a memory budget bounds the step" if self.prefetch_bytes >= UNBOUNDED_PREFETCH
                 else f"prefetch_bytes {self.prefetch_bytes / 1e6:.2f} MB")
        kept = (f"; forward's gather kept for backward in {len(self.kept_buckets)} buckets"
                if self.kept_buckets else "")
        return (f"{issued or 'no collectives'}; at most {self.max_gather_bytes_in_flight / 1e6:.2f} MB gathered "
                f"and {self.max_reduce_bytes_in_flight / 1e6:.2f} MB unreduced in flight "
                f"({bound}){kept}")


@dataclasses.dataclass(frozen=True)
class UpdateOrder:
    """overlap_updates: the buckets whose optimizer update runs before the last reduction's wait, in run order."""
    buckets: tuple[int, ...]     # in the order their reductions were issued (the last reduction's bucket not among them)
    nodes_moved: int


@dataclasses.dataclass(frozen=True)
class RecomputedTensor:
    """One forward value that backward recomputes instead of reading it from forward."""
    name: str            # the forward node whose value backward recomputes
    op: str
    bytes: int           # its storage: no longer kept from forward to backward (0 for a view)
    flops: int           # the work of recomputing it (FLOPs of matmuls and convolutions, elements otherwise)
    source: str          # the user's source line that computed it ("" when none was recorded)


# ``checkpoint_plan`` (of a step, of a plan) was renamed ``remat_plan``: "checkpoint" means saved state.
CHECKPOINT_PLAN_RENAMED = ("checkpoint_plan was renamed remat_plan (recomputing activations in backward is 'remat'; "
                           "'checkpoint' means saved state): read step.remat_plan")


@dataclasses.dataclass(frozen=True)
class ConsideredPlan:
    """One candidate ``place_remat`` measured: its schedule, what it recomputes, its peak and predicted step time."""
    schedule: str              # "default", "keep +<bytes>" (more forward gathers kept), "unbounded" (every one kept)
    recomputed: int            # forward nodes copied into backward
    peak_bytes: int            # the final plan's peak, the highest over ranks
    predicted_seconds: float   # zerocc/analysis/step_time.py on the profile the plan was chosen by
    moved_bytes: float         # bytes a rank sends or receives per step
    fits: bool


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """What ``place_remat`` decided: which forward values backward recomputes, and what it buys.

    Peaks are the most bytes alive at once in the scheduled step (model
    states, activations, gathered parameters, gradient buckets: the memory
    plan's ``live_peak_bytes``), measured on the graph after the passes that
    follow, for the plan with nothing recomputed and for the plan chosen.
    """
    budget_bytes: int
    peak_before_bytes: int                 # nothing recomputed, the default schedule (or every gather kept,
                                           # when that fits and so was the only plan measured)
    peak_bytes: int                        # with the recomputation chosen
    recomputed: tuple[RecomputedTensor, ...]   # every node copied into backward, in forward order
    saved_bytes: int                       # bytes of the storages no longer kept for backward
    extra_flops: int                       # the work the copies add to backward
    forward_flops: int                     # the forward's own work, for scale
    candidates: int                        # forward storages backward read before the pass
    evaluations: int                       # plans whose peak was measured
    unbounded_schedule: bool = False       # stage 3: the budget, not prefetch_bytes, bounds the schedule; every
                                           # forward gather is kept for backward, which gathers nothing
    budget_source: str = "memory_budget"   # or what the device offers (zerocc/device_budget.py): then the peaks
                                           # are the final plan's, filled in by the driver once it fits
    keep_extra_bytes: int = 0              # stage 3: bytes of forward gathers the schedule may keep for backward
                                           # beyond prefetch_bytes (0: prefetch_bytes bounds them; see schedule)
    predicted_seconds: float | None = None  # the chosen plan's step time by the cost model (None: not compared)
    hardware: str = ""                     # the profile candidates were compared on
    considered: tuple[ConsideredPlan, ...] = ()   # every candidate measured, in the order measured

    def summary(self) -> str:
        if self.evaluations == 0 and not self.recomputed and self.budget_source != "memory_budget":
            return (f"device budget {self.budget_bytes / 1e6:.2f} MB ({self.budget_source}): the fastest plan fits, "
                    f"schedule unbounded, every forward gather kept for backward (no all_gather in backward), "
                    f"nothing recomputed; peak {self.peak_bytes / 1e6:.2f} MB")
        share = f" ({self.extra_flops / self.forward_flops:.1%} of forward)" if self.forward_flops else ""
        kept = sum(1 for r in self.recomputed if r.bytes)
        gathers = "; schedule unbounded: every forward gather kept for backward (no all_gather in backward)" \
            if self.unbounded_schedule else f"; {self.keep_extra_bytes / 1e6:.2f} MB more of forward's gathers kept " \
            "for backward" if self.keep_extra_bytes else ""
        chosen = "" if self.predicted_seconds is None else \
            f"; predicted step {self.predicted_seconds * 1e3:.1f} ms, the fastest of the " \
            f"{sum(c.fits for c in self.considered)} that fit ({self.hardware})"
        source = "" if self.budget_source == "memory_budget" else f" ({self.budget_source})"
        return (f"{len(self.recomputed)} forward nodes recomputed in backward ({kept} of {self.candidates} "
                f"stored tensors){gathers}: {self.saved_bytes / 1e6:.2f} MB no longer kept, "
                f"+{self.extra_flops / 1e6:.1f} MFLOP{share}; peak {self.peak_before_bytes / 1e6:.2f} MB -> "
                f"{self.peak_bytes / 1e6:.2f} MB, budget {self.budget_bytes / 1e6:.2f} MB{source} "
                f"({self.evaluations} plans measured{chosen})")

    def table(self) -> str:
        """One row per recomputed node that does work (views and getitems are left out), with its source line."""
        rows = [("recomputed", "op", "bytes", "flops", "source")]
        rows += [(r.name, r.op, f"{r.bytes:,}", f"{r.flops:,}", r.source) for r in self.recomputed if r.bytes or r.flops]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join("  ".join([*(cell.rjust(w) if i in (2, 3) else cell.ljust(w)
                                      for i, (cell, w) in enumerate(zip(row[:4], widths))), row[4]]).rstrip()
                         for row in rows)

    def __str__(self) -> str:
        return (self.summary() + ("\n" + self.candidates_table() if self.considered else "")
                + ("\n" + self.table() if self.recomputed else ""))

    def candidates_table(self) -> str:
        """One row per candidate plan measured, in the order measured; ``*`` marks the one chosen."""
        chosen = next((c for c in self.considered if c.fits and c.peak_bytes == self.peak_bytes
                       and c.predicted_seconds == self.predicted_seconds), None)
        rows = [("", "schedule", "recomputed", "peak MB", "predicted ms", "moved MB", "fits")]
        rows += [("*" if c is chosen else "", c.schedule, str(c.recomputed), f"{c.peak_bytes / 1e6:.2f}",
                  f"{c.predicted_seconds * 1e3:.1f}", f"{c.moved_bytes / 1e6:.2f}", "yes" if c.fits else "no")
                 for c in self.considered]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                                   enumerate(zip(row, widths))).rstrip() for row in rows)

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "peak_before_bytes": self.peak_before_bytes,
                "peak_bytes": self.peak_bytes, "saved_bytes": self.saved_bytes, "extra_flops": self.extra_flops,
                "forward_flops": self.forward_flops, "unbounded_schedule": self.unbounded_schedule,
                "budget_source": self.budget_source, "keep_extra_bytes": self.keep_extra_bytes,
                "predicted_seconds": self.predicted_seconds, "hardware": self.hardware,
                "considered": [dataclasses.asdict(c) for c in self.considered],
                "recomputed": [dataclasses.asdict(r) for r in self.recomputed]}
