"""Eager references the tests compare zerocc against: optimizers and hand-written training steps.

Plain PyTorch doing what a compiled step promises to do. ``tests.models.eager_step``
is the one-step reference for the small models; what is here covers the other
features (param groups, mixed precision, gradient accumulation, models that return
their loss).
"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def adamw(model):
    """The optimizer most tests train with: AdamW with weight decay, a learning rate that moves tiny models."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def two_groups(model):
    """Several param groups: weights with decay, everything else (biases, norms) without, another lr."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)


def eager(model, optimizer, *batch):
    """One eager step of a model that returns its own loss."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def train_eagerly(model, optimizer, batch: dict, seed: int) -> torch.Tensor:
    """One eager step on a keyword batch: the model's own loss, dropout drawn after seeding with ``seed``."""
    torch.manual_seed(seed)
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return loss.detach()


def loss_of(model, loss_fn, batch):
    return model(*batch) if loss_fn is None else loss_fn(model(*batch[:-1]), batch[-1])


def eager_accumulated_step(model, optimizer, loss_fn, batch, k, clip=None, norm_type=2.0):
    """The reference: K micro-batches, ``(loss / K).backward()`` each (DDP: no_sync but the last), one update."""
    optimizer.zero_grad(set_to_none=True)
    total = None
    micro_batches = list(zip(*[t.chunk(k) for t in batch]))
    for index, micro in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else contextlib.nullcontext()
        with sync:
            loss = loss_of(model, loss_fn, micro)
            if k > 1:
                loss = loss / k
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    norm = None
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type)
    optimizer.step()
    return total, norm


def mixed_eager_step(master, optimizer, loss_fn, batch, dtype, *, scaler=None, world_size=1):
    """One step of hand-written mixed precision: low-precision compute, fp32 masters, averaged fp32 gradients."""
    low = copy.deepcopy(master)        # keeps tied weights tied
    for param in low.parameters():
        param.data = param.data.to(dtype)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in batch[:-1]] if loss_fn else list(batch)
    loss = low(*inputs) if loss_fn is None else loss_fn(low(*inputs), batch[-1])
    if scaler is not None:
        scaler.scale(loss.float()).backward()
    else:
        loss.backward()
    for param, computed in zip(master.parameters(), low.parameters()):
        param.grad = None if computed.grad is None else computed.grad.to(param.dtype)
        if param.grad is not None and world_size > 1:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float()


def assert_ranks_match_ddp(per_rank):
    """Each rank's ``{name: (DDP's losses, the step's losses, DDP's state, the step's full state)}``: equal within
    float tolerance (the ranks' sum of gradients runs in another order than one process's)."""
    for rank, results in enumerate(per_rank):
        for name, (expected, got, expected_state, state) in results.items():
            torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} rank {rank} losses: {m}")
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{name} rank {rank} {key}: {m}")
