"""``nn.SyncBatchNorm`` traced with functional collectives: statistics over the global batch, as DDP trains it.

SyncBatchNorm (what ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` puts in for DDP) computes each channel's
mean and variance over every rank's batch with eager ``torch.distributed`` collectives inside its forward and
backward, which the program cannot run (and which, on the CPU, eager refuses outright). While the step is traced,
a SyncBatchNorm that would synchronize (training mode, a process group of more than one rank) computes the same
thing with traceable collectives, which the program runs and waits on as it does its own: each rank's per-channel
sums are gathered with ``all_gather_single_autograd``, whose backward sums every rank's gradient back into each
rank's part (SyncBatchNorm's all-reduce of ``sum_dy`` and ``sum_dy_xmu``). The mean comes first and the variance
from the deviations (two gathers, as accurate as one process's batch norm); the running statistics take the
unbiased variance over the global count, as SyncBatchNorm's ``batch_norm_gather_stats_with_counts``. Equal to one
process's BatchNorm on the global batch within float rounding. In eval mode, or on one rank, SyncBatchNorm's own
forward runs (a BatchNorm).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn


def _group_size(module: nn.SyncBatchNorm) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(module.process_group or dist.group.WORLD)


def _synchronized_forward(module: nn.SyncBatchNorm, input: torch.Tensor) -> torch.Tensor:
    from torch.distributed._functional_collectives import all_gather_single_autograd
    module._check_input_dim(input)
    module._check_non_zero_input_channels(input)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.track_running_stats:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / module.num_batches_tracked.item() if module.momentum is None else module.momentum
    group = module.process_group or dist.group.WORLD
    ranks = dist.get_world_size(group)
    channels = input.shape[1]
    dims = [0, *range(2, input.dim())]
    count = input.numel() // channels * ranks   # every rank's batch has this rank's shape

    def summed(local: torch.Tensor) -> torch.Tensor:   # over every rank: gathered, gradients summed back
        return all_gather_single_autograd(local, 0, group).view(ranks, channels).sum(0)

    shape = [1, channels] + [1] * (input.dim() - 2)
    mean = summed(input.sum(dims)) / count
    centered = input - mean.view(shape)
    var = summed(centered.square().sum(dims)) / count
    output = centered * torch.rsqrt(var + module.eps).view(shape)
    if module.weight is not None:
        output = output * module.weight.view(shape)
    if module.bias is not None:
        output = output + module.bias.view(shape)
    if module.track_running_stats:
        with torch.no_grad():
            module.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            module.running_var.mul_(1 - factor).add_(var.detach() * (count / max(count - 1, 1)) * factor)
    return output


@contextlib.contextmanager
def synchronized_batch_norm_traceable():
    """Within the block a SyncBatchNorm that would synchronize traces with functional collectives."""
    original = nn.SyncBatchNorm.forward

    def forward(self, input):
        if self.training and _group_size(self) > 1:
            return _synchronized_forward(self, input)
        return original(self, input)

    nn.SyncBatchNorm.forward = forward
    try:
        yield
    finally:
        nn.SyncBatchNorm.forward = original
