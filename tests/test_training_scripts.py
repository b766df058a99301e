"""Well-known training scripts ported as their users port them (nanoGPT's ``train.py``, minGPT's ``Trainer``, a
hand-written Hugging Face loop): the pieces of them that zerocc first met wrongly, each against eager or DDP."""
from __future__ import annotations

import copy

import pytest
import torch

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
