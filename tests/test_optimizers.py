"""Optimizers beyond torch.optim's elementwise ones: what trains at which stage, and what is refused, how.

Any update trains at stage 0, where every rank updates whole parameters: torch.optim.Muon (Newton-Schulz on
each matrix), a user's own update mixing a parameter's elements (a per-row normalization), one optimizer
holding Muon's update for the hidden matrices and AdamW's for the rest. Stages 1-3 refuse an update that is
not elementwise at compile time, naming the op and the optimizer's line. Every stage refuses state that is not
shaped like its parameter (a factored second moment), two optimizers, and a ZeroRedundancyOptimizer.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests import distributed

STEPS = 3


class Net(nn.Module):
    """An embedding, matrices, a norm and biases: what a Muon recipe splits between Muon and AdamW."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.hidden = nn.Linear(16, 24)
        self.norm = nn.LayerNorm(24)
        self.square = nn.Linear(24, 24, bias=False)
        self.head = nn.Linear(24, 5)

    def forward(self, tokens):
        x = F.gelu(self.hidden(self.embed(tokens).mean(1)))
        return self.head(F.gelu(self.square(self.norm(x))))

    def matrices(self):
        return [self.hidden.weight, self.square.weight]

    def others(self):
        return [p for p in self.parameters() if not any(p is m for m in self.matrices())]


def data(steps=STEPS, batch=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 20, (batch, 6), generator=generator), torch.randn(batch, 5, generator=generator))
            for _ in range(steps)]


class RowNormalized(torch.optim.Optimizer):
    """Each row of the gradient normalized: the update of an element reads its whole row."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm(dim=-1, keepdim=True) + 1e-8), alpha=-group["lr"])


def newton_schulz(g, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.mT if g.size(-2) > g.size(-1) else g
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


class MuonWithAdamW(torch.optim.Optimizer):
    """The modern recipe as one optimizer: Muon for the hidden matrices, AdamW for the rest (a flag per group);
    the AdamW step count a tensor, as zerocc carries only tensor state."""

    def __init__(self, matrices, others, lr=0.02, adamw_lr=3e-3):
        super().__init__([dict(params=matrices, use_muon=True, lr=lr, momentum=0.95),
                          dict(params=others, use_muon=False, lr=adamw_lr, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.01)], {})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    if "momentum" not in state:
                        state["momentum"] = torch.zeros_like(p)
                    state["momentum"].lerp_(p.grad, 1 - group["momentum"])
                    update = newton_schulz(p.grad.lerp(state["momentum"], group["momentum"]))
                    p.add_(update, alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)
                    continue
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                beta1, beta2 = group["betas"]
                state["step"] += 1
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denominator = (state["exp_avg_sq"] / (1 - beta2 ** state["step"])).sqrt().add_(group["eps"])
                p.addcdiv_(state["exp_avg"] / (1 - beta1 ** state["step"]), denominator, value=-group["lr"])


OPTIMIZERS = {
    "muon": lambda model: torch.optim.Muon(model.matrices(), lr=0.02),
    "row_normalized": lambda model: RowNormalized(model.parameters()),
    "muon_with_adamw": lambda model: MuonWithAdamW(model.matrices(), model.others()),
}


def _state_equal(reference: torch.optim.Optimizer, optimizer: torch.optim.Optimizer) -> bool:
    expected, got = reference.state_dict()["state"], optimizer.state_dict()["state"]
    return expected.keys() == got.keys() and all(
        expected[i].keys() == got[i].keys() and all(torch.equal(v, got[i][k]) for k, v in expected[i].items())
        for i in expected)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_an_update_that_is_not_elementwise_trains_at_stage_0_bit_for_bit(name):
    """Stage 0 traced the update over each parameter flattened into its bucket: Muon's "Param gradient must be a 2D
    matrix", and a per-row normalization silently normalized whole parameters instead, training wrong."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference_optimizer, optimizer = OPTIMIZERS[name](reference), OPTIMIZERS[name](model)
    step = zerocc.compile(model, optimizer, stage=0, loss_fn=F.mse_loss)
    for tokens, target in data():
        reference_optimizer.zero_grad()
        loss = F.mse_loss(reference(tokens), target)
        loss.backward()
        reference_optimizer.step()
        assert torch.equal(step(tokens, target), loss.detach())
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
    step.close()
    assert _state_equal(reference_optimizer, optimizer)


@pytest.mark.parametrize("name, op, line", [
    ("muon", "mm", r"_muon.py:\d+: gram_matrix = ortho_grad @ ortho_grad.T"),   # torch's own file, not the graph node
    ("row_normalized", "linalg_vector_norm", r"test_optimizers.py:\d+: p.add_\(p.grad / \(p.grad.norm"),
    ("muon_with_adamw", "mm", r"test_optimizers.py:\d+: update = newton_schulz\("),   # the line in step()
])
def test_an_update_that_is_not_elementwise_is_refused_at_stages_1_to_3_naming_op_and_line(name, op, line):
    for stage in (1, 2, 3):
        model = Net()
        step = zerocc.compile(model, OPTIMIZERS[name](model), stage=stage, loss_fn=F.mse_loss)
        with pytest.raises(zerocc.UnsupportedOptimizerError,
                           match=rf"(?s)step\(\) is not elementwise per parameter:.*aten\.{op}, \d+ call\(s\), first "
                                 rf"at .*{line}.*or stage=0"):
            step(*data(1)[0])


class RowStatistics(torch.optim.Optimizer):
    """A factored second moment: one statistic per row of each matrix."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "rows" not in state:
                    state["rows"] = torch.zeros(p.shape[:1], dtype=p.dtype)
                squares = p.grad.square()
                state["rows"].lerp_(squares.mean(dim=tuple(range(1, p.dim()))) if p.dim() > 1 else squares, 0.1)
                rows = state["rows"].view(-1, *([1] * (p.dim() - 1)))
                p.addcdiv_(p.grad, rows.sqrt() + 1e-8, value=-group["lr"])


@pytest.mark.parametrize("stage", [0, 3])
def test_state_not_shaped_like_its_parameter_is_refused_naming_it(stage):
    """It failed inside the shard pass, on a flat slot of the parameter's size ("Attempting to broadcast")."""
    model = Net()
    step = zerocc.compile(model, RowStatistics(model.parameters()), stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.UnsupportedOptimizerError,
                       match=r"(?s)RowStatistics.step\(\) keeps state 'rows' of shape \(20,\) for parameter "
                             r"'embed.weight' of shape \(20, 16\), made at .*test_optimizers.py:\d+: .*lerp_.*"
                             r"fix: keep each state tensor shaped like its parameter or 0-dim"):
        step(*data(1)[0])


class PlainSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p.grad, alpha=group["lr"])


def _adamw_with_tensor_weight_decay(model):
    return torch.optim.AdamW([dict(params=model.matrices(), weight_decay=torch.tensor(0.1)),
                              dict(params=model.others(), weight_decay=torch.tensor(0.0))], lr=0.01)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("make", [lambda model: PlainSGD(model.parameters()), _adamw_with_tensor_weight_decay],
                         ids=["sub_alpha_lr", "tensor_weight_decay"])
def test_elementwise_updates_that_failed_to_trace_train_bit_for_bit(make, stage):
    """``p.sub_(p.grad, alpha=lr)`` (the learning rate a symbol in the trace) failed in torch's fake kernel for sub,
    which branches on ``alpha != 1``: "Could not guard on data-dependent expression Ne(zuf1, 1.0)". A tensor
    weight_decay was a constant of unknown value to the trace: AdamW's ``if weight_decay != 0`` was refused as a
    branch. Changed between steps, it compiles a program for the new value, as eager reads it."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    reference_optimizer, optimizer = make(reference), make(model)
    step = zerocc.compile(model, optimizer, stage=stage, loss_fn=F.mse_loss)
    for number, (tokens, target) in enumerate(data(4)):
        if number == 2 and "weight_decay" in optimizer.defaults:
            for opt in (reference_optimizer, optimizer):
                opt.param_groups[0]["weight_decay"] = torch.tensor(0.2)
        reference_optimizer.zero_grad()
        loss = F.mse_loss(reference(tokens), target)
        loss.backward()
        reference_optimizer.step()
        with pytest.warns(UserWarning, match="optimizer settings changed") if number == 2 and \
                "weight_decay" in optimizer.defaults else contextlib.nullcontext():
            assert torch.equal(step(tokens, target), loss.detach()), number
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_two_optimizers_are_refused_with_the_way_out():
    model = Net()
    optimizers = [torch.optim.Muon(model.matrices()), torch.optim.AdamW(model.others())]
    with pytest.raises(zerocc.ConfigError, match=r"(?s)zerocc.compile takes one optimizer, got a list of 2 \(Muon, "
                                                 r"AdamW\).*fix: one torch.optim.Optimizer whose param groups choose"):
        zerocc.compile(model, optimizers, stage=0, loss_fn=F.mse_loss)


def test_zero_redundancy_optimizer_is_refused_naming_the_one_it_wraps(tmp_path):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = Net()
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        with pytest.raises(zerocc.ConfigError, match=r"(?s)is a ZeroRedundancyOptimizer: .*ZeRO-1.*fix: pass the "
                                                     r"optimizer it wraps.*AdamW\(model.parameters\(\), ...\)"):
            zerocc.compile(model, optimizer, stage=1, loss_fn=F.mse_loss)
    finally:
        torch.distributed.destroy_process_group()


class _PreparedOptimizer(torch.optim.Optimizer):
    """What accelerate's accelerator.prepare returns (AcceleratedOptimizer): an Optimizer subclass that skips
    Optimizer.__init__ and forwards param_groups, state and step() to the optimizer it holds."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None):
        return self.optimizer.step(closure)


class _NoInit(torch.optim.Optimizer):
    def __init__(self, params):
        self.param_groups = [{"params": list(params), "lr": 0.1}]


@pytest.mark.parametrize("stage", [0, 3])
def test_an_optimizer_wrapper_from_accelerate_prepare_is_refused_naming_the_optimizer_it_wraps(stage):
    """Passing accelerate's prepared optimizer failed at the first call with an AttributeError about
    _optimizer_step_pre_hooks; the optimizer it wraps trains as eager."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    wrapper = _PreparedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    with pytest.raises(zerocc.ConfigError, match=r"(?s)\(tests\.test_optimizers\._PreparedOptimizer\) wraps the optimizer AdamW "
                                                 r"\(accelerator.prepare.*fix: pass the optimizer it wraps, "
                                                 r"zerocc.compile\(model, optimizer.optimizer, ...\)"):
        zerocc.compile(model, wrapper, stage=stage, loss_fn=F.mse_loss)
    with pytest.raises(zerocc.ConfigError, match=r"(?s)never ran torch.optim.Optimizer.__init__.*fix: call "
                                                 r"super\(\).__init__\(params, defaults\) in _NoInit.__init__"):
        zerocc.compile(model, _NoInit(model.parameters()), stage=stage, loss_fn=F.mse_loss)
    step = zerocc.compile(model, wrapper.optimizer, stage=stage, loss_fn=F.mse_loss)
    eager = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for tokens, target in data(batch=4):
        eager.zero_grad()
        loss = F.mse_loss(reference(tokens), target)
        loss.backward()
        eager.step()
        assert torch.equal(step(tokens, target), loss.detach())
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in step.full_state_dict().items())


def _muon_at_stage_0(rank, world_size):
    torch.manual_seed(0)
    model = Net()
    step = zerocc.compile(model, MuonWithAdamW(model.matrices(), model.others()), stage=0, loss_fn=F.mse_loss)
    losses = [step(tokens.chunk(world_size)[rank], target.chunk(world_size)[rank]) for tokens, target in data(batch=8)]
    return losses, step.full_state_dict()


@pytest.mark.multirank
def test_muon_with_adamw_at_stage_0_on_two_ranks_matches_one_process_on_the_global_batch():
    torch.manual_seed(0)
    reference = Net()
    optimizer = MuonWithAdamW(reference.matrices(), reference.others())
    expected = []
    for tokens, target in data(batch=8):
        optimizer.zero_grad()
        loss = F.mse_loss(reference(tokens), target)
        loss.backward()
        optimizer.step()
        expected.append(loss.detach())
    per_rank = distributed.run(_muon_at_stage_0, 2)
    # each rank's loss is its half's mean: their mean is the global batch's
    torch.testing.assert_close(torch.stack([(a + b) / 2 for a, b in zip(per_rank[0][0], per_rank[1][0])]),
                               torch.stack(expected), rtol=1e-5, atol=1e-6)
    for rank, (_, state) in enumerate(per_rank):
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {key}: {m}")
            assert torch.equal(state[key], per_rank[0][1][key]), f"rank {rank} {key}"
