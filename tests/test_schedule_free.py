"""Schedule-Free optimizers (Defazio et al.) and other third-party optimizers whose code outside ``step()`` reads
their state, or whose ``step()`` makes Python numbers of their betas.

A Schedule-Free optimizer trains at a point ``y`` and is evaluated and saved at the average ``x``: the user calls
``optimizer.eval()`` before evaluating or checkpointing and ``optimizer.train()`` before training on, each moving
every parameter toward its state ``'z'`` (``p.lerp_(state['z'], ...)``). Once the compiled step holds the optimizer
state, ``optimizer.state[p]`` raises, so those calls failed; they run inside ``with step.full_optimizer():``.

The schedulefree package's own optimizers keep their step count and weight sum in the param group, which zerocc
refuses (tests/test_third_party_optimizers.py); the ones here keep them as tensors in ``self.state[p]`` and are
written out, so the tests need no third-party package.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def data(steps=6, batch=6):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, generator=generator), torch.randn(batch, 4, generator=generator)) for _ in range(steps)]


class _ScheduleFree(torch.optim.Optimizer):
    """The train()/eval() swap of the schedulefree package's optimizers, with ``beta`` its interpolation."""

    def _beta(self, group) -> float:
        raise NotImplementedError

    @torch.no_grad()
    def eval(self):
        for group in self.param_groups:
            if group["train_mode"]:
                for p in group["params"]:
                    state = self.state[p]
                    if "z" in state:
                        p.lerp_(end=state["z"], weight=1 - 1 / self._beta(group))
                group["train_mode"] = False

    @torch.no_grad()
    def train(self):
        for group in self.param_groups:
            if not group["train_mode"]:
                for p in group["params"]:
                    state = self.state[p]
                    if "z" in state:
                        p.lerp_(end=state["z"], weight=1 - self._beta(group))
                group["train_mode"] = True

    def _weights(self, state, group):
        """Warmup and the weighted average's coefficient, as schedulefree computes them, from tensors in ``state``."""
        if "z" not in state:
            state["step"], state["weight_sum"], state["lr_max"] = torch.tensor(0.0), torch.tensor(0.0), torch.tensor(-1.0)
        state["step"] += 1
        k = state["step"]
        lr = (k / group["warmup_steps"]).clamp(max=1.0) * group["lr"] if group["warmup_steps"] else torch.ones_like(k) * group["lr"]
        state["lr_max"] = torch.maximum(state["lr_max"], lr)
        weight = k ** group["r"] * state["lr_max"] ** group["weight_lr_power"]
        state["weight_sum"] += weight
        return k, lr, weight / state["weight_sum"]


class AdamWScheduleFree(_ScheduleFree):
    """schedulefree's AdamWScheduleFree (its single-tensor path), its counts per parameter, as tensors."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, warmup_steps=3, r=0.0,
                 weight_lr_power=2.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
                                      r=r, weight_lr_power=weight_lr_power, train_mode=False))

    def _beta(self, group):
        return group["betas"][0]

    @torch.no_grad()
    def step(self, closure=None):
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError("Optimizer was not in train mode when step is called")
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                k, lr, ckp1 = self._weights(state, group)
                if "z" not in state:
                    state["z"], state["exp_avg_sq"] = p.clone(), torch.zeros_like(p)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                grad = p.grad / (state["exp_avg_sq"] / (1 - beta2 ** k)).sqrt_().add_(group["eps"])
                grad.add_(p, alpha=group["weight_decay"])
                p.lerp_(state["z"], ckp1)
                p.add_(grad * (lr * (beta1 * (1 - ckp1) - 1)))
                state["z"].sub_(grad * lr)


class SGDScheduleFree(_ScheduleFree):
    """schedulefree's SGDScheduleFree, its counts per parameter, as tensors."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.0, warmup_steps=2, r=0.0, weight_lr_power=2.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, warmup_steps=warmup_steps,
                                      r=r, weight_lr_power=weight_lr_power, train_mode=False))

    def _beta(self, group):
        return group["momentum"]

    @torch.no_grad()
    def step(self, closure=None):
        if not self.param_groups[0]["train_mode"]:
            raise RuntimeError("Optimizer was not in train mode when step is called")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                _, lr, ckp1 = self._weights(state, group)
                if "z" not in state:
                    state["z"] = p.clone()
                grad = p.grad.add(p, alpha=group["weight_decay"])
                p.lerp_(state["z"], ckp1)
                p.add_(grad * (lr * (group["momentum"] * (1 - ckp1) - 1)))
                state["z"].sub_(grad * lr)


MAKERS = {"adamw": lambda m: AdamWScheduleFree(m.parameters()), "sgd": lambda m: SGDScheduleFree(m.parameters())}


def _eager_step(model, optimizer, x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.detach()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", list(MAKERS))
def test_train_and_eval_inside_full_optimizer_match_eager_bit_for_bit(name, stage, tmp_path):
    """optimizer.eval() after the step's first call failed on optimizer.state[p] (the step holds the state), so the
    model could not be evaluated or saved at Schedule-Free's averaged point x."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference_optimizer, optimizer = MAKERS[name](reference), MAKERS[name](model)
    reference_optimizer.train()
    optimizer.train()
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    batches, losses = data(), []
    for number, (x, y) in enumerate(batches):
        losses.append(_eager_step(reference, reference_optimizer, x, y))
        assert torch.equal(step(x, y), losses[-1]), number
        if number == 2:   # evaluate and save at x, then train on from y
            reference_optimizer.eval()
            reference.eval()
            with step.full_optimizer():
                optimizer.eval()
            with torch.no_grad():
                assert torch.equal(step.eval_forward(x), reference(x))
            reference.train()
            at_x = copy.deepcopy(reference.state_dict())
            full = step.full_state_dict()
            for key, value in at_x.items():
                assert torch.equal(full[key], value), key
            zerocc.save_checkpoint(step, str(tmp_path / "x"))
            reference_optimizer.train()
            at_y = copy.deepcopy(reference.state_dict())
            with step.full_optimizer():
                optimizer.train()
    with step.full_optimizer():   # the state the block shows is the step's, current
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)
            for key, value in reference_optimizer.state[q].items():
                assert torch.equal(optimizer.state[p][key], value), key
    # the checkpoint saved after eval() holds x and the optimizer in eval mode: loaded into a fresh step, whose
    # first call it starts, it gives eager's model at x; train() inside full_optimizer gives eager's y again
    restored = Net()
    restored_optimizer = MAKERS[name](restored)
    later = zerocc.compile(restored, restored_optimizer, stage=stage, loss_fn=F.mse_loss)
    zerocc.load_checkpoint(later, str(tmp_path / "x"))
    for expected in (at_x, at_y):
        if expected is at_y:
            with pytest.raises(zerocc.UnsupportedOptimizerError, match=r"(?s)not in train mode.*fix: call "
                                                                     r"optimizer.train\(\) before the step's first call"):
                later(*batches[0])
            with later.full_optimizer():
                restored_optimizer.train()
        full = later.full_state_dict()
        for key, value in expected.items():
            assert torch.equal(full[key], value), key
    assert torch.equal(later(*batches[3]), losses[3])   # and trains on from there as eager did


def test_optimizer_eval_outside_the_block_says_where_it_runs():
    model = Net()
    optimizer = AdamWScheduleFree(model.parameters())
    optimizer.train()
    step = zerocc.compile(model, optimizer, stage=0, loss_fn=F.mse_loss)
    step(*data(1)[0])
    with pytest.raises(zerocc.ConfigError, match=r"(?s)optimizer.state\['a.weight'\] after the compiled step's first "
                                                 r"call.*with step.full_optimizer\(\): optimizer.eval\(\)"):
        optimizer.eval()


def test_a_state_entry_replaced_inside_the_block_is_refused_and_nothing_written_back():
    model = Net()
    optimizer = AdamWScheduleFree(model.parameters())
    optimizer.train()
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    step(*data(1)[0])
    before = step.full_state_dict()
    with pytest.raises(zerocc.ConfigError, match=r"optimizer.state\['a.weight'\] changed its layout inside"):
        with step.full_optimizer():
            optimizer.eval()
            optimizer.state[model.a.weight]["z"] = torch.zeros(3)
    after = step.full_state_dict()
    assert all(torch.equal(after[key], value) for key, value in before.items())


class GroupCountScheduleFree(SGDScheduleFree):
    """The schedulefree package's way: the step count ``k`` kept in the param group, a Python int."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            k = group.setdefault("k", 0)
            for p in group["params"]:
                self.state[p].setdefault("z", p.clone())
                p.sub_(p.grad, alpha=group["lr"] / (k + 1))
            group["k"] = k + 1


def test_the_packages_count_in_the_param_group_is_refused_pointing_at_full_optimizer():
    model = Net()
    optimizer = GroupCountScheduleFree(model.parameters())
    optimizer.train()
    step = zerocc.compile(model, optimizer, stage=0, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)param_groups\[0\]\['k'\].*Schedule-Free optimizers .* keep k and weight_sum so; one "
                             r"keeping them as tensors .*with step.full_optimizer\(\)"):
        step(*data(1)[0])


class DebiasedAdam(torch.optim.Optimizer):
    """Adam whose step makes Python numbers of its betas, as pytorch_optimizer's do (``math.sqrt(1 - beta2)``);
    ``pow_of_item`` makes one of its step count too (``math.pow(beta1, step.item())``)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, pow_of_item=False):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.pow_of_item = pow_of_item

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if "m" not in state:
                    state["m"], state["v"], state["step"] = torch.zeros_like(p), torch.zeros_like(p), torch.tensor(0.0)
                state["step"] += 1
                if self.pow_of_item:
                    correction = 1 - math.pow(beta1, state["step"].item())
                else:
                    correction = (1 - beta1 ** state["step"]) / math.sqrt(1 - float(beta2))
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.sub_(group["lr"] * state["m"] / correction / (state["v"].sqrt() + group["eps"]))


@pytest.mark.parametrize("stage", [0, 3])
def test_betas_made_python_numbers_by_a_third_party_step_train_bit_for_bit(stage):
    """zerocc reads betas each step as traced numbers; math.sqrt(1 - float(beta2)) in a third-party step() then
    failed to trace, refused as a Python branch on a value. Such an optimizer's betas are traced in as constants
    now, and a change of them compiles a new program that uses them."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference_optimizer, optimizer = DebiasedAdam(reference.parameters()), DebiasedAdam(model.parameters())
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    for number, (x, y) in enumerate(data()):
        if number == 3:   # a betas schedule: the next program reads the new ones
            for group in (*optimizer.param_groups, *reference_optimizer.param_groups):
                group["betas"] = (0.8, 0.99)
        if number == 3:
            with pytest.warns(UserWarning, match="optimizer settings changed.*betas"):
                loss = step(x, y)
        else:
            loss = step(x, y)
        assert torch.equal(loss, _eager_step(reference, reference_optimizer, x, y)), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_a_python_number_made_of_the_step_count_is_refused_saying_so():
    """math.pow(beta1, state['step'].item()) was refused as a "branch", with no word of the conversion or of
    the tensor op that does the same."""
    model = Net()
    step = zerocc.compile(model, DebiasedAdam(model.parameters(), pow_of_item=True), stage=0, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)or makes a Python number of one, at [^\n]*test_schedule_free.py:\d+: correction = "
                             r"1 - math.pow\(beta1, state\[\"step\"\].item\(\)\).*compute with tensor ops"):
        step(*data(1)[0])


def _on_two_ranks(rank, world_size, name):
    torch.manual_seed(0)
    model = Net()
    optimizer = MAKERS[name](model)
    optimizer.train()
    step = zerocc.compile(model, optimizer, stage=3, loss_fn=F.mse_loss)
    losses, at_x = [], None
    for number, (x, y) in enumerate(data(batch=8)):
        losses.append(step(x.chunk(world_size)[rank], y.chunk(world_size)[rank]))
        if number == 2:
            with step.full_optimizer():
                optimizer.eval()
            at_x = step.full_state_dict()
            with step.full_optimizer():
                optimizer.train()
    return losses, at_x, step.full_state_dict()


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(MAKERS))
def test_on_two_ranks_at_stage_3_matches_one_process_on_the_global_batch(name):
    torch.manual_seed(0)
    reference = Net()
    optimizer = MAKERS[name](reference)
    optimizer.train()
    expected, at_x = [], None
    for number, (x, y) in enumerate(data(batch=8)):
        expected.append(_eager_step(reference, optimizer, x, y))
        if number == 2:
            optimizer.eval()
            at_x = copy.deepcopy(reference.state_dict())
            optimizer.train()
    per_rank = distributed.run(_on_two_ranks, 2, name)
    torch.testing.assert_close(torch.stack([(a + b) / 2 for a, b in zip(per_rank[0][0], per_rank[1][0])]),
                               torch.stack(expected), rtol=1e-5, atol=1e-6)
    for rank, (_, x_state, final) in enumerate(per_rank):
        for expected_state, got in ((at_x, x_state), (reference.state_dict(), final)):
            for key, value in expected_state.items():
                torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
