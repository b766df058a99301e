"""Count the collectives a piece of code really issues, and their volume as the ZeRO paper counts it.

    with CountCollectives() as counted:
        step(x, y)
    counted.calls["all_gather"], counted.bytes["reduce_scatter"]

It sits at the dispatcher, so it sees zerocc's functional collectives and the
in-place ``c10d`` ones that DDP's reducer, FSDP2 and DeepSpeed issue alike.
Volume is the bytes of the full (unsharded) tensor; an all_reduce counts twice,
as a reduce_scatter followed by an all_gather.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, index of the argument holding the full tensor(s), or None: the output holds it)
COLLECTIVE_OPS = {
    # _c10d_functional (zerocc)
    "all_gather_into_tensor": ("all_gather", None), "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0),
    "all_gather_into_tensor_out": ("all_gather", None),          # into an arena (passes/place_buffers.py)
    "reduce_scatter_tensor_out": ("reduce_scatter", 0),
    "all_to_all_single": ("reduce_scatter", 0),   # zerocc's reduce-scatter on gloo (passes/scatter_by_all_to_all.py)
    # zerocc (zerocc/ops.py)
    "all_gather_by_send_recv": ("all_gather", None),   # zerocc's all-gather on gloo (passes/gather_by_send_recv.py)
    "all_to_all_single_out": ("reduce_scatter", 0),    # all_to_all_single into an arena (passes/place_buffers.py)
    # c10d, in place (torch.distributed, DDP, FSDP2, DeepSpeed)
    "_allgather_base_": ("all_gather", 0), "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "allgather_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "broadcast_": ("broadcast", 0),
}


class CountCollectives(TorchDispatchMode):
    """Calls and bytes per kind of collective (all_gather, reduce_scatter, all_reduce, broadcast)."""

    supports_higher_order_operators = True   # a higher-order op in the program (flex_attention) runs whole

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor
        if any(t is DTensor for t in types):
            return NotImplemented    # let DTensor desugar into the local collectives first
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("_c10d_functional", "c10d", "zerocc") and func._opname in COLLECTIVE_OPS:
            kind, index = COLLECTIVE_OPS[func._opname]
            full = out if index is None else args[index]
            tensors = [t for t in torch.utils._pytree.tree_leaves(full) if isinstance(t, torch.Tensor)]
            volume = sum(t.numel() * t.element_size() for t in tensors)
            self.calls[kind] += 1
            self.bytes[kind] += volume * (2 if kind == "all_reduce" else 1)
        return out
