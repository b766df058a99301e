"""Features combined, at world size 1 against eager references (fast): each pair once.

- ``memory_budget`` with ``param_dtype=bf16``: the same losses and masters as
  the hand-written bf16 reference of ``test_mixed_precision`` (recomputation
  is exact), under the budget.
- ``memory_pools=True`` with bf16, at stage 2 (the kept bf16 bucket is a slot
  the update writes) and stage 3: bit for bit the reference.
- ``grad_accumulation`` with ``clip_grad_norm`` at stages 0, 1 and 3 (stage 2
  is in ``test_training_loop``), AdamW: bit for bit eager's accumulation with
  ``clip_grad_norm_``.
"""
from __future__ import annotations

import pytest
import torch

import zerocc
from tests.models import batches, build
from tests.reference import adamw, mixed_eager_step
from tests.reference import eager_accumulated_step

BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


def _against_bf16_reference(name, stage, steps=2, batch_size=8, **options):
    """Train the compiled step and the hand-written bf16 reference on the same batches; return the step."""
    reference, _, loss_fn = build(name)
    reference_optimizer = adamw(reference)
    model, _, _ = build(name)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, **BF16, **options)
    for batch in batches(name, steps, batch_size):
        expected = mixed_eager_step(reference, reference_optimizer, loss_fn, batch, torch.bfloat16)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].dtype == value.dtype and torch.equal(full[key], value), key
    return step


def test_memory_budget_with_bf16_recomputes_exactly_and_fits():
    unbudgeted = _against_bf16_reference("gpt", 3, batch_size=32).report()["live_peak_bytes"]
    budget = int(unbudgeted * 0.8)   # forces recomputation; the smallest peak the planner reaches is 0.56 of it
    step = _against_bf16_reference("gpt", 3, batch_size=32, memory_budget=budget)
    report = step.report()
    assert step.remat_plan.recomputed
    assert report["live_peak_bytes"] <= budget < unbudgeted
    assert report["measured_peak_bytes"] <= budget


@pytest.mark.parametrize("name,stage", [("gpt", 2), ("mlp", 3)])
def test_memory_pools_with_bf16_bit_for_bit(name, stage):
    step = _against_bf16_reference(name, stage, memory_pools=True)
    report = step.report()
    assert report["memory_pools"] and report["arena_bytes"] > 0
    if stage == 2:   # the bf16 bucket is a slot of its own, the masters a shard (the whole at world size 1)
        assert {k: v.dtype for k, v in step.state.slots.items() if k.startswith(("bucket:", "compute:"))} == {
            **{f"bucket:{b.index}": torch.float32 for b in step.shard_plan.buckets},
            **{f"compute:{b.index}": torch.bfloat16 for b in step.shard_plan.buckets}}


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_grad_accumulation_with_clipping_bit_for_bit(stage):
    reference, _, loss_fn = build("gpt")
    reference_optimizer = adamw(reference)
    model, _, _ = build("gpt")
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, grad_accumulation=2,
                          clip_grad_norm=0.5, bucket_bytes=16 * 1024)
    for batch in batches("gpt", 2, 8):
        expected, norm = eager_accumulated_step(reference, reference_optimizer, loss_fn, batch, 2, clip=0.5)
        assert torch.equal(step(*batch), expected)
        assert torch.equal(step.last_grad_norm, norm)
        assert norm > 0.5   # the clip acts
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(full[key], value), key
