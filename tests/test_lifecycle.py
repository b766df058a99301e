"""A whole training loop's life, from fresh processes, every loss against an uninterrupted eager run.

Two ranks train at stage 3 with an LR scheduler, evaluate between steps,
meet a failing batch mid-loop and go on, save, and end (the process group
is torn down: state passes on only through files). A fresh 2-rank run
resumes at the same world size; another resumes on one rank at stage 2 and
saves; the checkpoint is exported to safetensors, loaded into a plain module
and trained eagerly on. The GPT ties its input and output embeddings.
"""
from __future__ import annotations

import os

import pytest
import torch

import zerocc
from zerocc import state_dict
from tests import distributed
from tests.models import batches, build, eager_step

STEPS, SAVE_AT, GLOBAL_BATCH = 5, 3, 8
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
# parameters after several Adam steps: its normalized update turns last-bit gradient differences (2 ranks'
# sums against one) into parameter differences of a few lr * 1e-4
PARAMETER_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}

pytestmark = [pytest.mark.multirank, pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]


def make(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)


def data():
    return batches("gpt", STEPS, GLOBAL_BATCH), batches("gpt", 1, 4, seed=9)[0]


def eager_reference():
    """Single-process eager training on the global batches: losses and eval outputs after each step."""
    model, _, loss_fn = build("gpt")
    optimizer, scheduler = make(model)
    train, evaluation = data()
    losses, outputs = [], []
    for batch in train:
        losses.append(eager_step(model, optimizer, loss_fn, batch))
        scheduler.step()
        model.eval()
        with torch.no_grad():
            outputs.append(model(*evaluation))
        model.train()
    return losses, outputs, model


def _loop(step, scheduler, rank, world_size, start, stop, folder=None):
    train, evaluation = data()
    per_rank = GLOBAL_BATCH // world_size
    losses, outputs = [], []
    for index in range(start, stop):
        batch = tuple(t[rank * per_rank:(rank + 1) * per_rank] for t in train[index])
        if index == 1:   # a failing batch mid-loop: it raises, nothing changes, the loop goes on
            with pytest.raises(IndexError, match="index out of range"):
                step(batch[0] + 1000, batch[1])   # token ids past the vocabulary
        losses.append(step(*batch))
        scheduler.step()
        outputs.append(step.eval_forward(*evaluation))
        if folder is not None and index + 1 == SAVE_AT:
            zerocc.save_checkpoint(step, os.path.join(folder, "ckpt"))
            if rank == 0:
                torch.save(scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
    return losses, outputs


def _first_run(rank, world_size, folder):
    model, _, loss_fn = build("gpt")
    optimizer, scheduler = make(model)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn)
    return _loop(step, scheduler, rank, world_size, 0, STEPS, folder)


def _resume(rank, world_size, stage, folder):
    model, _, loss_fn = build("gpt", seed=5)    # other weights: everything comes from the files
    optimizer, scheduler = make(model)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    zerocc.load_checkpoint(step, os.path.join(folder, "ckpt"))
    scheduler.load_state_dict(torch.load(os.path.join(folder, "scheduler.pt")))
    result = _loop(step, scheduler, rank, world_size, SAVE_AT, STEPS)
    zerocc.save_checkpoint(step, os.path.join(folder, f"final-{world_size}"))
    return result


def global_losses(per_rank):
    return [torch.stack(losses).mean() for losses in zip(*[losses for losses, _ in per_rank])]


@pytest.mark.slow   # about 3 minutes on the shared 2-core machine: four process-group runs and an export
def test_lifecycle(tmp_path):
    folder = str(tmp_path)
    losses, outputs, reference = eager_reference()
    first = distributed.run(_first_run, 2, folder)
    torch.testing.assert_close(global_losses(first), losses, **TOLERANCE)
    for _, evaluated in first:
        torch.testing.assert_close(evaluated, outputs, **TOLERANCE)

    same = distributed.run(_resume, 2, 3, folder)   # fresh processes, same world size and stage: bit for bit
    for (resumed, evaluated), (uninterrupted, evaluated_before) in zip(same, first):
        assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[SAVE_AT:]))
        assert all(torch.equal(a, b) for a, b in zip(evaluated, evaluated_before[SAVE_AT:]))

    one = distributed.run(_resume, 1, 2, folder)    # resharded to one rank at stage 2
    torch.testing.assert_close(global_losses(one), losses[SAVE_AT:], **TOLERANCE)
    torch.testing.assert_close(one[0][1], outputs[SAVE_AT:], **TOLERANCE)

    # export, load into a plain module, train on eagerly beside the reference (both with a fresh optimizer)
    zerocc.export_full_state_dict(os.path.join(folder, "final-1"), os.path.join(folder, "model.safetensors"))
    plain, _, loss_fn = build("gpt", seed=8)
    plain.load_state_dict(state_dict.read_safetensors(os.path.join(folder, "model.safetensors")))
    torch.testing.assert_close(plain.state_dict(), reference.state_dict(), **PARAMETER_TOLERANCE)
    plain_optimizer, _ = make(plain)
    reference_optimizer, _ = make(reference)
    for batch in batches("gpt", 2, GLOBAL_BATCH, seed=3):
        torch.testing.assert_close(eager_step(plain, plain_optimizer, loss_fn, batch),
                                   eager_step(reference, reference_optimizer, loss_fn, batch), **PARAMETER_TOLERANCE)
