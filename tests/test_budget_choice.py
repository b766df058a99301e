"""The plan place_remat chooses under a memory budget, pinned (issue 19: a faster budget search must choose the same).

Recorded from main at f789bad with the tiny GPT on 2 simulated ranks (16 kB buckets), at
fractions of the peak without a budget (the pooled layout's with memory pools, else the live one). The choice is
the schedule (every forward gather kept or not, extra bytes kept) and the recomputed nodes (their count and a hash
of their names, in order). A change to the search that measures fewer plans, or each more cheaply, keeps these;
one that changes the cost model or the passes after ``shard`` may change them, and says so in its commit.
The 5M GPT and the CNN (stages 1 and 3, pools on and off, 0.8-1.2x) were checked the same way by a script
(benchmarks/results/compile_time_budget_cpu_2026-12-07.md, the 2026-12-07 afternoon section); they are too slow for the suite.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

import zerocc
from tests.models import batches, build

EXPECTED = {
    # (stage, memory_pools, fraction): (unbounded_schedule, keep_extra_bytes, recomputed nodes, sha1 of names)
    (1, True, 0.9): (False, 0, 72, "fc42e5c13d"),
    (3, False, 0.8): (False, 0, 77, "217e9e3941"),
    (3, False, 0.9): (False, 0, 57, "9064803a23"),
    (3, False, 1.0): (True, 0, 72, "fc42e5c13d"),
    (3, True, 0.9): (False, 0, 57, "9064803a23"),
    (3, True, 1.0): (True, 0, 72, "fc42e5c13d"),
}


def _plan(stage, pools, budget, disable=()):
    model, _, _ = build("gpt")
    data = batches("gpt", 1, 8)[0]
    return zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, world_size=2,
                       example_inputs=tuple(t.chunk(2)[0] for t in data), bucket_bytes=16 * 1024,
                       prefetch_bytes=16 * 1024, memory_pools=pools, memory_budget=budget, disable=disable)


def _choice(planned):
    remat = planned.remat_plan
    names = ",".join(r.name for r in remat.recomputed)
    return (remat.unbounded_schedule, remat.keep_extra_bytes, len(remat.recomputed),
            hashlib.sha1(names.encode()).hexdigest()[:10])


@pytest.mark.parametrize("stage,pools", sorted({(stage, pools) for stage, pools, _ in EXPECTED}))
def test_the_budget_search_chooses_the_plan_it_chose_on_main(stage, pools):
    # the peak the fractions are of: the default plan's, as on main (without a budget zerocc.plan now searches
    # under it, device_budget.DEFAULT_PLAN_PEAK)
    free = _plan(stage, pools, None, disable=["place_remat"]).memory_plan
    peak = free.planned_peak_bytes if pools else free.live_peak_bytes
    for (s, p, fraction), expected in EXPECTED.items():
        if (s, p) == (stage, pools):
            planned = _plan(stage, pools, int(peak * fraction))
            assert _choice(planned) == expected, (fraction, planned.remat_plan.summary())
            assert planned.remat_plan.peak_bytes <= int(peak * fraction)
