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

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build


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
