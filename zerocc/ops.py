"""Custom operators zerocc puts into graphs.

``zerocc::batch_norm_with_stats`` is ``aten.native_batch_norm`` with its
running-statistics update made visible: eager PyTorch updates the running
mean and variance inside the kernel without saying so in the op's schema, so
functionalization would not see it. This op returns the new statistics
instead, and runs the very same kernel, so numerics are unchanged.
"""
from __future__ import annotations

import torch

_lib = torch.library.Library("zerocc", "DEF")
_lib.define(
    "batch_norm_with_stats(Tensor input, Tensor? weight, Tensor? bias, Tensor running_mean, Tensor running_var, "
    "bool training, float momentum, float eps) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _batch_norm_with_stats(input, weight, bias, running_mean, running_var, training, momentum, eps):
    new_mean = running_mean.clone()
    new_var = running_var.clone()
    out, save_mean, save_invstd = torch.ops.aten.native_batch_norm.default(
        input, weight, bias, new_mean, new_var, training, momentum, eps
    )
    return out, save_mean, save_invstd, new_mean, new_var


_lib.impl("batch_norm_with_stats", _batch_norm_with_stats, "CompositeExplicitAutograd")


@torch.library.register_fake("zerocc::batch_norm_with_stats")
def _batch_norm_with_stats_fake(input, weight, bias, running_mean, running_var, training, momentum, eps):
    out, save_mean, save_invstd = torch.ops.aten.native_batch_norm.default(
        input, weight, bias, running_mean.clone(), running_var.clone(), training, momentum, eps
    )
    return out, save_mean, save_invstd, running_mean.clone(), running_var.clone()


batch_norm_with_stats = torch.ops.zerocc.batch_norm_with_stats.default


# Communication markers -------------------------------------------------------
# The shard pass says *what* layout a value needs with these two functions;
# insert_collectives decides *how*: it replaces each with asynchronous
# collectives and waits (or with nothing at world size 1). Their bodies are
# the world-size-1 meaning, so a graph that still holds them runs only there.

def unshard(shard: torch.Tensor, world_size: int) -> torch.Tensor:
    """The full flat bucket: every rank's shard, concatenated in rank order (all_gather)."""
    if world_size != 1:
        raise RuntimeError("unshard at world size > 1 must be lowered by the insert_collectives pass")
    return shard


def reduce_gradient(flat_grad: torch.Tensor, world_size: int, scatter: bool) -> torch.Tensor:
    """The gradient averaged over ranks: this rank's shard of it (reduce_scatter) or all of it (all_reduce)."""
    if world_size != 1:
        raise RuntimeError("reduce_gradient at world size > 1 must be lowered by the insert_collectives pass")
    return flat_grad
