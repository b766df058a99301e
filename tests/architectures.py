"""Architectures beyond transformers: each a small model whose step zerocc must compile unchanged."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ResNet(nn.Module):
    """Residual blocks with BatchNorm and a projection shortcut."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.block1 = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                                    nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8))
        self.down = nn.Sequential(nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16))
        self.shortcut = nn.Conv2d(8, 16, 1, stride=2, bias=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x, y):
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(x + self.block1(x))
        x = F.relu(self.shortcut(x) + self.down(x))
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


class UNet(nn.Module):
    """Encoder-decoder with skip connections concatenated across the bottleneck."""

    def __init__(self):
        super().__init__()
        self.enc1 = nn.Conv2d(3, 8, 3, padding=1)
        self.enc2 = nn.Conv2d(8, 16, 3, padding=1)
        self.mid = nn.Conv2d(16, 16, 3, padding=1)
        self.up = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.dec2 = nn.Conv2d(32, 8, 3, padding=1)
        self.up1 = nn.ConvTranspose2d(8, 8, 2, stride=2)
        self.dec1 = nn.Conv2d(16, 1, 3, padding=1)

    def forward(self, x, target):
        e1 = F.relu(self.enc1(x))                       # 16x16
        e2 = F.relu(self.enc2(F.max_pool2d(e1, 2)))     # 8x8
        m = F.relu(self.mid(F.max_pool2d(e2, 2)))       # 4x4
        d2 = F.relu(self.dec2(torch.cat([self.up(m), e2], 1)))
        out = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return F.mse_loss(out, target)


class Recurrent(nn.Module):
    """An LSTM and a GRU stacked, classifying sequences."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.lstm = nn.LSTM(16, 24, batch_first=True)
        self.gru = nn.GRU(24, 24, batch_first=True)
        self.head = nn.Linear(24, 4)

    def forward(self, tokens, y):
        h, _ = self.lstm(self.embed(tokens))
        h, _ = self.gru(h)
        return F.cross_entropy(self.head(h[:, -1]), y)


class MixtureOfExperts(nn.Module):
    """Top-2 routing over 4 experts, written densely (every expert sees every token, weighted by its gate)."""

    def __init__(self, d=16, experts=4, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, 32) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, 32, d) * 0.1)
        self.head = nn.Linear(d, 3)

    def forward(self, x, y):
        scores = self.router(x)                                   # tokens x experts
        top, index = scores.topk(self.k, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, index, F.softmax(top, dim=-1))
        hidden = F.gelu(torch.einsum("td,edh->teh", x, self.w1))
        out = torch.einsum("teh,ehd->ted", hidden, self.w2)
        mixed = (gates.unsqueeze(-1) * out).sum(1)
        return F.cross_entropy(self.head(x + mixed), y)


class MessagePassing(nn.Module):
    """A graph network: messages gathered along edges, summed into nodes with index_add."""

    def __init__(self, d=8):
        super().__init__()
        self.encode = nn.Linear(4, d)
        self.message = nn.Linear(2 * d, d)
        self.update = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, features, edges, target):
        h = F.relu(self.encode(features))
        for _ in range(2):
            source, destination = edges
            messages = F.relu(self.message(torch.cat([h[source], h[destination]], -1)))
            summed = torch.zeros_like(h).index_add(0, destination, messages)
            h = F.relu(self.update(torch.cat([h, summed], -1)))
        return F.mse_loss(self.head(h).squeeze(-1), target)


class EncoderDecoder(nn.Module):
    """nn.Transformer (encoder and decoder stacks, cross attention), dropout off."""

    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.transformer = nn.Transformer(d, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                          dim_feedforward=32, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, source, target):
        mask = nn.Transformer.generate_square_subsequent_mask(target.shape[1] - 1)
        decoded = self.transformer(self.embed(source), self.embed(target[:, :-1]), tgt_mask=mask, tgt_is_causal=True)
        logits = self.out(decoded)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1))


class ScaleGradient(torch.autograd.Function):
    """A custom autograd Function: identity forward, gradient scaled by 0.5 in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


@torch.library.custom_op("zerocc_tests::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A custom op (torch.library): one opaque node in the traced graph, with its own fake and backward."""
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _scaled_tanh_fake(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_setup(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_backward(x)
    ctx.scale = scale


def _scaled_tanh_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * ctx.scale * (1 - torch.tanh(x) ** 2), None


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class FrozenAndCustom(nn.Module):
    """A frozen layer (requires_grad=False), a custom autograd Function, a custom op, a weight used twice."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(12, 16)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        h = torch.tanh(self.frozen(x))
        h = torch.tanh(self.shared(ScaleGradient.apply(h)))
        h = scaled_tanh(self.shared(h), 0.5)    # the same weight, used a second time, through a custom op
        return F.mse_loss(self.head(h), y)


@torch.library.custom_op("zerocc_tests::running_mean_", mutates_args=("running",))
def running_mean_(running: torch.Tensor, x: torch.Tensor, momentum: float) -> None:
    """A custom op that writes into its argument (a kernel updating a running statistic in place)."""
    running.mul_(1 - momentum).add_(x.mean(0), alpha=momentum)


@running_mean_.register_fake
def _running_mean_fake(running, x, momentum):
    return None


@torch.library.custom_op("zerocc_tests::scaled_into", mutates_args=("out",))
def scaled_into(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """A custom op with an ``out=`` argument: it writes its result into a tensor the caller made."""
    torch.mul(x, scale, out=out)


@scaled_into.register_fake
def _scaled_into_fake(x, scale, out):
    return None


class WritingCustomOps(nn.Module):
    """Custom ops declared with ``mutates_args``: one updates a buffer (``per_sample``: from the batch's mean,
    which two ranks see apart; else by a constant), one writes into an ``out=`` tensor made in forward."""

    def __init__(self, per_sample=True):
        super().__init__()
        self.per_sample = per_sample
        self.embed = nn.Linear(12, 16)
        self.register_buffer("running", torch.zeros(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        h = torch.tanh(self.embed(x))
        running_mean_(self.running, h.detach() if self.per_sample else torch.ones_like(h), 0.1)
        out = torch.empty_like(h)
        scaled_into(h.detach(), 0.5, out)
        return F.mse_loss(self.head(h - self.running + out), y)


class SlidingWindows(nn.Module):
    """Longformer's overlapping chunks: ``as_strided`` windows of an activation and of a parameter.

    The windows' backward (``as_strided_backward``) and a window taken with an explicit storage offset (one
    ahead of the parameter's start, one reaching back from a slice to its base) read through ``as_strided``
    with offsets counted from the storage's start, while zerocc moves the tensors (arenas, buckets).
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.positions = nn.Parameter(torch.randn(48))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        h = self.embed(x)                                                               # (b, 8, 16)
        b = h.shape[0]
        windows = h.as_strided((b, 3, 4, 16), (h.stride(0), 2 * h.stride(1), h.stride(1), 1))   # overlapping by 2 rows
        ahead = self.positions.as_strided((4, 16), (6, 1), 8)                           # from element 8 on
        first_rows = h[:, 4:].as_strided((b, 16), (h.stride(0), 1), 0)                  # row 0, reached from row 4
        scores = (windows * ahead).sum((1, 2)) + first_rows
        return F.mse_loss(self.head(torch.tanh(scores)), y)


class _Reversible(torch.autograd.Function):
    """Reformer's reversible layers (RevNet): forward keeps no activations; backward recomputes each half of
    the block from its output and calls ``backward()`` on it, which accumulates the parameters' gradients into
    ``.grad`` instead of returning them."""

    @staticmethod
    def forward(ctx, x1, x2, f, g):
        y1 = x1 + f(x2)
        y2 = x2 + g(y1)
        ctx.save_for_backward(y1, y2)
        ctx.f, ctx.g = f, g
        return y1, y2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        with torch.enable_grad():
            y1 = y1.detach().requires_grad_(True)
            g_y1 = ctx.g(y1)
            g_y1.backward(dy2)
        with torch.no_grad():
            x2 = y2 - g_y1
            dx1 = dy1 + y1.grad
        with torch.enable_grad():
            x2 = x2.detach().requires_grad_(True)
            ctx.f(x2).backward(dx1)
        return dx1, dy2 + x2.grad, None, None


class Reversible(nn.Module):
    """Two reversible blocks between an embedding and a head that autograd differentiates as usual."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                                                   nn.Sequential(nn.Linear(8, 8), nn.Tanh())]) for _ in range(2))
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        x1, x2 = self.embed(x).chunk(2, dim=-1)
        for f, g in self.blocks:
            x1, x2 = _Reversible.apply(x1, x2, f, g)
        return F.mse_loss(self.head(torch.cat([x1, x2], -1)), y)


class _ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(tdim, cout)
        self.norm2, self.drop, self.conv2 = nn.GroupNorm(4, cout), nn.Dropout(0.1), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(emb))[:, :, None, None]
        return self.skip(x) + self.conv2(self.drop(F.silu(self.norm2(h))))


class _SpatialAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm, self.qkv, self.out = nn.GroupNorm(4, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        weights = torch.einsum("bci,bcj->bij", q, k).mul(c ** -0.5).softmax(-1)
        return x + self.out(torch.einsum("bij,bcj->bci", weights, v).reshape(b, c, h, w))


class DiffusionUNet(nn.Module):
    """A DDPM step as diffusion code writes it: timesteps and noise drawn in forward, the class label dropped at
    random for classifier-free guidance, a sinusoidal timestep embedding, GroupNorm, SiLU, attention, skips
    concatenated, nearest upsampling."""

    def __init__(self, c=8, classes=4, steps=100, p_uncond=0.2):
        super().__init__()
        self.c, self.classes, self.steps, self.p_uncond = c, classes, steps, p_uncond
        self.register_buffer("alpha_bar", torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps), 0), persistent=False)
        self.time = nn.Sequential(nn.Linear(c, 4 * c), nn.SiLU(), nn.Linear(4 * c, 4 * c))
        self.label = nn.Embedding(classes + 1, 4 * c)   # the last row: no label
        self.inp = nn.Conv2d(3, c, 3, padding=1)
        self.down1, self.down = _ResBlock(c, c, 4 * c), nn.Conv2d(c, c, 3, 2, 1)
        self.down2, self.attn = _ResBlock(c, 2 * c, 4 * c), _SpatialAttention(2 * c)
        self.up2, self.up = _ResBlock(4 * c, 2 * c, 4 * c), nn.Conv2d(2 * c, 2 * c, 3, padding=1)
        self.up1, self.norm, self.out = _ResBlock(3 * c, c, 4 * c), nn.GroupNorm(4, c), nn.Conv2d(c, 3, 3, padding=1)

    def denoise(self, x, t, labels):
        half = self.c // 2
        frequencies = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        angles = t[:, None].float() * frequencies[None]
        emb = self.time(torch.cat([angles.cos(), angles.sin()], -1).to(x.dtype))
        drop = torch.rand(labels.shape[0]) < self.p_uncond
        emb = emb + self.label(torch.where(drop, torch.full_like(labels, self.classes), labels))
        h1 = self.down1(self.inp(x), emb)
        h2 = self.attn(self.down2(self.down(h1), emb))
        h = self.up2(torch.cat([h2, h2], 1), emb)
        h = self.up1(torch.cat([self.up(F.interpolate(h, scale_factor=2, mode="nearest")), h1], 1), emb)
        return self.out(F.silu(self.norm(h)))

    def forward(self, images, labels):
        t = torch.randint(0, self.steps, (images.shape[0],))
        noise = torch.randn_like(images)
        a = self.alpha_bar[t][:, None, None, None].to(images.dtype)
        return F.mse_loss(self.denoise(a.sqrt() * images + (1 - a).sqrt() * noise, t, labels), noise)


def _images(g, b):
    return torch.randn(b, 3, 16, 16, generator=g), torch.randint(0, 10, (b,), generator=g)


def _graph(g, b):
    nodes = 6 * b
    edges = torch.randint(0, nodes, (2, 4 * nodes), generator=g)
    return torch.randn(nodes, 4, generator=g), edges, torch.randn(nodes, generator=g)


ARCHITECTURES = {
    "resnet": (ResNet, _images),
    "unet": (UNet, lambda g, b: (torch.randn(b, 3, 16, 16, generator=g), torch.randn(b, 1, 16, 16, generator=g))),
    "recurrent": (Recurrent, lambda g, b: (torch.randint(0, 32, (b, 10), generator=g), torch.randint(0, 4, (b,), generator=g))),
    "moe": (MixtureOfExperts, lambda g, b: (torch.randn(4 * b, 16, generator=g), torch.randint(0, 3, (4 * b,), generator=g))),
    "gnn": (MessagePassing, _graph),
    "encoder_decoder": (EncoderDecoder, lambda g, b: (torch.randint(0, 32, (b, 7), generator=g), torch.randint(0, 32, (b, 6), generator=g))),
    "frozen_custom": (FrozenAndCustom, lambda g, b: (torch.randn(b, 12, generator=g), torch.randn(b, 5, generator=g))),
    "windows": (SlidingWindows, lambda g, b: (torch.randn(b, 8, 8, generator=g), torch.randn(b, 4, generator=g))),
    "reversible": (Reversible, lambda g, b: (torch.randn(b, 12, generator=g), torch.randn(b, 5, generator=g))),
}


def build_architecture(name, seed=0):
    torch.manual_seed(seed)
    return ARCHITECTURES[name][0]()


def architecture_batches(name, steps, batch, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [ARCHITECTURES[name][1](generator, batch) for _ in range(steps)]
