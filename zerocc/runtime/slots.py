"""The runtime's persistent tensors ("slots"): built from the model and optimizer, read back out.

A slot is named by ``decisions.*_slot``; placeholders say which slot they read
and the graph's outputs which slots they replace. This module turns the
user's model and optimizer into slots for a ``ShardPlan`` and back.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import decisions
from ..capture import Captured, named_tensors
from ..decisions import ShardPlan


def initial_slots(plan: ShardPlan, captured: Captured, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, fresh_state=None) -> dict[str, torch.Tensor]:
    """Every persistent tensor this rank holds, laid out as ``plan`` says.

    The optimizer state comes from ``optimizer.state`` or, per parameter name,
    from ``fresh_state``: the optimizer's initial state as ``zerocc/optimizer_init.py``
    learned it, made here at the size of this rank's pieces.
    """
    fresh_state = fresh_state or {}
    tensors = {names[0]: t for names, t in named_tensors(model, "param")}
    tensors.update({names[0]: t for names, t in named_tensors(model, "buffer")})
    slots: dict[str, torch.Tensor] = {}
    bucketed = set()
    for bucket in plan.buckets:
        device = tensors[captured.params[bucket.segments[0].param].name].device
        bucketed.update(segment.param for segment in bucket.segments)
        start, end = (plan.rank * bucket.shard_numel, (plan.rank + 1) * bucket.shard_numel) \
            if plan.holds_shard(bucket) else (0, bucket.numel)
        if plan.has_compute_copy(bucket):   # mixed precision at stages 1-2: the full bucket in param_dtype
            full = _flat_range(bucket, captured, tensors, 0, bucket.numel, device)
            slots[decisions.compute_slot(bucket.index)] = full.to(plan.param_dtype)
            slots[decisions.bucket_slot(bucket.index)] = full[start:end].clone() if plan.holds_shard(bucket) else full
        else:   # only this rank's range: building the whole bucket to clone a shard was a second copy
            slots[decisions.bucket_slot(bucket.index)] = _flat_range(bucket, captured, tensors, start, end, device)
    for bucket, number, piece in plan.owned_pieces():
        name = captured.params[piece.param].name
        param = tensors[name]
        for key, initial in fresh_state.get(name, {}).items():
            slots[decisions.state_slot(decisions.piece_owner(bucket.index, number), key)] = \
                initial.make((piece.numel,), param.device)
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.dim() == 0:
                slots[decisions.state_slot(decisions.piece_owner(bucket.index, number), key)] = value.detach().clone()
            else:
                flat = value.detach().reshape(-1)[piece.param_offset: piece.param_offset + piece.numel]
                slots[decisions.state_slot(decisions.piece_owner(bucket.index, number), key)] = flat.clone()
    for index, info in enumerate(captured.params):
        if index not in bucketed:
            param = tensors[info.name]
            slots[decisions.param_slot(info.name)] = param.detach()
            for key, initial in fresh_state.get(info.name, {}).items():
                slots[decisions.state_slot(info.name, key)] = initial.make(info.shape, param.device)
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    slots[decisions.state_slot(info.name, key)] = value.detach()
    for info in captured.frozen:
        slots[decisions.frozen_slot(info.name)] = tensors[info.name].detach()
    for info in captured.buffers:
        slots[decisions.buffer_slot(info.name)] = tensors[info.name].detach()
    return slots


def _flat_range(bucket, captured: Captured, tensors: dict[str, torch.Tensor], start: int, end: int,
                device) -> torch.Tensor:
    """Elements ``start:end`` of the bucket's flat layout: its parameters' values, zeros in its padding."""
    flat = torch.empty(end - start, dtype=bucket.dtype, device=device)
    written = start
    for segment in sorted(bucket.segments, key=lambda s: s.offset):
        low, high = max(segment.offset, start), min(segment.offset + segment.numel, end)
        if low >= high:
            continue
        if low > written:
            flat[written - start: low - start].zero_()
        values = tensors[captured.params[segment.param].name].detach().reshape(-1)
        flat[low - start: high - start] = values[low - segment.offset: high - segment.offset]
        written = high
    if written < end:
        flat[written - start:].zero_()
    return flat


def full_buckets(plan: ShardPlan, slots: dict[str, torch.Tensor], group) -> dict[int, torch.Tensor]:
    """Each bucket's full flat tensor; gathered from every rank's shard where ranks hold shards (a collective)."""
    result = {}
    for bucket in plan.buckets:
        local = slots[decisions.bucket_slot(bucket.index)]
        if plan.holds_shard(bucket) and plan.world_size > 1:
            full = torch.empty(bucket.numel, dtype=local.dtype, device=local.device)
            dist.all_gather_single(full, local.contiguous(), group=group)
            result[bucket.index] = full
        else:
            result[bucket.index] = local
    return result


def refresh_compute_copies(plan: ShardPlan, slots: dict[str, torch.Tensor], group) -> None:
    """Stages 1-2 under mixed precision: rebuild each ``compute:<i>`` from the master shards (after a load)."""
    for bucket in plan.buckets:
        if not plan.has_compute_copy(bucket):
            continue
        low = slots[decisions.bucket_slot(bucket.index)].to(plan.param_dtype)
        if plan.world_size > 1:
            full = torch.empty(bucket.numel, dtype=low.dtype, device=low.device)
            dist.all_gather_single(full, low.contiguous(), group=group)
            low = full
        slots[decisions.compute_slot(bucket.index)].copy_(low)


def parameter_views(plan: ShardPlan, captured: Captured, buckets: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each parameter of the buckets given (by index), as a view of its full bucket."""
    views = {}
    for bucket in plan.buckets:
        if bucket.index not in buckets:
            continue
        full = buckets[bucket.index]
        for segment in bucket.segments:
            info = captured.params[segment.param]
            views[segment.param] = full[segment.offset: segment.offset + segment.numel].view(info.shape)
    return views
