"""The multi-rank harness (tests/distributed.py) fails loudly: a rank that raises, dies or hangs fails the test.

A harness that swallowed a rank's failure or waited forever on a stuck rank
would turn every multi-rank test into a test of rank 0 alone, or hang CI.
"""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests import distributed

pytestmark = pytest.mark.multirank


def _rank_and_sum(rank, world_size):
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return rank, total


def test_every_rank_returns_its_result():
    assert [(rank, total.item()) for rank, total in distributed.run(_rank_and_sum, 2)] == [(0, 3.0), (1, 3.0)]


def _last_rank_raises(rank, world_size):
    if rank == world_size - 1:
        raise ValueError("the last rank fails on purpose")
    return rank


def test_a_rank_that_raises_fails_the_run_with_its_traceback():
    with pytest.raises(distributed.RanksFailed, match=r"(?s)rank 1 raised:.*_last_rank_raises.*"
                                                      r"ValueError: the last rank fails on purpose"):
        distributed.run(_last_rank_raises, 2)


def _last_rank_exits(rank, world_size):
    if rank == world_size - 1:
        os._exit(0)
    return rank


def test_a_rank_that_exits_without_a_result_fails_the_run():
    with pytest.raises(distributed.RanksFailed, match="rank 1 exited with code 0 and returned no result"):
        distributed.run(_last_rank_exits, 2)


def _sleep_forever():
    time.sleep(3600)


def _last_rank_hangs(rank, world_size):
    if rank == world_size - 1:
        _sleep_forever()        # stuck in Python
    dist.all_reduce(torch.ones(1))   # the others: stuck inside gloo, waiting for it
    return rank


def test_a_hung_rank_is_killed_at_the_deadline_and_named_with_its_stack():
    start = time.monotonic()
    with pytest.raises(distributed.RanksFailed) as failure:
        distributed.run(_last_rank_hangs, 2, timeout=5)
    assert time.monotonic() - start < 60
    message = str(failure.value)
    assert "rank 1 was still running" in message and "deadline 5 s" in message
    rank_1 = message[message.index("rank 1 was still running"):]
    assert "_sleep_forever" in rank_1 and "_last_rank_hangs" in rank_1
    rank_0 = message[message.index("rank 0 was still running"):message.index("rank 1 was still running")]
    assert "all_reduce" in rank_0   # the stack of a rank waiting in C++ is written too
