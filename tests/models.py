"""Small models the tests train: each factory returns (model, batch maker, loss_fn)."""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT  # noqa: E402  (examples/gpt.py: the model the example and the benchmarks train)


class MLP(nn.Module):
    def __init__(self, width=32, depth=3, out=5):
        super().__init__()
        layers = [nn.Linear(12, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        layers.append(nn.Linear(width, out))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


def TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16):
    """The example GPT (tied input and output embeddings; returns the loss), tiny, with PyTorch's default init."""
    return GPT(vocab=vocab, d_model=d, layers=layers, heads=heads, seq=seq, gpt2_init=False)


class BooleanMask(nn.Module):
    """Boolean-mask indexing: how many rows reach the linear layer depends on the data."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)

    def forward(self, x):
        return self.linear(x[x.sum(1) > 0]).square().mean()


class ConvNet(nn.Module):
    """A CNN with BatchNorm, whose running statistics are buffers the step updates."""

    def __init__(self, classes=10):
        super().__init__()
        # no conv bias before BatchNorm: its gradient is zero in theory, so Adam would
        # amplify rounding noise (and it is dead weight, as in every ResNet)
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(x.flatten(1))


class CenteredHead(nn.Module):
    """DINO's head in small: forward *reassigns* a center buffer under no_grad (``self.center = ...``, which
    ``Module.__setattr__`` puts in ``_buffers``) rather than writing it in place as BatchNorm does; the model returns
    its loss. Across ranks the batch center is all-reduced with the traceable collective, as DINO all-reduces it."""

    def __init__(self, width=16, out=8):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(12, width), nn.GELU(), nn.Linear(width, out))
        self.register_buffer("center", torch.zeros(1, out))

    def forward(self, x):
        out = self.net(x)
        loss = torch.sum(-F.softmax((out - self.center) / 0.5, -1).detach() * F.log_softmax(out, -1), -1).mean()
        with torch.no_grad():
            total = out.float().sum(0, keepdim=True)
            rows = len(out)
            if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
                import torch.distributed._functional_collectives as funcol
                total = funcol.all_reduce(total, "sum", torch.distributed.group.WORLD)
                rows *= torch.distributed.get_world_size()
            self.center = self.center * 0.9 + total / rows * 0.1
        return loss


class RoutedExperts(nn.Module):
    """A small LM whose feed-forward is a top-2 mixture of four experts, as first MoEs write it: each expert's tokens
    found with torch.where (a data-dependent count), a Switch-style load-balancing auxiliary loss added to the loss,
    and a router buffer (tokens per expert) written in forward under no_grad, as torchtitan counts them."""

    def __init__(self, width=16, hidden=32, experts=4, vocab=64):
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) / width ** 0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) / hidden ** 0.5)
        self.head = nn.Linear(width, vocab)
        self.experts = experts
        self.register_buffer("tokens_per_expert", torch.zeros(experts))

    def forward(self, ids, labels):
        h = self.embedding(ids)
        x = self.norm(h).flatten(0, 1)
        scores = self.router(x).float().softmax(-1)
        gates, chosen = scores.topk(2, dim=-1)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype)
        with torch.no_grad():
            counts = torch.histc(chosen.float(), bins=self.experts, min=0, max=self.experts - 1)
            self.tokens_per_expert += counts
        aux = self.experts * (counts / chosen.numel() * scores.mean(0)).sum()
        out = torch.zeros_like(x)
        for e in range(self.experts):
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, F.silu(x[token] @ self.w1[e]) @ self.w2[e] * gates[token, slot, None])
        h = h + out.view_as(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten()) + 0.01 * aux


def mlp_batch(generator, batch):
    return torch.randn(batch, 12, generator=generator), torch.randn(batch, 5, generator=generator)


def gpt_batch(generator, batch):
    idx = torch.randint(0, 64, (batch, 16), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def centered_batch(generator, batch):
    return (torch.randn(batch, 12, generator=generator),)


def token_batch(generator, batch):
    ids = torch.randint(0, 64, (batch, 8), generator=generator)
    return ids, ids.roll(1, 1)


def conv_batch(generator, batch):
    return torch.randn(batch, 3, 16, 16, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


# name -> (factory, batch maker, loss_fn or None when the model returns its loss)
ZOO = {
    "mlp": (MLP, mlp_batch, F.mse_loss),
    "gpt": (TinyGPT, gpt_batch, None),
    "cnn": (ConvNet, conv_batch, F.cross_entropy),
    "centered": (CenteredHead, centered_batch, None),   # a buffer forward reassigns (DINO's center)
    "moe": (RoutedExperts, token_batch, None),          # routed experts, an aux loss, a buffer forward writes
}


def build(name, seed=0):
    factory, batch_maker, loss_fn = ZOO[name]
    torch.manual_seed(seed)
    return factory(), batch_maker, loss_fn


def batches(name, steps, batch, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [ZOO[name][1](generator, batch) for _ in range(steps)]


def eager_step(model, optimizer, loss_fn, batch):
    """One step of plain PyTorch training: the reference every test compares against."""
    optimizer.zero_grad(set_to_none=True)
    if loss_fn is None:
        loss = model(*batch)
    else:
        loss = loss_fn(model(*batch[:-1]), batch[-1])
    loss.backward()
    optimizer.step()
    return loss.detach()
