"""The cost model (zerocc/analysis/step_time.py) and hardware profiles (zerocc/hardware.py).

What a prediction is worth is measured against real steps by
``benchmarks/predict.py``, not here (timings are a benchmark's business);
these tests pin the model's arithmetic and the profiles' handling.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import pytest
import torch

import zerocc
from tests import distributed
from tests.helpers import compiled
from tests.models import batches, build
from zerocc import graph as g
from zerocc import hardware
from zerocc.analysis.step_time import HardwareProfile, moved_bytes, op_seconds, predict
from zerocc.errors import ConfigError

PROFILE = HardwareProfile(name="test", matmul_flops_per_s=1e10, memory_bytes_per_s=1e9, op_overhead_s=1e-5,
                          link_latency_s=1e-4, link_bytes_per_s=1e8, overlap=1.0)


def _stage3_two_ranks():
    gm, ctx, _ = compiled(3)
    return gm, ctx


def test_compute_is_the_sum_of_the_ops_and_communication_of_the_collectives():
    gm, ctx = _stage3_two_ranks()
    predicted = predict(gm, 2, PROFILE)
    collectives = [n for n in gm.graph.nodes if g.is_collective(n)]
    assert collectives
    expected_link = sum(PROFILE.link_latency_s + moved_bytes(n, 2) / PROFILE.link_bytes_per_s for n in collectives)
    assert math.isclose(predicted.communication_seconds, expected_link)
    assert math.isclose(predicted.moved_bytes, sum(moved_bytes(n, 2) for n in collectives))
    assert math.isclose(sum(predicted.by_phase.values()), predicted.compute_seconds)
    assert {"forward", "backward", "optimizer"} <= set(predicted.by_phase)
    # a ring all-gather: each rank receives the other ranks' halves
    gather = next(n for n in collectives if g.is_all_gather(n))
    assert moved_bytes(gather, 2) == g.nbytes(gather) / 2 and moved_bytes(gather, 4) == g.nbytes(gather) * 3 / 4
    assert max(predicted.compute_seconds, predicted.communication_seconds) <= predicted.seconds
    assert predicted.seconds <= predicted.compute_seconds + predicted.communication_seconds + 1e-12
    assert "predicted step" in str(predicted) and predicted.to_dict()["profile"] == "test"


def test_a_free_link_leaves_compute_and_a_blocking_one_adds_all_of_it():
    gm, _ = _stage3_two_ranks()
    free = predict(gm, 2, dataclasses.replace(PROFILE, link_latency_s=0.0, link_bytes_per_s=math.inf))
    assert math.isclose(free.seconds, free.compute_seconds) and free.exposed_seconds == 0
    blocking = predict(gm, 2, dataclasses.replace(PROFILE, overlap=0.0))
    assert math.isclose(blocking.seconds, blocking.compute_seconds + blocking.communication_seconds)
    assert math.isclose(blocking.exposed_seconds, blocking.communication_seconds)
    half = predict(gm, 2, dataclasses.replace(PROFILE, overlap=0.5))
    overlapped = predict(gm, 2, PROFILE)
    assert overlapped.seconds <= half.seconds <= blocking.seconds
    assert overlapped.exposed_seconds <= half.exposed_seconds <= blocking.exposed_seconds


def test_matmuls_are_priced_by_flops_and_the_rest_by_bytes():
    gm, _ = _stage3_two_ranks()
    matmul = next(n for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target))
    slow = dataclasses.replace(PROFILE, matmul_flops_per_s=1.0, op_overhead_s=0.0)
    flops = 2 * math.prod(g.tensor_meta(matmul).shape) * g.tensor_meta(matmul.args[0]).shape[-1]
    assert op_seconds(matmul, slow) == pytest.approx(flops)
    add = next(n for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("aten.add"))
    bandwidth = dataclasses.replace(PROFILE, memory_bytes_per_s=1.0, op_overhead_s=0.0)
    read = sum(g.nbytes(a) for a in add.all_input_nodes if a is not add.kwargs.get("out"))
    assert op_seconds(add, bandwidth) == pytest.approx(read + g.nbytes(add))


def test_named_profiles_predict_a_plan_and_unknown_names_are_refused():
    model, _, loss_fn = build("gpt")
    plan = zerocc.plan(model, torch.optim.AdamW(model.parameters()), stage=3, world_size=8,
                       example_inputs=batches("gpt", 1, 4)[0], loss_fn=loss_fn)
    fast, slow = plan.predicted_step_time("h100-sxm-bf16"), plan.predicted_step_time("a100-sxm-bf16")
    assert 0 < fast.seconds < slow.seconds and fast.communication_seconds > 0
    with pytest.raises(ConfigError, match="h100-sxm-bf16"):
        plan.predicted_step_time("tpu")


def test_a_budgeted_plan_chooses_on_the_hardware_named_and_lists_every_candidate():
    model, _, loss_fn = build("gpt")
    example = batches("gpt", 1, 4)[0]

    def plan(**options):
        return zerocc.plan(model, torch.optim.AdamW(model.parameters()), stage=3, world_size=2,
                           example_inputs=example, loss_fn=loss_fn, memory_pools=False, **options)
    peak = plan().memory_plan.live_peak_bytes
    remat = plan(memory_budget=peak, hardware="a100-sxm-bf16").remat_plan
    assert remat.hardware.startswith("a100-sxm-bf16") and remat.considered
    fitting = [c for c in remat.considered if c.fits]
    assert remat.predicted_seconds == pytest.approx(min(c.predicted_seconds for c in fitting), rel=0.02)
    assert all(c.peak_bytes <= peak for c in fitting) and remat.peak_bytes <= peak
    table = remat.candidates_table()   # printed with the plan: one row per candidate, the chosen one starred
    assert table in str(remat) and table.count("\n") == len(remat.considered)
    assert sum(line.startswith("*") for line in table.splitlines()) == 1
    assert plan(memory_budget=peak).remat_plan.hardware.startswith("h100-sxm-bf16")   # the default
    with pytest.raises(ConfigError, match="a100-sxm-bf16"):
        plan(memory_budget=peak, hardware="tpu")


def test_measured_profile_is_kept_per_machine_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROCC_CACHE_DIR", str(tmp_path))
    torch.manual_seed(7)
    rng = torch.get_rng_state()
    measured = zerocc.measure_hardware(device="cpu")
    # a compile measures when a budget's plans are compared, mid-trace: the user's dropout draws must not move
    assert torch.equal(torch.get_rng_state(), rng)
    assert measured.matmul_flops_per_s > 0 and measured.memory_bytes_per_s > 0 and measured.op_overhead_s > 0
    assert measured.overlap == 1.0 and "1 rank" in measured.name   # nothing to overlap with
    (kept,) = (tmp_path / "hardware").iterdir()
    monkeypatch.setattr(hardware, "_measure", lambda *args: pytest.fail("measured again instead of reading"))
    assert zerocc.measure_hardware(device="cpu") == measured
    monkeypatch.undo()
    monkeypatch.setenv("ZEROCC_CACHE_DIR", str(tmp_path))
    kept.write_text("not json")   # an unreadable profile is measured again
    assert zerocc.measure_hardware(device="cpu").name == measured.name
    # a compiled step predicts its last program
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3, loss_fn=loss_fn)
    step(*batches("gpt", 1, 4)[0])
    assert step.predicted_step_time(measured).seconds > 0


def _measure_on_rank(rank, world_size, folder):
    # rank 0 has a profile kept from an earlier run, rank 1 none: both measure, since the link is measured together
    os.environ["ZEROCC_CACHE_DIR"] = os.path.join(folder, f"rank{rank}")
    if rank == 0:
        path = hardware._cached_path(torch.device("cpu"), torch.float32, world_size)
        os.makedirs(os.path.dirname(path))
        with open(path, "w") as handle:
            json.dump(dataclasses.replace(PROFILE, name="kept").to_dict(), handle)
    with warnings.catch_warnings(record=True) as caught:   # torch's deprecation of the collective it called
        warnings.simplefilter("always")
        first = zerocc.measure_hardware(device="cpu")
    again = zerocc.measure_hardware(device="cpu")
    return first, again, [str(w.message) for w in caught]


@pytest.mark.multirank
def test_two_ranks_measure_their_link_together(tmp_path):
    results = distributed.run(_measure_on_rank, 2, str(tmp_path))
    assert results[0][0] == results[1][0]   # one profile for every rank: rank 0's
    for first, again, caught in results:
        assert caught == []
        assert first == again and first.name != "kept"   # measured together, then read back on both
        assert 0 < first.link_latency_s and 0 < first.link_bytes_per_s < math.inf and "over gloo" in first.name
        assert 0 <= first.overlap <= 1
