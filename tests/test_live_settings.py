"""Optimizer settings a schedule or a loop changes between steps: every float setting step() reads is read every
step, computed with in Python doubles as eager's step() computes, so a change neither recompiles nor changes a bit;
a change of the update's structure (a flag, a float crossing zero where step() branches on it) compiles the other
update, still eager's to the bit."""
from __future__ import annotations

import re
import warnings

import pytest
import torch

import zerocc
from tests import distributed
from tests.models import batches, build, eager_step


def one_cycle(optimizer, step_index):
    """OneCycleLR with cycle_momentum (its default): SGD's and RMSprop's momentum, Adam's betas, cycle with lr."""
    optimizer.schedule.step()


def annealed_weight_decay(optimizer, step_index):
    for group in optimizer.param_groups:
        group["weight_decay"] *= 0.7


def rmsprop_alpha_and_momentum(optimizer, step_index):
    for group in optimizer.param_groups:
        group["alpha"] = 0.99 - 0.01 * step_index
        group["momentum"] = 0.5 + 0.1 * step_index


def eps_and_lr_decay_warmup(optimizer, step_index):
    for group in optimizer.param_groups:
        group["eps"] = 1e-10 * (step_index + 2)
        group["lr_decay"] = 0.01 * (step_index + 1)


def with_one_cycle(optimizer):
    optimizer.schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=10)
    return optimizer


CHANGING = {
    "sgd_momentum_one_cycle": (lambda p: with_one_cycle(torch.optim.SGD(p, lr=0.01, momentum=0.9)), one_cycle),
    "sgd_dampening_weight_decay_one_cycle": (
        lambda p: with_one_cycle(torch.optim.SGD(p, lr=0.01, momentum=0.9, dampening=0.1, weight_decay=1e-3)), one_cycle),
    "adam_one_cycle": (lambda p: with_one_cycle(torch.optim.Adam(p, lr=0.01, weight_decay=0.01)), one_cycle),
    "adamw_foreach_one_cycle": (lambda p: with_one_cycle(torch.optim.AdamW(p, lr=0.01, foreach=True)), one_cycle),
    "adamw_annealed_weight_decay": (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), annealed_weight_decay),
    "rmsprop_alpha_momentum": (lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5), rmsprop_alpha_and_momentum),
    "adagrad_eps_lr_decay": (lambda p: torch.optim.Adagrad(p, lr=0.01, lr_decay=0.0), eps_and_lr_decay_warmup),
}


def _train(make, change, stage, steps=4):
    """Eager and compiled side by side, ``change`` applied to both optimizers after each step: whether every loss
    and the final parameters are equal bit for bit, the number of programs compiled, the warnings said."""
    reference, _, loss_fn = build("mlp")
    model, _, _ = build("mlp")
    optimizers = [make(list(m.parameters())) for m in (reference, model)]
    step = zerocc.compile(model, optimizers[1], stage=stage, loss_fn=loss_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, batch in enumerate(batches("mlp", steps, 8)):
            assert torch.equal(step(*batch), eager_step(reference, optimizers[0], loss_fn, batch)), f"step {index}"
            for optimizer in optimizers:
                change(optimizer, index)
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    return len(step.compile_stats), [str(w.message) for w in caught if "optimizer settings changed" in str(w.message)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", sorted(CHANGING))
def test_a_float_setting_changed_every_step_is_read_at_run_time(case, stage):
    """Momentum, betas, weight decay, alpha, eps, lr_decay changed after every step: one program, eager's bits."""
    programs, said = _train(*CHANGING[case], stage)
    assert said == []
    # SGD's first step copies the gradient into its momentum buffer: that step's program is its own, as with the
    # settings left alone (optimizer_init.py makes no initial state for it)
    assert programs == (2 if case.startswith("sgd") else 1)


def momentum_switched_on(optimizer, step_index):
    for group in optimizer.param_groups:
        group["momentum"] = 0.9


def weight_decay_switched_off(optimizer, step_index):
    for group in optimizer.param_groups:
        group["weight_decay"] = 0.0


def nesterov_switched_on(optimizer, step_index):
    for group in optimizer.param_groups:
        group["nesterov"] = True


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("make, change, setting", [
    # SGD branches on `momentum != 0`: 0.0 -> 0.9 takes the momentum branch (a momentum buffer from then on)
    (lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.0), momentum_switched_on, "momentum: 0.0 ->"),
    # Adam(W) branches on `weight_decay != 0`
    (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), weight_decay_switched_off, "weight_decay: .* -> 0.0"),
    (lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), nesterov_switched_on, "nesterov: False -> True"),
], ids=["momentum_from_zero", "weight_decay_to_zero", "nesterov"])
def test_a_change_of_the_updates_branch_compiles_the_other_branch(make, change, setting, stage):
    """A float crossing zero where step() branches on it, or a flag: the program of the other side, told once."""
    programs, said = _train(make, change, stage)
    assert len(said) == 1 and re.search(setting, said[0]), said
    assert programs >= 2


def _one_cycle_across_ranks(rank, world_size):
    """Per rank and optimizer: the final state under OneCycleLR at stage 3, eager's on the global batch, and the
    number of programs compiled."""
    results = {}
    for name, make in [("sgd", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9, weight_decay=1e-3)),
                       ("adamw", lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1))]:
        data = batches("mlp", 4, 4 * world_size)
        reference, _, loss_fn = build("mlp")
        model, _, _ = build("mlp")
        optimizers = [with_one_cycle(make(list(m.parameters()))) for m in (reference, model)]
        step = zerocc.compile(model, optimizers[1], stage=3, loss_fn=loss_fn)
        for batch in data:
            step(*(t[rank * 4:(rank + 1) * 4] for t in batch))
            eager_step(reference, optimizers[0], loss_fn, batch)
            for optimizer in optimizers:
                optimizer.schedule.step()
        results[name] = (step.full_state_dict(), reference.state_dict(), len(step.compile_stats))
    return results


@pytest.mark.multirank
def test_a_cycled_momentum_across_ranks_matches_eager_on_the_global_batch():
    """SGD's momentum and AdamW's betas cycled by OneCycleLR, two ranks: eager's training on the global batch."""
    for results in distributed.run(_one_cycle_across_ranks, 2):
        for name, (state, expected_state, programs) in results.items():
            assert programs == (2 if name == "sgd" else 1), name   # SGD's first step: its own program
            for key, value in expected_state.items():
                torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")


def _layerwise_groups(params, weight_decay=0.1):
    """Layer-wise learning rates (LLRD): a group per parameter, decayed weights and undecayed biases."""
    return [{"params": [p], "lr": 0.01 * 0.8 ** i, "weight_decay": weight_decay if p.dim() > 1 else 0.0}
            for i, p in enumerate(params)]


@pytest.mark.parametrize("make, expected_programs", [
    (lambda params: torch.optim.AdamW(_layerwise_groups(params)), 1),
    (lambda params: torch.optim.SGD(_layerwise_groups(params), momentum=0.9), 2),   # its first step's own
], ids=["adamw", "sgd_momentum"])
def test_look_alike_param_groups_are_probed_once(make, expected_programs, monkeypatch):
    """Layer-wise learning rates make a param group per layer. Which settings each group's step() reads every step
    was found by tracing two steps per group (2.3 s of CPU for AdamW's 24 groups of a 12-layer model); groups alike
    but for their float settings' values (not signs) share one probe. Their lrs and weight decays changed after
    every step: eager's training bit for bit, no recompile."""
    from zerocc import optimizer_step

    probes = []
    original = optimizer_step._probe
    monkeypatch.setattr(optimizer_step, "_probe", lambda *args: probes.append(args[1]) or original(*args))

    def decay_each_group(optimizer, step_index):
        for index, group in enumerate(optimizer.param_groups):
            group["lr"] *= 0.9
            group["weight_decay"] *= 0.5 if group["weight_decay"] else 1.0

    programs, said = _train(make, decay_each_group, stage=0)
    assert said == []
    assert programs == expected_programs
    # only the first group of each class of look-alike groups (a parameter's shape: a weight's decay is positive, a
    # bias's zero) is probed
    shapes = [tuple(p.shape) for p in build("mlp")[0].parameters()]
    assert len(set(shapes)) < len(shapes)
    assert sorted(set(probes)) == sorted({shapes.index(shape) for shape in shapes}), probes


def _hyper_placeholders(plan):
    from zerocc import graph as g
    return [node.name for node in g.placeholders(plan.gm, g.ROLE_HYPER)]


def test_keys_no_torch_optim_step_reads_are_no_settings_inputs():
    """OneCycleLR adds five float keys to each group (``initial_lr``, ``max_lr``, ``min_lr``, ``max_momentum``,
    ``base_momentum``) and a user keeps a layer's scale there for logging: torch.optim's step() reads none of them.
    Each was a settings input, 64 bytes of the plan per key and group, so a plan made before the scheduler planned
    less than the step compiled after it, and a memory_budget of that plan's peak was refused. They are no inputs
    now: the plans agree, and the step under that budget trains as eager while OneCycleLR cycles lr and beta1."""
    reference, _, loss_fn = build("mlp")
    model, _, _ = build("mlp")
    data = batches("mlp", 5, 8)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.01) for m in (reference, model)]
    before = zerocc.plan(model, optimizers[1], stage=3, example_inputs=data[0], loss_fn=loss_fn)
    schedules = [torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=10) for optimizer in optimizers]
    for optimizer in optimizers:
        optimizer.param_groups[0]["layer_scale"] = 0.5
    after = zerocc.plan(model, optimizers[1], stage=3, example_inputs=data[0], loss_fn=loss_fn)
    assert _hyper_placeholders(after) == _hyper_placeholders(before)
    assert not any(name in placeholder for placeholder in _hyper_placeholders(after)
                   for name in ("initial_lr", "max_lr", "min_lr", "momentum", "layer_scale"))
    peak = before.report()["planned_peak_bytes"]
    assert after.report()["planned_peak_bytes"] == peak
    step = zerocc.compile(model, optimizers[1], stage=3, loss_fn=loss_fn, memory_budget=peak)
    betas = set()
    for index, batch in enumerate(data):
        assert torch.equal(step(*batch), eager_step(reference, optimizers[0], loss_fn, batch)), f"step {index}"
        for schedule in schedules:
            schedule.step()
        betas.add(optimizers[1].param_groups[0]["betas"][0])
    assert len(betas) == len(data)   # beta1 cycled: read every step
    assert len(step.compile_stats) == 1
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_a_key_no_torch_optim_step_reads_changes_nothing(stage):
    """A loop writing its own keys into the groups every step (an int epoch, a float layer scale, a name): SGD's
    step() reads none of them, so none recompiles (an int key's value was baked into the signature: a program per
    step, with a warning each time); the training is eager's."""
    def tag_groups(optimizer, step_index):
        for group in optimizer.param_groups:
            group["epoch"] = step_index
            group["layer_scale"] = 0.5 + step_index
            group["phase"] = f"warmup {step_index}"
            group["lr"] *= 0.9

    programs, said = _train(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), tag_groups, stage)
    assert said == []
    assert programs == 2   # SGD with momentum: its first step's own program, then one


class _ScaledSGD(torch.optim.Optimizer):
    """A third-party optimizer: its step() reads a key of the group its defaults do not name (``scale``, set by the
    user's loop), which zerocc cannot rule out for an optimizer not torch.optim's own."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        for group in self.param_groups:
            group.setdefault("scale", 1.0)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * group["scale"])


class _GradScaledSGD(torch.optim.SGD):
    """A user's subclass of a torch.optim optimizer overriding step(): it may read any key (here ``scale``)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        for group in self.param_groups:
            group.setdefault("scale", 1.0)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad.mul_(group["scale"])
        return super().step(closure)


@pytest.mark.parametrize("make", [lambda p: _ScaledSGD(p, lr=0.01), lambda p: _GradScaledSGD(p, lr=0.01)],
                         ids=["own_optimizer", "sgd_subclass_with_its_own_step"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_third_party_optimizer_reads_its_own_key_every_step(stage, make):
    """Its own float key, changed between steps, changes the update as eager's does, with no recompile."""
    def rescale(optimizer, step_index):
        for group in optimizer.param_groups:
            group["scale"] = 0.5 * (step_index + 2)

    programs, said = _train(make, rescale, stage)
    assert said == []
    assert programs == 1
