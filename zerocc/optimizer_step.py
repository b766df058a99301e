"""Run a user's real ``torch.optim`` optimizer over tensors we choose, under tracing.

Capture traces it over whole parameters; the shard pass traces it again over
the pieces of parameters each rank owns. Both go through ``optimizer_update``
so the update in the graph is always the optimizer's own ``step()``, never a
re-implementation.
"""
from __future__ import annotations

import collections
import functools
import numbers
import inspect
import operator
import os
import traceback
import weakref
from typing import Sequence

import torch
import torch.fx as fx
import torch.optim.optimizer as torch_optimizer
import torch.utils._pytree as pytree
from torch._prims_common import make_contiguous_strides_for

from . import graph as g
from .tracing import fakeify, loaded_uninteresting_files, make_fake_mode, record_source_lines_of, trace_functional
from .errors import ConfigError, UnsupportedOptimizerError, innermost_frame, user_line_of_node
from .optimizer_init import has_train_and_eval, shadow_of, shadow_of_group
from .user_tooling import suspended_user_tooling

aten = torch.ops.aten

# Settings read from the param groups at every step (graph inputs: ``live_settings``), so that a scheduler or a
# loop changing them needs no recompilation, and the update computes with them in Python doubles as eager's does:
# every float setting of a group its step() may read (lr, momentum, dampening, weight_decay, eps, alpha, lr_decay,
# rho, and each float of betas, etas, step_sizes: for torch.optim's optimizers the keys their defaults name, for
# another any key, ``_keys_read``), each read one of two ways (``live_modes``):
FREE = "free"       # a symbolic float no branch of step() reads: any value runs the one program
SIGNED = "signed"   # step() branches on it (``if weight_decay != 0``, ``if momentum > 0``): a symbolic float known to
#                     be positive (or negative), the sign keyed on (``hyperparameter_signature``); at 0 it is traced
#                     in as a constant, so a value crossing zero compiles the update of the other branch.
# Every other setting (a flag: nesterov, amsgrad, maximize; an int; a float a branch compares with another value)
# is traced into the program and keyed on.


def _is_float(value) -> bool:
    return isinstance(value, float)   # not a bool, an int (their arithmetic is not a float's), a tensor


def _keys_read(optimizer: torch.optim.Optimizer) -> frozenset | None:
    """The keys of a param group its optimizer's ``step()`` may read: ``lr`` and the keys ``optimizer.defaults``
    names, for an optimizer whose step() reads nothing else of its group (``_reads_only_its_group``); None (any key)
    for another.

    A scheduler and a user's loop add keys no torch.optim step() reads (``OneCycleLR``'s ``initial_lr``, ``max_lr``,
    ``min_lr``, ``max_momentum``, ``base_momentum``; a layer's scale kept for logging): made settings inputs, each
    was a tensor made every step and 64 bytes of the plan per group, so that a plan made before the scheduler
    existed planned less than the step compiled after it, and a ``memory_budget`` of that plan's peak was refused.
    Left out of the signature too (``hyperparameter_signature``): a change of one compiles nothing, as it changes
    nothing eager's step() computes."""
    if not _reads_only_its_group(type(optimizer)):
        return None
    return frozenset(("lr", *optimizer.defaults))


def _read_items(group: dict, read: frozenset | None):
    """``group``'s (key, value) pairs but ``params``, of the keys in ``read`` (``_keys_read``; None: every key)."""
    return ((key, value) for key, value in group.items() if key != "params" and (read is None or key in read))


def _candidates(group: dict, read: frozenset | None = None) -> list[tuple[str, int | None]]:
    """(key, position in a tuple or None) of each setting of ``group`` that may be read every step: ``lr`` first.
    Only keys in ``read`` (``_keys_read``; None: any key).

    With a tensor lr, only it (passed as itself, its dtype eager's): the rest of the group is traced."""
    if isinstance(group["lr"], torch.Tensor):
        return [("lr", None)]
    found = []
    for key, value in _read_items(group, read):
        if key == "lr":
            continue
        if _is_float(value):
            found.append((key, None))
        elif isinstance(value, (tuple, list)):
            found += [(key, position) for position, item in enumerate(value) if _is_float(item)]
    return [("lr", None), *sorted(found, key=lambda item: (item[0], -1 if item[1] is None else item[1]))]


def _value(group: dict, key: str, position: int | None):
    return group[key] if position is None else group[key][position]


def _name(key: str, position: int | None) -> str:
    return key if position is None else f"{key}{position}"


def _class(value):
    """What of a setting's value decides how ``step()`` may branch on it: a float's sign, else the value itself."""
    if type(value) is float or type(value) is int:   # most settings: skips numbers.Real's ABC check, every step
        return (type(value).__name__, (value > 0) - (value < 0))
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, *map(_class, value))
        if isinstance(value, torch.Tensor):
            return ("tensor", str(value.dtype), tuple(value.shape))
        try:
            hash(value)
            return value
        except TypeError:
            return repr(value)
    # numpy's scalars (``np.float64`` from a schedule array: DINO's ``param_group["lr"] = lr_schedule[it]``) compare
    # to ``np.bool_``, which refuses ``-``
    return (type(value).__name__, int(value > 0) - int(value < 0))


# per optimizer, per the classes of its groups' settings (``_class``): each group's live settings (``live_modes``)
_MODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# What ``live_modes`` gives: per param group, (key, position) -> FREE or SIGNED. The step's call finds them once and
# hands them to ``hyperparameter_signature``, ``live_layout`` and ``live_settings``: the lookup's key (every setting's
# ``_class``, over every group) was the most of the call's Python time with layer-wise groups, found three times
Modes = list[dict[tuple[str, int | None], str]]


def live_modes(optimizer: torch.optim.Optimizer) -> Modes:
    """Per param group: (key, position) -> FREE or SIGNED for each setting its program reads every step.

    Found once per optimizer and per sign of its settings by tracing one ``step()`` of a fake stand-in parameter
    (``_probe``) with them symbolic: a setting a branch reads fails there (``GuardOnDataDependentSymNode``) and is
    tried SIGNED, then traced in. A float setting step() makes a Python number of (another package's
    ``math.sqrt(1 - beta2)``, ``float(beta1)``) is traced in the same way: eager's update is the same at every step.
    """
    structure = settings_structure(optimizer)
    known = _MODES.setdefault(optimizer, {})
    if structure not in known:
        if len(known) >= 16:   # a setting that is another int every step (a count) is another structure each time
            del known[next(iter(known))]
        known[structure] = _modes_of_groups(optimizer, structure)
    return known[structure]


def settings_structure(optimizer: torch.optim.Optimizer) -> tuple:
    """What of the optimizer's param groups ``live_modes`` finds its modes per (``_MODES``' key): each setting's
    ``_class``, and whether the group has parameters and of which dtype. A key step() never reads (``_keys_read``)
    neither is probed nor makes another structure."""
    read = _keys_read(optimizer)
    return tuple(tuple((key, _class(value)) for key, value in sorted(_read_items(group, read)))
                 + ((len(group["params"]) > 0, str(group["params"][0].dtype) if group["params"] else None),)
                 for group in optimizer.param_groups)


def remember_modes(optimizer: torch.optim.Optimizer, modes: Modes) -> None:
    """``modes`` found earlier for the optimizer's present settings (the compile cache on disk,
    ``disk_cache.SettingsModes``): ``live_modes`` returns them without probing."""
    _MODES.setdefault(optimizer, {})[settings_structure(optimizer)] = modes


def _modes_of_groups(optimizer: torch.optim.Optimizer, structure: tuple) -> list[dict[tuple[str, int | None], str]]:
    """``_modes_of_group`` of every group, probing once per class of look-alike groups.

    Layer-wise learning rates make a group per layer (24 for a 12-layer model's decayed and undecayed
    weights), and each probe traces two steps: 2.3 s of CPU for AdamW's 24 groups, where two probes find
    everything. Groups look alike when their settings have the same classes (``_class``: a float's sign, any
    other value itself), no setting is a tensor, and their first parameter has the same shape and their
    parameters the same devices: what a probe reads. A probe's outcome is shared only when it traced every
    candidate symbolic (FREE or SIGNED), so that no value but a sign entered it.
    """
    found: list[dict[tuple[str, int | None], str]] = []
    shared: dict[tuple, dict[tuple[str, int | None], str]] = {}
    read = _keys_read(optimizer)
    for index, group in enumerate(optimizer.param_groups):
        look_alike = None
        if group["params"] and not any(isinstance(value, torch.Tensor) for key, value in _read_items(group, read)):
            look_alike = (structure[index], tuple(group["params"][0].shape),
                          tuple(sorted({p.device.type for p in group["params"]})))
        if look_alike in shared:
            found.append(dict(shared[look_alike]))
            continue
        modes, value_free = _modes_of_group(optimizer, index)
        if look_alike is not None and value_free:
            shared[look_alike] = modes
        found.append(modes)
    return found


def _modes_of_group(optimizer: torch.optim.Optimizer, index: int) -> tuple[dict[tuple[str, int | None], str], bool]:
    """Group ``index``'s live settings (see ``live_modes``), and whether its last probe traced every candidate
    symbolic: then only the settings' signs decided the outcome (``_modes_of_groups`` shares it)."""
    group = optimizer.param_groups[index]
    candidates = _candidates(group, _keys_read(optimizer))
    if isinstance(group["lr"], torch.Tensor) or not candidates or not group["params"]:
        return {candidate: FREE for candidate in candidates}, True   # no update reads them: no branch to find
    if isinstance(group["lr"], bool) or not isinstance(group["lr"], numbers.Real):
        raise ConfigError(f"param group {index} has lr={group['lr']!r}; zerocc needs a number")
    modes = {candidate: FREE for candidate in candidates}
    error: BaseException | None = None
    for _ in range(2 * len(candidates) + 1):
        error, symbol_of = _probe(optimizer, index, modes)
        if error is None:
            break
        symbols = getattr(error, "cond", None)
        symbols = symbols.free_symbols if symbols is not None else set()
        # the learning rate is read every step whatever step() does with it, as it always was (a branch on it
        # fails naming the line)
        blamed = [candidate for candidate, symbol in symbol_of.items() if symbol in symbols and candidate != ("lr", None)]
        if not blamed and ("lr", None) in [c for c, symbol in symbol_of.items() if symbol in symbols]:
            break
        if not blamed:   # not a branch on one of them: traced in if that traces; else the real trace says what fails
            constants = {candidate: FREE if candidate == ("lr", None) else None for candidate in candidates}
            if modes != constants and _probe(optimizer, index, constants)[0] is None:
                modes = constants
            break
        for candidate in blamed:
            modes[candidate] = SIGNED if modes[candidate] == FREE else None
    value_free = error is None and all(mode in (FREE, SIGNED) for mode in modes.values())
    return {candidate: mode for candidate, mode in modes.items()
            if mode == FREE or (mode == SIGNED and _value(group, *candidate) != 0)}, value_free


def _probe(optimizer: torch.optim.Optimizer, index: int, modes: dict) -> tuple[BaseException | None, dict]:
    """Two ``step()`` calls of group ``index`` on a fake stand-in parameter with its settings symbolic per ``modes``:
    the error they raise (None if none), and the symbol of each symbolic setting."""
    # the ShapeEnv's source location of each .item() (tracing.py); the user's dispatch modes and global optimizer
    # hooks sit out, as they do the step's own trace (a counting mode saw the probe's ops in the first call)
    with loaded_uninteresting_files(), suspended_user_tooling():
        return _probe_traced(optimizer, index, modes)


def _probe_traced(optimizer: torch.optim.Optimizer, index: int, modes: dict) -> tuple[BaseException | None, dict]:
    """``_probe`` as the step's own trace runs it (``trace_functional``: its decompositions branch too, addmm's
    ``if beta == 0`` on Muon's coefficients), on the group's shape (Muon's step needs 2-d; fakes cost nothing)."""
    group = optimizer.param_groups[index]
    like = group["params"][0]
    symbolic = [(candidate, mode) for candidate, mode in modes.items()
                if mode is not None and not (mode == SIGNED and _value(group, *candidate) == 0)]
    symbol_of: dict = {}

    def two_steps(param, grad, numbers):
        settings: dict = {}
        for ((key, position), mode), tensor in zip(symbolic, numbers):
            number = tensor.item()
            if mode == SIGNED and isinstance(number, torch.SymFloat):
                torch._check(number > 0 if _value(group, key, position) > 0 else number < 0)
            if isinstance(number, torch.SymFloat):
                symbol_of[(key, position)] = number.node.expr
            if position is None:
                settings[key] = number
            else:
                settings[key] = list(settings.get(key, group[key]))
                settings[key][position] = number
        shadow = shadow_of_group(optimizer, index, param)
        for key, value in settings.items():
            shadow.param_groups[0][key] = type(group[key])(value) if isinstance(group[key], (tuple, list)) else value
        shadow_group = shadow.param_groups[0]
        if "foreach" in shadow_group and shadow_group["foreach"] is None and not shadow_group.get("fused"):
            shadow_group["foreach"] = eager_picks_foreach(shadow_group, group["params"])
        with torch.no_grad():
            for _ in range(2):   # the first step and a step with state: either may branch
                param.grad = grad
                shadow.step()
        return param

    fake_mode = make_fake_mode()
    args = fakeify(fake_mode, (torch.zeros(like.shape, dtype=like.dtype, device="meta"),
                               torch.zeros(like.shape, dtype=like.dtype, device="meta"),
                               [torch.zeros((), dtype=torch.float64) for _ in symbolic]))
    try:
        trace_functional(two_steps, args, fake_mode)
    except Exception as error:   # a guard on a setting, or anything else: the caller tells which
        return error, symbol_of
    return None, symbol_of


def live_layout(optimizer: torch.optim.Optimizer, modes: Modes | None = None) -> list[tuple[int, str]]:
    """(param group, name) of each tensor ``live_settings`` returns, in order: ``lr``, then the others by key
    (an element of a tuple setting named with its position: ``betas0``, ``betas1``). ``modes``: the optimizer's
    ``live_modes`` where the caller found them for this step, else found here."""
    modes = live_modes(optimizer) if modes is None else modes
    return [(index, _name(*candidate)) for index, of_group in enumerate(modes) for candidate in of_group]


def hyperparameter_signature(optimizer: torch.optim.Optimizer, modes: Modes | None = None) -> tuple:
    """The group settings baked into a traced update; a change means re-capture. A setting read every step is in
    it as how it is read (and a SIGNED one's sign), not as its value; a key the optimizer's step() never reads
    (``_keys_read``) not at all. ``modes`` as ``live_layout``'s."""
    signature = []
    read = _keys_read(optimizer)
    for group, of_group in zip(optimizer.param_groups, live_modes(optimizer) if modes is None else modes):
        items = []
        if isinstance(group["lr"], torch.Tensor):
            items.append(("lr", ("a tensor", str(group["lr"].dtype))))
        for key, value in sorted(_read_items(group, read)):
            if key == "lr" and isinstance(value, torch.Tensor):
                continue
            if isinstance(value, torch.Tensor):   # a tensor setting (a scheduler's initial_lr of a tensor lr)
                value = ("tensor", tuple(value.shape), tuple(value.flatten().tolist()))
            elif isinstance(value, (tuple, list)) and any((key, i) in of_group for i in range(len(value))):
                value = (type(value).__name__, *(_how_read(of_group[(key, i)], v) if (key, i) in of_group else v
                                                 for i, v in enumerate(value)))
            elif (key, None) in of_group:
                value = _how_read(of_group[(key, None)], value)
            items.append((key, value))
        signature.append(tuple(items))
    return tuple(signature)


def _how_read(mode: str, value) -> tuple:
    return ("read every step",) if mode == FREE else ("read every step", "positive" if value > 0 else "negative")


# Param groups sharing a trace. Layer-wise learning-rate decay (fine-tuning) makes a param group per layer, alike
# but for the values of their lr and weight decay; the update used to be traced once per group and class of
# look-alike parameters (a 98M GPT's 26 groups: a 22.7 s first step against 7.5 s with one group). A group's float
# settings are graph inputs (``live_settings``), so two groups whose baked-in settings are equal (flags, modes, the
# sign of a SIGNED setting, any setting not read every step) trace the same ops, reading each its own inputs:
# ``splice_update`` traces one of them and copies its ops for the other with the settings inputs rebound.


@functools.lru_cache(maxsize=None)
def _reads_only_its_group(optimizer_class: type) -> bool:
    """Whether ``step()`` of a param group reads nothing per group but the group's settings that the optimizer's
    defaults name and its parameters' state: torch.optim's own optimizers, and subclasses that change only
    ``__init__``. Another optimizer's step() may read anything (a list of the user's indexed by the group's
    position, a key of the group's own), which a trace of another group would bake in wrongly."""
    for cls in optimizer_class.__mro__:
        if cls in (torch.optim.Optimizer, object):
            continue
        for name, function in vars(cls).items():
            function = getattr(function, "__func__", function)
            if name == "__init__" or not callable(function):
                continue
            module = inspect.getmodule(inspect.unwrap(function))
            if module is None or not module.__name__.startswith("torch.optim"):
                return False
    return True


def trace_classes(optimizer: torch.optim.Optimizer) -> list:
    """Per param group, its class: groups of one class trace the same update, each reading its own settings inputs.

    The class is the group's ``hyperparameter_signature`` (a setting read every step in it as how it is read, any
    other by its value), which holds only the settings the optimizer's defaults name (``_keys_read``:
    ``add_param_group`` fills them into every group; a key of the user's own, a layer's name for logging,
    ``param_names``, a scheduler's ``initial_lr``, is never read by torch.optim's step()). A group of another
    optimizer (``_reads_only_its_group``) is its own class.
    """
    signature = hyperparameter_signature(optimizer)
    shared = _reads_only_its_group(type(optimizer))
    classes = []
    for index, items in enumerate(signature):
        key = ("group", index)
        if shared:
            key = ("settings", items)
            try:
                hash(key)
            except TypeError:   # an unhashable setting (a list holding tensors): not compared, its own class
                key = ("group", index)
        classes.append(key)
    return classes


def settings_slots(optimizer: torch.optim.Optimizer) -> list[dict[tuple[str, int | None], int]]:
    """Per param group, the position in ``live_settings`` (``live_layout``) of each setting it reads every step."""
    slots, position = [], 0
    for modes in live_modes(optimizer):
        slots.append({candidate: position + offset for offset, candidate in enumerate(modes)})
        position += len(modes)
    return slots


def live_settings(optimizer: torch.optim.Optimizer, modes: Modes | None = None) -> list[torch.Tensor]:
    """This step's live settings in ``live_layout`` order: each a float64 scalar (exact as a Python float), but a
    tensor lr, passed as a copy of itself. ``modes`` as ``live_layout``'s.

    The float ones are made by one ``torch.tensor`` of them all, unbound into views of its one storage: a tensor
    each cost 1 ms a step for AdamW's 24 layer-wise groups (108 settings), the most of the step's Python outside
    the program. A new storage every step, so nothing holding last step's settings sees them change."""
    values: list[torch.Tensor | None] = []
    floats, at = [], []
    for index, (group, of_group) in enumerate(zip(optimizer.param_groups, live_modes(optimizer) if modes is None else modes)):
        for key, position in of_group:
            value = _value(group, key, position)
            if isinstance(value, torch.Tensor):   # eager's update computes with the tensor, in its dtype: so does ours
                values.append(value.detach().to("cpu", copy=True).reshape(()))
            elif isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ConfigError(f"param group {index} has {key}={group[key]!r}; zerocc needs a number")
            else:
                at.append(len(values))
                values.append(None)
                floats.append(float(value))
    if floats:
        for place, tensor in zip(at, torch.tensor(floats, dtype=torch.float64).unbind()):
            values[place] = tensor
    return values


def _read_settings(optimizer: torch.optim.Optimizer, values: Sequence[torch.Tensor]) -> list[dict]:
    """Per param group, its live settings as its optimizer reads them, from ``live_settings``' tensors: Python
    numbers the trace keeps symbolic, a SIGNED one known to have its sign (so ``if momentum != 0`` is decided)."""
    read: list[dict] = [{} for _ in optimizer.param_groups]
    flat = [(index, candidate, mode) for index, modes in enumerate(live_modes(optimizer))
            for candidate, mode in modes.items()]
    for (index, (key, position), mode), value in zip(flat, values, strict=True):
        group = optimizer.param_groups[index]
        original = _value(group, key, position)
        if isinstance(original, torch.Tensor):
            read[index][key] = value
            continue
        number = value.item()
        if mode == SIGNED and isinstance(number, torch.SymFloat):
            torch._check(number > 0 if original > 0 else number < 0)
        if position is None:
            read[index][key] = number
        else:
            items = list(read[index].get(key, group[key]))
            items[position] = number
            read[index][key] = type(group[key])(items)
    return read


def eager_picks_foreach(settings: dict, params: Sequence[torch.Tensor]) -> bool:
    """Whether eager's ``step()`` runs a param group with ``settings`` over ``params`` (fakes of its parameters) on
    its multi-tensor (foreach) path.

    With ``foreach=None`` torch.optim decides by the parameters' type and device (``_default_to_fused_or_foreach``):
    on CUDA the foreach kernels, on the CPU the single-tensor ones. Under tracing the parameters are fake tensors, a
    type it does not list, so left to itself it would trace the single-tensor update on CUDA, whose kernels round
    otherwise than the foreach ones eager runs. The decision is made here on what the fakes stand for.
    """
    if "foreach" not in settings or settings.get("fused") or settings.get("differentiable"):
        return False
    if settings["foreach"] is not None:
        return bool(settings["foreach"])
    devices = torch_optimizer._get_foreach_kernels_supported_devices()
    return all(p.device.type in devices for p in params)


def optimizer_update(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    group_of: Sequence[int],
    learning_rates: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """One real ``optimizer.step()`` over ``params`` with ``grads``; returns new params and states.

    Called inside a trace: ``params`` and the rest are fake tensors. The user's
    optimizer object is not modified; a shallow copy gets its own groups and state.
    """
    for function in (type(optimizer).step, *_optimizer_methods(type(optimizer)), *_optimizer_functions(type(optimizer))):
        record_source_lines_of(function)
    shadow = shadow_of(optimizer, [])
    read = _read_settings(optimizer, learning_rates)
    for index, group in enumerate(optimizer.param_groups):
        settings = {key: _known_constant(value) if isinstance(value, torch.Tensor) else value
                    for key, value in group.items() if key != "params"}
        settings["params"] = [p for p, owner in zip(params, group_of) if owner == index]
        settings.update(read[index])
        if "foreach" in settings and settings["foreach"] is None and not settings.get("fused"):
            settings["foreach"] = eager_picks_foreach(settings, settings["params"])
        shadow.param_groups.append(settings)
    for param, grad, state in zip(params, grads, states):
        param.grad = grad
        shadow.state[param].update(state)
    name = type(optimizer).__name__
    try:
        with torch.no_grad():
            shadow.step()
    except Exception as error:
        if isinstance(error, UnsupportedOptimizerError):
            raise
        if "closure" in str(error).lower():   # LBFGS's TypeError; SAM's `assert closure is not None, "... closure"`
            where = _optimizer_frame(error, type(optimizer))
            raise UnsupportedOptimizerError(
                f"{name}.step() needs a closure{f', at {where}' if where else ''}: {type(error).__name__}: "
                f"{str(error).splitlines()[0]}\n"
                "  why: such a step re-evaluates the loss itself, a second forward and backward inside step() (SAM's "
                "perturbed gradient, LBFGS's line search), while zerocc traces one forward and backward per step and "
                "calls step() without a closure.\n"
                "  fix: use an optimizer whose step() takes no closure, or train it with eager PyTorch."
            ) from error
        if any(group.get("fused") for group in optimizer.param_groups):
            raise UnsupportedOptimizerError(
                f"{name}(fused=True).step() could not be traced: {type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}\n"
                "  why: the fused kernel takes the learning rate as a Python float, which zerocc reads from the step's "
                "learning-rate tensor each step (a scheduler may change it), and the kernel has no fake implementation "
                "for a tensor learning rate.\n"
                f"  fix: build the optimizer with fused=False (the default); foreach=True also traces."
            ) from error
        if any(group.get("capturable") for group in optimizer.param_groups) and "capturable" in str(error):
            raise UnsupportedOptimizerError(
                f"{name}(capturable=True).step() raised: {type(error).__name__}: {str(error).splitlines()[0]}\n"
                "  why: torch.optim supports capturable=True (the step count kept on the device, for CUDA graphs) "
                "on the devices it names only; eager's optimizer.step() raises the same on these parameters.\n"
                "  fix: build the optimizer with capturable=False (the default)."
            ) from error
        if has_train_and_eval(optimizer) and "train" in str(error).lower():
            where = _optimizer_frame(error, type(optimizer))
            raise UnsupportedOptimizerError(
                f"{name}.step() raised{f' at {where}' if where else ''}: {type(error).__name__}: "
                f"{str(error).splitlines()[0]}\n"
                "  why: a Schedule-Free optimizer steps only in train mode, a setting of its param groups "
                "(optimizer.eval() leaves it, as does loading a checkpoint saved after optimizer.eval()); the compiled "
                "step traces step() with the param groups as they are at the call.\n"
                "  fix: call optimizer.train() before the step's first call, and after optimizer.eval() or a load, "
                "inside `with step.full_optimizer(): optimizer.train()` (it moves the parameters back with the state "
                "the step holds)."
            ) from error
        branch = _optimizer_branch(error, type(optimizer))
        if branch is not None:
            raise UnsupportedOptimizerError(
                f"{name}.step() branches in Python on a value it computes from its state or settings, or makes a "
                f"Python number of one, at {branch}\n"
                "  why: zerocc traces the update once, on tensors whose values it does not know, and runs it every "
                "step; a branch on the step count (RAdam's rho_t, ASGD's mu) takes different sides at different "
                "steps, and a Python number made of it (state['step'].item(), float(...), math.pow(beta, step)) would "
                "be the first step's at every step. (RAdam's and ASGD's updates are otherwise elementwise; it is this "
                "branch that cannot be traced.)\n"
                "  fix: use an optimizer whose step() does not branch on values (SGD, Adam, AdamW, NAdam, Adamax, "
                "Adagrad, Adadelta, RMSprop, Rprop); in an optimizer of your own, compute with tensor ops "
                "(1 - beta1 ** state['step'] with the step count a tensor, torch.where instead of an if)."
            ) from error
        raise UnsupportedOptimizerError(
            f"{name}.step() could not be traced: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}\n"
            "  why: zerocc needs the update as one fixed sequence of tensor ops; an update that branches on "
            "tensor values, or keeps state that is not shaped like its parameter, cannot be sharded.\n"
            "  fix: use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...)."
        ) from error
    new_states = []
    for param in params:
        state = shadow.state.get(param, {})
        new_states.append({key: value for key, value in state.items() if isinstance(value, torch.Tensor)})
        param.grad = None
    return list(params), new_states


def _known_constant(value: torch.Tensor) -> torch.Tensor:
    """A tensor setting (``weight_decay=torch.tensor(0.01)``) made again inside the trace from its values.

    The trace then knows its value, so the optimizer's branches on it (``if weight_decay != 0``) are decided as
    eager decides them, where the tensor itself would be a constant of unknown value; the program is keyed on the
    value (``hyperparameter_signature``). The update still computes with a tensor of its dtype, as eager does.
    """
    return torch.tensor(value.tolist(), dtype=value.dtype, device=value.device)


def _optimizer_branch(error: BaseException, optimizer_class: type) -> str | None:
    """'file:line: code' of the optimizer's own branch on a traced value that ``error`` stopped at, if it is one."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    if not isinstance(error, GuardOnDataDependentSymNode):
        return None
    return _optimizer_frame(error, optimizer_class)


def _optimizer_frame(error: BaseException, optimizer_class: type) -> str | None:
    """'file:line: code' of the innermost frame of ``error``'s traceback in the optimizer's own code, if any."""
    return innermost_frame(traceback.extract_tb(error.__traceback__), _optimizer_files(optimizer_class).__contains__)


def _optimizer_files(optimizer_class: type) -> set[str]:
    """The source files of the optimizer class's own functions and of those it inherits (not the base class's)."""
    files = set()
    for cls in optimizer_class.__mro__:
        if cls in (torch.optim.Optimizer, object):   # not the base class's step() wrappers
            continue
        # the files of the class's own functions: torch.optim's public classes (Adafactor) name the package as
        # their __module__, so the class's source file is not where its step() is
        functions = [inspect.unwrap(f) for f in vars(cls).values() if callable(f)]
        for source in (cls, *functions):
            try:
                files.add(os.path.abspath(inspect.getsourcefile(source) or ""))
            except (TypeError, OSError):   # OSError: a class defined in a notebook cell (its module has no file)
                continue
    return files


def _optimizer_line_of_node(node: fx.Node, optimizer_class: type) -> str | None:
    """'file:line: code' of the innermost frame of the optimizer's own source in ``node``'s stack trace.

    For torch.optim's optimizers, whose files ``user_line_of_node`` leaves out as library code by default.
    """
    return user_line_of_node(node, wanted=_optimizer_files(optimizer_class).__contains__)


@functools.lru_cache(maxsize=None)
def _optimizer_methods(optimizer_class: type) -> tuple:
    """The methods of the optimizer class and of the classes it inherits from (not torch's base class): the
    helpers its step() calls (pytorch_optimizer's ``_step_per_param``), whose lines the error messages name."""
    return tuple(inspect.unwrap(function) for cls in optimizer_class.__mro__
                 if cls not in (torch.optim.Optimizer, object)
                 for function in vars(cls).values() if inspect.isfunction(inspect.unwrap(function)))


@functools.lru_cache(maxsize=None)
def _optimizer_functions(optimizer_class: type) -> tuple:
    """The functions of torch's modules that define the optimizer class's own methods (torch.optim.Muon's step()
    calls its module's ``muon``, which calls ``_zeropower_via_newtonschulz``): their lines go into the traced nodes.

    Only torch's: a user's module may hold the training loop too, whose frames would then be kept in every node's
    stack trace; a user's optimizer has the lines of its own step() in any case.
    """
    modules = set()
    for cls in optimizer_class.__mro__:
        if cls in (torch.optim.Optimizer, object):
            continue
        for function in vars(cls).values():
            module = inspect.getmodule(inspect.unwrap(function)) if callable(function) else None
            if module is not None and module.__name__.startswith("torch."):
                modules.add(module)
    return tuple(function for module in modules for function in vars(module).values()
                 if inspect.isfunction(function) and function.__module__ == module.__name__)


# Ops an elementwise update may use besides those tagged pointwise.
_ELEMENTWISE_EXTRAS = {
    aten._local_scalar_dense.default, aten.clone.default, aten.copy.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten._to_copy.default, aten.lift_fresh_copy.default, aten.scalar_tensor.default,
    aten.zeros.default, aten.full.default, aten.detach.default, aten.alias.default,
    aten.view_as_real.default, aten.view_as_complex.default,
}


def _is_masked_fill(node: fx.Node) -> bool:
    """``x[mask] = scalar`` with a mask shaped like ``x`` (Rprop's sign updates): each element on its own."""
    if node.target not in (aten.index_put.default, aten.index_put_.default):
        return False
    target, indices, values = (g.tensor_meta(a) if isinstance(a, fx.Node) else a for a in node.args[:3])
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], fx.Node)):
        return False
    mask = g.tensor_meta(indices[0])
    return (target is not None and mask is not None and values is not None and mask.dtype == torch.bool
            and tuple(mask.shape) == tuple(target.shape) and values.dim() == 0)


def elementwise_offenders(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """The nodes of an update that mix elements of a parameter (a norm, a matmul, a row mean)."""
    offenders = []
    for node in nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.pointwise in target.tags or target in _ELEMENTWISE_EXTRAS:
                continue
            if target._opname.startswith("_foreach_") or target._opname.startswith("_fused_"):
                continue
            if _is_masked_fill(node):
                continue
            value = g.tensor_meta(node)
            if value is not None and value.dim() == 0 and all(
                (a.meta.get(g.VAL) is None) or (isinstance(a.meta.get(g.VAL), torch.Tensor) and a.meta[g.VAL].dim() == 0)
                for a in node.all_input_nodes
            ):
                continue  # arithmetic on scalars (step counts) is fine
            offenders.append(node)
        elif target is operator.getitem or getattr(target, "__module__", "") in ("_operator", "math", "torch"):
            continue
        else:
            offenders.append(node)
    return offenders


def check_elementwise(nodes: Sequence[fx.Node], optimizer: torch.optim.Optimizer) -> None:
    """Refuse an update that mixes elements of a parameter (a norm, a matmul, a row mean).

    zerocc runs the update on the slice of each parameter a rank owns, which is
    only the same computation if every element is updated on its own.
    """
    offenders = elementwise_offenders(nodes)
    if offenders:
        by_op: dict[str, list[fx.Node]] = {}
        for node in offenders:
            by_op.setdefault(g.short_name(node.target), []).append(node)
        lines = []
        for op, nodes in by_op.items():
            where = (_optimizer_line_of_node(nodes[0], type(optimizer)) or user_line_of_node(nodes[0])
                     or f"graph node {nodes[0].name}")
            lines.append(f"  - aten.{op}, {len(nodes)} call(s), first at {where}")
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step() is not elementwise per parameter:\n" + "\n".join(lines) + "\n"
            "  why: at stages 1-3 zerocc runs the update on the 1/N slice of each parameter a rank owns, "
            "which computes the same thing only if every element is updated on its own.\n"
            "  fix: use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...), or stage=0, "
            "which updates whole parameters."
        )


def check_state_shapes(states: Sequence[dict[str, fx.Node]], shapes: Sequence[tuple[int, ...]],
                       names: Sequence[str], optimizer: torch.optim.Optimizer) -> None:
    """Refuse per-parameter state that is neither shaped like its parameter nor 0-dim (a factored second moment).

    Every stage lays out a state tensor as its parameter is laid out, flat in the parameter's bucket (1/N of it
    per rank at stages 1-3): a tensor of another shape has no place there.
    """
    for state, shape, name in zip(states, shapes, names):
        for key, node in sorted(state.items()):
            value = node.meta.get(g.VAL)
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != tuple(shape):
                where = _optimizer_line_of_node(node, type(optimizer)) or user_line_of_node(node)
                raise UnsupportedOptimizerError(
                    f"{type(optimizer).__name__}.step() keeps state {key!r} of shape {tuple(value.shape)} for "
                    f"parameter {name!r} of shape {tuple(shape)}{f', made at {where}' if where else ''}\n"
                    "  why: zerocc lays out each optimizer state tensor as its parameter is laid out, flat in the "
                    "parameter's bucket (1/N of it per rank at stages 1-3), at every stage: it holds state shaped like "
                    "its parameter, or 0-dim (a step count), not a factored statistic (per-row or per-column "
                    "moments).\n"
                    "  fix: keep each state tensor shaped like its parameter or 0-dim, or use an optimizer that does "
                    "(SGD, Adam, AdamW, Adagrad, RMSprop, ...)")


REPLICATE_IF_ELEMENTWISE = "if elementwise"


def splice_update(
    gm: fx.GraphModule,
    fake_mode,
    optimizer: torch.optim.Optimizer,
    params: Sequence[fx.Node],
    grads: Sequence[fx.Node],
    states: Sequence[dict[str, fx.Node]],
    learning_rates: Sequence[fx.Node],
    group_of: Sequence[int],
    *,
    replicate: bool | str,
    cache: dict | None = None,
    units: Sequence[int] | None = None,
) -> tuple[list[fx.Node], list[dict[str, fx.Node]], list[fx.Node]]:
    """Trace ``optimizer.step()`` over ``params`` and splice it into ``gm`` before the output.

    Returns the new parameter nodes, the new state nodes (by key) and every
    node added. With ``replicate``, the step is traced once per class of
    parameters that look alike to the optimizer (shape, dtype, group, state
    layout) and its subgraph is copied for each member, in order: valid when
    the update of one parameter reads only that parameter's tensors, which
    ``check_elementwise`` requires anyway. Tracing is the costly part of
    compilation (a GPT's layers share a dozen classes), copying is cheap.
    The group in the class is the group's ``trace_classes`` class: param groups
    differing only in the values of the settings read every step (layer-wise
    learning rates) share a trace, each copy reading its own group's settings
    inputs (``settings_slots``).
    ``cache`` keeps traced classes for later calls with the same fake mode
    (a planner planning many world sizes). With ``REPLICATE_IF_ELEMENTWISE``
    (stage 0, which takes any optimizer), the update is replicated if its
    per-class trace is elementwise and traced over all parameters at once if not.

    A param group whose update runs foreach kernels (eager's choice on CUDA, or ``foreach=True``) is not
    replicated: one copy per parameter would launch every foreach op once per parameter (on an H200 the
    124M GPT's step took 2,263 kernels against eager's 836, the host the bottleneck). Its update is traced
    over each of ``units`` (an id per parameter: the bucket, so that ``overlap_updates`` can still run a
    bucket's update after its reduction; None: the whole group, as eager launches it). Foreach kernels
    compute each element as they do over eager's lists, so the step stays bit for bit.
    """
    if replicate == REPLICATE_IF_ELEMENTWISE:
        stepped, stepped_states, added = splice_update(
            gm, fake_mode, optimizer, params, grads, states, learning_rates, group_of, replicate=True, cache=cache,
            units=units)
        if not elementwise_offenders(added):
            return stepped, stepped_states, added
        for node in reversed(added):
            gm.graph.erase_node(node)
        g.drop_unread_constants(gm)
        replicate = False
    from .tracing import trace_functional   # tracing imports nothing from here; kept local for clarity
    import torch.utils._pytree as pytree

    def describe(node):
        value = node.meta[g.VAL]
        return (tuple(value.shape), value.dtype, str(value.device))

    foreach_groups = {index for index in set(group_of) if replicate and eager_picks_foreach(
        optimizer.param_groups[index], [params[i].meta[g.VAL] for i in range(len(params)) if group_of[i] == index])}
    slots = settings_slots(optimizer)
    class_of = trace_classes(optimizer)
    if len(learning_rates) != sum(map(len, slots)):   # not the settings inputs of live_layout: nothing to rebind
        class_of = [("group", index) for index in range(len(slots))]
    members: dict[tuple, list[int]] = collections.OrderedDict()
    for i in range(len(params)):
        if not replicate:
            key = "all"
        elif group_of[i] in foreach_groups:
            key = ("foreach", group_of[i], None if units is None else units[i])
        else:
            key = (describe(params[i]), describe(grads[i]), class_of[group_of[i]],
                   tuple((k, describe(n)) for k, n in sorted(states[i].items())))
        members.setdefault(key, []).append(i)

    def copied(key) -> bool:
        """Whether ``key``'s trace is of its first member, copied for the others."""
        return bool(replicate) and key[0] != "foreach"

    def fresh(node):
        value = node.meta[g.VAL]
        return g.empty_fake(fake_mode, value.shape, value.stride(), value.dtype, value.device)

    def family(i):
        """A class's key without the shapes: classes in one family differ only in the parameter's shape."""
        param = params[i].meta[g.VAL]

        def relative(node):
            value = node.meta[g.VAL]
            return ("like the parameter" if value.shape == param.shape else tuple(value.shape),
                    value.dtype, str(value.device), value.is_contiguous())
        return (param.dtype, str(param.device), param.is_contiguous(), relative(grads[i]), class_of[group_of[i]],
                tuple((k, relative(n)) for k, n in sorted(states[i].items())))

    def rebound(traced_group: int, group: int) -> list[fx.Node]:
        """The settings inputs of a copy of ``traced_group``'s trace for a parameter of ``group`` (one class)."""
        sources = list(learning_rates)
        if group != traced_group:
            for candidate, slot in slots[traced_group].items():
                if candidate[0] == "lr" or candidate[0] in optimizer.defaults:
                    sources[slot] = learning_rates[slots[group][candidate]]
        return sources

    traced = {}   # class -> (subgraph, output spec, constants on gm, traced for another shape, the group traced)
    shape_free_traces = {}   # family -> its first class's key, when that trace holds for any shape
    for key, indices in members.items():
        chosen = indices[:1] if copied(key) else indices
        borrowed = shape_free_traces.get(family(indices[0])) if copied(key) else None
        if borrowed is not None:
            traced[key] = (*traced[borrowed][:3], True, traced[borrowed][4])
            continue
        cache_key = (key, id(optimizer), tuple(describe(n) for n in learning_rates))
        traced_group = group_of[chosen[0]]
        if copied(key) and cache is not None and cache_key in cache:
            sub, spec, traced_group = cache[cache_key]
        else:
            def update(ps, gs, ss, lrs, chosen=chosen):
                return optimizer_update(optimizer, ps, gs, ss, [group_of[i] for i in chosen], lrs)

            args = ([fresh(params[i]) for i in chosen], [fresh(grads[i]) for i in chosen],
                    [{k: fresh(n) for k, n in sorted(states[i].items())} for i in chosen],
                    [fresh(n) for n in learning_rates])
            sub, spec = trace_functional(update, args, fake_mode)
            if copied(key) and cache is not None:
                cache[cache_key] = (sub, spec, traced_group)
        attributes = {}
        for node in sub.graph.nodes:
            if node.op == "get_attr":
                attributes[node.target] = g.unique_attribute(gm, "opt" + node.target)
                gm.register_buffer(attributes[node.target], getattr(sub, node.target))
        traced[key] = (sub, spec, attributes, False, traced_group)
        if copied(key) and _holds_for_any_shape(sub):
            shape_free_traces[family(indices[0])] = key

    graph = gm.graph
    output = g.output_node(gm)
    new_params: list[fx.Node | None] = [None] * len(params)
    new_states: list[dict[str, fx.Node] | None] = [None] * len(params)
    added: list[fx.Node] = []
    order = [(key, [i]) if copied(key) else (key, indices) for key, indices in members.items()
             for i in (indices if copied(key) else indices[:1])]
    order.sort(key=lambda item: item[1][0])
    copies_of: collections.Counter = collections.Counter()
    with graph.inserting_before(output):
        for key, indices in order:
            sub, spec, attributes, reshaped, traced_group = traced[key]
            sources = [*[params[i] for i in indices], *[grads[i] for i in indices],
                       *[n for i in indices for _, n in sorted(states[i].items())],
                       *(rebound(traced_group, group_of[indices[0]]) if copied(key) else learning_rates)]
            env = dict(zip(g.placeholders(sub), sources))
            first_copy = copies_of[key] == 0
            copies_of[key] += 1
            for node in sub.graph.nodes:
                if node.op == "placeholder":
                    continue
                if node.op == "output":
                    results = [env[n] for n in node.args[0]]
                    break
                if node.op == "get_attr":
                    copy = graph.get_attr(attributes[node.target])
                    copy.meta.update(node.meta)
                else:
                    copy = g.copy_node(graph, node, env.__getitem__)
                    if reshaped:
                        _propagate_fake(copy, fake_mode, broadcast=True)
                    elif not first_copy:
                        _propagate_fake(copy, fake_mode)
                added.append(copy)
                env[node] = copy
            stepped, stepped_states = pytree.tree_unflatten(results, spec)
            for position, i in enumerate(indices):
                new_params[i] = stepped[position]
                new_states[i] = stepped_states[position]
    return new_params, new_states, added


# Ops whose output has the broadcast shape of their tensor inputs, besides those tagged pointwise: the
# elementwise extras but those that take a size (zeros, full) or change it (view_as_real/complex).
_BROADCASTING_EXTRAS = _ELEMENTWISE_EXTRAS - {
    aten.zeros.default, aten.full.default, aten.view_as_real.default, aten.view_as_complex.default,
}


def _holds_for_any_shape(sub: fx.GraphModule) -> bool:
    """Whether a traced update is the same sequence of ops whatever the parameter's shape.

    True when every op broadcasts its inputs (pointwise ops, ``*_like``
    factories, copies) and every tensor is contiguous: no op takes a size, a
    dimension or an offset, so the trace of one shape serves every shape, and
    a copy's values are re-shaped by ``_propagate_fake(broadcast=True)``.
    """
    for node in sub.graph.nodes:
        value = node.meta.get(g.VAL)
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            return False
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            if torch.Tag.pointwise not in target.tags and target not in _BROADCASTING_EXTRAS:
                return False
        elif getattr(target, "__module__", "") not in ("_operator", "math"):
            return False
    return True


def _propagate_fake(node: fx.Node, fake_mode, broadcast: bool = False) -> None:
    """Give a copied node its own fake value, so copies never look like aliases of one another.

    A fresh empty tensor of the same layout, except for views, which are
    re-derived from their (copied) input so that they still alias it.
    Running every op again under the fake mode would cost ~4 ms a node
    (measured: the symbolic step counts defeat its cache). With ``broadcast``
    (a trace borrowed from a parameter of another shape, see
    ``_holds_for_any_shape``) the fresh tensor takes its inputs' broadcast shape.
    """
    value = node.meta.get(g.VAL)
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return   # symbolic scalars (.item() of a step count) keep the traced copy's symbol
    returns = node.target._schema.returns if isinstance(node.target, torch._ops.OpOverload) else ()
    if returns and returns[0].alias_info is not None:
        args, kwargs = g.fake_arguments(node.args, node.kwargs)
        with fake_mode:
            node.meta[g.VAL] = node.target(*args, **kwargs)
        return
    if broadcast:
        shapes = [a.meta[g.VAL].shape for a in node.all_input_nodes if isinstance(a.meta.get(g.VAL), torch.Tensor)]
        shape = tuple(shapes[0] if shapes and all(s == shapes[0] for s in shapes) else
                      torch.broadcast_shapes(*shapes) if shapes else value.shape)
        node.meta[g.VAL] = g.empty_fake(fake_mode, shape, make_contiguous_strides_for(shape), value.dtype,
                                      value.device)
        return
    node.meta[g.VAL] = g.empty_fake(fake_mode, value.shape, value.stride(), value.dtype, value.device)


def initial_state_layout(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                         shapes: Sequence[tuple[int, ...]] | None = None,
                         ) -> list[dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Per parameter of ``params``: the (shape, dtype) of each state tensor the optimizer's first step creates.

    Traced on fake tensors with zero gradients: nothing real is read or
    written. A checkpoint loaded before the first step needs it to ask for
    the saved optimizer state by name (``zerocc/state_dict.py``). ``shapes``:
    the parameters' own, where the module holds placeholders (a started step).
    """
    group_of_id = {id(p): index for index, group in enumerate(optimizer.param_groups) for p in group["params"]}
    group_of = [group_of_id[id(p)] for p in params]
    if has_train_and_eval(optimizer) and any(group.get("train_mode") is False for group in optimizer.param_groups):
        # Schedule-Free's step() raises in eval mode, and a checkpoint saved after optimizer.eval() loads into a
        # step before its first call in eval mode: the state its first step creates is the same in either mode
        optimizer = shadow_of(optimizer, [{**group, "train_mode": True} if "train_mode" in group else group
                                          for group in optimizer.param_groups])
    fake_mode = make_fake_mode()
    if shapes is None:
        fakes = fakeify(fake_mode, ([p.detach() for p in params], [torch.zeros_like(p.detach()) for p in params]))
    else:
        with fake_mode:
            fake_params = [torch.empty(shape, dtype=p.dtype, device=p.device) for p, shape in zip(params, shapes)]
            fakes = (fake_params, [torch.zeros_like(p) for p in fake_params])

    live_modes(optimizer)   # found now, by a trace of its own, not inside this one's

    def first_step(fake_params, fake_grads):
        _, states = optimizer_update(optimizer, fake_params, fake_grads, [{} for _ in params], group_of,
                                     live_settings(optimizer))
        return states

    gm, spec = trace_functional(first_step, fakes, fake_mode)
    values = [node.meta[g.VAL] for node in g.output_node(gm).args[0]]
    states = pytree.tree_unflatten(values, spec)
    return [{key: (tuple(value.shape), value.dtype) for key, value in sorted(state.items())} for state in states]
