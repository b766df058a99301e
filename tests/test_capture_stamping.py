"""Trace one block, stamp the rest (``ZEROCC_STAMP=1``, zerocc/stamping.py): the stamped graph is the traced one.

Each test compares the program captured with stamping against the one captured without, node by node modulo
names (target, arguments, the fake value's layout and aliasing, stack trace, module path), and trains against
eager PyTorch bit for bit; the refusals check that a look-alike block that is not the same ops is traced whole.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from zerocc import stamping
from zerocc.capture import capture
from zerocc.tracing import make_fake_mode


class Block(nn.Module):
    """examples/gpt.py's block, with an optional per-block flag that changes its ops."""

    def __init__(self, d: int, heads: int, gated: bool = False, dropout: float = 0.0):
        super().__init__()
        self.heads, self.gated = heads, gated
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(attention.transpose(1, 2).reshape(b, t, d)))
        h = self.fc(self.ln2(x))
        return x + self.out(torch.sigmoid(h) * h if self.gated else F.gelu(h))


class GPT(nn.Module):
    def __init__(self, layers=3, d=32, vocab=64, seq=16, gated=(), dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, 4, i in gated, dropout) for i in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens, targets):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def _batches(steps=3, batch=2, seq=16, vocab=64):
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=generator) for _ in range(steps)]


def _captured(model, monkeypatch, stamp: bool, **options):
    monkeypatch.setenv(stamping.ENV, "1" if stamp else "0")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = _batches(1, batch=4)[0]
    return capture(model, optimizer, [tokens[:, :-1], tokens[:, 1:]], loss_fn=None, num_targets=0,
                   fake_mode=make_fake_mode(), **options).gm


def _canonical(gm) -> list:
    names = {node: f"n{i}" for i, node in enumerate(gm.graph.nodes)}
    storages: dict[int, int] = {}
    rows = []
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        layout = (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, type(value).__name__,
                  value.requires_grad, str(value.device),
                  storages.setdefault(value.untyped_storage()._cdata, len(storages))) \
            if isinstance(value, torch.Tensor) else repr(value)
        rows.append((node.op, str(node.target), str(fx.node.map_arg((node.args, node.kwargs), names.get)), layout,
                     node.meta.get("stack_trace"), str(node.meta.get("nn_module_stack"))))
    return rows


def _stamped_equals_traced(build, monkeypatch, **options) -> stamping.Stamper:
    torch.manual_seed(0)
    model = build()
    traced = _canonical(_captured(model, monkeypatch, False, **options))
    stamped = _canonical(_captured(model, monkeypatch, True, **options))
    assert len(stamped) == len(traced)
    for row, (a, b) in enumerate(zip(traced, stamped)):
        assert a == b, f"node {row} differs"
    return stamping.LAST[0]


def test_the_stamped_gpt_program_is_the_traced_one_node_for_node(monkeypatch):
    stamper = _stamped_equals_traced(lambda: GPT(layers=4), monkeypatch)
    assert stamper.stamped == 3, stamper.refused


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_stamped_gpt_trains_as_eager_bit_for_bit(stage, monkeypatch):
    monkeypatch.setenv(stamping.ENV, "1")
    torch.manual_seed(0)
    reference = GPT(layers=3)
    model = copy.deepcopy(reference)
    eager_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage)
    for tokens in _batches():
        eager_optimizer.zero_grad()
        expected = reference(tokens[:, :-1], tokens[:, 1:])
        expected.backward()
        eager_optimizer.step()
        assert torch.equal(step(tokens[:, :-1], tokens[:, 1:]), expected.detach())
        assert stamping.LAST[0].stamped == 2
    with step.full_model():
        for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
            assert torch.equal(actual, expected), name


def test_a_block_whose_flag_changes_its_ops_is_not_stamped_from_another(monkeypatch):
    # blocks 1 and 3 gate their MLP: same parameters, other ops; each kind is stamped from its own first call
    stamper = _stamped_equals_traced(lambda: GPT(layers=4, gated=(1, 3)), monkeypatch)
    assert stamper.stamped == 2, stamper.refused


def test_a_block_that_draws_random_numbers_is_traced_whole(monkeypatch):
    stamper = _stamped_equals_traced(lambda: GPT(layers=3, dropout=0.1), monkeypatch)
    assert stamper.stamped == 0 and "random" in stamper.refused


def test_micro_batches_stamp_from_the_first_micro_batchs_block(monkeypatch):
    # the second micro-batch's first block is a stamped call too, its input the copy of an earlier stamped call's
    stamper = _stamped_equals_traced(lambda: GPT(layers=4), monkeypatch, grad_accumulation=2)
    assert stamper.stamped == 7, stamper.refused


def test_a_frozen_block_is_stamped_from_its_own_kind(monkeypatch):
    def build():
        model = GPT(layers=4)
        model.blocks[1].requires_grad_(False)
        return model
    stamper = _stamped_equals_traced(build, monkeypatch)
    assert stamper.stamped == 2, stamper.refused


def test_blocks_under_autocast_are_stamped(monkeypatch):
    with torch.autocast("cpu", torch.bfloat16):
        stamper = _stamped_equals_traced(lambda: GPT(layers=4), monkeypatch)
    assert stamper.stamped == 3, stamper.refused


class Heads(nn.Module):
    """Look-alike heads inside look-alike layers: only the layers are stamped (a copy holds its heads' nodes)."""

    def __init__(self, d=16, heads=3):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(heads))

    def forward(self, x):
        for head in self.heads:
            x = x + head(x)
        return x


class Nested(nn.Module):
    def __init__(self, layers=3, d=16):
        super().__init__()
        self.layers = nn.ModuleList(Heads(d) for _ in range(layers))

    def forward(self, tokens, targets):
        x = F.one_hot(tokens % 16, 16).float()
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(x.mean(-1), targets.float())


def test_look_alike_modules_inside_a_stamped_block_are_its_nodes(monkeypatch):
    stamper = _stamped_equals_traced(Nested, monkeypatch)
    # the first layer's input needs no gradient (traced as is): the second is the template, the third its copy
    assert stamper.stamped == 1, stamper.refused
