"""After compile the user's model and optimizer tell the truth: current values, ``step.full_model()``, or clear errors."""
from __future__ import annotations

import contextlib

import pytest
import torch

import zerocc
from tests.models import batches, build, eager_step
from tests.reference import adamw

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("stage", [0, 3])
def test_model_and_optimizer_views_stay_current(stage):
    model, _, loss_fn = build("cnn")
    optimizer = adamw(model)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    reference, _, _ = build("cnn")
    reference_optimizer = adamw(reference)
    data = batches("cnn", 4, 8)
    for batch in data[:3]:
        step(*batch)
        eager_step(reference, reference_optimizer, loss_fn, batch)

    assert int(model.bn1.num_batches_tracked) == 3   # module buffers are the step's
    state = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key
    got, expected = optimizer.state_dict(), reference_optimizer.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        assert all(torch.equal(got["state"][index][key], value) for key, value in entries.items()), index

    if stage == 3:
        with pytest.raises(zerocc.ConfigError, match=r"sharded across the compiled step .* step.full_model\(\)"):
            model(data[0][0])
    with step.full_model():   # the whole model in place; an edit there trains on
        model.eval()
        reference.eval()
        assert torch.equal(model(data[0][0]), reference(data[0][0]))
        model.train()
        reference.train()
        with torch.no_grad():
            model.fc.weight.mul_(0.5)
            reference.fc.weight.mul_(0.5)
    with step.full_model(writeback=False):
        with torch.no_grad():
            model.fc.weight.zero_()   # dropped
    assert torch.equal(step(*data[3]), eager_step(reference, reference_optimizer, loss_fn, data[3]))

    with pytest.raises(zerocc.ConfigError, match=r"optimizer.load_state_dict\(\) after compile.*zerocc.load_checkpoint"):
        optimizer.load_state_dict(expected)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_second_compile_on_the_same_model_is_refused(stage):
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    step(*batches("mlp", 1, 8)[0])
    with pytest.raises(zerocc.ConfigError, match=r"this model is already trained by a compiled step .*"
                                                 r"zerocc.save_checkpoint\(first_step, path\)"):
        zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn)
    other, _, _ = build("mlp")
    with pytest.raises(zerocc.ConfigError, match="this optimizer is already trained by a compiled step"):
        zerocc.compile(other, optimizer, stage=stage, loss_fn=loss_fn)


@pytest.mark.parametrize("stage", [2, 3])
def test_an_average_of_the_weights_kept_beside_training_equals_eager(stage):
    """An EMA updated after each step (docs/guide/checkpoints.md): from model.parameters() at stages 0-2, inside
    full_model(writeback=False) at stage 3, where the module holds empty placeholders."""
    def averaged(compiled):
        model, _, loss_fn = build("gpt")
        optimizer = adamw(model)
        step = zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn) if compiled else None
        average = [p.detach().clone() for p in model.parameters()]
        for batch in batches("gpt", 3, 4):
            if compiled:
                step(*batch)
            else:
                eager_step(model, optimizer, loss_fn, batch)
            with step.full_model(writeback=False) if compiled and stage == 3 else contextlib.nullcontext(), \
                    torch.no_grad():
                for kept, param in zip(average, model.parameters()):
                    kept.mul_(0.9).add_(param, alpha=0.1)
        return average
    for got, expected in zip(averaged(True), averaged(False)):
        assert torch.equal(got, expected)
