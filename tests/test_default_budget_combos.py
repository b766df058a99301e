"""The CPU default budget (the default plan's peak, docs/guide/memory-budget.md) in combination with what a user
does around the step: resume in new processes, the disk cache, ranks that offer different budgets.

The tiny GPT with 16 KiB buckets and 8 sequences per rank makes place_remat choose a plan other than the default
(every forward gather kept, cheap ops recomputed): 12 instead of 21 all_gathers on 2 ranks. Every test before the
CPU default budget assumed the default plan.
"""
from __future__ import annotations

import os

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step
from zerocc import device_budget as budget_module

PER_RANK = 8
OPTIONS = dict(stage=3, bucket_bytes=16 * 1024, prefetch_bytes=0)
STEPS = 4

pytestmark = pytest.mark.multirank


def _global_batches():
    return batches("gpt", STEPS, 2 * PER_RANK)


def _mine(batch, rank):
    return [t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in batch]


def _eager():
    model, _, loss_fn = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = [eager_step(model, optimizer, loss_fn, batch) for batch in _global_batches()]
    return losses, model.state_dict()


def _plan_of(step):
    plan = step.remat_plan
    return {"unbounded": plan.unbounded_schedule, "recomputed": len(plan.recomputed), "budget": plan.budget_bytes,
            "source": plan.budget_source, "gathers": step.report()["collectives_per_step"]["all_gather"]}


def _train(rank, world_size, start, stop, checkpoint, save_at, options):
    os.environ.pop(budget_module.ENVIRONMENT, None)
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn,
                          **OPTIONS, **options)
    if start:
        zerocc.load_checkpoint(step, checkpoint)
    losses = []
    for i, batch in enumerate(_global_batches()[start:stop], start):
        losses.append(step(*_mine(batch, rank)))
        if i + 1 == save_at:
            zerocc.save_checkpoint(step, checkpoint)
    return losses, step.full_state_dict(), _plan_of(step), step.report()["compile_cache"]


def test_resumed_in_new_processes_the_chosen_plan_is_chosen_again_and_trains_on(tmp_path):
    """Saved after 2 steps of the plan the CPU default chose, a resume in new processes (the checkpoint loaded
    before the first call) chooses the same plan and trains the losses and parameters of an uninterrupted run,
    which match eager on the global batch."""
    checkpoint = str(tmp_path / "latest")
    whole = distributed.run(_train, 2, 0, STEPS, checkpoint, 2, {})
    resumed = distributed.run(_train, 2, 2, STEPS, checkpoint, None, {})
    for rank in range(2):
        losses, state, plan, _ = whole[rank]
        assert plan["unbounded"] and plan["recomputed"] and "default plan's peak" in plan["source"]
        assert resumed[rank][2] == plan
        assert [float(x) for x in resumed[rank][0]] == [float(x) for x in losses[2:]]
        for key, value in state.items():
            assert torch.equal(resumed[rank][1][key], value), key
    expected, expected_state = _eager()
    global_losses = (torch.stack(whole[0][0]) + torch.stack(whole[1][0])) / 2   # equal slices: the global mean
    torch.testing.assert_close(global_losses, torch.stack(expected), rtol=1e-5, atol=1e-5)
    for key, value in expected_state.items():
        torch.testing.assert_close(whole[0][1][key], value, rtol=1e-4, atol=1e-5)


def _budgets(rank, world_size, offered):
    """Rank 0 is given $ZEROCC_DEVICE_MEMORY, rank 1 has the CPU default."""
    if rank in offered:
        os.environ[budget_module.ENVIRONMENT] = str(offered[rank])
    else:
        os.environ.pop(budget_module.ENVIRONMENT, None)
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loss_fn=loss_fn, **OPTIONS)
    losses = [step(*_mine(batch, rank)) for batch in _global_batches()[:2]]
    return losses, _plan_of(step), step.report()["measured_peak_bytes"], step.full_state_dict()


def test_a_number_another_rank_offers_does_not_lift_the_default_plans_peak():
    """$ZEROCC_DEVICE_MEMORY on some ranks only (a node's environment): a CPU rank's budget is its default plan's
    peak, which is smaller than a roomy number; the smallest offered is planned against. Before, the number won
    (a rank offering no number was read as offering anything): the CPU rank planned against 100 MB, over its own
    default plan's peak."""
    roomy = distributed.run(_budgets, 2, {0: 10**8})
    alone = distributed.run(_budgets, 2, {})
    for rank in range(2):
        plan, default = roomy[rank][1], alone[rank][1]
        assert plan["budget"] == default["budget"] < 10**8, plan
        assert "default plan's peak" in plan["source"] and "another rank's" in plan["source"]
        assert plan["gathers"] == default["gathers"] and roomy[rank][2] <= default["budget"]
        assert [float(x) for x in roomy[rank][0]] == [float(x) for x in alone[rank][0]]
    # a number under the default plan's peak is met too (the plan searched again under it)
    tight = distributed.run(_budgets, 2, {0: int(alone[0][1]["budget"] * 0.8)})
    for rank in range(2):
        assert tight[rank][1]["budget"] == int(alone[0][1]["budget"] * 0.8)
        assert tight[rank][2] <= tight[rank][1]["budget"]
        assert [float(x) for x in tight[rank][0]] == [float(x) for x in alone[rank][0]]


@pytest.mark.slow
def test_a_second_run_loads_the_chosen_plan_from_the_disk_cache(tmp_path):
    """The disk cache stores the plan the CPU default chose: a second run loads it and trains the same numbers;
    another memory_budget misses, saying the options changed."""
    options = {"cache_dir": str(tmp_path / "cache")}
    first = distributed.run(_train, 2, 0, 2, None, None, options)
    second = distributed.run(_train, 2, 0, 2, None, None, options)
    for rank in range(2):
        assert first[rank][3].startswith("miss (no entry), then stored") and second[rank][3] == "loaded"
        assert second[rank][2] == first[rank][2] and first[rank][2]["unbounded"]
        assert [float(x) for x in second[rank][0]] == [float(x) for x in first[rank][0]]
        for key, value in first[rank][1].items():
            assert torch.equal(second[rank][1][key], value), key
    budgeted = distributed.run(_train, 2, 0, 1, None, None, dict(options, memory_budget=2_000_000))
    assert all(result[3].startswith("miss (changed since the entry for this program: options)") for result in budgeted)
