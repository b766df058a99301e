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


def mlp_batch(generator, batch):
    return torch.randn(batch, 12, generator=generator), torch.randn(batch, 5, generator=generator)


def gpt_batch(generator, batch):
    idx = torch.randint(0, 64, (batch, 16), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def conv_batch(generator, batch):
    return torch.randn(batch, 3, 16, 16, generator=generator), torch.randint(0, 10, (batch,), generator=generator)


# name -> (factory, batch maker, loss_fn or None when the model returns its loss)
ZOO = {
    "mlp": (MLP, mlp_batch, F.mse_loss),
    "gpt": (TinyGPT, gpt_batch, None),
    "cnn": (ConvNet, conv_batch, F.cross_entropy),
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
