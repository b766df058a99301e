"""Communication volume: what the report says, what the step issues, and what the ZeRO paper predicts."""
from __future__ import annotations

import pytest
import torch

import zerocc
from zerocc.runtime.comm_counter import CountCollectives
from tests import distributed
from tests.models import batches, build

def _measure(rank, world_size, stage, bucket_bytes=16 * 1024, disable=()):
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage, loss_fn=loss_fn,
                          bucket_bytes=bucket_bytes, disable=disable)
    data = batches("gpt", 3, 2, seed=rank)
    step(*data[0])
    step(*data[1])            # steady state: the optimizer state exists
    with CountCollectives() as counter:
        step(*data[2])
    return step.report(), dict(counter.calls), dict(counter.bytes)


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_reported_volume_is_what_is_issued_and_what_the_paper_says(stage):
    for report, calls, volume in distributed.run(_measure, 2, stage):
        assert report["buckets"] > 1
        assert calls == report["collectives_per_step"]
        assert volume == {k: v for k, v in report["comm_bytes_per_step"].items() if v}
        padded_param_bytes = report["param_bytes"] + report["padding_elements"] * 4
        comm = report["comm_bytes_per_step"]
        if stage == 0:
            assert comm["all_reduce"] == 2 * report["param_bytes"] + 2 * report["padding_elements"] * 4
            assert comm["all_gather"] == comm["reduce_scatter"] == 0
        elif stage in (1, 2):
            assert comm["all_gather"] == comm["reduce_scatter"] == padded_param_bytes
            assert comm["all_reduce"] == 0
        else:
            # gathered for forward, and again for backward unless backward never reads the
            # bucket (an embedding table's backward needs only the indices) or reads forward's
            # copy (kept by the schedule pass): <= 3x in all
            assert comm["reduce_scatter"] == padded_param_bytes
            assert padded_param_bytes <= comm["all_gather"] <= 2 * padded_param_bytes
            assert comm["all_reduce"] == 0
        # padding is small: parameters are aligned to 64 bytes and buckets to the world size
        assert report["padding_elements"] * 4 < 0.02 * report["param_bytes"]


def _measure_one_bucket_scheduled_and_not(rank, world_size):
    return _measure(rank, world_size, 3, 1 << 30), _measure(rank, world_size, 3, 1 << 30, ("schedule",))


@pytest.mark.multirank
def test_stage_3_is_three_times_the_parameters_when_backward_gathers_every_bucket_again():
    for scheduled, unscheduled in distributed.run(_measure_one_bucket_scheduled_and_not, 2):   # one bucket
        report, calls, volume = unscheduled
        padded_param_bytes = report["param_bytes"] + report["padding_elements"] * 4
        assert calls == {"all_gather": 2, "reduce_scatter": 1}
        assert sum(volume.values()) == 3 * padded_param_bytes
        # scheduled, backward's gather would be prefetched while forward's copy is still alive
        # (the one bucket holds every parameter): backward reads forward's copy, 2x in all
        report, calls, volume = scheduled
        assert calls == report["collectives_per_step"] == {"all_gather": 1, "reduce_scatter": 1}
        assert sum(volume.values()) == 2 * padded_param_bytes


def test_world_size_1_issues_no_collectives():
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3, loss_fn=loss_fn)
    data = batches("gpt", 2, 2)
    step(*data[0])
    with CountCollectives() as counter:
        step(*data[1])
    assert not counter.calls
    assert step.report()["comm_bytes_per_step"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0, "broadcast": 0}
