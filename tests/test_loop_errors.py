"""The loop around the step: misuse between calls is an error naming the input or object and the fix (issue 20, 7-9)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zerocc
from tests.models import MLP, batches, build


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def compiled_mlp(stage=3, **options):
    model, _, loss_fn = build("mlp")
    optimizer = adamw(model)
    return zerocc.compile(model, optimizer, stage=stage, loss_fn=loss_fn, **options), model, optimizer


# -- item 8: crashes and silent cases around compile ------------------------------------

@pytest.mark.parametrize("stage", [True, 3.0, "3"])
def test_a_stage_that_only_compares_equal_to_one_is_refused(stage):
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=rf"stage={stage!r} is not a ZeRO stage; .* as an int"):
        zerocc.compile(model, adamw(model), stage=stage, loss_fn=F.mse_loss)


def test_a_model_on_the_meta_device_points_to_plan():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"on the meta device \(net.0.weight, .*zerocc.plan\(model, "
                                                 r"optimizer.*model.to_empty\(device='cpu'\)"):
        zerocc.compile(model, adamw(model), stage=3, loss_fn=F.mse_loss)


def test_add_param_group_after_the_first_step_is_refused_with_the_way_out():
    model, _, loss_fn = build("mlp")
    head = nn.Linear(5, 5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = zerocc.compile(model, optimizer, stage=0, loss_fn=loss_fn)
    data = batches("mlp", 2, 4)
    step(*data[0])
    optimizer.add_param_group({"params": head.parameters()})
    with pytest.raises(zerocc.ConfigError, match=r"the optimizer's parameters changed after the step's first call "
                                                 r"\(it had 1 param group\(s\) of \d+ tensors, it now has 2 .*"
                                                 r"Add every param group before the first step"):
        step(*data[1])


@pytest.mark.parametrize("method", ["report", "explain"])
def test_report_and_explain_without_a_memory_plan(method):
    step, _, _ = compiled_mlp(stage=0, disable=["plan_memory"])
    step(*batches("mlp", 1, 4)[0])
    result = getattr(step, method)()
    if method == "report":
        assert result["planned_peak_bytes"] is None and result["memory_pools"] is False
    else:
        assert "passes:" in result


def test_memory_plan_plot_without_a_path_writes_a_default_file(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    step, _, _ = compiled_mlp(stage=0)
    step(*batches("mlp", 1, 4)[0])
    monkeypatch.chdir(tmp_path)
    assert step.memory_plan.plot() == "memory_plan.png"
    assert (tmp_path / "memory_plan.png").stat().st_size > 0


def test_memory_budget_error_is_exported():
    assert issubclass(zerocc.MemoryBudgetError, zerocc.ZeroccError)
    assert "MemoryBudgetError" in zerocc.__all__


def test_disabling_capture_says_why_it_stays():
    step, _, _ = compiled_mlp(stage=0)
    assert step.passes[0] == "capture"
    model = MLP()
    with pytest.raises(zerocc.ConfigError, match=r"cannot disable 'capture': it traces the step"):
        zerocc.compile(model, adamw(model), stage=0, loss_fn=F.mse_loss, disable=["capture"])
