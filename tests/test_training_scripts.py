"""Well-known training scripts ported as their users port them (nanoGPT's ``train.py``, minGPT's ``Trainer``, a
hand-written Hugging Face loop, DINO's ``main_dino.py``): the pieces of them that zerocc first met wrongly, each against
eager or DDP."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step
from tests.reference import adamw


def _eager_eval(model, x):
    model.eval()
    with torch.no_grad():
        output = model(x)
    model.train()
    return output


@pytest.mark.parametrize("stage", [0, 3])
def test_eval_forward_before_the_first_step_is_the_models_own_eval(stage):
    """nanoGPT's ``estimate_loss()`` runs at iteration 0, before any training step: ``step.eval_forward`` raised a
    ConfigError there (no buckets yet). The module still holds its whole parameters then, so it is eager's
    evaluation, bit for bit (BatchNorm's running statistics in eval mode), training modes are left as they were,
    and training after it, with evaluations between steps, goes on as eager's."""
    model, _, loss_fn = build("cnn")
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    data = batches("cnn", 3, 4)
    assert torch.equal(step.eval_forward(data[0][0]), _eager_eval(reference, data[0][0]))
    assert all(module.training for module in model.modules())
    for x, y in data:
        assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, loss_fn, (x, y)))
        assert torch.equal(step.eval_forward(x), _eager_eval(reference, x))
    for name, value in step.full_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name


def _nanogpt_checkpoint_on_rank_0(rank, world_size, stage):
    """nanoGPT's save: ``{'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), ...}`` on the
    master process only."""
    model, _, loss_fn = build("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    step(*(t[rank * 4:(rank + 1) * 4] for t in batches("gpt", 1, 8)[0]))
    if rank != 0:
        return None
    with pytest.raises(zerocc.ConfigError) as refused:
        checkpoint = {'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'iter_num': 1}  # noqa: F841
    return str(refused.value)


@pytest.mark.multirank
@pytest.mark.parametrize("stage, refused", [(1, "optimizer.state_dict()"), (3, "model.state_dict()")])
def test_a_checkpoint_dict_saved_by_rank_0_is_refused_naming_the_users_line(stage, refused):
    """The refusals said what to call instead but not where: a training script builds its checkpoint dict in one
    line among many, under ``if master_process:``. They name the user's line, and say to save on every rank."""
    message = distributed.run(_nanogpt_checkpoint_on_rank_0, 2, stage)[0]
    line = _nanogpt_checkpoint_on_rank_0.__code__.co_firstlineno + 10
    assert message.startswith(f"{refused} at {__file__}:{line}"), message
    assert "on every rank" in message and "zerocc.save_checkpoint" in message, message


class _CenteredLoss(torch.nn.Module):
    """DINO's loss in small: a center buffer that forward *reassigns* under no_grad (``self.center = ...``), which
    ``Module.__setattr__`` puts in ``_buffers``, rather than writing it in place as BatchNorm does."""

    def __init__(self, shape=(1, 4), new_shape=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("center", torch.zeros(shape))
        self.new_shape = new_shape

    def forward(self, x):
        out = self.lin(x)
        loss = torch.sum(-F.softmax(out - self.center, -1).detach() * F.log_softmax(out, -1), -1).mean()
        with torch.no_grad():
            batch_center = out.mean(0, keepdim=True)
            if torch.distributed.is_initialized():   # DINO all-reduces it; the traceable collective (an eager one is refused)
                total = funcol.all_reduce(out.sum(0, keepdim=True), "sum", torch.distributed.group.WORLD)
                batch_center = total / (len(out) * torch.distributed.get_world_size())
            center = self.center * 0.9 + batch_center * 0.1
            self.center = center if self.new_shape is None else center.expand(self.new_shape)
        return loss


@pytest.mark.parametrize("stage, accumulation", [(0, 1), (3, 1), (3, 2)])
def test_a_buffer_forward_reassigns_is_carried_to_the_next_step_as_in_eager(stage, accumulation):
    """DINO's ``update_center`` assigns the buffer a new tensor in forward: the step returned the buffer it was given,
    dropping the new value at every step (the center stayed zeros, the losses drifted from eager's silently). Each
    micro-batch reads the center the previous one set, as eager's accumulation loop does."""
    torch.manual_seed(0)
    model = _CenteredLoss()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    step = zerocc.compile(model, optimizer, stage=stage, grad_accumulation=accumulation)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 4, generator=generator)
        reference_optimizer.zero_grad()
        expected = 0
        for micro in x.chunk(accumulation):
            loss = reference(micro) / accumulation
            loss.backward()
            expected = expected + loss.detach()
        reference_optimizer.step()
        assert torch.equal(step(x), expected)
        assert torch.equal(model.center, reference.center)
    for name, value in step.full_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name


def _reassigned_center_on_ranks(rank, world_size):
    torch.manual_seed(0)
    model = _CenteredLoss()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), stage=3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x = torch.randn(4 * world_size, 4, generator=generator)
        losses.append(step(x[rank * 4:(rank + 1) * 4]))
    return losses, model.center.clone(), step.full_state_dict()


@pytest.mark.multirank
def test_a_reassigned_all_reduced_center_on_two_ranks_matches_eager_on_the_global_batch():
    """DINO's center over ranks: each rank's forward all-reduces its batch's sum and reassigns the buffer; the new
    value reaches the next step on every rank, as single-process eager training on the global batch has it."""
    torch.manual_seed(0)
    reference = _CenteredLoss()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    expected = [eager_step(reference, optimizer, None, (torch.randn(8, 4, generator=generator),)) for _ in range(3)]
    results = distributed.run(_reassigned_center_on_ranks, 2)
    mean_loss = sum(torch.stack(losses) for losses, _, _ in results) / 2   # each rank returns its own batch's loss
    torch.testing.assert_close(mean_loss, torch.stack(expected), rtol=1e-5, atol=1e-6)
    for _, center, state in results:
        torch.testing.assert_close(center, reference.center, rtol=1e-5, atol=1e-6)
        for name, value in state.items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_buffer_forward_reassigns_in_eval_forward_is_carried_to_training_as_in_eager(stage):
    """DINO evaluates with the same head: eager's ``model.eval(); model(x)`` reassigns the center there too, and the
    next training step reads it. ``eval_forward`` returned the output but dropped the new center (the program only
    copied back buffers written in place), so the next step trained on the old one."""
    torch.manual_seed(0)
    model = _CenteredLoss()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    step = zerocc.compile(model, optimizer, stage=stage)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(4, 4, generator=generator) for _ in range(4)]
    for x in data[:2]:
        assert torch.equal(step(x), eager_step(reference, reference_optimizer, None, (x,)))
    assert torch.equal(step.eval_forward(data[2]), _eager_eval(reference, data[2]))
    assert torch.equal(model.center, reference.center)
    assert torch.equal(step(data[3]), eager_step(reference, reference_optimizer, None, (data[3],)))
    for name, value in step.full_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
    with step.full_model():
        assert torch.equal(model.center, reference.center) and torch.equal(model.lin.weight, reference.lin.weight)


def _reassigned_center_evaluated_on_ranks(rank, world_size):
    torch.manual_seed(0)
    model = _CenteredLoss()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), stage=3)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(4 * world_size, 4, generator=generator)[rank * 4:(rank + 1) * 4] for _ in range(4)]
    losses = [step(x) for x in data[:2]]
    evaluated = step.eval_forward(data[2])
    losses.append(step(data[3]))
    return losses, evaluated, step.full_state_dict()


@pytest.mark.multirank
def test_a_reassigned_center_in_eval_forward_on_two_ranks_matches_eager_on_the_global_batch():
    """The center all-reduced and reassigned by ``eval_forward`` on every rank reaches the next training step, as
    eager's evaluation of the global batch between its training steps."""
    torch.manual_seed(0)
    reference = _CenteredLoss()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 4, generator=generator) for _ in range(4)]
    expected = [eager_step(reference, optimizer, None, (x,)) for x in data[:2]]
    evaluated = _eager_eval(reference, data[2])
    expected.append(eager_step(reference, optimizer, None, (data[3],)))
    results = distributed.run(_reassigned_center_evaluated_on_ranks, 2)
    mean = sum(torch.stack(losses) for losses, _, _ in results) / 2
    torch.testing.assert_close(mean, torch.stack(expected), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sum(value for _, value, _ in results) / 2, evaluated, rtol=1e-5, atol=1e-6)
    for _, _, state in results:
        for name, value in state.items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6)


class _CenterAttribute(torch.nn.Module):
    """The same center as a plain tensor attribute (no ``register_buffer``), reassigned in forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.center = torch.zeros(1, 4)

    def forward(self, x):
        out = self.lin(x)
        with torch.no_grad():
            self.center = self.center * 0.9 + out.mean(0, keepdim=True) * 0.1
        return ((out - self.center) ** 2).mean()


def test_a_tensor_attribute_read_and_reassigned_in_forward_is_refused_naming_it():
    """Eager's next call reads the new tensor; the step kept the one it was traced with as a constant and trained on
    it at every step, without a word (its second loss already differed from eager's). Refused, pointing to a buffer,
    which the step carries; the module keeps its attribute as it was."""
    model = _CenterAttribute()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), stage=0)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)'center' and assigns them a new tensor.*register_buffer\('center'"):
        step(torch.randn(2, 4))
    assert torch.equal(model.center, torch.zeros(1, 4))


def test_a_buffer_reassigned_another_shape_is_refused_naming_it():
    model = _CenteredLoss(new_shape=(2, 4))
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.5), stage=0)
    with pytest.raises(zerocc.ConfigError, match=r"buffer 'center' a new value of shape \(2, 4\)"):
        step(torch.randn(2, 4))


@pytest.mark.parametrize("stage", [0, 3])
def test_numpy_schedule_values_set_into_param_groups_train_as_eager(stage):
    """DINO's loop sets ``param_group["lr"] = lr_schedule[it]`` and ``weight_decay`` from NumPy arrays (np.float64):
    the step's look-up of its settings' signs raised numpy's "boolean subtract is not supported"."""
    model, _, loss_fn = build("cnn")
    reference = copy.deepcopy(model)
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    lr_schedule, wd_schedule = np.linspace(1e-2, 1e-3, 3), np.linspace(0.04, 0.4, 3)
    for it, (x, y) in enumerate(batches("cnn", 3, 4)):
        for opt in (optimizer, reference_optimizer):
            opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"] = lr_schedule[it], wd_schedule[it]
        assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, loss_fn, (x, y)))
    for name, value in step.full_state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), name
