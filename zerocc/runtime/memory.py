"""Measuring what a step really holds: the peak of live tensor bytes on this rank.

The memory plan (``zerocc/memory_plan.py``) says what should be alive at each
position of the schedule; this module measures what is. It watches every op
the program dispatches (a ``TorchDispatchMode`` that only looks), counts each
distinct storage once (views share their base's storage), and notices a
storage's release through a weak reference. The peak is taken after every op,
so it is the most bytes alive between ops: an op's own workspace inside a
kernel is not seen, nor is allocator caching or fragmentation.

A reduction's input (a gradient bucket) dies at the reduction's wait in the
plan, but gloo's worker thread drops its own reference a moment after the
wait returns, and only once it holds the GIL: about one wait in five, the
bucket was still counted a few ops later, and a budget met with a bucket to
spare measured over it. The tracker gives the thread that moment (at most
``_RELEASE_WAIT`` seconds per reduction), so what it measures is the
program's order of releases, not the thread's timing.
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


_REDUCTIONS = {torch.ops._c10d_functional.all_to_all_single.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default}
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_RELEASE_WAIT = 1e-3


class LiveBytesTracker(TorchDispatchMode):
    """``with LiveBytesTracker(state, batch) as tracker: run()`` then ``tracker.peak_bytes``.

    The batch counts as the plan counts it, each input its own bytes: an input sliced from a larger tensor
    (``X[i:i + 8]`` of a dataset held in memory, ``x.chunk(world_size)[rank]``) shares that tensor's storage,
    which the user holds whatever the step does; counted whole, it measured the step over its budget by the
    dataset's size (a ``MemoryBudgetWarning`` asking to lower the budget by it).
    """

    def __init__(self, tensors: Iterable[torch.Tensor] = (), batch: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self._reduced: dict[int, StorageWeakRef] = {}   # a reduction's output storage -> its input's
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
        reference = StorageWeakRef(storage)
        known = self._live.get(reference.cdata)
        if known is not None and not known[0].expired():
            return
        if known is not None:
            self.live_bytes -= known[1]
        size = storage.nbytes()
        self._live[reference.cdata] = (reference, size)
        self.live_bytes += size

    def _sweep(self) -> None:
        for key in [k for k, (reference, _) in self._live.items() if reference.expired()]:
            self.live_bytes -= self._live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with autocast_as(users_op_autocast()):   # a user's op the program runs under autocast (zerocc/ops.py)
            result = func(*args, **(kwargs or {}))
        if func in _REDUCTIONS and (reduced := StorageWeakRef(args[0].untyped_storage())).cdata not in self._given:
            self._reduced[result.untyped_storage()._cdata] = reduced
        elif func is _WAIT and (reduced := self._reduced.pop(result.untyped_storage()._cdata, None)) is not None:
            deadline = time.perf_counter() + _RELEASE_WAIT
            while not reduced.expired() and time.perf_counter() < deadline:
                time.sleep(0)   # the worker thread needs the GIL to drop the input
        for value in pytree.tree_leaves(result):
            if isinstance(value, torch.Tensor):
                self._add(value)
        if self.live_bytes > self.peak_bytes:   # counting released storages too: maybe a new peak
            self._sweep()                        # (sweeping only lowers the count, so skip it otherwise)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return result
