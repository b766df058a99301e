"""Every asynchronous collective a step issues is waited inside the step: none is left touching a tensor after it.

gloo's works (the functional collectives', and ``zerocc::all_gather_by_send_recv``'s
sends and receives) hold their tensors and are kept in torch's work registry
until ``wait_tensor``; a work never waited would keep reading or writing a
tensor the program has dropped. After every step on 2 ranks the registry is
empty at stage 3 (gathers by send/recv, reduce-scatters as all-to-all, old
state released early), plain and with memory pools. A guard, not a bug fix:
nothing was found unwaited (the heap-corruption hunt of issue 17, item 7).
"""
from __future__ import annotations

import ctypes
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import zerocc
from tests import distributed
from tests.models import batches, build
from zerocc import ops
from zerocc.passes.gather_by_send_recv import TAG_BASE

c10d = torch.ops._c10d_functional


def _registry_after_each_step(rank, world_size):
    registry = torch._C._distributed_c10d._get_work_registry_size
    sizes = {}
    for stage, pools in ((3, False), (3, True)):
        model, _, loss_fn = build("mlp")
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, loss_fn=loss_fn,
                              bucket_bytes=2048, memory_pools=pools)
        sizes[(stage, pools)] = []
        for batch in batches("mlp", 3, 4, seed=rank):
            step(*batch)
            sizes[(stage, pools)].append(registry())
        sizes[(stage, pools, "passes")] = step.passes
    return sizes


@pytest.mark.multirank
def test_no_collective_is_left_in_flight_after_a_step():
    for sizes in distributed.run(_registry_after_each_step, 2):
        assert "gather_by_send_recv" in sizes[(3, False, "passes")]
        for key, value in sizes.items():
            if "passes" not in key:
                assert value == [0, 0, 0], key


def _storage_lives_until_the_work_is_done(rank, world_size):
    group = torch.distributed.group.WORLD
    seen = {}
    # zerocc's gather: the program drops its shard (and a released slot's last reference) at once
    shard = torch.full((3, 2), float(rank))
    sent = StorageWeakRef(shard.untyped_storage())
    full = ops.all_gather_by_send_recv(shard, world_size, group.group_name, TAG_BASE)
    del shard
    gc.collect()
    seen["shard kept while the gather is in flight"] = not sent.expired()
    full = c10d.wait_tensor(full)
    gc.collect()
    seen["shard freed once waited"] = sent.expired()
    seen["gathered"] = full[:, 0].tolist()
    # the reduce-scatter's all-to-all (passes/scatter_by_all_to_all.py): its input dropped before the wait
    bucket = torch.arange(4, dtype=torch.float32) + 10 * rank
    given = StorageWeakRef(bucket.untyped_storage())
    out = c10d.all_to_all_single(bucket, [2, 2], [2, 2], group.group_name)
    del bucket
    gc.collect()
    seen["all-to-all input kept while in flight"] = not given.expired()
    seen["exchanged"] = c10d.wait_tensor(out).tolist()
    gc.collect()
    seen["all-to-all input freed once waited"] = given.expired()
    # a receive still pending (the peer sends only after the barrier) when its destination is dropped
    if rank == 1:
        destination = torch.zeros(5)
        target, address = StorageWeakRef(destination.untyped_storage()), destination.data_ptr()
        work = group.recv([destination], 0, TAG_BASE + 99)
        del destination
        gc.collect()
        seen["pending receive's buffer kept"] = not target.expired()
        torch.distributed.barrier()
        work.wait()
        seen["still kept once received"] = not target.expired()
        # no tensor refers to the buffer any more: read its bytes where gloo wrote them (alive: the work holds them)
        seen["received into the kept buffer"] = list((ctypes.c_float * 5).from_address(address))
        del work
        gc.collect()
        seen["buffer freed with the work"] = target.expired()
    else:
        torch.distributed.barrier()
        group.send([torch.arange(5, dtype=torch.float32)], 1, TAG_BASE + 99).wait()
    return seen


@pytest.mark.multirank
def test_a_dropped_tensor_lives_until_its_gloo_work_is_done():
    """The release of a slot or a local cannot free memory gloo still reads or writes: the work holds the storage."""
    first, second = distributed.run(_storage_lives_until_the_work_is_done, 2)
    for seen in (first, second):
        assert seen["shard kept while the gather is in flight"] and seen["shard freed once waited"]
        assert seen["gathered"] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
        assert seen["all-to-all input kept while in flight"] and seen["all-to-all input freed once waited"]
    assert first["exchanged"] == [0.0, 1.0, 10.0, 11.0] and second["exchanged"] == [2.0, 3.0, 12.0, 13.0]
    assert second["pending receive's buffer kept"] and second["still kept once received"] and second["buffer freed with the work"]
    assert second["received into the kept buffer"] == [0.0, 1.0, 2.0, 3.0, 4.0]
