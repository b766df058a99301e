"""Small models the tests train: each factory returns (model, batch maker, loss_fn)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        # no bias: a key bias gets a gradient of exactly zero in theory (softmax ignores a
        # constant shift), so Adam turns its rounding noise into full-size updates
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT with tied input and output embeddings; returns the loss when given targets."""

    def __init__(self, vocab=64, d=32, layers=2, heads=4, seq=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight   # tied

    def forward(self, idx, targets):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


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
