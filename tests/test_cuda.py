"""World size 1 on a CUDA device: what one lent GPU checks in one call (skipped without one).

    python -m pytest -q tests/test_cuda.py

The same contract as on CPU: stages 0-3 equal eager PyTorch bit for bit (fp32,
deterministic algorithms on, as eager runs them), bf16 mixed precision equals
the hand-written reference, the memory plan bounds what runs (measured by the
step and by the CUDA allocator), and without a ``memory_budget`` the step is
planned against the device's free memory (``zerocc/device_budget.py``).
The 2-GPU NCCL test is in ``tests/test_schedule.py``.
"""
from __future__ import annotations

import os

import pytest
import torch

import zerocc
from tests.helpers import OpCalls
from tests.models import batches, build, eager_step
from tests.reference import adamw, mixed_eager_step
from zerocc import device_budget as budget_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 3
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def deterministic(monkeypatch):
    """Deterministic kernels (embedding and scatter backward use atomics otherwise), for eager and zerocc alike."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"))
    monkeypatch.delenv(budget_module.ENVIRONMENT, raising=False)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def _on_cuda(batch):
    return tuple(t.to(CUDA) for t in batch)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_world_size_1_equals_eager_bit_for_bit(name, stage):
    model, _, loss_fn = build(name)
    reference, _, _ = build(name)
    model, reference = model.to(CUDA), reference.to(CUDA)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
    optimizer = adamw(reference)
    for batch in batches(name, STEPS, 8):
        batch = _on_cuda(batch)
        expected = eager_step(reference, optimizer, loss_fn, batch)
        assert torch.equal(step(*batch), expected)
    full = step.full_state_dict()
    for key, value in reference.state_dict().items():
        assert full[key].device.type == "cuda" and torch.equal(full[key], value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_the_update_launches_as_eager_does(stage):
    """On CUDA eager runs AdamW's foreach kernels once per op over the group: so does the program (it launched
    them once per parameter, 2,263 kernels a step against eager's 836 on the 124M GPT), bit for bit."""
    model, _, loss_fn = build("gpt")
    reference, _, _ = build("gpt")
    model, reference = model.to(CUDA), reference.to(CUDA)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn)
    optimizer = adamw(reference)
    for number, batch in enumerate(batches("gpt", STEPS, 8)):
        batch = _on_cuda(batch)
        with OpCalls() as eager_calls:
            expected = eager_step(reference, optimizer, loss_fn, batch)
        with OpCalls() as program_calls:
            assert torch.equal(step(*batch), expected)
        if number > 0:
            assert eager_calls.foreach() > 0 and program_calls.foreach() == eager_calls.foreach()


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_equals_the_hand_written_reference(stage):
    model, _, loss_fn = build("gpt")
    reference, _, _ = build("gpt")
    model, reference = model.to(CUDA), reference.to(CUDA)
    step = zerocc.compile(model, adamw(model), stage=stage, loss_fn=loss_fn, param_dtype=torch.bfloat16,
                          reduce_dtype=torch.float32)
    optimizer = adamw(reference)
    for batch in batches("gpt", STEPS, 8):
        batch = _on_cuda(batch)
        assert torch.equal(step(*batch), mixed_eager_step(reference, optimizer, loss_fn, batch, torch.bfloat16))
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key


def test_the_plan_bounds_what_runs_and_the_allocator_agrees():
    model, _, loss_fn = build("gpt")
    model = model.to(CUDA)
    step = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    data = [_on_cuda(b) for b in batches("gpt", STEPS, 8)]
    step(*data[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step(*data[1])
    torch.cuda.synchronize()
    report = step.report()
    assert report["measured_peak_bytes"] <= report["planned_peak_bytes"]
    # the allocator sees the step's tensors plus the batch and what lives outside the plan (the loss it returns)
    batch_bytes = sum(t.numel() * t.element_size() for t in data[1])
    assert torch.cuda.max_memory_allocated() - before <= report["planned_peak_bytes"] + batch_bytes + 2**20


def test_no_budget_plans_against_the_free_memory(monkeypatch):
    """A device with less free memory than the default plan needs makes the step recompute, and still train as
    eager; one with room takes the default plan (world size 1: nothing to keep gathered)."""
    model, _, loss_fn = build("gpt")
    data = [_on_cuda(b) for b in batches("gpt", STEPS, 8)]
    roomy = zerocc.compile(model.to(CUDA), adamw(model), stage=3, loss_fn=loss_fn)
    roomy(*data[0])
    assert roomy.remat_plan is None   # it fit: nothing recomputed, nothing to report
    peak = roomy.report()["planned_peak_bytes"]

    model, _, loss_fn = build("gpt")
    model = model.to(CUDA)
    held = budget_module.held_bytes([*model.parameters(), *model.buffers()], CUDA)
    offered = int(peak * 0.95)
    free = int((offered - held) / (1 - budget_module.CUDA_MARGIN)) + 1
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    tight = zerocc.compile(model, adamw(model), stage=3, loss_fn=loss_fn)
    reference, _, _ = build("gpt")
    reference = reference.to(CUDA)
    optimizer = adamw(reference)
    for batch in data:
        assert torch.equal(tight(*batch), eager_step(reference, optimizer, loss_fn, batch))
    assert tight.remat_plan.recomputed and "free memory" in tight.remat_plan.budget_source
    assert tight.report()["measured_peak_bytes"] <= offered
