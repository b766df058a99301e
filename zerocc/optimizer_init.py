"""The optimizer's initial state, made before the first step: one program for every step.

A ``torch.optim`` optimizer creates its state lazily, inside its first
``step()``: Adam's ``step = tensor(0.)``, ``exp_avg = zeros_like(p)``. Traced as
is, the first step is a different program from every later one (it creates the
state, they read it), and a compile pays for both. This module finds what the
optimizer's first ``step()`` creates, so the step can make that state itself
and run the steady-state program from the first call: a resume without a
checkpoint.

It learns the initial state from the optimizer itself, on small stand-in
parameters of each group, dtype and number of dimensions: every tensor the
step creates and keeps as state is recorded as it was when created. Only two
kinds are accepted: a 0-dim tensor (a step count, NAdam's ``mu_product``) and
a tensor shaped like its parameter with one value everywhere (``zeros_like``,
``full_like(grad, lr)``). The guess is then checked: two steps from a fresh
optimizer and two from one given the guessed state must agree bit for bit, on
other values. State made from the gradient (SGD's momentum buffer is the first
gradient), shaped otherwise (factored second moments), or anything the check
rejects means ``None``: the step traces the optimizer's own first step as
before. So does ``$ZEROCC_TRACE_FIRST_STEP=1`` (tests of the first step's own
program use it).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import traceback
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclasses.dataclass(frozen=True)
class InitialValue:
    """One state tensor as the optimizer creates it: a 0-dim ``value``, or ``value`` filled to a shape."""
    value: torch.Tensor   # 0-dim
    fills: bool           # True: shaped like the parameter, every element ``value``

    def make(self, shape: Sequence[int], device: torch.device | str) -> torch.Tensor:
        """The state for a parameter (or a flat piece of one) of ``shape``."""
        if not self.fills:
            return self.value.clone().to(device)
        return torch.full(tuple(shape), self.value.item(), dtype=self.value.dtype, device=device)

    def signature(self) -> tuple[bool, torch.dtype]:
        """As ``CompiledStep``'s state signatures: (0-dim, dtype)."""
        return (not self.fills, self.value.dtype)


class _Creations(TorchDispatchMode):
    """Every tensor an op returns that is none of its inputs, as it was when returned."""

    def __init__(self):
        super().__init__()
        self.first_value: dict[int, torch.Tensor] = {}
        self.keep: list[torch.Tensor] = []   # holds every output, so no id is reused during the step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        if func is torch.ops.aten.lift_fresh.default:   # torch.tensor(0.0): made outside dispatch, lifted here
            inputs = set()
        for tensor in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(tensor, torch.Tensor) and id(tensor) not in inputs and id(tensor) not in self.first_value:
                self.first_value[id(tensor)] = tensor.detach().clone()
                self.keep.append(tensor)
        return out


_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


def shadow_of(optimizer: torch.optim.Optimizer, param_groups: list[dict]) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` with ``param_groups``, no state and no hooks, whose ``step()`` the user's never sees.

    Every attribute of the optimizer is copied (shallowly): ``copy.copy`` goes through torch's
    ``Optimizer.__getstate__``, which keeps only ``defaults``, ``state`` and ``param_groups``, so an optimizer that
    keeps a setting on itself (pytorch_optimizer's ``self.maximize``) failed in its own ``step()`` with an
    ``AttributeError``. The hooks are left out, as ``Optimizer.__setstate__`` leaves them out of such a copy.
    """
    shadow = object.__new__(type(optimizer))
    # not the instance's own patches of the class's methods: an LR scheduler replaces ``optimizer.step`` by a
    # wrapper that calls the user's optimizer (through a weak reference to it), so the shadow's step() updated the
    # user's parameters and groups instead of its own (the shard pass then failed on a KeyError)
    shadow.__dict__.update({name: value for name, value in optimizer.__dict__.items()
                            if not (callable(value) and callable(getattr(type(optimizer), name, None)))})
    for hooks in _HOOKS:
        setattr(shadow, hooks, collections.OrderedDict())
    shadow.state = collections.defaultdict(dict)
    shadow.param_groups = param_groups
    return shadow


def shadow_of_group(optimizer: torch.optim.Optimizer, group: int, param: torch.Tensor) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` holding only ``param`` in a copy of group ``group``, with no state.

    Tensor settings are copied too: a ``step()`` that writes into one in place leaves the user's untouched.
    """
    settings = {key: value.clone() if isinstance(value, torch.Tensor) else value
                for key, value in optimizer.param_groups[group].items() if key != "params"}
    settings["params"] = [param]
    return shadow_of(optimizer, [settings])


def _stand_in(shape, dtype, device, seed: int) -> list[torch.Tensor]:
    """A parameter and two gradients with values drawn from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    draw = [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
            for _ in range(3)]
    return [torch.nn.Parameter(draw[0]), draw[1], draw[2]]


def _two_steps(optimizer, group, shape, dtype, device, seed, state=None):
    param, *grads = _stand_in(shape, dtype, device, seed)
    shadow = shadow_of_group(optimizer, group, param)
    if state is not None:
        shadow.state[param].update({key: value.make(shape, device) for key, value in state.items()})
    with torch.no_grad():
        for grad in grads:
            param.grad = grad
            shadow.step()
    return [param.detach(), *(v for _, v in sorted(shadow.state[param].items()) if isinstance(v, torch.Tensor))]


def _learned(optimizer, group, shape, dtype, device) -> dict[str, InitialValue] | None:
    """The state one step of group ``group`` creates for a parameter like ``shape``, ``dtype``; None if unsure."""
    param, grad, _ = _stand_in(shape, dtype, device, seed=0)
    shadow = shadow_of_group(optimizer, group, param)
    param.grad = grad
    creations = _Creations()
    try:
        with torch.no_grad(), creations:
            shadow.step()
    except Exception:   # the trace of the first step will say what is wrong
        return None
    learned = {}
    for key, tensor in shadow.state[param].items():
        if not isinstance(tensor, torch.Tensor):
            continue
        first = creations.first_value.get(id(tensor))
        if first is None or first.is_complex():
            return None
        if first.dim() == 0:
            learned[key] = InitialValue(first, fills=False)
        elif tuple(first.shape) == tuple(shape) and bool((first == first.reshape(-1)[0]).all()):
            learned[key] = InitialValue(first.reshape(-1)[0].clone(), fills=True)
        else:
            return None
    for seed in (1, 2):   # the guess gives the optimizer's own first steps, on other values
        try:   # the guess may lack state the step needs (SOAP's list of matrices 'Q', not a tensor): KeyError
            fresh = _two_steps(optimizer, group, shape, dtype, device, seed)
            given = _two_steps(optimizer, group, shape, dtype, device, seed, state=learned)
        except Exception:   # the trace of the first step will say what is wrong
            return None
        # compared on the CPU: eager keeps some state elsewhere than the parameter (Adam's step count on the
        # CPU for a CUDA parameter), the guess makes it on the parameter's device; the values are what matters
        if len(fresh) != len(given) or not all(a.dtype == b.dtype and a.shape == b.shape
                                               and torch.equal(a.cpu(), b.cpu()) for a, b in zip(fresh, given)):
            return None
    return learned


class _RecordedWrites(dict):
    """A param group that remembers where ``step()`` first wrote each key ('file:line: code'), for the message."""

    def __init__(self, *args):
        super().__init__(*args)
        self.lines: dict = {}

    def _record(self, key):
        if key not in self.lines:
            frame = traceback.extract_stack(limit=3)[0]
            self.lines[key] = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"

    def __setitem__(self, key, value):
        self._record(key)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self._record(key)
        return super().setdefault(key, default)

    def update(self, *args, **kwargs):
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def _snapshot(values: dict) -> dict:
    """``values`` with each tensor copied, so that one written in place is seen to change."""
    return {key: value.detach().clone() if isinstance(value, torch.Tensor) else value for key, value in values.items()
            if key not in ("params", "state", "param_groups")}


def _same(a, b) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(a, b)
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _undo_writes(values: dict, before: dict, owner: str, is_group: bool) -> dict[str, tuple[str, str | None]]:
    """Put back the values ``step()`` changed in ``values`` (a param group or the optimizer's ``vars``), as the
    program would have them at its next step; returns each changed one, named, with its change and line."""
    changed = {}
    for key in [key for key in values if key not in ("params", "state", "param_groups")]:
        if key in before and _same(values[key], before[key]):
            continue
        name = f"{owner}[{key!r}]" if is_group else f"{owner}.{key}"
        was = f"{before[key]!r}" if key in before and not isinstance(before[key], torch.Tensor) else \
            ("a tensor" if key in before else "absent")
        now = values[key]
        now = "a tensor" if isinstance(now, torch.Tensor) else f"{now!r}"
        line = getattr(values, "lines", {}).get(key)
        changed[name] = (f"{was} before the first step, {now} after", line)
        if key in before:
            values[key] = before[key].clone() if isinstance(before[key], torch.Tensor) else before[key]
        else:
            del values[key]
    return changed


_SCHEDULE_FREE_HINT = (
    "\n  Schedule-Free optimizers (the schedulefree package's AdamWScheduleFree, SGDScheduleFree) keep k and "
    "weight_sum so; one keeping them as tensors in self.state[p] trains, with optimizer.eval() and optimizer.train() "
    "called inside `with step.full_optimizer():` (zerocc's docs/guide/training-loops.md, Schedule-Free).")


def has_train_and_eval(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has ``train()`` and ``eval()`` methods, as Schedule-Free's optimizers do."""
    return callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None))


def refuse_python_state(optimizer: torch.optim.Optimizer, params: Sequence[tuple[str, torch.Tensor, int]]) -> None:
    """Refuse an optimizer whose per-parameter state holds a Python value that its later steps depend on.

    The step's program carries only tensor state from step to step: a Python value in the state (a step count
    kept as an ``int``, an ``initialized`` flag) is made afresh by every traced update, as if each step were the
    first. Per group, dtype and number of dimensions, two steps on a stand-in parameter are run as eager runs
    them and again with the Python values dropped between the steps, as the program would: if the parameter or
    the tensor state differ, the optimizer is refused. A Python value the steps do not depend on is harmless.
    """
    from .errors import UnsupportedOptimizerError
    checked = set()
    for _, tensor, group in params:
        kind = (group, tensor.dtype, tensor.dim())
        if kind in checked:
            continue
        checked.add(kind)
        shape = tuple(range(2, 2 + tensor.dim()))
        runs = []
        for drop in (False, True):
            python_values, written = {}, {}
            try:
                param, *grads = _stand_in(shape, tensor.dtype, "cpu", seed=0)
                shadow = shadow_of_group(optimizer, group, param)
                shadow.param_groups[0] = settings = _RecordedWrites(shadow.param_groups[0])
                before_settings, before_attributes = _snapshot(settings), _snapshot(vars(shadow))
                with torch.no_grad():
                    for grad in grads:
                        state = shadow.state[param]
                        if drop:
                            for key in [key for key, value in state.items() if not isinstance(value, torch.Tensor)]:
                                python_values[key] = state.pop(key)
                            written.update(_undo_writes(settings, before_settings, f"param_groups[{group}]", True))
                            written.update(_undo_writes(vars(shadow), before_attributes, "self", False))
                        param.grad = grad
                        shadow.step()
                tensors = sorted((k, v) for k, v in shadow.state[param].items() if isinstance(v, torch.Tensor))
                runs.append((param.detach(), tensors, python_values, written))
            except Exception:   # the trace of the step will say what is wrong; without the values, they are needed
                runs.append(None if not drop or not (python_values or written) else (None, None, python_values, written))
        if runs[0] is None or runs[1] is None:
            continue
        (eager_param, eager_state, _, _), (program_param, program_state, dropped, written) = runs
        same = program_param is not None and torch.equal(eager_param, program_param) \
            and [k for k, _ in eager_state] == [k for k, _ in program_state] \
            and all(torch.equal(a, b) for (_, a), (_, b) in zip(eager_state, program_state))
        if written and not same:
            described = "; ".join(f"{name} ({change}{f', at {line}' if line else ''})"
                                  for name, (change, line) in written.items())
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}.step() writes values its later steps read into its param group or "
                f"onto itself: {described}\n"
                "  why: zerocc traces the update once, with the settings of the param groups and the optimizer's "
                "attributes as constants, and runs it every step: every step would see them as before the first "
                "step (a step count kept in the param group stays 0) and update differently from eager.\n"
                "  fix: keep what changes from step to step as a tensor in the per-parameter state "
                "(self.state[p]['step'] = torch.tensor(0.0), as torch.optim's optimizers keep their step count); a "
                "statistic over all parameters (D-Adaptation's and Prodigy's d) cannot be kept per parameter: "
                "such an optimizer trains with eager PyTorch only." + _SCHEDULE_FREE_HINT * has_train_and_eval(optimizer))
        if dropped and not same:
            described = ", ".join(f"{key!r} (a Python {type(value).__name__}, {value!r} after the first step)"
                                  for key, value in dropped.items())
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}.step() keeps per-parameter state that is not a tensor: {described}; "
                f"param group {group}\n"
                "  why: zerocc traces the update once and carries only tensor state from step to step: every step "
                "would see the state without it, as if it were the first step, and update differently from eager.\n"
                "  fix: keep it as a tensor in the state (a count as torch.tensor(0.0), as torch.optim's optimizers "
                "keep their step), or decide first steps by a tensor's presence (`if 'exp_avg' not in state`).")


def initial_state(optimizer: torch.optim.Optimizer,
                  params: Sequence[tuple[str, torch.Tensor, int]]) -> dict[str, dict[str, InitialValue]] | None:
    """Per trained parameter (name, tensor, group), the state the optimizer's first step would create.

    None when any parameter's cannot be learned (see the module docstring), or
    when the optimizer already holds state (a loaded checkpoint: that is the state).
    """
    if optimizer.state or os.environ.get("ZEROCC_TRACE_FIRST_STEP") == "1":
        return None
    learned: dict[tuple, dict[str, InitialValue] | None] = {}
    result = {}
    for name, tensor, group in params:
        if tensor.is_complex():
            return None
        kind = (group, tensor.dtype, tensor.dim(), tensor.device)
        if kind not in learned:
            shape = tuple(range(2, 2 + tensor.dim()))   # small, every dimension different
            learned[kind] = _learned(optimizer, group, shape, tensor.dtype, tensor.device)
        if learned[kind] is None:
            return None
        result[name] = learned[kind]
    return result
