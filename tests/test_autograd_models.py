"""Models whose loss differentiates inside forward, and parametrized weights: bit for bit like eager."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import zerocc


class GradientPenalty(nn.Module):
    """WGAN-GP's critic loss: the penalty on the critic's gradient in its input (``create_graph=True``)."""

    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, real, fake):
        eps = torch.rand(real.shape[0], 1)
        mix = (eps * real + (1 - eps) * fake).requires_grad_(True)
        (slope,) = torch.autograd.grad(self.critic(mix).sum(), mix, create_graph=True)
        penalty = ((slope.norm(2, dim=1) - 1) ** 2).mean()
        return self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty


class PhysicsInformed(nn.Module):
    """Burgers' residual: first and second derivatives of the output in the input."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, xt, _):
        xt = xt.clone().requires_grad_(True)
        u = self.net(xt)
        (du,) = torch.autograd.grad(u, xt, torch.ones_like(u), create_graph=True)
        (ddu,) = torch.autograd.grad(du[:, :1], xt, torch.ones_like(u), create_graph=True)
        return ((du[:, 1:] + u * du[:, :1] - 0.01 * ddu[:, :1]) ** 2).mean()


class PerSampleGradients(nn.Module):
    """``vmap(grad(f))`` per sample inside forward, the gradient norms weighting the loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y):
        params = dict(self.net.named_parameters())

        def one(p, row, target):
            return F.mse_loss(functional_call(self.net, p, (row[None],)), target[None])

        losses = vmap(one, in_dims=(None, 0, 0))(params, x, y)
        norms = sum(g.flatten(1).norm(dim=1) for g in vmap(grad(one), in_dims=(None, 0, 0))(params, x, y).values())
        return (losses * torch.softmax(-norms.detach(), 0)).sum() + 0.001 * norms.mean()


class Parametrized(nn.Module):
    """weight_norm, spectral_norm (power-iteration buffers written in forward) and orthogonal parametrizations."""

    def __init__(self):
        super().__init__()
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(6, 8))
        self.spectral = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.orthogonal = nn.utils.parametrizations.orthogonal(nn.Linear(8, 1))

    def forward(self, x, y):
        return F.mse_loss(self.orthogonal(torch.tanh(self.spectral(torch.tanh(self.norm(x))))), y)


MODELS = {"gradient_penalty": GradientPenalty, "physics_informed": PhysicsInformed,
          "per_sample_gradients": PerSampleGradients, "parametrized": Parametrized}


def _batches(name):
    generator = torch.Generator().manual_seed(0)
    second = (8, 6) if name == "gradient_penalty" else (8,) if name == "per_sample_gradients" else (8, 1)
    first = (8, 2) if name == "physics_informed" else (8, 6)
    return [(torch.randn(first, generator=generator), torch.randn(second, generator=generator)) for _ in range(3)]


def _trained(name, compiled, stage):
    torch.manual_seed(0)
    model = MODELS[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = zerocc.compile(model, optimizer, stage=stage, grad_accumulation=2) if compiled else None
    losses = []
    torch.manual_seed(1)
    for batch in _batches(name):
        if step is not None:
            losses.append(step(*batch))
            continue
        optimizer.zero_grad(set_to_none=True)
        total = 0
        for micro in zip(*(t.chunk(2) for t in batch)):
            loss = model(*micro) / 2
            loss.backward()
            total = total + loss.detach()
        optimizer.step()
        losses.append(total)
    return losses, (step.full_state_dict() if step is not None else model.state_dict())


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_loss_that_differentiates_in_forward_or_a_parametrized_weight_trains_as_eager(name, stage):
    expected_losses, expected = _trained(name, False, stage)
    losses, state = _trained(name, True, stage)
    for got, want in zip(losses, expected_losses):
        assert torch.equal(got, want)
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
