"""Measuring what a step really holds: the peak of live tensor bytes on this rank.

The memory plan (``zerocc/memory_plan.py``) says what should be alive at each
position of the schedule; this module measures what is. It watches every op
the program dispatches (a ``TorchDispatchMode`` that only looks), counts each
distinct storage once (views share their base's storage), and notices a
storage's release through a weak reference. The peak is taken after every op,
so it is the most bytes alive between ops: an op's own workspace inside a
kernel is not seen, nor is allocator caching or fragmentation.

A collective's input (a gradient bucket, a shard cast to ``param_dtype``)
dies at the collective's wait in the plan: the collective reads it until
then. gloo's worker thread holds it only until the collective is done, which
may be before the wait (then the program's own reference gone, the input was
not counted from there: stage 3 with ``grad_accumulation`` issues a bucket's
gathers for every micro-batch at once, from one cast shard, and measured up
to 4% under its plan) or a moment after the wait returns, once the thread
holds the GIL (about one wait in five, a reduced bucket was still counted a
few ops later, and a budget met with a bucket to spare measured over it).
The tracker holds each collective's input until its wait and there gives the
thread that moment (at most ``_RELEASE_WAIT`` seconds per collective), so what
it measures is the program's order of releases, not the thread's timing.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from .. import graph as g
from ..autocast import autocast_as
from ..ops import users_op_autocast


_c10d = torch.ops._c10d_functional
# the collectives that read their input until their wait (g.reads_inputs_until_wait; an all_reduce or a
# broadcast clones its input when called)
_READ_UNTIL_WAIT = {_c10d.all_to_all_single.default, _c10d.reduce_scatter_tensor.default,
                    _c10d.reduce_scatter_tensor_out.default, _c10d.all_gather_into_tensor.default,
                    _c10d.all_gather_into_tensor_out.default, torch.ops.zerocc.all_gather_by_send_recv.default,
                    torch.ops.zerocc.all_to_all_single_out.default}
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_RELEASE_WAIT = 1e-3


class LiveBytesTracker(TorchDispatchMode):
    """``with LiveBytesTracker(state, batch) as tracker: run()`` then ``tracker.peak_bytes``.

    The batch counts as the plan counts it, each input its own bytes: an input sliced from a larger tensor
    (``X[i:i + 8]`` of a dataset held in memory, ``x.chunk(world_size)[rank]``) shares that tensor's storage,
    which the user holds whatever the step does; counted whole, it measured the step over its budget by the
    dataset's size (a ``MemoryBudgetWarning`` asking to lower the budget by it).

    A higher-order op in the program (flex_attention, ``torch.cond``) comes here whole, as one op: torch
    refuses such an op under a mode that does not say it takes them.
    """

    supports_higher_order_operators = True

    def __init__(self, tensors: Iterable[torch.Tensor] = (), batch: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._in_flight: dict[int, torch.Tensor] = {}   # a collective's output address -> its input, held
        for tensor in tensors:
            self._add(tensor)
        inputs: dict[int, tuple[StorageWeakRef, int]] = {}   # inputs sharing a storage: their bytes added, at most it
        for tensor in batch:
            reference = StorageWeakRef(tensor.untyped_storage())
            if reference.cdata not in self._live:
                counted = inputs.get(reference.cdata, (reference, 0))[1]
                inputs[reference.cdata] = (reference, min(tensor.untyped_storage().nbytes(),
                                                          counted + g.span_bytes(tensor)))
        self._live.update(inputs)
        self.live_bytes += sum(size for _, size in inputs.values())
        self.peak_bytes = self.live_bytes
        self._given = set(self._live)   # the slots, the batch and the memory pools: alive all along

    def _add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata   # what StorageWeakRef(storage).cdata is: a storage already counted makes no weak reference
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return
        if known is not None:
            self.live_bytes -= known[1]
        size = storage.nbytes()
        self._live[key] = (StorageWeakRef(storage), size)
        self.live_bytes += size

    def _sweep(self) -> None:
        for key in [k for k, (reference, _) in self._live.items() if reference.expired()]:
            self.live_bytes -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # every op of the first run passes here (thousands: a 12-layer GPT's first step ran ~0.2 s longer than the
        # next): the common cases (no user's op under autocast, one tensor out) skip the context and the pytree walk
        autocast = users_op_autocast()
        if autocast:   # a user's op the program runs under autocast (zerocc/ops.py)
            with autocast_as(autocast):
                result = func(*args, **(kwargs or {}))
        else:
            result = func(*args, **kwargs) if kwargs else func(*args)
        if func in _READ_UNTIL_WAIT and StorageWeakRef(args[0].untyped_storage()).cdata not in self._given:
            self._in_flight[result.data_ptr()] = args[0]   # read until the wait, as planned: held until then
        elif func is _WAIT and (held := self._in_flight.pop(result.data_ptr(), None)) is not None:
            reference = StorageWeakRef(held.untyped_storage())
            del held
            deadline = time.perf_counter() + _RELEASE_WAIT
            while not reference.expired() and time.perf_counter() < deadline:
                time.sleep(0)   # the worker thread needs the GIL to drop the input
        if isinstance(result, torch.Tensor):
            self._add(result)
        else:
            for value in pytree.tree_leaves(result):
                if isinstance(value, torch.Tensor):
                    self._add(value)
        if self.live_bytes > self.peak_bytes:   # counting released storages too: maybe a new peak
            self._sweep()                        # (sweeping only lowers the count, so skip it otherwise)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return result
