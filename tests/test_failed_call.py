"""A first call that fails leaves the step, the model and the optimizer as they were: the next call trains as eager."""
from __future__ import annotations

import pytest
import torch

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
