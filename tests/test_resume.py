"""Resume from a fresh process the way users do: ``dcp.save(step.state_dict())``, then in a new process
``sd = step.state_dict(); dcp.load(sd, ...); step.load_state_dict(sd)`` before the first call.

Each phase is its own process-group run (``tests/distributed.py``): state passes only through files.
The resumed losses must equal the uninterrupted run's bit for bit (same world size and stage), or
within float tolerance when the checkpoint is resharded to another world size and stage.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zerocc
from tests import distributed
from tests.models import batches, build

K = 2   # steps before and after the save

OPTIONS = {
    "plain": {},
    "bf16": {"param_dtype": torch.bfloat16},
    "accumulate": {"grad_accumulation": 2},
    # the riskiest cell for the default suite: sharded bf16 compute copies and accumulated fp32 gradients
    "bf16+accumulate": {"param_dtype": torch.bfloat16, "grad_accumulation": 2},
}
MATRIX_OPTIONS = ["accumulate", "bf16", "plain"]

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def compiled(stage, seed, options):
    model, _, loss_fn = build("gpt", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, **OPTIONS[options])


def local_batches(rank, world_size, steps):
    """This rank's slice of the same global batches (8 samples) at any world size."""
    per_rank = 8 // world_size
    return [tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in batch) for batch in batches("gpt", steps, 8)]


def _train_save_train(rank, world_size, stage, options, folder):
    step = compiled(stage, 0, options)
    data = local_batches(rank, world_size, 2 * K)
    for batch in data[:K]:
        step(*batch)
    dcp.save(step.state_dict(), checkpoint_id=folder)
    return [step(*batch) for batch in data[K:]]


def _fresh_resume(rank, world_size, stage, options, folder):
    step = compiled(stage, 7, options)          # other weights: everything must come from the files
    state = step.state_dict()
    dcp.load(state, checkpoint_id=folder)
    step.load_state_dict(state)
    return [step(*batch) for batch in local_batches(rank, world_size, 2 * K)[K:]]


def check_resume(folder, world_size, stage, options, load_world_size=None, load_stage=None):
    expected = distributed.run(_train_save_train, world_size, stage, options, folder)
    if load_world_size is None:   # same layout: every rank's losses bit for bit
        got = distributed.run(_fresh_resume, world_size, stage, options, folder)
        for rank, (a, b) in enumerate(zip(got, expected)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, a, b)
        return
    got = distributed.run(_fresh_resume, load_world_size, load_stage, options, folder)
    global_loss = [torch.stack(losses).mean() for losses in zip(*expected)]   # equal slices: mean of the means
    for x, y in zip(got[0], global_loss):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


# the default suite's cell: world 2, stage 3, bf16 and accumulation together (the matrix below has each alone)
@pytest.mark.parametrize("world_size,stage,options", [(2, 3, "bf16+accumulate")])
def test_fresh_process_resume_is_exact(tmp_path, world_size, stage, options):
    check_resume(str(tmp_path / "ckpt"), world_size, stage, options)


def test_fresh_process_resume_resharded_to_one_rank_at_stage_2(tmp_path):
    check_resume(str(tmp_path / "ckpt"), 2, 3, "plain", load_world_size=1, load_stage=2)


@pytest.mark.slow
@pytest.mark.parametrize("options", MATRIX_OPTIONS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fresh_process_resume_matrix(tmp_path, world_size, stage, options):
    check_resume(str(tmp_path / "ckpt"), world_size, stage, options)


# -- the optimizer's param_groups (an LR scheduler's learning rate) -------------------
def _with_scheduler(stage, seed):
    model, _, loss_fn = build("mlp", seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    return step, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_with_an_lr_scheduler_is_exact(tmp_path, stage):
    data = batches("mlp", 2 * K + 1, 8)
    step, scheduler = _with_scheduler(stage, 0)
    for batch in data[:K]:
        step(*batch)
        scheduler.step()
    zerocc.save_checkpoint(step, tmp_path / "ckpt")
    saved_scheduler = scheduler.state_dict()   # the scheduler's own state, saved beside the step's (README)
    expected = []
    for batch in data[K:]:
        expected.append(step(*batch))
        scheduler.step()

    resumed, scheduler = _with_scheduler(stage, 5)
    zerocc.load_checkpoint(resumed, tmp_path / "ckpt")
    scheduler.load_state_dict(saved_scheduler)
    assert resumed.optimizer.param_groups[0]["lr"] == 1e-2 * 0.5 ** K
    for batch, loss in zip(data[K:], expected):
        assert torch.equal(resumed(*batch), loss)
        scheduler.step()
