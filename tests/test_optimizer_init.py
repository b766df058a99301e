"""The optimizer's initial state is made before the first step, so one program runs every step.

``zerocc/optimizer_init.py`` learns what an optimizer's first ``step()``
creates; the compiled step makes that state itself and compiles the steady
state's program once. Checked against eager PyTorch, bit for bit, and against
the optimizers whose first step cannot be learned (they keep two programs).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zerocc
from tests.models import batches, build, eager_step
from zerocc.capture import trained_parameters
from zerocc.optimizer_init import initial_state

LEARNED = [
    (torch.optim.AdamW, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.NAdam, {}),
    (torch.optim.Adamax, {}), (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}),
    (torch.optim.Adadelta, {}), (torch.optim.SGD, {}),
]   # RAdam, ASGD and Rprop branch on their step count in Python: their steady state cannot be traced, with or
#     without this (the error names the optimizer at the first call now, not at the second)


def _train(make_optimizer, stage, steps=3, name="mlp", model_and_loss=None):
    torch.manual_seed(0)
    model, _, loss_fn = model_and_loss() if model_and_loss else build(name)
    reference, _, _ = model_and_loss() if model_and_loss else build(name)
    reference.load_state_dict(model.state_dict())
    step = zerocc.compile(model, make_optimizer(model), stage=stage, loss_fn=loss_fn)
    reference_optimizer = make_optimizer(reference)
    data = batches(name, steps, 4) if not model_and_loss else [(torch.randn(4, 6), torch.randn(4, 3))] * steps
    for batch in data:
        assert torch.equal(step(*batch), eager_step(reference, reference_optimizer, loss_fn, batch))
    return step, reference, reference_optimizer


@pytest.mark.parametrize("stage", [0, 1, 3])
@pytest.mark.parametrize("optimizer_class, settings", LEARNED, ids=lambda x: getattr(x, "__name__", str(x)))
def test_the_first_step_runs_the_steady_program_and_matches_eager(optimizer_class, settings, stage):
    step, reference, reference_optimizer = _train(lambda m: optimizer_class(m.parameters(), lr=1e-2, **settings), stage)
    assert len(step.compile_stats) == 1, "one program for the first and every later step"
    weights = step.full_state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(weights[name], value), name
    state, eager_state = step.optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert sorted(state) == sorted(eager_state)
    for index, entries in eager_state.items():
        assert sorted(state[index]) == sorted(entries)
        for key, value in entries.items():
            assert torch.equal(state[index][key], value), (index, key)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adafactor"])
def test_state_made_from_the_gradient_or_shaped_otherwise_is_not_guessed(optimizer):
    model = nn.Linear(3, 2)
    if optimizer == "sgd_momentum":   # the first momentum buffer is the first gradient
        made = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:   # factored second moments: a row and a column per matrix
        made = torch.optim.Adafactor(model.parameters(), lr=0.1)
    assert initial_state(made, trained_parameters(model, made)) is None


def test_sgd_with_momentum_traces_its_own_first_step_and_matches_eager():
    step, _, _ = _train(lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9), stage=3)
    assert len(step.compile_stats) == 2, "a first-step program that creates the momentum buffers, then the steady one"


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_parameter_the_loss_does_not_reach_gets_no_state_as_in_eager_and_one_program(stage):
    """Eager's optimizer makes no state for a parameter without a gradient. The step made the initial state for
    the others only after tracing again without any (the first step's own program), so a model with an unused
    module (a pooler, a spare head) compiled a second program at its second step."""
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x):
            return self.used(x)

    def model_and_loss():
        return WithSpare(), None, nn.functional.mse_loss

    step, reference, reference_optimizer = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), stage,
                                                  steps=4, model_and_loss=model_and_loss)
    state, eager_state = step.optimizer.state_dict()["state"], reference_optimizer.state_dict()["state"]
    assert sorted(state) == sorted(eager_state) == [0, 1]
    for index, entries in eager_state.items():
        assert all(torch.equal(state[index][key], value) for key, value in entries.items())
    weights = step.full_state_dict()
    assert all(torch.equal(weights[name], value) for name, value in reference.state_dict().items())
    assert len(step.compile_stats) == 1, "one program for the first and every later step"


def test_the_switch_traces_the_first_step_as_before(monkeypatch):
    monkeypatch.setenv("ZEROCC_TRACE_FIRST_STEP", "1")
    step, _, _ = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), stage=3)
    assert len(step.compile_stats) == 2
