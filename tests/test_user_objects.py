"""After compile the user's model and optimizer tell the truth: current values, ``step.full_model()``, or clear errors."""
from __future__ import annotations

import contextlib
import copy

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


class _GeneratorLoss(torch.nn.Module):
    """A GAN's generator step: the discriminator scores the generated samples."""

    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator

    def forward(self, noise):
        return torch.nn.functional.softplus(-self.discriminator(self.generator(noise))).mean()


class _DiscriminatorLoss(torch.nn.Module):
    """A GAN's discriminator step: real samples against the generator's, detached."""

    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator

    def forward(self, noise, real):
        with torch.no_grad():
            fake = self.generator(noise)
        softplus = torch.nn.functional.softplus
        return softplus(-self.discriminator(real)).mean() + softplus(self.discriminator(fake)).mean()


def _gan():
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    discriminator = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 1))
    return generator, discriminator, *(torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.5, 0.99))
                                       for m in (generator, discriminator))


def _gan_batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=generator), torch.randn(8, 6, generator=generator) + 2) for _ in range(3)]


@pytest.mark.parametrize("stage", [0, 3])
def test_two_steps_over_a_shared_module_one_of_them_trains_are_refused_naming_it(stage):
    """A GAN compiled as two steps over the same generator and discriminator: each step kept what it trains in its
    own slots, so the other read stale values (stage 0: trained silently apart from eager from the second step on)
    or the placeholders stage 3 left in the module (an error deep in tracing)."""
    generator, discriminator, generator_optimizer, discriminator_optimizer = _gan()
    discriminator_step = zerocc.compile(_DiscriminatorLoss(generator, discriminator), discriminator_optimizer,
                                        stage=stage)
    generator_step = zerocc.compile(_GeneratorLoss(generator, discriminator), generator_optimizer, stage=stage)
    noise, real = _gan_batches()[0]
    discriminator_step(noise, real)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)shares 8 parameter\(s\) with the model of another compiled "
                       r"step \(_DiscriminatorLoss, stage \d\).*'discriminator.0.weight': this step reads it, the "
                       r"other step trains it.*'generator.0.weight': this step trains it, the other step reads it.*"
                       r"full_model\(writeback=False\)"):
        generator_step(noise)
    assert all(p.numel() > 0 for p in generator.parameters())   # refused before the step took them over


def test_two_steps_over_a_shared_module_that_writes_its_buffers_are_refused_and_read_only_sharing_trains():
    """A frozen encoder two heads share: its weights are read by both (fine), its BatchNorm statistics in train
    mode would be updated by each step in its own copy."""
    def heads(encoder):
        made = [torch.nn.Sequential(encoder, torch.nn.Linear(8, 1)) for _ in range(2)]
        return [zerocc.compile(m, torch.optim.SGD(m[1].parameters(), lr=0.1), stage=3, loss_fn=mse) for m in made]
    mse = torch.nn.functional.mse_loss
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    def encoder():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).requires_grad_(False)
    first, second = heads(encoder())
    first(x, y)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)shares 3 buffer\(s\).*'0.1.running_mean': this step writes it"):
        second(x, y)
    first, second = heads(encoder().eval())   # statistics only read: both steps train on the shared frozen encoder
    for step in (first, second, first):
        step(x, y)


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_gan_whose_steps_read_frozen_copies_refreshed_in_place_trains_as_eager(stage):
    """The way the refusal above points to (docs/guide/your-model.md): each step reads a frozen copy of the other
    network, copied into in place after the other's step; a step reads its frozen parameters as they are now."""
    generator, discriminator, generator_optimizer, discriminator_optimizer = _gan()
    generator_copy = copy.deepcopy(generator).requires_grad_(False)
    discriminator_copy = copy.deepcopy(discriminator).requires_grad_(False)
    discriminator_step = zerocc.compile(_DiscriminatorLoss(generator_copy, discriminator), discriminator_optimizer,
                                        stage=stage)
    generator_step = zerocc.compile(_GeneratorLoss(generator, discriminator_copy), generator_optimizer, stage=stage)
    eager_generator, eager_discriminator, eager_generator_optimizer, eager_discriminator_optimizer = _gan()
    eager_steps = [(_DiscriminatorLoss(eager_generator, eager_discriminator), eager_discriminator_optimizer),
                   (_GeneratorLoss(eager_generator, eager_discriminator), eager_generator_optimizer)]
    for noise, real in _gan_batches():
        expected = []
        for loss_of, optimizer in eager_steps:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_of(noise, real) if isinstance(loss_of, _DiscriminatorLoss) else loss_of(noise)
            loss.backward()
            optimizer.step()
            expected.append(loss.detach())
        assert torch.equal(discriminator_step(noise, real), expected[0])
        with discriminator_step.full_model(writeback=False):
            discriminator_copy.load_state_dict(discriminator.state_dict())
        assert torch.equal(generator_step(noise), expected[1])
        with generator_step.full_model(writeback=False):
            generator_copy.load_state_dict(generator.state_dict())
    for step, name, reference in ((discriminator_step, "discriminator", eager_discriminator),
                                  (generator_step, "generator", eager_generator)):
        full = step.full_state_dict()
        for key, value in reference.state_dict().items():
            assert torch.equal(full[f"{name}.{key}"], value), key


@pytest.mark.parametrize("stage,param_dtype", [(3, None), (2, torch.bfloat16)])
def test_model_load_state_dict_on_placeholders_says_to_load_inside_full_model(stage, param_dtype):
    """Stage 3, and stages 1-2 under param_dtype (fp32 masters sharded), hold placeholders in the module:
    model.load_state_dict failed with PyTorch's "size mismatch for wte.weight: ... torch.Size([0])"."""
    model, _, loss_fn = build("gpt")
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn,
                          param_dtype=param_dtype)
    step(*batches("gpt", 1, 8)[0])
    halved = {key: value * 0.5 for key, value in step.full_state_dict().items()}
    with pytest.raises(zerocc.ConfigError, match=r"model.load_state_dict after compile: .* placeholders.*"
                                                 r"with step.full_model\(\): model.load_state_dict\(sd\)"):
        model.load_state_dict(halved)
    with step.full_model():   # the way it points to: loaded into the step's parameters
        model.load_state_dict(halved)
    full = step.full_state_dict()
    assert all(torch.equal(full[key], halved[key]) for key in halved)
