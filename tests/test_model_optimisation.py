"""Model-optimisation tooling run inside the training loop, from torch itself, against the same eager loop: bit for
bit at world size 1, and as DDP on 2 ranks.

- Quantization-aware training (``torch.ao.quantization``): eager mode (``prepare_qat`` of a fused Conv-BN-ReLU) and
  FX mode (``prepare_qat_fx``). The fused fake-quant modules (``get_default_qat_qconfig("x86")``) update their
  observers' min/max buffers in forward and take ``observer_enabled`` / ``fake_quant_enabled`` as tensors, which
  ``model.apply(disable_observer)`` writes in place between steps; ``freeze_bn_stats`` sets a Python flag and the
  BatchNorm's ``training`` (a program of its own). ``convert`` after training gives eager's quantized model.
- Sparsity (``torch.ao.pruning``): a sparsifier's ``step()`` between training steps sets each mask's ``.data``
  (the same buffer object): the step went on reading the first mask, silently.
- Weight averaging (``torch.optim.swa_utils``): ``update_parameters`` inside ``step.full_model(writeback=False)``.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed

with warnings.catch_warnings():   # torch.ao.quantization warns that it is deprecated, on import and on each call
    warnings.simplefilter("ignore")
    import torch.ao.quantization as tq
    from torch.ao.nn.intrinsic.qat import freeze_bn_stats
    from torch.ao.pruning import WeightNormSparsifier
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_qat_fx

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class QuantNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.quant = tq.QuantStub()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(8 * 8 * 8, 10)
        self.dequant = tq.DeQuantStub()

    def forward(self, x):
        x = self.relu(self.bn(self.conv(self.quant(x))))
        return self.dequant(self.fc(x.flatten(1)))


def eager_qat(qconfig=None):
    torch.manual_seed(0)
    model = QuantNet().eval()
    model = tq.fuse_modules(model, [["conv", "bn", "relu"]]).train()
    model.qconfig = qconfig or tq.get_default_qat_qconfig("x86")
    return tq.prepare_qat(model)


def fx_qat():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10))
    return prepare_qat_fx(model.train(), tq.get_default_qat_qconfig_mapping("x86"), (torch.randn(2, 3, 8, 8),))


def images(steps, batch=4):
    torch.manual_seed(1)
    return [(torch.randn(batch, 3, 8, 8), torch.randint(0, 10, (batch,))) for _ in range(steps)]


def eager_step(model, optimizer, loss_fn, x, y):
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def end_observing(model):
    """What a QAT recipe does after N steps: the observers' ranges freeze, then the BatchNorm statistics."""
    model.apply(tq.disable_observer)
    model.apply(freeze_bn_stats)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("build, convert", [(eager_qat, tq.convert), (fx_qat, convert_fx)], ids=["eager", "fx"])
def test_quantization_aware_training_with_observers_disabled_midway_trains_and_converts_as_eager(stage, build, convert):
    """Losses, every buffer (the observers' min/max, scale, zero point, the flags) and parameter equal eager's at
    every step, across the step where the observers are disabled and BatchNorm frozen; ``convert`` of the trained
    model (inside ``full_model``) is eager's quantized model."""
    model, reference = build(), build()
    step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=F.cross_entropy)
    eager = functools.partial(eager_step, reference, sgd(reference), F.cross_entropy)
    for number, (x, y) in enumerate(images(5)):
        if number == 3:
            end_observing(model)
            end_observing(reference)
        assert torch.equal(step(x, y), eager(x, y)), number
        full = step.full_state_dict()
        for key, value in reference.state_dict().items():
            assert torch.equal(full[key], value), (number, key)
    with step.full_model(writeback=False):
        quantized = convert(copy.deepcopy(model).eval())
    expected = convert(copy.deepcopy(reference).eval())
    x = images(1)[0][0]
    assert torch.equal(quantized(x), expected(x))


def test_fake_quantize_branching_on_its_flags_is_refused_naming_the_users_line():
    """``tq.default_qat_qconfig``'s ``FakeQuantize`` branches in Python on its ``observer_enabled`` buffer (and its
    observer on whether min/max were ever set): refused at the first call naming the model's line, not traced down
    one side for every step, and (before, only "use tensor ops") pointing at the fused fake quantize that trains."""
    model = eager_qat(tq.default_qat_qconfig)
    step = zerocc.compile(model, sgd(model), stage=0, loss_fn=F.cross_entropy)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)test_model_optimisation.py:\d+: x = self.relu\(self.bn\(self."
                                                  r"conv.*depends on the values in a tensor.*fused FakeQuantize of "
                                                  r"get_default_qat_qconfig\(\"x86\"\)"):
        step(*images(1)[0])


def pruned_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    sparsifier = WeightNormSparsifier(sparsity_level=0.5, sparse_block_shape=(1, 4), zeros_per_block=4)
    sparsifier.prepare(model, [{"tensor_fqn": "0.weight"}, {"tensor_fqn": "2.weight"}])
    return model, sparsifier


def rows(steps):
    torch.manual_seed(1)
    return [(torch.randn(8, 8), torch.randint(0, 4, (8,))) for _ in range(steps)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_sparsifiers_masks_updated_between_steps_are_read_as_eager_reads_them(stage):
    """``sparsifier.step()`` sets each mask's ``.data`` (``WeightNormSparsifier._make_tensor_mask``): the buffer
    stays the same object, so no check saw it, and the step trained on the first mask (every loss after the first
    ``sparsifier.step()`` differed from eager's, at every stage). At stage 3 the sparsifier reads the whole weights:
    inside ``full_model``. ``squash_mask`` at the end leaves eager's pruned weights."""
    (model, sparsifier), (reference, reference_sparsifier) = pruned_mlp(), pruned_mlp()
    step = zerocc.compile(model, sgd(model), stage=stage, loss_fn=F.cross_entropy)
    eager = functools.partial(eager_step, reference, sgd(reference), F.cross_entropy)
    for number, (x, y) in enumerate(rows(6)):
        assert torch.equal(step(x, y), eager(x, y)), number
        if number % 2 == 1:
            with step.full_model():
                sparsifier.step()
            reference_sparsifier.step()
    assert torch.equal(step.eval_forward(x), reference.eval()(x))
    with step.full_model():
        sparsifier.squash_mask()
        trained = {key: value.clone() for key, value in model.state_dict().items()}
    reference_sparsifier.squash_mask()
    assert trained.keys() == reference.state_dict().keys()
    for key, value in reference.state_dict().items():
        assert torch.equal(trained[key], value), key


@pytest.mark.parametrize("inside", [False, True], ids=["between-steps", "inside-full-model"])
def test_a_buffer_whose_data_is_set_to_another_shape_is_refused_and_the_step_trains_on(inside):
    """A mask of another shape than the one compiled for is refused naming the buffer (no program reads it); the
    buffer holds the step's values again, and the next call trains on as eager does without the change."""
    (model, _), (reference, _) = pruned_mlp(), pruned_mlp()
    step = zerocc.compile(model, sgd(model), stage=0, loss_fn=F.cross_entropy)
    eager = functools.partial(eager_step, reference, sgd(reference), F.cross_entropy)
    data = rows(3)
    assert torch.equal(step(*data[0]), eager(*data[0]))
    mask = model[0].parametrizations.weight[0].mask
    before = mask.clone()
    message = r"\.data of buffer\(s\) '0\.parametrizations\.weight\.0\.mask' \(\(16, 8\) torch\.float32 then, \(8, 16\)"
    if inside:
        with pytest.raises(zerocc.ConfigError, match=message):
            with step.full_model():
                mask.data = torch.ones(8, 16)
    else:
        mask.data = torch.ones(8, 16)
        with pytest.raises(zerocc.ConfigError, match=message):
            step(*data[1])
    assert torch.equal(mask, before)
    for x, y in data[1:]:
        assert torch.equal(step(x, y), eager(x, y))


def mlp_with_batchnorm():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("average", ["swa", "ema"])
def test_averaged_model_updated_inside_full_model_with_swalr_and_update_bn_is_eagers(stage, average):
    """The documented recipe: the ``AveragedModel`` built before compiling, updated from the whole parameters, then
    ``update_bn``; and a hand-written EMA (``lerp_`` over the parameters) beside it."""
    from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
    options = dict(use_buffers=True, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if average == "ema" else {}
    model, reference = mlp_with_batchnorm(), mlp_with_batchnorm()
    averaged, reference_averaged = AveragedModel(model, **options), AveragedModel(reference, **options)
    ema = [p.detach().clone() for p in model.parameters()]
    reference_ema = [p.detach().clone() for p in reference.parameters()]
    optimizer, reference_optimizer = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    schedules = SWALR(optimizer, swa_lr=0.05, anneal_epochs=2), SWALR(reference_optimizer, swa_lr=0.05, anneal_epochs=2)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(5)]
    for number, (x, y) in enumerate(data):
        assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, F.cross_entropy, x, y)), number
        with step.full_model(writeback=False):
            averaged.update_parameters(model)
            torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 0.01)
        reference_averaged.update_parameters(reference)
        torch._foreach_lerp_(reference_ema, [p.detach() for p in reference.parameters()], 0.01)
        for schedule in schedules:
            schedule.step()
    update_bn(data, averaged)
    update_bn(data, reference_averaged)
    for key, value in reference_averaged.state_dict().items():
        assert torch.equal(averaged.state_dict()[key], value), key
    assert all(map(torch.equal, ema, reference_ema))


def _qat_and_pruning_on_ranks(rank, world_size):
    """This rank's slice under DDP (which broadcasts rank 0's buffers at every forward, as the step does) and under
    the stage-3 step: (DDP's, the step's) losses and states, for QAT across disable_observer and for a sparsifier."""
    from torch.nn.parallel import DistributedDataParallel
    results = {}
    for name, steps in (("qat", 5), ("pruning", 6)):
        data = images(steps, batch=8) if name == "qat" else rows(steps)
        data = [(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in data]
        if name == "qat":
            (model, reference), sparsifiers = (eager_qat(), eager_qat()), (None, None)
        else:
            (model, sparsifier), (reference, reference_sparsifier) = pruned_mlp(), pruned_mlp()
            sparsifiers = sparsifier, reference_sparsifier
        ddp = DistributedDataParallel(reference)
        step = zerocc.compile(model, sgd(model), stage=3, loss_fn=F.cross_entropy)
        expected, got, states, expected_states = [], [], [], []
        reference_optimizer = sgd(reference)
        for number, (x, y) in enumerate(data):
            if name == "qat" and number == 3:
                end_observing(model)
                end_observing(reference)
            got.append(step(x, y))
            expected.append(eager_step(ddp, reference_optimizer, F.cross_entropy, x, y))
            if name == "pruning" and number % 2 == 1:
                with step.full_model():
                    sparsifiers[0].step()
                sparsifiers[1].step()
            states.append(step.full_state_dict())
            expected_states.append({key: value.clone() for key, value in reference.state_dict().items()})
        results[name] = expected, got, expected_states, states
    return results


@pytest.mark.multirank
def test_qat_and_pruning_on_two_ranks_at_stage_3_train_as_ddp_with_each_ranks_observer_statistics():
    """Each rank's losses, parameters and buffers (the observers' min/max, which each rank updates on its own slice
    after rank 0's are broadcast, as DDP does) at every step against DDP's on that rank, within float tolerance."""
    for rank, results in enumerate(distributed.run(_qat_and_pruning_on_ranks, 2)):
        for name, (expected, got, expected_states, states) in results.items():
            torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name} rank {rank} losses: {m}")
            for number, (expected_state, state) in enumerate(zip(expected_states, states)):
                for key, value in expected_state.items():
                    torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5,
                                               msg=lambda m: f"{name} rank {rank} step {number} {key}: {m}")
