"""Without a memory_budget the step is planned against what the device offers (zerocc/device_budget.py).

The contract: the fastest plan when it fits the device (at stage 3 across
ranks, every forward gather kept for backward), the default schedule or
recomputation when it does not, a clear error when nothing fits; the
numbers trained are the same in every case, and equal eager's.
"""
from __future__ import annotations

import os

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step
from zerocc import device_budget as budget_module
from zerocc.device_budget import DeviceBudget, device_budget, held_bytes
from zerocc.errors import ConfigError, MemoryBudgetError
from zerocc.runtime.comm_counter import CountCollectives

BUCKET_BYTES = 16 * 1024   # several buckets for the tiny GPT
PER_RANK = 8


def test_cpu_offers_the_default_plans_peak_unless_the_environment_says(monkeypatch):
    monkeypatch.delenv(budget_module.ENVIRONMENT, raising=False)
    assert device_budget(torch.device("cpu"), [torch.zeros(10)]) == budget_module.DEFAULT_PLAN_PEAK
    assert budget_module.DEFAULT_PLAN_PEAK.bytes is None
    monkeypatch.setenv(budget_module.ENVIRONMENT, "123456")
    assert device_budget(torch.device("cpu")) == DeviceBudget(123456, "$ZEROCC_DEVICE_MEMORY")
    for bad in ("8GB", "-1", "0"):
        monkeypatch.setenv(budget_module.ENVIRONMENT, bad)
        with pytest.raises(ConfigError, match="ZEROCC_DEVICE_MEMORY"):
            device_budget(torch.device("cpu"))


def test_cuda_offers_its_free_memory_less_a_margin_plus_what_the_step_takes_over(monkeypatch):
    monkeypatch.delenv(budget_module.ENVIRONMENT, raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000_000, 80_000_000))
    got = device_budget(torch.device("cuda", 0))
    assert got.bytes == int(10_000_000 * (1 - budget_module.CUDA_MARGIN)) and "free memory" in got.source
    # the tensors the step takes over count once per storage, and only on the device
    base = torch.zeros(1000)
    assert held_bytes([base, base[:10], base.view(10, 100), torch.zeros(5, dtype=torch.float64)],
                      torch.device("cpu")) == 4000 + 40
    assert held_bytes([base], torch.device("cuda", 0)) == 0


def _plan(**options):
    model, _, loss_fn = build("gpt")
    data = [t[:PER_RANK] for t in batches("gpt", 1, 2 * PER_RANK)[0]]
    return zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, world_size=2,
                       example_inputs=data, loss_fn=loss_fn, bucket_bytes=BUCKET_BYTES, prefetch_bytes=0, **options)


def _default_schedule():
    """The plan before budgets: the default schedule, nothing recomputed (place_remat disabled)."""
    return _plan(disable=["place_remat"])


def _peaks():
    """The pooled peaks of the default schedule (backward gathers again) and of the fastest plan (it does not)."""
    return _default_schedule().memory_plan.planned_peak_bytes, \
        _plan(device_memory=10**12).memory_plan.planned_peak_bytes


def test_without_device_memory_a_plan_is_searched_under_the_default_plans_peak():
    """CPU's budget (and zerocc.plan's without device_memory) is the default plan's peak: the default schedule is
    measured first, and a plan keeping every forward gather is taken only at or under its peak."""
    default, chosen = _default_schedule(), _plan()
    remat = chosen.remat_plan
    assert "the default plan's peak" in remat.budget_source and remat.budget_source in remat.summary()
    assert remat.considered[0].schedule == "default" and remat.considered[0].fits
    assert remat.budget_bytes == remat.peak_before_bytes == remat.considered[0].peak_bytes
    assert chosen.memory_plan.planned_peak_bytes <= remat.budget_bytes
    assert abs(remat.budget_bytes - default.memory_plan.planned_peak_bytes) <= 0.01 * remat.budget_bytes
    # at most the default plan and AT_DEFAULT_PEAK_PLANS plans keeping every gather are measured
    from zerocc.passes.place_remat import AT_DEFAULT_PEAK_PLANS
    assert remat.evaluations <= 1 + AT_DEFAULT_PEAK_PLANS
    gathers = chosen.report()["collectives_per_step"]["all_gather"]
    assert gathers < default.report()["collectives_per_step"]["all_gather"] if remat.unbounded_schedule \
        else gathers == default.report()["collectives_per_step"]["all_gather"]


def test_under_the_default_plans_peak_only_the_plan_predicted_to_fit_is_measured():
    """Every default CPU compile at stage 3 across ranks pays for what place_remat measures beside the default plan
    (a run of the later passes each): the plan keeping every gather is not measured to learn its live peak, which
    is read off the step as place_remat sees it (each bucket's gather read in forward and in backward, as that
    schedule keeps them), and only the plan predicted to fit is measured (it was 3 plans, and 1.8x the compile)."""
    from zerocc.analysis.lifetimes import memory_plan_of
    chosen = _plan()
    remat = chosen.remat_plan
    assert remat.unbounded_schedule and remat.recomputed and remat.evaluations == 2
    assert [plan.schedule for plan in remat.considered] == ["default", "unbounded"]
    assert all(plan.fits for plan in remat.considered)
    # the prediction's ground: the unbounded schedule's live peak, measured through every pass, is the step's
    # live peak as place_remat is handed it
    unbounded = _plan(device_memory=10**12)
    assert unbounded.remat_plan.unbounded_schedule and not unbounded.remat_plan.recomputed
    handed = memory_plan_of(unbounded.graph("shard").graph_module, placed=False).live_peak_bytes
    assert handed == unbounded.memory_plan.live_peak_bytes


def test_plan_takes_the_fastest_plan_the_device_fits_and_recomputes_when_it_must():
    bounded, fastest = _peaks()
    assert fastest > bounded   # keeping every forward gather costs memory: there is a trade to make
    roomy = _plan(device_memory=10**12)
    assert roomy.remat_plan.unbounded_schedule and roomy.remat_plan.evaluations == 0
    assert roomy.remat_plan.budget_source == "device_memory= given to zerocc.plan"
    assert roomy.report()["collectives_per_step"]["all_gather"] < \
        _default_schedule().report()["collectives_per_step"]["all_gather"]
    assert "device budget" in str(roomy.remat_plan)
    # a device between the two: planned against, as a memory_budget of its size is
    between = (bounded + fastest) // 2
    middle = _plan(device_memory=between)
    assert middle.memory_plan.planned_peak_bytes <= between
    assert middle.remat_plan.evaluations > 0 and middle.remat_plan.budget_source.startswith("device_memory")
    assert middle.memory_plan.planned_peak_bytes == _plan(memory_budget=between).memory_plan.planned_peak_bytes
    # smaller than the default schedule's peak: recomputation
    tight = _plan(device_memory=int(bounded * 0.95))
    assert tight.memory_plan.planned_peak_bytes <= bounded * 0.95 and tight.remat_plan.recomputed
    # too small for anything: an error that names the device
    with pytest.raises(MemoryBudgetError, match="does not fit what the device offers"):
        _plan(device_memory=bounded // 4)
    # the user's budget wins over the device's
    mine = _plan(memory_budget=fastest * 2, device_memory=between)
    assert mine.remat_plan.budget_bytes == fastest * 2 and mine.remat_plan.budget_source == "memory_budget"


def test_device_memory_must_be_a_positive_number_of_bytes():
    with pytest.raises(ConfigError, match="device_memory"):
        _plan(device_memory=-5)


def test_one_rank_recomputes_to_fit_its_device_bit_for_bit_as_eager(monkeypatch):
    model, _, loss_fn = build("gpt")
    data = batches("gpt", 3, PER_RANK)
    peak = zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3,
                       example_inputs=data[0], loss_fn=loss_fn).memory_plan.planned_peak_bytes
    monkeypatch.setenv(budget_module.ENVIRONMENT, str(int(peak * 0.95)))
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn)
    reference, _, _ = build("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in data:
        assert torch.equal(step(*batch), eager_step(reference, optimizer, loss_fn, batch))
    assert step.remat_plan.recomputed and step.remat_plan.budget_source == "$ZEROCC_DEVICE_MEMORY"
    assert step.report()["measured_peak_bytes"] <= peak * 0.95
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def _train_on_rank(rank, world_size, device_memory):
    """Three steps of the tiny GPT on this rank's slice, with the device offering ``device_memory`` (None: CPU's
    unknown): losses, full state, the steady step's all_gathers, the remat plan."""
    if device_memory is None:
        os.environ.pop(budget_module.ENVIRONMENT, None)
    else:
        os.environ[budget_module.ENVIRONMENT] = str(device_memory)
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=3, loss_fn=loss_fn,
                          bucket_bytes=BUCKET_BYTES, prefetch_bytes=0)
    losses = []
    for batch in batches("gpt", 3, world_size * PER_RANK):
        with CountCollectives() as counted:
            losses.append(step(*(t[rank * PER_RANK:(rank + 1) * PER_RANK] for t in batch)))
    return {"losses": losses, "state": step.full_state_dict(), "all_gathers": counted.calls.get("all_gather", 0),
            "remat": step.remat_plan, "peak": step.report()["planned_peak_bytes"],
            "measured": step.report()["measured_peak_bytes"]}


def _devices(rank, world_size, devices):
    results = {name: _train_on_rank(rank, world_size, device) for name, device in devices.items()}
    # a device known on rank 0 only ($ZEROCC_DEVICE_MEMORY set on one node): every rank plans against it
    results["rank 0 only"] = _train_on_rank(rank, world_size, 10**12 if rank == 0 else None)
    return results


@pytest.mark.multirank
def test_two_ranks_spend_the_device_on_speed_and_train_as_eager_on_the_global_batch():
    bounded, fastest = _peaks()
    devices = {"cpu": None, "roomy": 10**12, "between": (bounded + fastest) // 2}
    results = distributed.run(_devices, 2, devices)
    model, _, loss_fn = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = [eager_step(model, optimizer, loss_fn, batch) for batch in batches("gpt", 3, 2 * PER_RANK)]
    for per_rank in results:
        cpu, roomy, between, one = per_rank["cpu"], per_rank["roomy"], per_rank["between"], per_rank["rank 0 only"]
        assert one["remat"].unbounded_schedule and one["all_gathers"] == roomy["all_gathers"]
        # CPU: the default plan's peak is the budget, every rank deciding alike
        assert "the default plan's peak" in cpu["remat"].budget_source
        assert cpu["peak"] <= cpu["remat"].budget_bytes == cpu["remat"].peak_before_bytes
        assert roomy["remat"].unbounded_schedule and roomy["all_gathers"] <= cpu["all_gathers"]
        assert roomy["peak"] <= 10**12 and between["peak"] <= devices["between"]
        assert between["measured"] <= devices["between"]
        for result in (cpu, roomy, between, one):   # the same numbers whatever the plan
            for got, want in zip(result["losses"], cpu["losses"]):
                assert torch.equal(got, want)
            for key, value in cpu["state"].items():
                assert torch.equal(result["state"][key], value), key
        for key, value in model.state_dict().items():
            torch.testing.assert_close(cpu["state"][key], value, rtol=1e-4, atol=1e-5)
    # each rank's loss is its slice's mean; equal slices average to the global batch's
    averaged = torch.stack([torch.stack(r["cpu"]["losses"]) for r in results]).mean(0)
    torch.testing.assert_close(averaged, torch.stack(expected), rtol=1e-5, atol=1e-6)
