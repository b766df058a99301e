"""Capture meets the user's own code and tools: tensor attributes, module hooks, dispatch modes, MemTracker."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from zerocc.capture import capture, tensor_attributes
from zerocc.tracing import make_fake_mode


class CountingAttribute(nn.Module):
    """Counts its calls in a plain tensor attribute (not a buffer) and scales by a read-only one."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.counter = torch.zeros(())
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        self.counter += 1
        return self.linear(x).square().mean() * self.counter * self.scale


class CountingBuffer(nn.Module):
    """The fix the error names: the counter as a buffer, which the step carries."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 5)
        self.register_buffer("counter", torch.zeros(()))
        self.scale = torch.tensor(2.0)

    def forward(self, x):
        self.counter += 1
        return self.linear(x).square().mean() * self.counter * self.scale


class Normalized(nn.Module):
    """Parameters, BatchNorm buffers and read-only tensor attributes of several sizes."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(12, 8)
        self.norm = nn.BatchNorm1d(8)
        self.shift = torch.linspace(-1, 1, 8)
        self.scale = torch.tensor(0.5)

    def forward(self, x):
        return (self.norm(self.linear(x)) * self.scale + self.shift).square().mean()


def every_tensor(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    tensors = {f"param {name}": t for name, t in model.named_parameters()}
    tensors |= {f"buffer {name}": t for name, t in model.named_buffers()}
    tensors |= {f"attribute {name}": t for name, t in tensor_attributes(model).values()}
    for index, state in enumerate(optimizer.state.values()):
        tensors |= {f"state {index} {key}": t for key, t in state.items() if isinstance(t, torch.Tensor)}
    return tensors


def eager(model, optimizer, *batch):
    optimizer.zero_grad(set_to_none=True)
    loss = model(*batch)
    loss.backward()
    optimizer.step()
    return loss.detach()


# -- tensor attributes that forward changes in place ----------------------------------

@pytest.mark.parametrize("stage", [0, 3])
def test_a_tensor_attribute_written_in_forward_is_refused_naming_it_and_left_as_it_was(stage):
    model = CountingAttribute()
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    with pytest.raises(zerocc.CaptureError, match=r"(?s)neither parameters nor buffers:\n  - 'counter' by add_ at "
                       r".*test_user_tooling.py:\d+: self.counter \+= 1\n.*"
                       r"fix: register it as a buffer .*self.register_buffer\('counter', torch.zeros\(\(\)\)\)"):
        step(torch.randn(4, 12))
    assert torch.equal(model.counter, torch.zeros(())) and torch.equal(model.scale, torch.tensor(2.0))


@pytest.mark.parametrize("stage", [0, 3])
def test_the_counter_as_a_buffer_counts_like_eager(stage):
    torch.manual_seed(0)
    model = CountingBuffer()
    reference = copy.deepcopy(model)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 12, generator=generator)
        assert torch.equal(step(x), eager(reference, reference_optimizer, x))
    assert torch.equal(step.full_state_dict()["counter"], torch.tensor(3.0))
    assert torch.equal(model.scale, torch.tensor(2.0))


def test_capture_leaves_every_tensor_reachable_from_the_model_and_optimizer_untouched():
    torch.manual_seed(0)
    model = Normalized()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    eager(model, optimizer, torch.randn(4, 12))   # optimizer state exists, BatchNorm statistics moved
    before = {name: (t._version, t.detach().clone()) for name, t in every_tensor(model, optimizer).items()}
    capture(model, optimizer, [torch.randn(4, 12)], loss_fn=None, num_targets=0, fake_mode=make_fake_mode())
    after = every_tensor(model, optimizer)
    assert after.keys() == before.keys()
    changed = [name for name, (version, value) in before.items()
               if after[name]._version != version or not torch.equal(after[name], value)]
    assert not changed
