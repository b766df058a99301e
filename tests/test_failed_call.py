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
