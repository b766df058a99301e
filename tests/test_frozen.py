"""Frozen parameters (``requires_grad=False``) at stages 1-3 over 2 ranks, against DDP.

What the issue asks of them: no gradient, no optimizer state, never reduced.
Checked on the compiled program itself (no gradient or update of a frozen
parameter in it, no bucket or state slot for one, reductions moving exactly
the trained buckets' bytes), and the training against DDP on the same model.
Frozen parameters are kept whole on every rank (not sharded, even at stage 3).
"""
from __future__ import annotations

import pytest
import torch

import zerocc
from zerocc import graph as g
from tests import distributed
from tests.architectures import architecture_batches, build_architecture
from tests.models import eager_step
from tests.reference import two_groups
from zerocc.runtime.comm_counter import CountCollectives

FROZEN = ("frozen.weight", "frozen.bias")


def _frozen_against_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel
    data = [tuple(t.chunk(world_size)[rank] for t in batch)
            for batch in architecture_batches("frozen_custom", 3, 4 * world_size)]
    reference = build_architecture("frozen_custom")
    initial = {name: reference.state_dict()[name].clone() for name in FROZEN}
    ddp = DistributedDataParallel(reference)
    reference_optimizer = two_groups(reference)
    expected = [eager_step(ddp, reference_optimizer, None, batch) for batch in data]
    results = {}
    for stage in (1, 2, 3):
        model = build_architecture("frozen_custom")
        step = zerocc.compile(model, two_groups(model), stage=stage)
        losses = [step(*batch) for batch in data[:-1]]
        with CountCollectives() as counter:
            losses.append(step(*data[-1]))
        captured, plan = step.state.captured, step.shard_plan
        gm = step.cache.last.program.gm
        results[stage] = {
            "losses": losses, "state": step.full_state_dict(),
            "frozen": sorted(info.name for info in captured.frozen),
            "bucketed": sorted(captured.params[s.param].name for b in plan.buckets for s in b.segments),
            "state_owners": sorted({captured.params[piece.param].name for _, _, piece in plan.owned_pieces()}),
            "written_slots": [s for s in step.cache.last.program.output_slots if s.startswith("frozen:")],
            "frozen_readers": sorted(user.meta.get(g.PHASE) for node in g.placeholders(gm, g.ROLE_FROZEN)
                                     for user in node.users),
            "reduced_bytes": counter.bytes.get("reduce_scatter", 0),
            "bucket_bytes": sum(b.nbytes for b in plan.buckets),
        }
    return expected, {k: v.clone() for k, v in reference.state_dict().items()}, initial, results


@pytest.mark.multirank
def test_frozen_parameters_get_no_gradient_no_state_no_reduction_and_train_as_ddp():
    for rank, (expected, expected_state, initial, results) in enumerate(distributed.run(_frozen_against_ddp, 2)):
        for stage, got in results.items():
            assert got["frozen"] == sorted(FROZEN), stage
            assert not set(FROZEN) & set(got["bucketed"]), stage          # in no bucket: nothing to reduce or shard
            assert not set(FROZEN) & set(got["state_owners"]), stage      # no optimizer state
            assert got["written_slots"] == [], stage                      # never updated by the program
            assert set(got["frozen_readers"]) == {g.FORWARD}, stage       # read by forward only: no gradient
            assert got["reduced_bytes"] == got["bucket_bytes"], stage    # the reductions move trained buckets only
            for name in FROZEN:
                assert torch.equal(got["state"][name], initial[name]), (stage, name)
            torch.testing.assert_close(torch.stack(got["losses"]), torch.stack(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"stage {stage} rank {rank} losses: {m}")
            for key, value in expected_state.items():
                torch.testing.assert_close(got["state"][key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"stage {stage} rank {rank} {key}: {m}")
