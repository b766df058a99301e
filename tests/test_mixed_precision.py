"""Mixed precision, compiled: bf16 compute from fp32 masters, reductions in reduce_dtype, fp16 loss scaling.

The reference is hand-written eager PyTorch doing the same thing
(``mixed_eager_step``): cast the fp32 master parameters to the compute
dtype, run forward and backward there, cast each gradient to fp32, average
it over ranks (all_reduce, then divide by N, as DDP does), and step the fp32
optimizer on the masters; with loss scaling, ``torch.amp.GradScaler`` scales
the loss, unscales, skips and updates the scale. At world size 1 the compiled
step equals it bit for bit; at world size 2 too (see the test for why).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zerocc
from tests import distributed
from tests.models import batches, build

STAGES = (0, 1, 2, 3)
STEPS = 3


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def mixed_eager_step(master, optimizer, loss_fn, batch, dtype, *, scaler=None, world_size=1):
    """One step of hand-written mixed precision: low-precision compute, fp32 masters, averaged fp32 gradients."""
    low = copy.deepcopy(master)        # keeps tied weights tied
    for param in low.parameters():
        param.data = param.data.to(dtype)
    inputs = [t.to(dtype) if t.is_floating_point() else t for t in batch[:-1]] if loss_fn else list(batch)
    loss = low(*inputs) if loss_fn is None else loss_fn(low(*inputs), batch[-1])
    if scaler is not None:
        scaler.scale(loss.float()).backward()
    else:
        loss.backward()
    for param, computed in zip(master.parameters(), low.parameters()):
        param.grad = None if computed.grad is None else computed.grad.to(param.dtype)
        if param.grad is not None and world_size > 1:
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach().float()


def _compiled(name, stage, **precision):
    model, _, loss_fn = build(name)
    return zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, **precision)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_bf16_world_size_1_equals_the_hand_written_reference_bit_for_bit(name, stage):
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    step = _compiled(name, stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for batch in batches(name, STEPS, 8):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        loss = step(*batch)
        assert loss.dtype == torch.float32
        assert torch.equal(loss, expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == torch.float32, key      # the masters stay fp32
        assert torch.equal(full[key], value), key
