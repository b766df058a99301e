"""The user's model and optimizer after compile: every view of them current, or a clear error.

Sits beside the runtime, like ``zerocc/state_dict.py``: once a step's first
call moves the parameters and optimizer state into its slots
(``runtime/slots.py``), the user's objects would otherwise show stale or
empty copies (stage 3 releases parameters to shape ``(0,)``; the optimizer's
``state`` is cleared). Hooks installed here make them tell the truth:

- ``model(x)`` and ``model.load_state_dict`` with released parameters raise, pointing at ``step.full_model()``;
- ``model.state_dict()`` holds the current full parameters where this rank
  has them without a collective, else raises, pointing at ``step.full_state_dict()``;
- ``optimizer.state_dict()`` holds the current state in torch's format where
  this rank holds all of it, else raises; ``optimizer.load_state_dict`` raises,
  pointing at ``step.load_state_dict`` and ``zerocc.load_checkpoint``;
- ``optimizer.state[param]`` of a trained parameter raises (``HeldOptimizerState``),
  pointing at what holds it now.

``full_model(step)`` is the in-place full model FSDP's ``summon_full_params``
and DeepSpeed's ``GatheredParameters`` give: the parameters gathered into the
module for the block, written back into the step's shards on exit.
"""
from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
import sysconfig
import traceback
import types
import weakref

import torch

from . import decisions
from .errors import ConfigError
from .runtime import slots as slot_store


def install(step) -> list:
    """Hook the user's model and optimizer to ``step``; returns the hook handles (removed if the first call fails)."""
    return [
        step.model.register_forward_pre_hook(_StepHook(step, lambda module, args: _refuse_released_forward(step))),
        step.model.register_state_dict_pre_hook(_StepHook(step, lambda module, prefix, keep_vars: _saving(step, True))),
        step.model.register_state_dict_post_hook(_StepHook(
            step, lambda module, state, prefix, metadata: _current_model_state(step, state, prefix))),
        step.model.register_load_state_dict_pre_hook(_StepHook(step, lambda module, *args: _refuse_released_load(step))),
        step.optimizer.register_state_dict_post_hook(
            _StepHook(step, lambda optimizer, state: _current_optimizer_state(step, state))),
        step.optimizer.register_load_state_dict_pre_hook(
            _StepHook(step, lambda optimizer, state: _refuse_optimizer_load())),
    ]


class _StepHook:
    """One of ``install``'s hooks; a copy of it (``copy.deepcopy(model)``, ``torch.save(model)``, which copy the
    module's hooks with it) is a ``_Detached`` hook: the copy is a plain model, which no step holds.

    A lambda could not be pickled (``torch.save(model)`` failed at every stage on "Can't pickle local object"), and
    a deep copy kept hooks bound to the step. Where the module holds released placeholders (stage 3), a copy would
    hold them too, empty, and an EMA or a saved model built from it would silently stay empty: refused, naming
    ``full_model``, where a copy takes the whole parameters."""

    def __init__(self, step, hook):
        # names of their own: torch's _WrappedHook (load_state_dict pre-hooks) copies a hook's __dict__ onto itself
        self._zerocc_step, self._zerocc_hook = step, hook

    def __call__(self, *args):
        return self._zerocc_hook(*args)

    def __reduce__(self):
        if _released(self._zerocc_step):
            raise copy_refusal(self._zerocc_step.stage)
        return _Detached, ()


def copy_refusal(stage: int, parameter: str | None = None, note: str = "") -> ConfigError:
    """A copy or pickle of the model (its hooks) or of one of its placeholders (``HeldParameter``), naming the
    user's line (the copy's own frames, ``copy.py`` and pickle's, are not the user's)."""
    what = f" (parameter {parameter!r})" if parameter else ""
    return ConfigError(
        f"copying or pickling the model after compile (copy.deepcopy(model), torch.save(model)) or its parameters"
        f"{what} at {user_line() or '(no user frame found)'}: the parameters are sharded across the compiled step "
        f"(stage {stage}), and a copy (an EMA or teacher model, a 'best model' snapshot) would be empty: the module "
        "holds empty placeholders. Copy it inside `with step.full_model(writeback=False): snapshot = "
        "copy.deepcopy(model)` (every rank enters it: a gather), or save step.full_state_dict() / "
        f"zerocc.save_checkpoint(step, path){note}")


def user_line(stack: traceback.StackSummary | None = None) -> str | None:
    """The innermost frame of the user's code (not zerocc's, torch's, the standard library's or an installed
    package's) in ``stack`` (the calling frames, extracted here unless given): the line that called
    ``copy.deepcopy``, ``torch.save`` or ``clip_grad_norm_``."""
    from .errors import innermost_frame, is_users
    return innermost_frame(traceback.extract_stack() if stack is None else stack,
                           lambda path: is_users(path) and not path.startswith(_NOT_USERS))


_NOT_USERS = tuple(dict.fromkeys(os.path.abspath(sysconfig.get_paths()[key]) + os.sep
                                 for key in ("stdlib", "platstdlib", "purelib", "platlib")))


class _Detached:
    """A copied ``_StepHook``: does nothing."""

    def __call__(self, *args):
        return None


def _released(step) -> bool:
    """Parameters of the user's module are (0,)-shaped now (stage 3 outside ``full_model``)."""
    if not step.state.released_shapes or step.state.full_model_depth:
        return False
    name = next(iter(step.state.released_shapes))
    module = step.model
    *path, leaf = name.split(".")
    for part in path:
        module = getattr(module, part)
    return held_numel(getattr(module, leaf)) == 0   # while capture traces, the module holds the traced tensor


def _refuse_released_forward(step) -> None:
    if _released(step):
        raise ConfigError(
            f"the model's parameters are sharded across the compiled step (stage {step.stage}): the module holds "
            "empty placeholders. To run the eager model, wrap the call in `with step.full_model(): model(x)` "
            "(`writeback=False` to discard changes); to evaluate, use step.eval_forward(x); to hand the model back "
            "whole for good, step.close() (`del step` does not: the model keeps the step, which holds its parameters, "
            "alive; without the step at hand, zerocc.compile(model, optimizer).close() closes it)")


def _refuse_released_load(step) -> None:
    if _released(step):
        raise ConfigError(
            f"model.load_state_dict after compile: the model's parameters are sharded across the compiled step "
            f"(stage {step.stage}): the module holds empty placeholders, which PyTorch reports as a size mismatch. "
            "Load inside `with step.full_model(): model.load_state_dict(sd)` (written back into the step on exit), "
            "or load a checkpoint with zerocc.load_checkpoint / step.load_state_dict")


def _saving(step, saving: bool) -> None:
    """``model.state_dict()`` of the step's model is running (its pre-hook) or done (its post-hook): while it runs,
    torch's ``_save_to_state_dict`` takes ``p.detach()`` of each placeholder, which the post-hook
    (``_current_model_state``) replaces by the whole values or refuses. A submodule's ``state_dict()``
    (``model.fc.state_dict()``) runs no hook of the model's: its ``detach`` is refused, naming the user's line (it
    gave empty tensors, silently, while a look at the calling frames let any ``_save_to_state_dict`` through).

    The mark is the frame of the model's running ``state_dict()`` (``_state_dict_frame``), not a flag: a hook of the
    user's raising between the two hooks (a post-hook registered before compile runs before the step's) skips the
    post-hook, and a flag left set let a later submodule's ``detach`` through, empty; the frame marks only while it
    is on the stack (``_saving_now``)."""
    if step.state.watch is not None:
        step.state.watch.saving_state_dict = _state_dict_frame() if saving else None


def _state_dict_frame():
    """The frame of the ``nn.Module.state_dict`` that runs the model's pre-hook: the nearest one up the stack (the
    model's own, not an enclosing module's), found by its code, not at a fixed depth past the hook, which a frame
    between them (a tool that wraps module hooks, a torch that calls them through a helper) would have moved onto
    the wrapper's frame, gone before ``_save_to_state_dict`` runs. None where there is none: a placeholder's
    ``detach`` is then refused, never let through empty."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not _MODULE_STATE_DICT:
        frame = frame.f_back
    return frame


_MODULE_STATE_DICT = torch.nn.Module.state_dict.__code__   # where torch runs a module's state-dict pre-hooks


def _saving_now(watch) -> bool:
    """Whether the model's ``state_dict()`` marked by ``_saving`` is running: its frame is on the stack here."""
    saving = watch.saving_state_dict
    frame = sys._getframe(1) if saving is not None else None
    while frame is not None:
        if frame is saving:
            return True
        frame = frame.f_back
    watch.saving_state_dict = None   # left by a state_dict() an exception ended, or none
    return False


def _current_model_state(step, state: dict, prefix: str) -> None:
    _saving(step, False)
    if not _released(step) or step.state.reading_model_keys:
        return
    plan = step.state.plan
    if any(plan.holds_shard(b) for b in plan.buckets) and step.ranks.world_size > 1:
        why = "" if step.stage == 3 else " under param_dtype (the fp32 masters are sharded)"
        raise ConfigError(
            f"model.state_dict() at {user_line() or '(no user frame found)'}, after compile at stage {step.stage}{why} "
            f"over {step.ranks.world_size} ranks: each rank holds a shard of the parameters. Call step.full_state_dict() "
            "on every rank (a collective), use `with step.full_model(): model.state_dict()` on every rank, or save "
            "with zerocc.save_checkpoint")
    full = step.full_state_dict()
    for key in state:
        if key.startswith(prefix) and key[len(prefix):] in full:
            state[key] = full[key[len(prefix):]]


def _current_optimizer_state(step, state: dict) -> dict:
    if not step.state.started:
        return state
    if step.ranks.world_size > 1 and step.stage > 0:
        raise ConfigError(
            f"optimizer.state_dict() at {user_line() or '(no user frame found)'}, after compile at stage {step.stage} "
            f"over {step.ranks.world_size} ranks: each rank holds a shard of the optimizer state, and a checkpoint "
            "saved by one rank cannot hold the others'. Save with zerocc.save_checkpoint(step, path) on every rank "
            "(or step.state_dict() and torch.distributed.checkpoint), which reshards it on load")
    from .state_dict import whole_optimizer_state
    position = {id(p): i for i, p in enumerate(p for g in step.optimizer.param_groups for p in g["params"])}
    params = step.state.tensors("param")
    state["state"] = {position[id(params[fqn])]: entries for fqn, entries in whole_optimizer_state(step).items()}
    return state


class HeldOptimizerState(collections.defaultdict):
    """``optimizer.state`` while a started step holds the optimizer state in its slots: empty.

    A user reading a trained parameter's state after a step (``optimizer.state[p]["exp_avg"]`` to log it, Adam's
    ``step`` count) got an empty dict and a bare ``KeyError: 'exp_avg'`` (and an in-place edit of it would change
    nothing the step trains on): that read raises now, naming the parameter and what holds its state. Anything else
    (a frozen parameter's empty state, ``.get``, iteration: empty) is a plain ``defaultdict(dict)``'s, and a copy or
    pickle of the optimizer holds one."""

    def __init__(self, step):
        super().__init__(dict)
        self._zerocc_step = weakref.ref(step)

    def __missing__(self, key):
        step = self._zerocc_step()
        if step is not None and not step.closed and step.state.started:
            tensors, params = step.state.tensors("param"), step.state.captured.params
            names = [params[i].name for i in step.state.param_indices() if tensors[params[i].name] is key]
            if names:
                current = ("optimizer.state_dict()['state'] (current, indexed like its param_groups' params)"
                           if step.ranks.world_size == 1 or step.stage == 0 else
                           "step.state_dict() (this rank's pieces, under 'optim/<parameter>/<key>')")
                raise ConfigError(
                    f"optimizer.state[{names[0]!r}] after the compiled step's first call: the step holds the "
                    f"optimizer state in its own buckets (stage {step.stage}), and optimizer.state is left empty. "
                    f"Read it from {current}; change it with step.load_state_dict or zerocc.load_checkpoint; "
                    "step.close() hands it back to optimizer.state. To run the optimizer's own code over its "
                    "state (Schedule-Free's optimizer.eval() and optimizer.train()), call it inside `with "
                    "step.full_optimizer(): optimizer.eval()`, which puts the whole state there for the block")
        return super().__missing__(key)

    def __reduce__(self):   # copy.deepcopy(optimizer), torch.save(optimizer): a plain defaultdict, no step
        return collections.defaultdict, (dict,), None, None, iter(self.items())


def _refuse_optimizer_load() -> None:
    raise ConfigError(
        "optimizer.load_state_dict() after compile: the compiled step holds the optimizer state now. Load "
        "with step.load_state_dict(state) (after dcp.load) or zerocc.load_checkpoint(step, path)")


@contextlib.contextmanager
def full_model(step, writeback: bool = True):
    """The whole model in place for the block (a collective at stage 3 over several ranks).

    On exit, with ``writeback``, the module's parameter values are copied
    into the step's buckets (this rank's shard of them), so in-place edits
    (``model.fc.weight.mul_(0.5)``) reach training; without it they are dropped.
    """
    if not step.state.started:   # before the first call the module is the model
        yield step.model
        return
    plan, captured = step.state.plan, step.state.captured
    buckets = slot_store.full_buckets(plan, step.state.slots, step.ranks.group)
    views = slot_store.parameter_views(plan, captured, buckets)
    params = step.state.tensors("param")
    kept = {name: held_data(tensor) for name, tensor in params.items()}
    for index, view in views.items():
        set_data(params[captured.params[index].name], view.clone())
    step.state.full_model_depth += 1
    try:
        yield step.model
        if writeback:
            _write_back(step, buckets, params)
    finally:
        step.state.full_model_depth -= 1
        if step.state.watch is not None:   # `p.data = new` inside the block went into the step with the rest
            step.state.watch.replaced.clear()
        for name, tensor in params.items():
            set_data(tensor, kept[name])
        try:   # `mask.data = new` inside the block (a sparsifier's step) goes into the step too, or is refused here
            adopt_replaced_buffers(step)
        finally:
            step.state.pointed_at.clear()   # the write-back may have replaced slots
            point_module_at_slots(step)
            _note_placeholder_versions(step)


@contextlib.contextmanager
def full_optimizer(step):
    """The whole model and the whole optimizer state in the user's objects for the block (a collective at stages
    1-3 over several ranks), both written back into the step on exit.

    Some optimizers have methods of their own that read the state their ``step()`` keeps and change the
    parameters: Schedule-Free's ``optimizer.eval()`` and ``optimizer.train()`` move each parameter between the
    training point ``y`` and the averaged point ``x`` it is evaluated and saved at, ``p.lerp_(state['z'], ...)``.
    Outside a block ``optimizer.state`` of a trained parameter raises (``HeldOptimizerState``): the step holds it in
    its slots. Inside, the parameters are whole in the module (``full_model``) and ``optimizer.state`` holds each
    trained parameter's state whole, as eager's optimizer keeps it, so that code runs as in eager, on the same
    values with the same elementwise ops: bit for bit. On exit the parameters and the state go back into the
    step's slots (this rank's shard of each); a state entry replaced by one of another shape or dtype, or a key
    added or dropped, is refused: the step's program reads the layout its first call laid out. An exception in the
    block writes nothing back.
    """
    if not step.state.started:   # before the first call the optimizer holds its state itself
        yield step.optimizer
        return
    from .state_dict import _copy_into, _parts, gathered_optimizer_state, optim_key
    whole = gathered_optimizer_state(step)   # a collective at stages 1-3 over several ranks
    held = step.optimizer.state
    params = {names[0]: tensor for names, tensor in step.state.module_tensors["param"]}
    given = {fqn: dict(entries) for fqn, entries in whole.items() if fqn in params}
    with full_model(step, writeback=True):
        state = collections.defaultdict(dict, {p: s for p, s in held.items()})   # frozen parameters' state
        for fqn, entries in whole.items():
            if fqn in params:
                state[params[fqn]] = entries
        step.optimizer.state = state
        try:
            yield step.optimizer
            parts = _parts(step)
            writes = []
            for fqn, before in given.items():
                now = state.get(params[fqn], {})
                if set(now) != set(before) or any(
                        not isinstance(now[key], torch.Tensor) or now[key].shape != value.shape
                        or now[key].dtype != value.dtype for key, value in before.items()):
                    raise ConfigError(
                        f"optimizer.state[{fqn!r}] changed its layout inside `with step.full_optimizer():` (keys "
                        f"{sorted(before)} before, {sorted(now)} after, or an entry of another shape or dtype): the "
                        "compiled step's program reads the layout its first call laid out. Change the values in "
                        "place (state['z'].copy_(...)); nothing of the block was written back")
                # a rank holding no piece of a parameter's state (stage 3, a small bias on another rank) has no part
                writes += [(parts[optim_key(fqn, key)], now[key]) for key in sorted(before) if optim_key(fqn, key) in parts]
            for part, value in writes:
                _copy_into(part, [(0, value.detach().reshape(-1))])
        finally:
            step.optimizer.state = held


def refuse_inside_full_model(step, call: str) -> None:
    """``call`` (a training step, a load, ``close``) inside ``with step.full_model():`` changes the step's state while
    the module holds whole copies of the parameters taken on entering the block: leaving it wrote those stale copies
    back over what ``call`` did (the steps taken inside, a loaded checkpoint: silently undone; ``close`` failed on a
    ``TypeError``). Refused before it changes anything."""
    if step.state.full_model_depth:
        raise ConfigError(
            f"{call} inside `with step.full_model():`: the module holds whole copies of the parameters for the block, "
            f"taken on entering it, which {call} does not update, and leaving the block writes them back into the step "
            f"(writeback=True), undoing what {call} changed. Call it after the block; inside it, read, evaluate or "
            "edit the whole model")


def _write_back(step, buckets: dict[int, torch.Tensor], params: dict[str, torch.Tensor]) -> None:
    plan, captured, slots = step.state.plan, step.state.captured, step.state.slots
    with torch.no_grad():
        for bucket in plan.buckets:
            full = buckets[bucket.index].clone()
            for segment in bucket.segments:
                value = params[captured.params[segment.param].name].detach().reshape(-1)
                full[segment.offset: segment.offset + segment.numel].copy_(value)
            slot = slots[decisions.bucket_slot(bucket.index)]
            if plan.holds_shard(bucket):
                start = plan.rank * bucket.shard_numel
                slot.copy_(full[start: start + bucket.shard_numel])
            else:
                slot.copy_(full)
        slot_store.refresh_compute_copies(plan, slots, step.ranks.group)


def point_module_at_slots(step) -> None:
    """Keep the user's module current: its buffers are the step's, its parameters view the new buckets.

    Runs after every step. Parameters of buckets whose masters are sharded
    (stage 3, and mixed precision at stages 1-2) stay released: no rank
    holds them whole (``step.full_model()`` gathers them).
    """
    state = step.state
    # the slots the module's tensors point at, as of the last time: with memory pools a step writes its updates
    # into the same tensors, so nothing is pointed again (every call comes here; on a GPU host time is step time)
    pointed = state.pointed_at
    buffers = state.tensors("buffer")
    for info in state.captured.buffers:
        slot = state.slots[decisions.buffer_slot(info.name)]
        if pointed.get(info.name) is not slot:
            buffers[info.name].data = pointed[info.name] = slot
    if step.stage == 3:
        return
    whole = {b.index: state.slots[decisions.bucket_slot(b.index)] for b in state.plan.buckets
             if not state.plan.holds_shard(b)}
    whole = {index: bucket for index, bucket in whole.items() if pointed.get(index) is not bucket}
    views = slot_store.parameter_views(state.plan, state.captured, whole)
    tensors = state.tensors("param")
    for index, view in views.items():
        set_data(tensors[state.captured.params[index].name], view)
    pointed.update(whole)


def adopt_replaced_buffers(step) -> None:
    """A buffer whose ``.data`` was set to another tensor since the step last pointed it at its slot
    (``buffer.data = new``) is taken into the step: its values are copied into the slot, which it views again.

    The module's buffers view the step's slots (``point_module_at_slots``), so a write in place (``disable_observer``'s
    ``observer_enabled[0] = 0``) is the step's. ``torch.ao.pruning``'s sparsifiers instead set the mask's ``.data``
    at every ``sparsifier.step()`` (the same buffer object, so ``check_module_tensors_unchanged`` sees nothing): the
    program went on reading the first mask, silently, where eager reads the new one, and leaving
    ``step.full_model()`` pointed the buffer back at the slot, dropping it. Same shape and dtype: adopted, as eager
    reads it (across ranks rank 0's, broadcast at the start of the step as DDP does). Another shape or dtype, which
    the program was not compiled for: refused, naming it, and the buffer views the step's slot again."""
    pointed = step.state.pointed_at
    if not pointed:
        return
    buffers = step.state.tensors("buffer")
    other = []
    for info in step.state.captured.buffers:
        slot = pointed.get(info.name)
        buffer = buffers[info.name]
        if slot is None or (buffer.data_ptr() == slot.data_ptr() and buffer.shape == slot.shape):
            continue
        if buffer.shape == slot.shape and buffer.dtype == slot.dtype and buffer.stride() == slot.stride():
            with torch.no_grad():
                slot.copy_(buffer)
        else:
            other.append(f"'{info.name}' ({tuple(slot.shape)} {slot.dtype} then, {tuple(buffer.shape)} {buffer.dtype} now)")
        set_data(buffer, slot)
    if other:
        raise ConfigError(
            f".data of buffer(s) {', '.join(other[:4])}{', ...' if len(other) > 4 else ''} was set to a tensor of "
            "another shape, dtype or layout after the step's last call: the step's program reads the buffer as its "
            "first call laid it out. Write values of the same shape in place (model.mask.copy_(new)); to change its "
            "shape, compile the model and optimizer again (zerocc.compile(model, optimizer, ...) takes them over from "
            "this step). The buffer holds the step's values again (the new tensor was dropped)")


def release_model_parameters(step) -> None:
    """At the first compile: the user's module gives up the parameters whose masters the step shards."""
    state = step.state
    watch_parameters(step)
    tensors = state.tensors("param")
    for index in state.param_indices(sharded_only=True):
        info = state.captured.params[index]
        param = tensors[info.name]
        state.released_shapes[info.name] = info.shape
        if math.prod(info.shape) and type(param) is HeldParameter:
            param.__dict__["_zerocc_watch"].placeholders[id(param)] = (info.name, torch.Size(info.shape))
        set_data(param, torch.empty(0, dtype=param.dtype, device=param.device))
    state.pointed_at.clear()
    point_module_at_slots(step)
    _note_placeholder_versions(step)


class ParameterWatch:
    """What was done to the step's parameters through ``.data`` since the last check (``HeldParameter``)."""

    def __init__(self, stage: int = 3):
        self.stage = stage
        self.saving_state_dict = None   # the frame of the model's running state_dict() (``_saving``)
        # the step and its optimizer, weakly: a copy or pickle of the optimizer copies its placeholders empty; a
        # clip_grad_norm_ between the step's calls is refused
        self.step = self.optimizer = lambda: None
        # id of each released parameter -> (its name, its whole shape): what a placeholder reports and names
        self.placeholders: dict[int, tuple[str, torch.Size]] = {}
        self.reads: list[tuple[torch.nn.Parameter, torch.Tensor]] = []   # each ``.data`` taken of a placeholder
        # each parameter whose ``.data`` was set to another tensor, with the tensor it held before
        self.replaced: list[tuple[torch.nn.Parameter, torch.Tensor]] = []


class HeldParameter(torch.nn.Parameter):
    """The class of each parameter the step holds, from its first call until it hands them back (``close``): a
    ``Parameter`` whose ``.data`` tells the step's ``ParameterWatch`` what was done with it.

    Two edits between steps went past the checks, silently lost:

    - a write through ``p.data`` into a released placeholder (stage 3): ``p.data`` is a new tensor with a version
      counter of its own, so the placeholder's (``check_placeholders_unwritten``) did not move. The original WGAN
      clips its critic so, ``for p in D.parameters(): p.data.clamp_(-0.01, 0.01)``: the step trained on unclipped
      weights where eager clips. Each ``.data`` taken of a placeholder is kept until the next check, which finds
      its counter moved.
    - ``p.data = other`` at every stage (``p.data = p.data.clamp(-c, c)``, ``model.half()`` or ``model.to(dtype)``,
      which set ``.data`` of each parameter): the module's parameter then holds a tensor the step never reads,
      while the step trains on its own copy of the old values. Noted here, refused at the next call
      (``check_parameters_unreplaced``). A ``.to`` that changes nothing (``model.float()`` of a float model) sets
      the parameter to itself and is not a change.

    A read of a released placeholder's values (stage 3; stages 1-2 under ``param_dtype``) ran on no values,
    silently: an EMA taken after compile (``[p.clone() for p in model.parameters()]``) and its ``lerp_`` stayed
    empty, ``p.norm()`` logged 0, ``sum(p.numel() ...)`` counted 0 parameters, ``clip_grad_norm_`` returned 0.
    ``__torch_function__`` (torch calls it for every op given one of these parameters) refuses such an op, naming
    the user's line, ``step.full_model()`` and ``step.full_state_dict()``; the shape queries (``p.shape``,
    ``numel()``, ``size()``, ``dim()``, ``len(p)``) report the whole parameter's, as FSDP2's DTensor does; what
    reads no values (``requires_grad``, ``dtype``, ``.grad``, ``.data``, a ``.to`` that changes nothing, the
    ``detach`` of ``model.state_dict()``, whose hook puts the whole values in) runs as a ``Parameter``'s. A
    parameter holding values (stages 0-2, inside ``full_model``) runs every op as a ``Parameter`` does: the
    compiled step reads its slots, never these objects.

    Set on the parameter objects themselves (``p.__class__``): the user's references stay the same objects and
    ``isinstance(p, nn.Parameter)`` holds; the step's own moves of ``.data`` go through ``set_data``. A parameter
    of a subclass of the user's own keeps its class (and is not watched)."""

    @classmethod
    def __torch_function__(cls, func, types_=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _op_key(func)
        if key not in _READS_NO_VALUES:
            placeholder = _first_placeholder(args, kwargs)
            if placeholder is not None:
                return _on_placeholder(func, key, placeholder, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():   # as nn.Parameter's: plain tensors out
            result = func(*args, **kwargs)
        if key is _GRAD and result is None and sys._getframe(1).f_globals.get("__name__") == _CLIPPING:
            _refuse_clipping_between_steps(args[0])
        return result

    def __repr__(self):
        placeholder = placeholder_of(self)
        if placeholder is None:
            return super().__repr__()
        name, shape = placeholder
        return (f"Parameter {name!r} of shape {tuple(shape)}, {self.dtype}: held by the compiled step (this placeholder "
                "holds no values; read them inside `with step.full_model():`)")

    @property
    def data(self):
        data = held_data(self)
        watch = self.__dict__.get("_zerocc_watch")
        if watch is not None and held_numel(data) == 0:
            if placeholder_of(self) is not None:   # reads through it refused, writes in place seen at the next call
                data = data.as_subclass(PlaceholderData)
                data._zerocc_parameter = self
            watch.reads.append((self, data))
        return data

    @data.setter
    def data(self, value):
        watch = self.__dict__.get("_zerocc_watch")
        if watch is not None and value is not self:
            watch.replaced.append((self, torch._C.TensorBase.data.__get__(self)))
        torch._C.TensorBase.data.__set__(self, value)

    # A copy or a pickle (copy.deepcopy(model) for an EMA, torch.save(model)) is a plain Parameter, without the watch.
    # A placeholder's would be empty: `ema = copy.deepcopy(list(model.parameters()))` (an EMA, a teacher, a "best
    # model" snapshot) stayed empty, silently, and its lerp_ ran on nothing. Refused, naming the user's line, unless
    # the copy is the optimizer's (its param_groups hold the parameters: copy.deepcopy(optimizer) and
    # torch.save(optimizer) copy them empty, as before; the step holds what the optimizer trains). Gathering the
    # whole values here instead would be a collective no other rank knows to join: a copy on rank 0 alone would hang.
    def __deepcopy__(self, memo):
        if id(self) not in memo:
            if placeholder_of(self) is not None and id(self.__dict__["_zerocc_watch"].optimizer()) not in memo:
                raise copy_refusal(self.__dict__["_zerocc_watch"].stage, placeholder_of(self)[0])
            data = torch._C.TensorBase.data.__get__(self)
            memo[id(self)] = torch.nn.Parameter(data.clone(memory_format=torch.preserve_format), self.requires_grad)
        return memo[id(self)]

    def __reduce_ex__(self, protocol):
        if placeholder_of(self) is None:
            return super().__reduce_ex__(protocol)
        # torch.save(optimizer), its param_groups: the empty placeholder, as before; anything else (torch.save(model),
        # torch.save(list(model.parameters()))) is refused; not through PlaceholderData, which refuses a read
        within = _pickling_within(self.__dict__["_zerocc_watch"].optimizer())
        if not within:
            raise copy_refusal(self.__dict__["_zerocc_watch"].stage, placeholder_of(self)[0], "" if within is False else
                               ". A pickle of the optimizer, whose param_groups hold the parameters, is refused so "
                               "outside torch.save (pickle.dumps(optimizer)): torch.save(optimizer) and "
                               "copy.deepcopy(optimizer) copy them empty")
        state, hooks = self.__getstate__(), collections.OrderedDict()
        if state:
            return torch._utils._rebuild_parameter_with_state, (held_data(self), self.requires_grad, hooks, state)
        return torch._utils._rebuild_parameter, (held_data(self), self.requires_grad, hooks)

    def __getstate__(self):
        return {key: value for key, value in self.__dict__.items() if key != "_zerocc_watch"}


_GRAD = torch.Tensor.grad
_CLIPPING = torch.nn.utils.clip_grad.__name__   # clip_grad_norm_, clip_grad_value_, clip_grads_with_norm_


def _refuse_clipping_between_steps(param) -> None:
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` between the step's calls, where an eager loop
    clips between ``backward()`` and ``optimizer.step()``: the step ran both inside its program and left every
    trained parameter's ``.grad`` None, so it returned 0 and clipped nothing, silently (the Hugging Face Trainer's
    default ``max_grad_norm=1.0`` logged a grad_norm of 0). Refused, naming the user's line and ``clip_grad_norm=``,
    which clips inside the step. Only while the step holds the parameters (not inside ``full_model``, where eager
    code runs its own backward)."""
    watch = param.__dict__.get("_zerocc_watch")
    step = watch.step() if watch is not None else None
    if step is None or step.closed or step.state.full_model_depth or not param.requires_grad:
        return
    stack = traceback.extract_stack()
    by_value = any(frame.name == "clip_grad_value_" for frame in stack)
    how = ("zerocc compiles global-norm clipping only (clip_grad_norm=); to clamp each gradient, clamp p.grad in "
           "place in the optimizer's step() (a subclass of it), which the step traces" if by_value else
           "compile with zerocc.compile(..., clip_grad_norm=max_norm) (clip_norm_type= for another norm), which "
           "clips between the gradients' reduction and the update as clip_grad_norm_ does between backward() and "
           "optimizer.step(), and read the norm it returned from step.last_grad_norm (clip_grad_norm=float('inf') "
           "measures it without clipping). Hugging Face Trainer: max_grad_norm=0.0")
    raise ConfigError(
        f"torch.nn.utils.{'clip_grad_value_' if by_value else 'clip_grad_norm_'} at "
        f"{user_line(stack) or '(no user frame found)'} between the compiled step's calls: the step runs backward and "
        f"the optimizer's update inside its program (stage {step.stage}) and leaves every trained parameter's .grad "
        "None, so this would clip nothing (clip_grad_norm_ would return 0) where eager clips before the update. "
        f"Remove the call and {how}")


def _pickling_within(optimizer) -> bool | None:
    """Whether ``torch.save`` is pickling ``optimizer`` now, the object being pickled a part of it: the pickler
    memoizes an object before its state (the optimizer's ``param_groups``), as ``copy.deepcopy`` does. Another
    pickler (``pickle.dumps``) shows no frame of its own, nor its memo: None, not known.

    The pickler is ``_save``'s local ``pickler``, torch's private name: where it is not found or shows no memo (a
    later torch's ``_save``, a ``pickle_module=`` whose pickler hides it), False, refused as any other copy is,
    rather than failing inside this check."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_save" and frame.f_globals.get("__name__") == "torch.serialization":
            try:
                memo = frame.f_locals["pickler"].memo.copy()   # {id: (index, object)} of what it has pickled so far
            except (KeyError, AttributeError, TypeError):
                return False
            return optimizer is not None and id(optimizer) in memo
        frame = frame.f_back
    return None


class PlaceholderData(torch.Tensor):
    """``p.data`` of a released placeholder: ``p.data.mean()`` read no values (NaN), silently. A read of it giving
    values (a reduction, ``tolist``, an op with a whole tensor) is refused as one on the parameter is
    (``HeldParameter``); an in-place write into it (WGAN's ``p.data.clamp_(-c, c)``) runs, and an out-of-place op
    gives an empty tensor marked the same way (``p.data = p.data.clamp(-c, c)``, set back): the next call refuses
    both (``check_placeholders_unwritten``, ``check_parameters_unreplaced``)."""

    @classmethod
    def __torch_function__(cls, func, types_=(), args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _op_key(func)
        held = None if key in _READS_NO_VALUES else next(
            (value for value in (*args, *kwargs.values())
             if type(value) is PlaceholderData and placeholder_of(value._zerocc_parameter) is not None), None)
        with torch._C.DisableTorchFunctionSubclass():
            if held is None:
                return func(*args, **kwargs)
            parameter = held._zerocc_parameter
            shape = _whole_shape(key, held, parameter, args, kwargs)
            if shape is not None:
                return shape
            name = _op_name(func, key)
            if _writes_into(name, held, args) and not held.__dict__.get("_zerocc_derived", False):
                return func(*args, **kwargs)   # a write into the placeholder: refused at the next call
            # an out-of-place op runs on the empty placeholder (its empty result marked below); any other in-place op
            # (into another tensor, into a result derived from the placeholder) or dunder is refused
            result = func(*args, **kwargs) if not name.endswith("_") else None
        if isinstance(result, torch.Tensor) and held_numel(result) == 0 and type(result) is torch.Tensor:
            result = result.as_subclass(PlaceholderData)
            result._zerocc_parameter, result._zerocc_derived = parameter, True
            return result
        _refuse_placeholder_read(parameter, f".data.{name}" if args and args[0] is held else name)


def _op_key(func):
    """What stands for ``func`` in the tables below (``_READS_NO_VALUES``, ``_SHAPE_QUERIES``, ``_CONVERSIONS``).

    torch hands ``__torch_function__`` a property's getter or setter (``p.shape``, ``p.data = x``) as a
    method-wrapper bound anew at each access, never the same object twice; its descriptor is."""
    return func.__self__ if type(func) is types.MethodWrapperType else func


def _op_name(func, key) -> str:
    """The op's name as the user wrote it (``clamp_``, ``norm``): what tells an in-place op apart, and what a refusal
    names."""
    return getattr(key, "__name__", None) or getattr(func, "__name__", None) or repr(func)


def _writes_into(name: str, subject, args) -> bool:
    """The op ``name`` writes into ``subject`` in place, by torch's naming rule (a trailing underscore, a dunder's
    excepted: ``clamp_``, ``normal_``, not ``__add__``), ``subject`` being its first argument (``p.clamp_(-c, c)``,
    ``nn.init.zeros_(p)``, ``torch._foreach_lerp_`` given a list is not). A write into an empty placeholder runs (the
    placeholder holds nothing to lose) and is refused at the step's next call (``check_placeholders_unwritten``),
    where the user's write of the whole parameter is lost."""
    return name.endswith("_") and not name.endswith("__") and bool(args) and args[0] is subject


def _whole_shape(key, subject, parameter, args, kwargs):
    """The whole parameter's answer (as FSDP2's DTensor gives) where ``key`` asks ``subject`` (a placeholder, or a
    ``.data`` of one) its shape: ``p.shape``, ``p.size(1)``, ``p.numel()``, ``len(p)``; None where it asks no shape
    (no shape query answers None). ``parameter`` is the placeholder whose whole shape it is."""
    if key not in _SHAPE_QUERIES or not args or args[0] is not subject:
        return None
    return _SHAPE_QUERIES[key](placeholder_of(parameter)[1], *args[1:], **kwargs)


def _getter(name: str):
    return getattr(torch.Tensor, name)


# what reads none of a parameter's values: runs on a placeholder as on a Parameter (properties by their descriptor)
_READS_NO_VALUES = frozenset([
    *(_getter(name) for name in ("data", "_version", "requires_grad", "grad", "is_leaf", "dtype", "device", "layout",
                                 "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
                                 "grad_fn", "_base", "itemsize", "_backward_hooks", "_post_accumulate_grad_hooks",
                                 "_grad", "_grad_fn", "output_nr", "_cdata", "retains_grad", "is_sparse_csr")),
    torch.Tensor.requires_grad_, torch.Tensor.retain_grad, torch.Tensor.register_hook,
    torch.Tensor.register_post_accumulate_grad_hook, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.element_size, torch.Tensor.get_device, torch.Tensor._is_view, torch.Tensor.__format__,
    torch._has_compatible_shallow_copy_type, torch.is_floating_point, torch.is_complex,
])
# what a placeholder answers with the whole parameter's shape
_SHAPE_QUERIES = {
    _getter("shape"): lambda shape: shape, _getter("ndim"): len,
    torch.Tensor.size: lambda shape, dim=None: shape if dim is None else shape[dim],
    torch.Tensor.numel: math.prod, torch.Tensor.nelement: math.prod, torch.numel: math.prod,
    torch.Tensor.dim: len, torch.Tensor.__len__: lambda shape: shape[0],
}
# conversions that give the parameter itself back when they change nothing (model.to(device), model.float())
_CONVERSIONS = frozenset([torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.float, torch.Tensor.double,
                          torch.Tensor.half, torch.Tensor.bfloat16, torch.Tensor.type_as])


def placeholder_of(tensor) -> tuple[str, torch.Size] | None:
    """(name, whole shape) where ``tensor`` is a released placeholder now (outside ``full_model``), else None."""
    watch = tensor.__dict__.get("_zerocc_watch")
    placeholder = watch.placeholders.get(id(tensor)) if watch is not None and not _AS_PARAMETERS[0] else None
    return placeholder if placeholder is not None and held_numel(tensor) == 0 else None


def held_data(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.data`` as torch gives it (a plain tensor; no note of a read, no ``PlaceholderData``)."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch._C.TensorBase.data.__get__(tensor)


def held_numel(tensor: torch.Tensor) -> int:
    """The number of values ``tensor`` holds (a placeholder reports its whole parameter's ``numel()``)."""
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.numel()


_AS_PARAMETERS = [0]   # depth of placeholders_as_parameters()


@contextlib.contextmanager
def placeholders_as_parameters():
    """While zerocc itself works on the module (compiling again: capture reads each tensor's memory): a placeholder
    is a plain (0,)-shaped ``Parameter``, its reads not refused."""
    _AS_PARAMETERS[0] += 1
    try:
        yield
    finally:
        _AS_PARAMETERS[0] -= 1


def _first_placeholder(args, kwargs):
    if _AS_PARAMETERS[0]:
        return None
    for value in (*args, *kwargs.values()):
        if type(value) is HeldParameter:
            if placeholder_of(value) is not None:
                return value
        elif type(value) in (list, tuple):   # torch._foreach_lerp_(ema, params, w), torch.cat(params)
            for item in value:
                if type(item) is HeldParameter and placeholder_of(item) is not None:
                    return item
    return None


def _on_placeholder(func, key, placeholder, args, kwargs):
    """``func`` given a placeholder: a shape query answered whole, a conversion that changes nothing, the
    ``detach`` of ``model.state_dict()`` (its post-hook puts the whole values in, or refuses), or refused."""
    shape = _whole_shape(key, placeholder, placeholder, args, kwargs)
    if shape is not None:
        return shape
    name = _op_name(func, key)
    if _writes_into(name, placeholder, args) and _first_placeholder(args[1:], kwargs) is None:
        with torch._C.DisableTorchFunctionSubclass():   # nn.init.zeros_(p), from no other placeholder's values
            return func(*args, **kwargs)
    # model.half(), model.to(dtype) (nn.Module._apply): the next call refuses the new tensor (``.data`` set)
    by_torch = ((key in _CONVERSIONS and _called_by("_apply"))
                or (key is torch.Tensor.detach and _saving_now(placeholder.__dict__["_zerocc_watch"])))
    if key in _CONVERSIONS or by_torch:
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if result is placeholder or by_torch:
            return result
    _refuse_placeholder_read(placeholder, name)


def _called_by(function: str) -> bool:
    """Whether torch's ``function`` (``nn.Module._apply``) called the op, within a frame or three (a module's own
    override that calls it, a lambda ``_apply`` calls): ``model.half()``, ``model.to(dtype)``, ``model[0].float()``
    convert each parameter in ``_apply`` and set its ``.data``, which the next call refuses, naming it
    (``check_parameters_unreplaced``); the same ``p.half()`` of the user's own is a read, refused on its line.

    Frames, as nothing of torch's marks a conversion: ``_apply`` runs no hook, and wrapping it would patch
    ``nn.Module`` for every module of the process or put a bound method in each module's ``__dict__`` (which a
    ``copy.deepcopy(model)`` carries to the copy). The depth counts ``_on_placeholder`` and ``__torch_function__``
    (frame 3 is the op's caller); a function of the user's named ``_apply`` converting a placeholder is let through,
    its ``.data`` set refused at the next call as torch's is (``model.state_dict()``'s ``detach`` is marked by the
    model's own state-dict hooks instead: ``_saving``)."""
    frame = sys._getframe(3)
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _refuse_placeholder_read(placeholder, what: str):
    from .errors import user_frame_here
    name, shape = placeholder_of(placeholder)
    watch = placeholder.__dict__["_zerocc_watch"]
    why = "" if watch.stage == 3 else " under param_dtype (the fp32 masters are sharded)"
    raise ConfigError(
        f"{what} of parameter {name!r} at {user_frame_here() or '(no user frame found)'}: after the compiled step's "
        f"first call at stage {watch.stage}{why} the model holds an empty placeholder there (the step holds the "
        f"parameter, sharded), so this would compute on no values where eager reads the whole {tuple(shape)} weight "
        "(an EMA or a copy taken now would stay empty, a norm would be 0). Read or copy the parameters inside "
        "`with step.full_model(writeback=False): ...` (every rank enters it: a gather), or take "
        "step.full_state_dict(); edits inside `with step.full_model(): ...` go into the step on exit. "
        "p.shape, p.numel() and p.requires_grad work outside it")


def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """The step's own ``tensor.data = value`` (no change of the user's to note)."""
    torch._C.TensorBase.data.__set__(tensor, value)


def watch_parameters(step) -> None:
    """At the first call: every parameter the step holds becomes a ``HeldParameter`` reporting to ``step.state.watch``."""
    step.state.watch = watch = ParameterWatch(step.stage)
    watch.step, watch.optimizer = weakref.ref(step), weakref.ref(step.optimizer)
    for _, tensor in step.state.module_tensors["param"]:
        if type(tensor) in (torch.nn.Parameter, HeldParameter):   # HeldParameter: a step dropped without close()
            tensor.__class__ = HeldParameter
            tensor.__dict__["_zerocc_watch"] = watch


def restore_parameter_class(tensor: torch.Tensor) -> None:
    """A parameter the step hands back (closing, a first call undone) is a plain ``nn.Parameter`` again."""
    if type(tensor) is HeldParameter:
        tensor.__class__ = torch.nn.Parameter
        tensor.__dict__.pop("_zerocc_watch", None)


def _note_placeholder_versions(step) -> None:
    tensors = step.state.tensors("param")
    step.state.placeholder_versions = {name: tensors[name]._version for name in step.state.released_shapes}
    if step.state.watch is not None:
        step.state.watch.reads.clear()


def check_parameters_unreplaced(step) -> None:
    """A parameter whose ``.data`` was set to another tensor after the step's last call (``HeldParameter``) is
    refused at the next call, naming it: the step trains on its own tensors and would never read the new one."""
    watch = step.state.watch
    if watch is None or not watch.replaced or step.state.full_model_depth:
        return
    names = {id(tensor): names[0] for names, tensor in step.state.module_tensors["param"]}
    replaced = list(dict.fromkeys(names.get(id(p), "?") for p, _ in watch.replaced))
    for param, before in reversed(watch.replaced):   # the module shows the step's tensors again, as before the change
        set_data(param, before)
    watch.replaced.clear()
    _note_placeholder_versions(step)
    raise ConfigError(
        f".data of parameter(s) {', '.join(map(repr, replaced[:4]))}{', ...' if len(replaced) > 4 else ''} was set to "
        "another tensor after the step's last call (`p.data = ...`, or model.to(dtype) / model.half(), which set it): "
        "the step holds the parameters in its own buffers and would go on training those, never reading the new "
        "tensor, where eager reads it. To change values, write them in place (`p.copy_(new)`, `p.clamp_(-c, c)`, "
        "model.load_state_dict(sd); at stage 3, and under param_dtype, inside `with step.full_model(): ...`); to "
        "change the parameters' dtype, step.close(), cast the model and compile again (or compile with param_dtype=); "
        "to evaluate a cast copy, use `with step.full_model(writeback=False): copy.deepcopy(model)`. Nothing was "
        "trained by this call, and the module's parameters are the step's again (the new tensors were dropped)")


def _written_through_data(step) -> set[int]:
    """The ids of the parameters a ``.data`` of whose placeholder, handed out since the last check, was written."""
    return {id(param) for param, data in step.state.watch.reads if data._version} if step.state.watch else set()


def check_placeholders_unwritten(step) -> None:
    """An in-place write into a released parameter outside ``step.full_model()`` (``nn.init.zeros_(model.fc.bias)``,
    ``with torch.no_grad(): model.fc.weight.mul_(0.5)``, a re-initialization by ``model.apply``) wrote into an
    empty placeholder and was lost: the step trained on without it, where eager trains the re-initialized layer.
    Refused at the next call, once, naming the parameters (their version counters moved). Writes through
    ``.data`` (``weight.data.normal_()``) move no counter and are not seen."""
    state = step.state
    if not state.placeholder_versions or state.full_model_depth:
        return
    tensors = state.tensors("param")
    through_data = _written_through_data(step)
    written = [name for name, version in state.placeholder_versions.items()
               if tensors[name]._version != version or id(tensors[name]) in through_data]
    if not written:
        if state.watch is not None:   # reads that wrote nothing need not be kept
            state.watch.reads.clear()
        return
    _note_placeholder_versions(step)
    raise ConfigError(
        f"parameter(s) {', '.join(repr(n) for n in written[:4])}{', ...' if len(written) > 4 else ''} were written in "
        f"place after the step's last call, outside step.full_model() (directly or through .data): at stage {step.stage} "
        "the module holds empty placeholders there (the step holds the parameters, sharded), so the write changed "
        "nothing and this call would train without it. Write inside `with step.full_model(): ...` (an init, "
        "model.apply(fn), reset_parameters(), weight clipping `for p in D.parameters(): p.clamp_(-c, c)`): on exit "
        "the values go into the step. Nothing was trained by this call")


def hand_back(step, optimizer_state: dict[str, dict[str, torch.Tensor]]) -> None:
    """``CompiledStep.close``: the module holds the trained parameters and buffers whole, as copies (none a
    view of the step's slots or pools), and the optimizer ``optimizer_state`` (whole, by parameter fqn)."""
    full = step._whole_tensors("step.close")   # a collective at stage 3: close has met the other ranks
    params = {}
    for kind in ("param", "buffer"):
        for names, tensor in step.state.module_tensors[kind]:   # the tensors the step trained, renamed or not
            if names[0] in full:
                set_data(tensor, full[names[0]])
            restore_parameter_class(tensor)
            if kind == "param":
                params[names[0]] = tensor
    step.state.released_shapes = {}
    step.optimizer.state = collections.defaultdict(dict)
    for fqn, entries in optimizer_state.items():
        step.optimizer.state[params[fqn]] = entries
