"""Optimizers from outside torch.optim (pytorch_optimizer's, hand-written Lion, LAMB, Adan, SAM, D-Adaptation-like):
each trains as eager or is refused at compile time naming its line, never a silently different update.

Their essential updates are written here, so the tests need no third-party package; each class reproduces the
trait of a pytorch_optimizer optimizer that zerocc met: a setting kept on the optimizer itself (``self.maximize``),
a step count kept as a Python int in the param group, helpers the step calls, a step that needs a closure.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed

STEPS = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def data(steps=STEPS, batch=6):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, generator=generator), torch.randn(batch, 4, generator=generator)) for _ in range(steps)]


class Lion(torch.optim.Optimizer):
    """Lion (sign of an interpolated momentum), a setting kept on the optimizer as pytorch_optimizer keeps
    ``self.maximize``: elementwise, so every stage trains it."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, maximize=False):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        self.maximize = maximize

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if self.maximize else p.grad
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(state["exp_avg"].mul(beta1).add(grad, alpha=1 - beta1).sign_(), alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(grad, alpha=1 - beta2)


class Adan(torch.optim.Optimizer):
    """Adan with its step count a tensor in the per-parameter state: elementwise, trains at every stage."""

    def __init__(self, params, lr=1e-2, betas=(0.98, 0.92, 0.99), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2, beta3 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"], state["v"], state["n"], state["prev"] = (torch.zeros_like(p) for _ in range(4))
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                diff = torch.where(state["step"] > 1, p.grad - state["prev"], torch.zeros_like(p))
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].lerp_(diff, 1 - beta2)
                state["n"].lerp_((p.grad + beta2 * diff).square(), 1 - beta3)
                state["prev"].copy_(p.grad)
                p.addcdiv_(state["m"] + beta2 * state["v"], state["n"].sqrt() + group["eps"], value=-group["lr"])


class GroupStepAdam(torch.optim.Optimizer):
    """Adam with its step count a Python int in the param group, as pytorch_optimizer's Adan, Lamb, AdaBelief,
    SOAP keep theirs (``group['step'] += 1``)."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].lerp_(p.grad, 1 - beta1)
                state["v"].lerp_(p.grad.square(), 1 - beta2)
                step_size = group["lr"] / (1 - 0.9 ** group["step"])
                p.addcdiv_(state["m"], state["v"].sqrt().add_(group["eps"]), value=-step_size)


class CountingSGD(torch.optim.Optimizer):
    """SGD whose learning rate decays with a count kept on the optimizer itself."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"] / self.steps)


class Lamb(torch.optim.Optimizer):
    """LAMB: an Adam update scaled by each parameter's trust ratio ||p|| / ||update||, computed in a helper as
    pytorch_optimizer's ``_step_per_param``."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p)

    def _update(self, group, p):
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if "step" not in state:
            state["step"], state["m"], state["v"] = torch.tensor(0.0), torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        state["m"].lerp_(p.grad, 1 - beta1)
        state["v"].lerp_(p.grad.square(), 1 - beta2)
        update = (state["m"] / (1 - beta1 ** state["step"])) / (
            (state["v"] / (1 - beta2 ** state["step"])).sqrt() + group["eps"])
        update.add_(p, alpha=group["weight_decay"])
        weight_norm, update_norm = p.norm(), update.norm()
        trust = torch.where((weight_norm > 0) & (update_norm > 0), weight_norm / update_norm, torch.ones_like(weight_norm))
        p.add_(update * trust, alpha=-group["lr"])


class DAdaptSGD(torch.optim.Optimizer):
    """D-Adaptation's shape: a distance estimate d from sums over all parameters, kept as a 0-dim tensor in each
    parameter's state (as a Python float in the group it would be refused at every stage)."""

    def __init__(self, params, lr=1.0, d0=1e-3):
        super().__init__(params, dict(lr=lr, d0=d0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if "p0" not in state:
                    state["p0"], state["s"] = p.detach().clone(), torch.zeros_like(p)
                    state["d"] = torch.tensor(group["d0"])
            d = self.state[params[0]]["d"]
            numerator = sum((p.grad * (self.state[p]["p0"] - p)).sum() for p in params)
            for p in params:
                self.state[p]["s"].add_(p.grad, alpha=1.0).mul_(d)
            denominator = sum(self.state[p]["s"].abs().sum() for p in params)
            new_d = torch.maximum(d, numerator / (denominator + 1e-12))
            for p in params:
                self.state[p]["d"].copy_(new_d)
                p.sub_(p.grad * new_d, alpha=group["lr"])


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization: a second forward and backward, through the closure, at a perturbed point."""

    def __init__(self, params, lr=0.05, rho=0.05):
        super().__init__(params, dict(lr=lr, rho=rho))

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is not None, "SAM requires a closure"
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.stack([p.grad.norm() for p in params]).norm()
        perturbations = [p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12)) for p in params]
        for p, e in zip(params, perturbations):
            p.add_(e)
        with torch.enable_grad():
            closure()
        for p, e in zip(params, perturbations):
            p.sub_(e).sub_(p.grad, alpha=self.param_groups[0]["lr"])


def _train_both(make, stage):
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference_optimizer = make(reference)
    step = zerocc.compile(model, make(model), stage=stage, loss_fn=F.mse_loss)
    for number, (x, y) in enumerate(data()):
        reference_optimizer.zero_grad()
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        reference_optimizer.step()
        assert torch.equal(step(x, y), loss.detach()), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    step.close()


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("make", [lambda m: Lion(m.parameters()), lambda m: Adan(m.parameters())], ids=["lion", "adan"])
def test_elementwise_third_party_updates_train_bit_for_bit(make, stage):
    """Lion failed at every stage: the shadow optimizer zerocc traces was a ``copy.copy``, which goes through
    torch's ``Optimizer.__getstate__`` and dropped ``self.maximize`` ("'Lion' object has no attribute 'maximize'")."""
    _train_both(make, stage)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("make, written, line", [
    (lambda m: GroupStepAdam(m.parameters()), r"param_groups\[0\]\['step'\] \(absent before the first step, 1 after",
     r"test_third_party_optimizers.py:\d+: group\[\"step\"\] = group.get\(\"step\", 0\) \+ 1"),
    (lambda m: CountingSGD(m.parameters()), r"self.steps \(0 before the first step, 1 after", ""),
], ids=["group_step", "attribute_count"])
def test_a_count_kept_in_the_param_group_or_on_the_optimizer_is_refused_naming_it(make, written, line, stage):
    """The traced update read the group's step count as the constant of the first step, every step: bias
    correction of step 1 forever, a silently different update from step 2 on (pytorch_optimizer's Adan trained so)."""
    model = Net()
    step = zerocc.compile(model, make(model), stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=rf"(?s)step\(\) writes values its later steps read .*{written}.*{line}.*fix: keep what "
                             r"changes from step to step as a tensor in the per-parameter state"):
        step(*data(1)[0])


@pytest.mark.parametrize("make, op, line", [
    (lambda m: Lamb(m.parameters()), "linalg_vector_norm",
     r"test_third_party_optimizers.py:\d+: weight_norm, update_norm = p.norm\(\), update.norm\(\)"),
    (lambda m: DAdaptSGD(m.parameters()), "sum",
     r"test_third_party_optimizers.py:\d+: numerator = sum\(\(p.grad \* \(self.state\[p\]\[\"p0\"\] - p\)\).sum\(\)"),
], ids=["lamb_trust_ratio", "dadapt_global_sums"])
def test_per_parameter_norms_and_sums_over_all_parameters_train_at_stage_0_and_are_refused_at_1_to_3(make, op, line):
    """A rank's slice of a parameter gives neither its norm (LAMB's, LARS's trust ratio) nor the sums over all
    parameters (D-Adaptation's, Prodigy's d). The refusal names the line in the helper that step() calls, not
    the call in step() (LARS's "self._step_per_param(group)" was named)."""
    _train_both(make, 0)
    for stage in (1, 3):
        model = Net()
        step = zerocc.compile(model, make(model), stage=stage, loss_fn=F.mse_loss)
        with pytest.raises(zerocc.UnsupportedOptimizerError,
                           match=rf"(?s)step\(\) is not elementwise per parameter:.*aten\.{op}, \d+ call\(s\), first at "
                                 rf"[^\n]*{line}"):
            step(*data(1)[0])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_step_that_needs_a_closure_is_refused_naming_its_line(stage):
    """SAM's ``assert closure is not None`` was reported as an update that "could not be traced", with the advice
    to use an elementwise optimizer."""
    model = Net()
    step = zerocc.compile(model, SAM(model.parameters()), stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)SAM.step\(\) needs a closure, at [^\n]*test_third_party_optimizers.py:\d+: assert "
                             r"closure is not None.*zerocc traces one forward and backward per step"):
        step(*data(1)[0])


class ListState(torch.optim.Optimizer):
    """A preconditioner kept as a list of matrices (SOAP's ``state['Q']``)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["Q"] = [torch.eye(n) for n in p.shape]
                state["step"] += 1
                p.sub_(p.grad * state["Q"][0][0, 0], alpha=group["lr"])
                state["Q"][0].mul_(0.5)   # the preconditioner changes from step to step


def test_state_that_is_a_list_of_tensors_is_refused_not_a_key_error():
    """Learning the initial state checked its guess with a step that raised KeyError: 'Q' out of compile."""
    model = Net()
    step = zerocc.compile(model, ListState(model.parameters()), stage=0, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"ListState.step\(\) keeps per-parameter state that is not a tensor: 'Q' \(a Python list"):
        step(*data(1)[0])


def _on_two_ranks(rank, world_size, name):
    torch.manual_seed(0)
    model = Net()
    step = zerocc.compile(model, MAKERS[name](model), stage=3, loss_fn=F.mse_loss)
    losses = [step(x.chunk(world_size)[rank], y.chunk(world_size)[rank]) for x, y in data(batch=8)]
    return losses, step.full_state_dict()


MAKERS = {"lion": lambda m: Lion(m.parameters(), lr=1e-2), "adan": lambda m: Adan(m.parameters())}


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(MAKERS))
def test_on_two_ranks_at_stage_3_matches_one_process_on_the_global_batch(name):
    torch.manual_seed(0)
    reference = Net()
    optimizer = MAKERS[name](reference)
    expected = []
    for x, y in data(batch=8):
        optimizer.zero_grad()
        loss = F.mse_loss(reference(x), y)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    per_rank = distributed.run(_on_two_ranks, 2, name)
    torch.testing.assert_close(torch.stack([(a + b) / 2 for a, b in zip(per_rank[0][0], per_rank[1][0])]),
                               torch.stack(expected), rtol=1e-5, atol=1e-6)
    for rank, (_, state) in enumerate(per_rank):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
