"""Stage 3's released placeholders outside ``step.full_model()``: a read of their values is refused, naming the
user's line and ``full_model``; shape queries report the whole parameter's; inside the block the same code is eager's."""
from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zerocc
from tests import distributed
from tests.helpers import assert_rank_matches_reference
from tests.models import batches, build, eager_step
from tests.reference import adamw

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


def _one_step_at_stage_3(model, reference):
    """``model`` compiled at stage 3 and trained one step, ``reference`` by eager alongside: (step, the reference's
    optimizer, the batch)."""
    optimizer, reference_optimizer = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    assert torch.equal(step(x, y), eager_step(reference, reference_optimizer, F.cross_entropy, (x, y)))
    return step, reference_optimizer, (x, y)


def test_a_submodules_state_dict_is_refused_and_the_models_is_whole_and_conversions_are_refused_at_the_next_call():
    """``model[0].state_dict()`` runs none of the model's state-dict hooks: it gave ``(0,)`` tensors, silently, where
    eager gives the layer's weights (a look at the calling frames let any ``_save_to_state_dict``'s ``detach``
    through). Refused now, naming the line; ``model.state_dict()`` is whole, and a ``p.detach()`` after it is refused
    again (the model's hooks mark its own run only). A submodule's ``.half()`` goes through, and the next call refuses
    the new tensor, naming the parameter."""
    model, reference = _mlp(), _mlp()
    step, reference_optimizer, (x, y) = _one_step_at_stage_3(model, reference)
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


def test_a_state_dict_interrupted_by_the_users_own_hook_leaves_a_submodules_refused():
    """The model's state-dict pre-hook marks its ``state_dict()`` running and its post-hook unmarks it: a post-hook of
    the user's, registered before compile (so running before the step's), that raised skipped the unmarking, and a
    later ``model[0].state_dict()`` gave ``(0,)`` tensors, silently. The mark holds only while that call runs."""
    model, reference = _mlp(), _mlp()
    raised = []

    def flaky_hook(module, state, prefix, metadata):
        if not raised:
            raised.append(True)
            raise RuntimeError("the user's hook failed")

    model.register_state_dict_post_hook(flaky_hook)
    step, _, _ = _one_step_at_stage_3(model, reference)
    with pytest.raises(RuntimeError, match="the user's hook failed"):
        model.state_dict()
    with pytest.raises(zerocc.ConfigError, match=r"detach of parameter '0.weight' at .*test_placeholders.py:\d+: .*full_model"):
        model[0].state_dict()
    whole = model.state_dict()
    assert all(torch.equal(whole[key], value) for key, value in reference.state_dict().items())
    with pytest.raises(zerocc.ConfigError, match=r"detach of parameter '0.weight'"):
        model[0].state_dict()


def test_the_models_state_dict_is_whole_when_its_hooks_are_called_through_another_frame():
    """The step marked the model's running ``state_dict()`` as the frame a fixed depth past its pre-hook: a tool
    that wraps module hooks (one more frame between) moved the mark onto the wrapper, gone before the parameters'
    ``detach``, and the model's own ``state_dict()`` was refused. The mark is ``nn.Module.state_dict``'s frame."""
    model, reference = _mlp(), _mlp()
    step, _, _ = _one_step_at_stage_3(model, reference)

    def wrapped(hook):
        def instrumented(*args):   # a profiler's or debugger's wrapper: one more Python frame
            return hook(*args)
        return instrumented

    for key, hook in list(model._state_dict_pre_hooks.items()):
        model._state_dict_pre_hooks[key] = wrapped(hook)
    whole = model.state_dict()
    assert all(torch.equal(whole[key], value) for key, value in reference.state_dict().items())
    with pytest.raises(zerocc.ConfigError, match=r"detach of parameter '0.weight' at .*test_placeholders.py:\d+: .*full_model"):
        model[0].state_dict()


_COPY_REFUSED = (r"copying or pickling the model after compile .* at .*test_placeholders.py:\d+: .*empty placeholders. "
                 r"Copy it inside `with step.full_model\(writeback=False\): snapshot = copy.deepcopy\(model\)`")


def _saved(thing):
    buffer = io.BytesIO()
    torch.save(thing, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_copy_of_the_model_or_its_parameters_is_eagers_or_refused_naming_the_line(stage):
    """``copy.deepcopy(list(model.parameters()))`` after compile (an EMA, a teacher, a "best model" snapshot) copied
    stage 3's empty placeholders, silently, and so did ``torch.save`` of them. Refused now outside
    ``full_model``, naming the line; inside it (and at stages 0-2 anywhere) the copies are eager's, bit for bit. The
    optimizer still copies and saves (its param_groups hold the placeholders, empty: the step holds the state)."""
    model, reference = _mlp(), _mlp()
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    for batch in data[:2]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
    if stage == 3:
        for copying in (lambda: copy.deepcopy(list(model.parameters())), lambda: copy.deepcopy(model[0].weight),
                        lambda: copy.deepcopy(model), lambda: _saved(list(model.parameters())), lambda: _saved(model),
                        lambda: copy.deepcopy({"ema": dict(model.named_parameters())}),
                        lambda: pickle.dumps(list(model.parameters()))):
            with pytest.raises(zerocc.ConfigError, match=_COPY_REFUSED):
                copying()
    for copied in (copy.deepcopy(optimizer), _saved(optimizer)):
        assert [p.shape for p in copied.param_groups[0]["params"]] == (
            [(0,)] * 4 if stage == 3 else [p.shape for p in reference.parameters()])
    with step.full_model(writeback=False) if stage == 3 else contextlib.nullcontext():
        snapshot, ema = copy.deepcopy(model), copy.deepcopy(list(model.parameters()))
    expected_snapshot, expected_ema = copy.deepcopy(reference), copy.deepcopy(list(reference.parameters()))
    for batch in data[2:]:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, F.cross_entropy, batch))
        with step.full_model(writeback=False) if stage == 3 else contextlib.nullcontext(), torch.no_grad():
            torch._foreach_lerp_(ema, list(model.parameters()), 0.1)
        with torch.no_grad():
            torch._foreach_lerp_(expected_ema, list(reference.parameters()), 0.1)
    assert all(map(torch.equal, ema, expected_ema))
    for (key, value), (expected_key, expected) in zip(snapshot.state_dict().items(), expected_snapshot.state_dict().items()):
        assert key == expected_key and torch.equal(value, expected), key   # taken then, not moved by later steps
    assert torch.equal(snapshot(data[0][0]), expected_snapshot(data[0][0]))   # a plain model: no step's hooks


class _MemoHidingPickle:
    """A ``pickle_module=`` for ``torch.save`` whose pickler shows no ``memo`` (as a later torch's ``_save``, or a
    pickler that is not ``pickle.Pickler``, might): which objects it pickled cannot be read."""
    class Pickler(pickle.Pickler):
        @property
        def memo(self):
            raise AttributeError("memo")

    def __getattr__(self, name):
        return getattr(pickle, name)


def test_saving_with_a_pickler_showing_no_memo_refuses_the_optimizers_placeholders_as_any_copy():
    """``torch.save(optimizer)`` lets the optimizer's empty placeholders through by reading its pickler's memo; a
    pickler showing none failed inside that check with an AttributeError. Refused now as any other copy of them is,
    naming the line; ``torch.save`` with pickle's own pickler saves them empty, as before."""
    model = _mlp()
    optimizer = adamw(model)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.cross_entropy)
    torch.manual_seed(1)
    step(torch.randn(8, 6), torch.randint(0, 3, (8,)))
    with pytest.raises(zerocc.ConfigError, match=_COPY_REFUSED):
        torch.save(optimizer, io.BytesIO(), pickle_module=_MemoHidingPickle())
    assert [p.shape for p in _saved(optimizer).param_groups[0]["params"]] == [(0,)] * 4


@pytest.mark.parametrize("stage", [0, 3])
def test_clipping_between_steps_is_refused_naming_the_option_and_zero_grad_is_harmless(stage):
    """An eager loop's ``clip_grad_norm_(model.parameters(), 1.0)`` kept between the compiled step's calls found no
    ``.grad`` (the step runs backward and the update inside its program): it returned 0 and clipped nothing, at every
    stage, and ``clip_grad_value_`` failed inside torch. Both are refused now, naming the line and the way to clip;
    ``clip_grad_norm=`` trains as eager's clipping, bit for bit, with ``model.zero_grad()`` and
    ``optimizer.zero_grad()`` left in the loop; every trained parameter's ``.grad`` is None between steps."""
    model, reference = _mlp(), _mlp()
    optimizer, reference_optimizer = adamw(model), adamw(reference)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.cross_entropy, clip_grad_norm=0.5)
    torch.manual_seed(1)
    for number in range(3):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        loss = step(x, y)
        model.zero_grad()
        optimizer.zero_grad()
        optimizer.zero_grad(set_to_none=False)
        assert all(p.grad is None for p in model.parameters())
        reference_optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
        assert torch.equal(loss, expected.detach()) and torch.equal(step.last_grad_norm, norm)
        if number == 1:
            with pytest.raises(zerocc.ConfigError, match=r"torch.nn.utils.clip_grad_norm_ at .*test_placeholders.py:"
                                                         r"\d+: .*clip nothing \(clip_grad_norm_ would return 0\).* "
                                                         r"clip_grad_norm=max_norm.*step.last_grad_norm"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with pytest.raises(zerocc.ConfigError, match=r"torch.nn.utils.clip_grad_value_ at .*test_placeholders.py:"
                                                         r"\d+: .*clamp p.grad in place in the optimizer's step\(\)"):
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    with step.full_model(writeback=False) if stage == 3 else contextlib.nullcontext():
        for param, expected in zip(model.parameters(), reference.parameters()):
            assert torch.equal(param, expected)
    step.close()   # handed back: plain parameters, clip_grad_norm_ as eager's
    assert torch.equal(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5), torch.tensor(0.0))


def _copies_and_clipping_beside_ddp(rank, world_size):
    """Stage 3 on 2 ranks beside DDP with eager clipping: the refusals on every rank, zero_grad left in the loop,
    and a snapshot taken inside full_model. Per rank: losses, the snapshot's state, the refusals' messages."""
    from torch.nn.parallel import DistributedDataParallel
    data = [tuple(t[rank * 4:(rank + 1) * 4] for t in batch) for batch in batches("mlp", 3, 4 * world_size)]
    reference, _, loss_fn = build("mlp")
    reference_optimizer = adamw(reference)
    ddp = DistributedDataParallel(reference)
    expected = []
    for batch in data:
        reference_optimizer.zero_grad()
        loss = loss_fn(ddp(*batch[:-1]), batch[-1])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
        reference_optimizer.step()
        expected.append(loss.detach())
    model, _, _ = build("mlp")
    optimizer = adamw(model)
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=loss_fn, clip_grad_norm=0.05)
    losses, refusals = [], []
    for batch in data:
        losses.append(step(*batch))
        optimizer.zero_grad()
        model.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        for refused in (lambda: copy.deepcopy(list(model.parameters())), lambda: copy.deepcopy(model),
                        lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)):
            try:
                refused()
            except zerocc.ConfigError as error:
                refusals.append(str(error))
    with step.full_model(writeback=False):
        snapshot = copy.deepcopy(model)
    return losses, expected, snapshot.state_dict(), reference.state_dict(), refusals


@pytest.mark.multirank
def test_copies_and_clipping_between_steps_on_two_ranks_are_refused_on_every_rank_and_snapshots_are_ddps():
    for rank, (losses, expected, state, expected_state, refusals) in enumerate(
            distributed.run(_copies_and_clipping_beside_ddp, 2)):
        assert_rank_matches_reference(rank, losses, expected, state, expected_state, state_rtol=1e-4, state_atol=1e-5)
        assert len(refusals) == 9, refusals
        assert all(message.startswith("copying or pickling the model after compile") for message in refusals[:2])
        assert refusals[2].startswith("torch.nn.utils.clip_grad_norm_ at ") and "clip_grad_norm=max_norm" in refusals[2]
