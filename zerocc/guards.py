"""Checks of the user's objects that ``compile`` and the step make before anything runs.

Each one turns a case that used to crash deep inside zerocc (a ``KeyError``
on a slot name) or to run silently wrong (a meta model "training") into an
error that names the object and the fix.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .errors import ConfigError

STAGES = (0, 1, 2, 3)


def check_stage(stage) -> None:
    """``stage`` is one of the ints 0-3: ``True`` and ``3.0`` compare equal to 1 and 3 but are not stages."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ConfigError(f"stage={stage!r} is not a ZeRO stage; use 0 (plain data parallel), 1, 2 or 3, "
                          "as an int")


def check_not_meta(model: nn.Module) -> None:
    """A model on the meta device holds no data: a step on it would return a meta loss and train nothing."""
    on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if on_meta:
        raise ConfigError(
            f"the model's tensors are on the meta device ({', '.join(on_meta[:3])}"
            f"{', ...' if len(on_meta) > 3 else ''}): they hold no values, so a step would train nothing. "
            "To plan memory without materializing the model, use zerocc.plan(model, optimizer, stage=..., "
            "world_size=..., example_inputs=...); to train, materialize it first "
            "(model.to_empty(device='cpu'), then initialize its weights)")


def param_groups_of(optimizer: torch.optim.Optimizer) -> tuple[tuple[int, ...], ...]:
    """The optimizer's parameters by group, as ids: what the step's buckets were laid out for."""
    return tuple(tuple(id(p) for p in group["params"]) for group in optimizer.param_groups)


def check_param_groups_unchanged(compiled_for: tuple[tuple[int, ...], ...], optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.add_param_group`` (or editing a group's params) after the first step is refused."""
    now = param_groups_of(optimizer)
    if now == compiled_for:
        return
    raise ConfigError(
        f"the optimizer's parameters changed after the step's first call (it had {len(compiled_for)} param "
        f"group(s) of {', '.join(str(len(g)) for g in compiled_for)} tensors, it now has {len(now)} of "
        f"{', '.join(str(len(g)) for g in now)}): the step laid out its buckets and sharded optimizer state for "
        "the first ones. Add every param group before the first step; to train other parameters later (e.g. "
        "unfreezing), save a checkpoint, build a new optimizer over all of them and compile a new step. To "
        "keep a parameter frozen for a while, give it lr=0 in its own group from the start")
