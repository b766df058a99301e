"""Models that carry torch.compile'd pieces and higher-order ops train with zerocc as eager trains them.

Regional compilation (``block.compile()``, a ``@torch.compile`` helper), ``torch.compiler.disable`` inside a compiled
block and ``allow_in_graph`` are traced through the user's own code. ``flex_attention`` (a ``score_mod`` and a block
mask, called as it is or through ``torch.compile``) and ``torch.cond`` are higher-order ops: the fake mode capture
traces in had no rule for them (torch looks one up by the mode's exact class) and the autocast mode of the trace made
dynamo fail on the op itself. ``torch.compile`` around the step, or around a function that calls ``zerocc.compile``,
runs zerocc as it is. References are the same models built without torch.compile, run eagerly: a compiled piece
would run Inductor's kernels in the reference, which round otherwise.

flex_attention refuses a backward on the CPU (``_validate_device``) but its dense implementation, the one its eager
call runs, computes one there: the tests lift that check, in the reference as in the step, to stand for the GPU.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.attention.flex_attention as flex

import zerocc
from tests.distributed import run

SEQ, WIDTH, HEADS = 8, 16, 2


def _causal(batch, head, query, key):
    return query >= key


def _relative_bias(score, batch, head, query, key):
    return score + (query - key) * 0.1


@torch.compiler.disable
def _scaled_sine(x):   # a function the user keeps out of torch.compile
    return x.sin() * 2


@torch.compiler.allow_in_graph
def _shifted_tanh(x):
    return x.tanh() + 1


def _gelu_tanh(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * (x + 0.044715 * x ** 3)))


_compiled_gelu = torch.compile(_gelu_tanh)   # a helper decorated with @torch.compile


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return _scaled_sine(x + self.down(_shifted_tanh(self.up(self.norm(x)))))


class Regional(nn.Module):
    """Blocks compiled in place (``block.compile()``, as torchtitan does), a compiled helper between them."""

    def __init__(self, compiled: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 4)
        if compiled:
            for block in self.blocks:
                block.compile()
        self.gelu = _compiled_gelu if compiled else _gelu_tanh

    def forward(self, x, y):
        for block in self.blocks:
            x = self.gelu(block(x))
        return F.cross_entropy(self.head(x), y)


class FlexAttention(nn.Module):
    """Attention by flex_attention with a score_mod and a causal block mask, then a branch by torch.cond."""

    def __init__(self, compiled: bool):
        super().__init__()
        # no bias: the key's bias has a zero gradient (softmax ignores a shift), whose rounding noise AdamW scales
        # up to a step of lr, another one on each side of a two-rank comparison
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)
        self.attend = torch.compile(flex.flex_attention) if compiled else flex.flex_attention

    def forward(self, x, y):
        batch = x.shape[0]
        q, k, v = self.qkv(x).view(batch, SEQ, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        mask = flex.create_block_mask(_causal, None, None, SEQ, SEQ, device="cpu")
        o = self.attend(q, k, v, score_mod=_relative_bias, block_mask=mask)
        h = self.out(o.transpose(1, 2).reshape(batch, SEQ, WIDTH))
        # on a parameter, not the batch: each rank's half decides as the global batch does
        h = torch.cond(self.out.bias.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (h,))
        return F.cross_entropy(self.head(h).mean(1), y)


class CondOnly(nn.Module):
    def __init__(self, compiled: bool):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x, y):
        h = torch.cond(self.fc(x).sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (self.fc(x),))
        return F.cross_entropy(self.head(h), y)


MODELS = {"regional": Regional, "flex_attention": FlexAttention, "cond": CondOnly}


def _batches(name, steps, batch, seed=1):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, SEQ, WIDTH) if name == "flex_attention" else (batch, WIDTH)
    return [(torch.randn(*shape, generator=generator), torch.randint(0, 4, (batch,), generator=generator))
            for _ in range(steps)]


def _pair(name):
    """The model with its torch.compile'd pieces, and the same weights without them."""
    torch.manual_seed(0)
    model = MODELS[name](compiled=True)
    reference = MODELS[name](compiled=False)
    reference.load_state_dict(model.state_dict())
    return model, reference


def _eager_step(model, optimizer, batch):
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


def _lift_flex_cpu_check(monkeypatch):
    monkeypatch.setattr(flex, "_validate_device", lambda *args, **kwargs: None)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", ["regional", "flex_attention", "cond"])
def test_torch_compiled_pieces_and_higher_order_ops_train_bit_for_bit(name, stage, monkeypatch):
    _lift_flex_cpu_check(monkeypatch)
    model, reference = _pair(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.05), stage=stage)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for batch in _batches(name, 3, 4):
        assert torch.equal(step(*batch), _eager_step(reference, reference_optimizer, batch))
    full = step.full_state_dict()
    assert full.keys() == reference.state_dict().keys()
    assert all(torch.equal(full[key], value) for key, value in reference.state_dict().items())


@pytest.mark.parametrize("where", ["around_the_step", "around_zerocc_compile"])
def test_torch_compile_around_the_step_runs_it_as_it_is(where):
    """dynamo traced into zerocc and failed inside it ("RandomClassVariable() is not a constant"): zerocc's entry
    points are skipped by it, so the step runs, and trains, as it does without torch.compile."""
    model, reference = _pair("regional")
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    if where == "around_the_step":
        train = torch.compile(zerocc.compile(model, optimizer, stage=3))
    else:
        steps = []

        @torch.compile
        def train(x, y):
            if not steps:
                steps.append(zerocc.compile(model, optimizer, stage=3))
            return steps[0](x, y)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for batch in _batches("regional", 2, 4):
        assert torch.equal(train(*batch), _eager_step(reference, reference_optimizer, batch))


def _two_ranks(rank, world_size, name):
    flex._validate_device = lambda *args, **kwargs: None   # this rank's own process: as _lift_flex_cpu_check
    model, reference = _pair(name)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.05), stage=3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    losses = []
    for batch in _batches(name, 3, 4 * world_size):
        loss = step(*(t.chunk(world_size)[rank] for t in batch))
        losses.append((loss, _eager_step(reference, reference_optimizer, batch)))
    full = step.full_state_dict()
    return losses, {key: (full[key], value) for key, value in reference.state_dict().items()}


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["regional", "flex_attention"])
def test_two_ranks_train_like_one_process_on_the_global_batch(name):
    results = run(_two_ranks, 2, name)
    for (losses, state), (other, _) in zip(results, reversed(results)):
        for (loss, expected), (other_loss, _) in zip(losses, other):   # each rank's half: the mean is the global loss
            torch.testing.assert_close((loss + other_loss) / 2, expected, rtol=1e-5, atol=1e-6)
        for key, (trained, expected) in state.items():
            torch.testing.assert_close(trained, expected, rtol=1e-4, atol=1e-5, msg=key)


def _through_the_cache(rank, world_size, name, stage, folder):
    """Three steps of ``name`` with ``cache_dir`` beside eager, in a process of its own: the losses equal, the cache's
    outcome and the phases the compile timed."""
    validate = flex._validate_device
    flex._validate_device = lambda *args, **kwargs: None   # as _lift_flex_cpu_check, in this process
    try:
        model, reference = _pair(name)
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=0.05), stage=stage, cache_dir=folder)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
        equal = [torch.equal(step(*batch), _eager_step(reference, reference_optimizer, batch))
                 for batch in _batches(name, 3, 4)]
        full = step.full_state_dict()
        equal.append(all(torch.equal(full[key], value) for key, value in reference.state_dict().items()))
        report = step.report()
        return equal, report["compile_cache"], list(report["compile_seconds_by_phase"])
    finally:
        flex._validate_device = validate


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("name", ["flex_attention", "cond"])
def test_a_program_with_higher_order_ops_is_stored_and_a_new_process_loads_it(name, stage, tmp_path):
    """A program holding torch.cond or flex_attention was not stored by the compile cache ("not stored: Can't pickle
    local object 'HigherOrderOperator.py_autograd_impl...'"): the op is now written by its name. A new process loads
    it, traces nothing, runs no pass, and trains bit for bit like eager."""
    folder = str(tmp_path / "cache")
    [(cold, cold_outcome, _)] = run(_through_the_cache, 1, name, stage, folder)
    [(warm, warm_outcome, warm_phases)] = run(_through_the_cache, 1, name, stage, folder)
    assert cold_outcome.startswith("miss (no entry), then stored"), cold_outcome
    assert warm_outcome == "loaded", warm_outcome
    assert "capture: trace" not in warm_phases and not any(phase.startswith("pass ") for phase in warm_phases)
    assert all(cold) and all(warm), (cold, warm)
