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


def _persistent(step):
    """The step's parameter buckets and optimizer state, copied."""
    return {k: v.clone() for k, v in step._slots.items() if k.startswith(("bucket:", "state:"))}


def _fp16_against_grad_scaler(name, stage, scaling, steps):
    """Per step: (compiled loss, reference loss, compiled scale, reference scale, state equal, skipped exactly)."""
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaling.init_scale, growth_factor=scaling.growth_factor,
                                  backoff_factor=scaling.backoff_factor, growth_interval=scaling.growth_interval)
    step = _compiled(name, stage, param_dtype=torch.float16, reduce_dtype=torch.float32, loss_scale=scaling)
    rows = []
    for batch in batches(name, steps, 8):
        before = _persistent(step) if step._slots is not None else None
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.float16, scaler=scaler)
        loss = step(*batch)
        skipped = bool(step._slots[zerocc.precision.FOUND_INF_SLOT] > 0)
        after = _persistent(step)
        unchanged = before is not None and before.keys() == after.keys() and all(
            torch.equal(before[k], after[k]) for k in before)
        full = step.full_state_dict()
        same = all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
        rows.append((loss, expected, step.loss_scale, scaler.get_scale(), same, skipped, unchanged,
                     sorted(k for k in step._slots if k.startswith("state:"))))
    return rows


@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_dynamic_loss_scale_matches_grad_scaler_and_skips_overflow_exactly(stage):
    # growth every step from 2**13: the scale doubles until the gradients overflow in fp16, then halves
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 13, growth_interval=1)
    rows = _fp16_against_grad_scaler("mlp", stage, scaling, 6)
    for loss, expected, scale, expected_scale, same, skipped, unchanged, _ in rows:
        assert torch.equal(loss, expected)
        assert scale == expected_scale
        assert same
        if skipped:
            assert unchanged                     # params, optimizer state and its step counter untouched
    scales = [row[2] for row in rows]
    skips = [i for i, row in enumerate(rows) if row[5]]
    assert skips and all(scales[i] == scales[i - 1] / 2 for i in skips), scales   # a skip halves the scale
    assert scales[0] == 2.0 ** 14                                                   # a good step doubles it


def test_fp16_overflow_on_the_first_step_creates_no_state():
    # fp16 overflows at 65504: a scale of 2**40 overflows, the backoff brings it to 2**12, which does not
    scaling = zerocc.DynamicLossScale(init_scale=2.0 ** 40, backoff_factor=2.0 ** -28, growth_interval=3)
    rows = _fp16_against_grad_scaler("gpt", 3, scaling, 3)
    for loss, expected, scale, expected_scale, same, *_ in rows:
        assert torch.equal(loss, expected) and scale == expected_scale and same
    assert rows[0][5] and rows[0][2] == 2.0 ** 12 and rows[0][7] == []   # skipped: no optimizer state yet
    assert not rows[1][5] and rows[1][7]                                   # the next step creates it
