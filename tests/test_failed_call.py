"""A first call that fails leaves the step, the model and the optimizer as they were: the next call trains as eager."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerocc
from tests.models import batches, build, eager_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.mark.parametrize("stage", [0, 3])
def test_failed_first_calls_change_nothing(stage):
    model, _, loss_fn = build("gpt")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
    data = batches("gpt", 2, 8)
    with pytest.raises(IndexError, match="index out of range"):
        step(data[0][0] + 1000, data[0][1])         # a token id past the vocabulary fails in the program
    with pytest.raises(zerocc.CaptureError, match="tracing the training step failed"):
        step(data[0][0].double(), data[0][1])       # a float64 batch fails in capture
    assert step.steps == 0 and not step.optimizer.state
    for key, value in model.state_dict().items():   # the model is whole and unchanged: eager code can use it
        assert torch.equal(value, before[key]), key

    reference, _, _ = build("gpt")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in data:
        assert torch.equal(step(*batch), eager_step(reference, optimizer, loss_fn, batch))


class NormThenLookup(torch.nn.Module):
    """BatchNorm counting its batches, then an embedding lookup that fails on a token id past its table, after the
    count was updated."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.emb = torch.nn.Embedding(10, 2)

    def forward(self, x, ids):
        return self.bn(self.fc(x)).sum(1, keepdim=True) + self.emb(ids)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_failed_call_leaves_buffers_updated_before_the_failure_unchanged(stage):
    """With memory pools, ``num_batches_tracked += 1`` was written into its slot in forward, before the lookup
    failed: a failed call (first or later) left the count one higher than eager's without the bad batches."""
    model, reference = NormThenLookup(), NormThenLookup()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    step = zerocc.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), stage=stage,
                          loss_fn=torch.nn.functional.mse_loss, memory_pools=True)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=generator), torch.randint(0, 10, (4,), generator=generator),
             torch.randn(4, 2, generator=generator)) for _ in range(3)]
    bad = (data[0][0], torch.full((4,), 50), data[0][2])
    with pytest.raises(IndexError, match="index out of range"):
        step(*bad)
    assert int(model.bn.num_batches_tracked) == 0
    for number, batch in enumerate(data):
        assert torch.equal(step(*batch), eager_step(reference, optimizer, torch.nn.functional.mse_loss, batch))
        if number == 0:
            with pytest.raises(IndexError, match="index out of range"):
                step(*bad)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


class _AtOp(TorchDispatchMode):
    """Counts the ops the step runs; at op ``at``, sends this process SIGINT (Ctrl-C) or raises ``error``."""

    def __init__(self, at=None, error=None):
        super().__init__()
        self.ops, self.at, self.error = 0, at, error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if self.ops == self.at:
            if self.error is not None:
                raise self.error
            os.kill(os.getpid(), signal.SIGINT)
        return func(*args, **(kwargs or {}))


def _ops_of_one_step(step, reference, optimizer, loss_fn, batch) -> int:
    """How many ops a call runs (the last 30 or so are in the optimizer's update, or the module's views after it)."""
    with _AtOp() as counted:
        loss = step(*batch)
    assert torch.equal(loss, eager_step(reference, optimizer, loss_fn, batch))
    return counted.ops


@pytest.mark.parametrize("stage", [0, 3])
def test_ctrl_c_in_the_update_ends_the_step_and_ctrl_c_before_it_changes_nothing(stage):
    """Ctrl-C in the optimizer's update, after the program began to drop the old parameters and optimizer state,
    lost them: at stage 3 the next call failed with KeyError: 'bucket:0', at stage 0 it traced a first step again
    and trained on from fresh optimizer state, silently. The interrupt is now raised once the step has its new
    state; before the release point (forward, backward) it is raised at once and the step changes nothing."""
    model, _, loss_fn = build("mlp")
    reference, _, _ = build("mlp")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=stage, loss_fn=loss_fn)
    data = batches("mlp", 5, 8)
    step(*data[0])
    eager_step(reference, optimizer, loss_fn, data[0])
    ops = _ops_of_one_step(step, reference, optimizer, loss_fn, data[1])
    with pytest.raises(KeyboardInterrupt), _AtOp(at=3):   # in forward: nothing happened
        step(*data[2])
    assert step.steps == 2
    with pytest.raises(KeyboardInterrupt), _AtOp(at=ops - 30):   # in the update: the step ends, then the interrupt
        step(*data[2])
    assert step.steps == 3
    eager_step(reference, optimizer, loss_fn, data[2])
    for batch in data[3:]:
        assert torch.equal(step(*batch), eager_step(reference, optimizer, loss_fn, batch))
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key


def test_a_failure_in_the_update_refuses_every_later_call_naming_it(tmp_path):
    """An error in the update (out of memory) after the release point said "the step cannot go on", but the next
    call went on: from fresh optimizer state at stages 0-2 (silently), or with KeyError: 'bucket:0' at stage 3."""
    model, _, loss_fn = build("mlp")
    reference, _, _ = build("mlp")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), stage=0, loss_fn=loss_fn)
    data = batches("mlp", 3, 8)
    step(*data[0])
    eager_step(reference, optimizer, loss_fn, data[0])
    ops = _ops_of_one_step(step, reference, optimizer, loss_fn, data[1])
    with pytest.raises(RuntimeError, match="out of memory") as failed, \
            _AtOp(at=ops - 30, error=RuntimeError("out of memory")):
        step(*data[2])
    assert "the step failed after its release point" in "".join(failed.value.__notes__)
    lost = r"an earlier call of this step failed in the optimizer's update \(RuntimeError: out of memory\)"
    for call in (lambda: step(*data[2]), step.full_state_dict, lambda: zerocc.save_checkpoint(step, tmp_path / "checkpoint")):
        with pytest.raises(zerocc.ConfigError, match=lost + r".*load the last checkpoint"):
            call()
