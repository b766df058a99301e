"""Stage 3's released placeholders outside ``step.full_model()``: a read of their values is refused, naming the
user's line and ``full_model``; shape queries report the whole parameter's; inside the block the same code is eager's."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocc
from tests.models import eager_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def test_reading_placeholders_outside_full_model_is_refused_and_inside_is_eagers():
    """``[p.clone() for p in model.parameters()]`` after compile copied empty placeholders and ``lerp_`` between
    them ran: an EMA silently empty; ``p.norm()`` was 0, ``p.data.mean()`` NaN, ``sum(p.numel())`` 0."""
    from torch.optim.swa_utils import AveragedModel
    model, reference = _mlp(), _mlp()
    averaged, reference_averaged = AveragedModel(model), AveragedModel(reference)
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(3)]
    assert torch.equal(step(*data[0]), eager_step(reference, reference_optimizer, F.cross_entropy, data[0]))
    weight = model[0].weight
    assert weight.shape == (16, 6) and weight.numel() == 96 and weight.size(1) == 6 and weight.dim() == 2
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert weight.requires_grad and weight.dtype == torch.float32
    refused = r"of parameter '0.weight' at .*test_placeholders.py:\d+: .*with step.full_model\(writeback=False\)"
    for read in (lambda: [p.clone() for p in model.parameters()], lambda: weight.norm(), lambda: weight.data.mean(),
                 lambda: weight.detach().clone(), lambda: torch._foreach_lerp_([torch.zeros(16, 6)], [weight], 0.1),
                 lambda: torch.nn.utils.parameters_to_vector(model.parameters()), lambda: averaged.update_parameters(model)):
        with pytest.raises(zerocc.ConfigError, match=refused):
            read()
    with step.full_model(writeback=False):
        ema = [p.clone() for p in model.parameters()]
        norm = weight.norm()
        averaged.update_parameters(model)
    reference_averaged.update_parameters(reference)
    assert all(map(torch.equal, ema, reference.parameters()))
    assert torch.equal(norm, reference[0].weight.norm())
    for x, y in data[1:]:
        assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, F.cross_entropy, (x, y)))
        with step.full_model(writeback=False):
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.01)
            averaged.update_parameters(model)
        reference_averaged.update_parameters(reference)
    for key, value in reference_averaged.state_dict().items():
        assert torch.equal(averaged.state_dict()[key], value), key
    step.close()
    assert torch.equal(model[0].weight.norm(), reference[0].weight.norm())   # handed back: a plain Parameter


def test_a_submodules_state_dict_is_refused_and_the_models_is_whole_and_conversions_are_refused_at_the_next_call():
    """``model[0].state_dict()`` runs none of the model's state-dict hooks: it gave ``(0,)`` tensors, silently, where
    eager gives the layer's weights (a look at the calling frames let any ``_save_to_state_dict``'s ``detach``
    through). Refused now, naming the line; ``model.state_dict()`` is whole, and a ``p.detach()`` after it is refused
    again (the model's hooks mark its own run only). A submodule's ``.half()`` goes through, and the next call refuses
    the new tensor, naming the parameter."""
    model, reference = _mlp(), _mlp()
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, F.cross_entropy, (x, y)))
    with pytest.raises(zerocc.ConfigError, match=r"detach of parameter '0.weight' at .*test_placeholders.py:\d+: .*full_model"):
        model[0].state_dict()
    whole = model.state_dict()
    assert all(torch.equal(whole[key], value) for key, value in reference.state_dict().items())
    with pytest.raises(zerocc.ConfigError, match=r"detach of parameter '0.weight'"):
        model[0].weight.detach()
    with step.full_model(writeback=False):
        assert all(torch.equal(value, reference[0].state_dict()[key]) for key, value in model[0].state_dict().items())
    model[2].half()
    with pytest.raises(zerocc.ConfigError, match=r"\.data of parameter\(s\) '2.weight', '2.bias' was set"):
        step(x, y)
    assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, F.cross_entropy, (x, y)))
