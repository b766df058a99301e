"""Param groups sharing one trace of the update: layer-wise learning-rate decay makes a param group per layer, alike
but for their lr's and weight decay's values, which the step reads every step (``live_settings``). The update is
traced once per class of groups (``optimizer_step.trace_classes``) and copied for each group's parameters, each copy
reading its own group's settings: eager's training bit for bit, groups differing in a baked-in setting (a flag, a
weight decay of 0 against one above) traced apart."""
from __future__ import annotations

import pytest
import torch

import zerocc
import zerocc.tracing
from tests.models import batches, build, eager_step


def _layer_of(name: str) -> str:
    return name.split(".")[1] if name.startswith("blocks.") else name.split(".")[0]


def layerwise(model, lr=0.01, decay=0.7, weight_decay=0.1, **settings):
    """Layer-wise learning-rate decay as fine-tuning scripts build it: a group per layer and per decayed (weights)
    or undecayed (biases, norms) parameters, each with its own lr and weight decay."""
    groups: dict = {}
    for name, param in model.named_parameters():
        groups.setdefault((_layer_of(name), param.dim() > 1), []).append(param)
    return [{"params": params, "lr": lr * decay ** index, **settings,
             "weight_decay": weight_decay * (1 + index / 10) if decayed else 0.0}
            for index, ((_, decayed), params) in enumerate(groups.items())]


def _train(make, stage, steps=3, mark=None):
    """Eager and compiled side by side with a LambdaLR per group and weight decays changed each step: every loss and
    the final parameters bit for bit; returns the step."""
    reference, _, loss_fn = build("gpt")
    model, _, _ = build("gpt")
    optimizers = [make(m) for m in (reference, model)]
    if mark is not None:
        mark(optimizers)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, [lambda s, i=i: 0.9 ** (s * (i % 3 + 1))
                                                       for i in range(len(o.param_groups))]) for o in optimizers]
    step = zerocc.compile(model, optimizers[1], stage=stage)
    for index, batch in enumerate(batches("gpt", steps, 4)):
        assert torch.equal(step(*batch), eager_step(reference, optimizers[0], loss_fn, batch)), f"step {index}"
        for optimizer, schedule in zip(optimizers, schedules):
            schedule.step()
            for group in optimizer.param_groups:
                group["weight_decay"] *= 0.5
    for key, value in reference.state_dict().items():
        assert torch.equal(step.full_state_dict()[key], value), key
    return step


def _one_group_flipped(setting, value):
    def mark(optimizers):
        for optimizer in optimizers:
            optimizer.param_groups[3][setting] = value
    return mark


CASES = {
    "adamw": (lambda m: torch.optim.AdamW(layerwise(m)), None),
    "adamw_one_group_maximizes": (lambda m: torch.optim.AdamW(layerwise(m)), _one_group_flipped("maximize", True)),
    "adam_one_group_amsgrad": (lambda m: torch.optim.Adam(layerwise(m)), _one_group_flipped("amsgrad", True)),
    "sgd_one_group_nesterov": (lambda m: torch.optim.SGD(layerwise(m, momentum=0.9)), _one_group_flipped("nesterov", True)),
    "adamw_foreach": (lambda m: torch.optim.AdamW(layerwise(m), foreach=True), None),
    "adamw_tensor_lr": (lambda m: torch.optim.AdamW(
        [{**group, "lr": torch.tensor(group["lr"])} for group in layerwise(m)]), None),
}


@pytest.mark.parametrize("stage, case", [*((stage, "adamw_one_group_maximizes") for stage in (0, 1, 2, 3)),
                                         *((3, case) for case in sorted(CASES) if case != "adamw_one_group_maximizes")])
def test_layerwise_groups_each_read_their_own_settings(case, stage):
    """Distinct lrs and weight decays per group, a LambdaLR per group changing them, a group whose flag differs
    (traced apart: its ops are others): eager's losses and parameters bit for bit at every stage."""
    make, mark = CASES[case]
    step = _train(make, stage, mark=mark)
    if case != "adamw_tensor_lr":   # with a tensor lr the other settings are traced in: a weight decay changed recompiles
        assert len(step.compile_stats) == (2 if case.startswith("sgd") else 1)   # SGD's first step: its own program


def _update_traces(monkeypatch) -> list:
    traces = []
    original = zerocc.tracing.trace_functional

    def counting(fn, *args, **kwargs):
        if fn.__name__ == "update":   # splice_update's trace of the optimizer's step()
            traces.append(fn)
        return original(fn, *args, **kwargs)
    monkeypatch.setattr(zerocc.tracing, "trace_functional", counting)
    return traces


@pytest.mark.parametrize("stage", [0, 3])
def test_the_update_is_traced_once_per_class_of_groups_not_per_group(stage, monkeypatch):
    """A group per layer (a dozen) traces as many updates as two groups, decayed and undecayed, do."""
    traces = _update_traces(monkeypatch)

    def two_groups(model):
        groups = layerwise(model)
        assert groups[0]["weight_decay"] and not groups[2]["weight_decay"]
        return [{**groups[0], "params": [p for g in groups if g["weight_decay"] for p in g["params"]]},
                {**groups[2], "params": [p for g in groups if not g["weight_decay"] for p in g["params"]]}]
    _train(lambda m: torch.optim.AdamW(two_groups(m)), stage, steps=1)
    expected = len(traces)
    traces.clear()
    _train(lambda m: torch.optim.AdamW(layerwise(m)), stage, steps=1)
    assert len(build("gpt")[0].state_dict()) > 10 and len(traces) == expected


class ScaledSGD(torch.optim.SGD):
    """An optimizer of the user's own whose step() reads a list of its own by the group's position: a trace of one
    group holds its scale, so its groups may not share one."""

    def __init__(self, params, scales, **settings):
        super().__init__(params, **settings)
        self.scales = scales

    @torch.no_grad()
    def step(self, closure=None):
        for group, scale in zip(self.param_groups, self.scales):
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"] * scale)


def test_an_optimizer_reading_more_than_its_groups_traces_each_group():
    _train(lambda m: ScaledSGD(layerwise(m, weight_decay=0.0), [1.0 + i for i in range(20)]), stage=1, steps=2)

