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

    def bucket_of(self, param: int) -> Bucket:
        for bucket in self.buckets:
            if param in bucket.params:
                return bucket
        raise KeyError(param)

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


def piece_owner(bucket: int, number: int) -> str:
    return f"bucket{bucket}.piece{number}"


def lr_slot(group: int) -> str:
    return f"lr:{group}"


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the step, as the schedule pass ordered it."""
    kind: str                # all_gather / reduce_scatter / all_reduce / broadcast
    bucket: int | None
    nbytes: int              # the full-size buffer it holds while in flight (gathered output, unreduced input)
    prefetched: bool         # issued earlier than insert_collectives placed it


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When each collective is issued and waited; the issue order is the same on every rank."""
    prefetch_bytes: int                          # the bound on gathered (or unreduced) bytes in flight
    collectives: tuple[ScheduledCollective, ...]  # in issue order
    max_gather_bytes_in_flight: int
    max_reduce_bytes_in_flight: int
