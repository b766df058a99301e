"""Custom operators zerocc puts into graphs.

``zerocc::batch_norm_with_stats`` is ``aten.native_batch_norm`` with its
running-statistics update made visible: eager PyTorch updates the running
mean and variance inside the kernel without saying so in the op's schema, so
functionalization would not see it. This op returns the new statistics
instead, and runs the very same kernel, so numerics are unchanged.
``zerocc::bernoulli_in_layout`` draws a dropout mask in its input's memory
order, as eager's in-place draw does (below), and
``zerocc::binary_cross_entropy_with_logits`` keeps eager's kernel where
functionalization would swap in another formula.
"""
from __future__ import annotations

import threading

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


# ``zerocc::bernoulli_in_layout`` is ``aten.bernoulli.p`` whose result keeps its input's strides. Eager's dropout
# on CPU draws its mask in place, ``empty_like(x).bernoulli_(1 - p)``, in the memory order of ``x``;
# functionalization turns that into ``bernoulli.p(empty_like(x))``, whose result is contiguous: on a transposed
# ``x`` (nn.MultiheadAttention's batch_first output) the same random numbers land on other elements.
_lib.define("bernoulli_in_layout(Tensor self, float p) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))


def _bernoulli_in_layout(self, p):
    return torch.empty_like(self).bernoulli_(p)


_lib.impl("bernoulli_in_layout", _bernoulli_in_layout, "CompositeExplicitAutograd")


@torch.library.register_fake("zerocc::bernoulli_in_layout")
def _bernoulli_in_layout_fake(self, p):
    return torch.empty_like(self)


bernoulli_in_layout = torch.ops.zerocc.bernoulli_in_layout.default


# ``zerocc::binary_cross_entropy_with_logits`` is the aten op under another name. ``torch.func.functionalize`` (the
# replay in zerocc/tracing.py) swaps the aten op for functorch's own formula (PyTorchOperatorHacks.cpp:
# ``max_val + log(exp(-max_val) + exp(-x - max_val))``), while eager's kernel computes ``- log_sigmoid(x)``; the two
# round differently. Under this name functorch leaves it alone and the program runs eager's kernel.
_lib.define("binary_cross_entropy_with_logits(Tensor self, Tensor target, Tensor? weight=None, "
            "Tensor? pos_weight=None, int reduction=1) -> Tensor")


def _binary_cross_entropy_with_logits(self, target, weight=None, pos_weight=None, reduction=1):
    return torch.ops.aten.binary_cross_entropy_with_logits.default(self, target, weight, pos_weight, reduction)


_lib.impl("binary_cross_entropy_with_logits", _binary_cross_entropy_with_logits, "CompositeExplicitAutograd")
torch.library.register_fake("zerocc::binary_cross_entropy_with_logits")(_binary_cross_entropy_with_logits)

binary_cross_entropy_with_logits = torch.ops.zerocc.binary_cross_entropy_with_logits.default


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


# Collectives on gloo -----------------------------------------------------------
# passes/gather_by_send_recv.py puts this in place of all_gather_into_tensor on CPU.

_lib.define("all_gather_by_send_recv(Tensor shard, int group_size, str group_name, int tag) -> Tensor")


def _all_gather_by_send_recv(shard, group_size, group_name, tag):
    """all_gather_into_tensor's result, by sending the shard to each peer and receiving each peer's into place.

    Returns at once, like the functional collectives: the sends and receives
    are registered against the result, so ``_c10d_functional.wait_tensor`` on
    it waits for all of them. No staging buffer: gloo's all_gather gathers
    into a fresh flat buffer and copies it out, this receives where it belongs.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)
    rank, rows = group.rank(), shard.shape[0]
    shard = shard.contiguous()
    full = shard.new_empty((group_size * rows, *shard.shape[1:]))
    full[rank * rows:(rank + 1) * rows].copy_(shard)
    for distance in range(1, group_size):   # every rank posts in the same pattern; gloo's posts never block
        to, source = (rank + distance) % group_size, (rank - distance) % group_size
        torch._C._distributed_c10d._register_work(full, group.send([shard], to, tag))
        torch._C._distributed_c10d._register_work(
            full, group.recv([full[source * rows:(source + 1) * rows]], source, tag))
    return full


_lib.impl("all_gather_by_send_recv", _all_gather_by_send_recv, "CPU")


@torch.library.register_fake("zerocc::all_gather_by_send_recv")
def _all_gather_by_send_recv_fake(shard, group_size, group_name, tag):
    return shard.new_empty((group_size * shard.shape[0], *shard.shape[1:]))


all_gather_by_send_recv = torch.ops.zerocc.all_gather_by_send_recv.default


# passes/place_buffers.py puts this in place of all_to_all_single (passes/scatter_by_all_to_all.py) under
# memory_pools: _c10d_functional's all-to-all has no out= form, so its full bucket was left to the allocator,
# beside the arena, on top of the arena's peak (analysis/kernels.py, COLLECTIVE_OUT).

_lib.define("all_to_all_single_out(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
            "str group_name, *, Tensor(a!) out) -> Tensor(a!)")


def _all_to_all_single_out(input, output_split_sizes, input_split_sizes, group_name, *, out):
    """``_c10d_functional.all_to_all_single``'s exchange, received into ``out`` (a view of the arena).

    The same ``ProcessGroup.alltoall_base`` call the functional op makes, given
    the output instead of allocating it: the same bytes arrive in the same
    places. Returns at once; the work is registered against ``out``, so
    ``_c10d_functional.wait_tensor`` on it waits, as for ``all_gather_into_tensor_out``.
    """
    from torch.distributed.distributed_c10d import _resolve_process_group
    group = _resolve_process_group(group_name)
    work = group.alltoall_base(out, input.contiguous(), list(output_split_sizes), list(input_split_sizes))
    torch._C._distributed_c10d._register_work(out, work)
    return out


_lib.impl("all_to_all_single_out", _all_to_all_single_out, "CPU")


@torch.library.register_fake("zerocc::all_to_all_single_out")
def _all_to_all_single_out_fake(input, output_split_sizes, input_split_sizes, group_name, *, out):
    return out


all_to_all_single_out = torch.ops.zerocc.all_to_all_single_out.default


# Gradient buckets written in place ----------------------------------------------
# passes/gradients_into_buckets.py allocates a bucket, has each gradient's op write
# its slice (out=), and reads the bucket through this op, which names the writes.

_lib.define("bucket_written(Tensor(a) bucket, Tensor[] writes) -> Tensor(a)")


def _bucket_written(bucket, writes):
    """``bucket`` (a view of it), once ``writes`` are done: the edges that order the writes before any read.

    The writes are out= results into slices of ``bucket``; by taking them as
    arguments this node comes after all of them in any valid order of the
    graph, so a pass that reorders nodes by their inputs cannot move the
    bucket's reduction before the gradients are in it.
    """
    return torch.ops.aten.alias.default(bucket)


_lib.impl("bucket_written", _bucket_written, "CompositeExplicitAutograd")


@torch.library.register_fake("zerocc::bucket_written")
def _bucket_written_fake(bucket, writes):
    return torch.ops.aten.alias.default(bucket)


bucket_written = torch.ops.zerocc.bucket_written.default


_users_op_autocast = threading.local()   # the state under_autocast runs its op in, while it runs


def under_autocast(state: tuple, op, *args, **kwargs):
    """``op(*args, **kwargs)`` under the autocast ``state`` (``autocast.autocast_state``) a user's custom op was
    called in: the program runs outside autocast, and the op's own code (a reference implementation calling
    ``F.linear``) computes under the caller's autocast in eager, as a custom op has no autocast rule of its own."""
    from .autocast import autocast_as
    _users_op_autocast.state = state
    try:
        with autocast_as(state):
            return op(*args, **kwargs)
    finally:
        _users_op_autocast.state = ()


def written_copies_under_autocast(state: tuple, _mutable_op, **kwargs):
    """``under_autocast`` of a custom op that writes into its arguments, run on copies of them
    (``auto_functionalized_dense``, zerocc/tracing.py)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_dense
    return under_autocast(state, auto_functionalized_dense, _mutable_op, **kwargs)


def users_op_autocast() -> tuple:
    """The autocast state of the user's custom op ``under_autocast`` is running (empty outside one): a dispatch
    mode of zerocc's that sees the op runs it in that state, which the mode's own dispatch turns off."""
    return getattr(_users_op_autocast, "state", ())
