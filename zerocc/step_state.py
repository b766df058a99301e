"""What a ``CompiledStep`` owns between calls: the slots, the bucket layout they follow, and the step count.

At the first compile the step moves the model's parameters and buffers and
the optimizer's state into slots (``runtime/slots.py``) laid out by the
first ``ShardPlan``; from then on ``StepState`` is where they live.
``zerocc/state_dict.py`` (checkpoints), ``zerocc/eval.py`` and
``zerocc/user_views.py`` read and write the step through it. Also the
checks that the user's objects still fit that layout (the optimizer's param
groups) and the batch checks' reference (the first batch).
"""
from __future__ import annotations

import contextlib
import operator
from typing import Iterator

import torch

from . import precision
from .batch import FirstBatch
from .capture import Captured, named_tensors
from .decisions import ShardPlan
from .errors import ConfigError, defined_at
from .program_cache import INITIAL_STATE


class StepState:
    """The parameters, optimizer state, loss scale and step count a compiled step owns.

    Before the first call (``started`` False) the user's model and optimizer
    hold everything and only ``steps`` and the initial loss scale live here.
    """

    def __init__(self, scaler: dict[str, torch.Tensor]):
        self.steps = 0                                   # steps run, saved in checkpoints
        self.slots: dict[str, torch.Tensor] | None = None   # runtime/slots.py: every persistent tensor, by slot
        self.plan: ShardPlan | None = None               # the buckets the slots are laid out by (the first compile's)
        self.captured: Captured | None = None            # the first capture: parameter names, shapes, order
        # per trained parameter: its optimizer state's keys as (is scalar, dtype), to trace later steps with
        self.state_signature: list[dict[str, tuple[bool, torch.dtype]]] | None = None
        self.released_shapes: dict[str, tuple[int, ...]] = {}   # parameters the user's module holds as (0,)
        self.placeholder_versions: dict[str, int] = {}   # their version counters then (user_views.check_placeholders)
        self.watch = None   # user_views.ParameterWatch: .data read or set on the held parameters since the last check
        self.initial_scaler = scaler                     # the loss scale before the first compile (or a loaded one)
        self.param_groups: tuple[tuple[int, ...], ...] | None = None   # param_groups_of at the first call
        self.requires_grad: tuple[tuple[torch.nn.Parameter, bool], ...] | None = None   # requires_grad_of, 1st call
        # module_tensors_of at the first compile: the tensor objects the slots stand for, by their names then
        self.module_tensors: dict[str, tuple[tuple[tuple[str, ...], torch.Tensor], ...]] | None = None
        self.module_tree: ModuleTree | None = None      # the registrations then (check_module_tensors_unchanged)
        # user_views.point_module_at_slots: the slot tensor each buffer (by name) and whole bucket (by index) of the
        # module points at now
        self.pointed_at: dict = {}
        self.first_batch: FirstBatch | None = None       # zerocc/batch.py: later batches keep its dtypes and devices
        self.full_model_depth = 0                        # inside step.full_model(): the module holds whole parameters
        self.reading_model_keys = False                  # model.state_dict() called for its keys only
        self.lost: str | None = None                     # a call failed after its release point: the error, in short
        # the slots hold the optimizer's initial state the step made (optimizer_init), no step has updated it yet
        self.made_initial_state = False
        self.half_loaded: str | None = None              # a load_checkpoint failed after it began to write: its path

    @property
    def started(self) -> bool:
        """The first compile moved the model's and optimizer's tensors into the slots."""
        return self.slots is not None

    def state_key(self) -> tuple:
        """The optimizer-state slots a program traced now reads: part of its cache key."""
        if self.slots is None:
            return INITIAL_STATE
        return tuple(sorted(s for s in self.slots if s.startswith("state:")))

    def scaler_state(self) -> dict[str, torch.Tensor]:
        """The loss scale and its growth tracker, by slot (empty without loss scaling)."""
        if self.slots is None:
            return dict(self.initial_scaler)
        return {slot: self.slots[slot] for slot in precision.SCALER_SLOTS if slot in self.slots}

    def param_indices(self, sharded_only: bool = False) -> list[int]:
        """Indices (in capture's order) of the parameters in buckets; ``sharded_only``: whose masters are sharded."""
        return [s.param for b in self.plan.buckets for s in b.segments
                if not sharded_only or self.plan.holds_shard(b)]

    @contextlib.contextmanager
    def reading_keys_only(self) -> Iterator[None]:
        """``model.state_dict()`` inside the block is read for its keys: ``user_views`` skips the current values."""
        self.reading_model_keys = True
        try:
            yield
        finally:
            self.reading_model_keys = False

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """The module's parameters (``kind`` "param") or buffers ("buffer") the step was compiled for, by first name.

        The objects themselves, not a walk of the module now: a model changed since (a buffer replaced, a
        parameter renamed by ``torch.nn.utils.prune``) still gets its values from the tensors the step trained."""
        return {names[0]: tensor for names, tensor in self.module_tensors[kind]}

    def reset(self) -> None:
        """Back to before the first compile (a first call that failed): the user's objects hold everything."""
        self.slots = self.plan = self.captured = self.state_signature = self.module_tensors = self.module_tree = None
        self.param_groups = self.first_batch = self.requires_grad = None
        self.released_shapes = {}
        self.placeholder_versions = {}
        self.watch = None
        self.pointed_at = {}
        self.made_initial_state = False


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
        "unfreezing), compile the model and optimizer again after adding them: zerocc.compile(model, optimizer, "
        "...) takes them over from this step, trained as they are. To keep a parameter frozen for a while, give "
        "it lr=0 in its own group from the start")


def check_no_optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Hooks registered on the optimizer (``register_step_pre_hook`` / ``register_step_post_hook``) are refused.

    Eager runs them around every ``optimizer.step()``; the compiled step traces the optimizer's update on a copy
    of the optimizer, which (as ``copy.copy`` of any optimizer does) leaves them out, so they never ran: an
    MoE's load balancing that updates a bias buffer in a pre-step hook (torchtitan's) or clipping in a hook
    silently did nothing. Checked at every call (two dict lookups): a hook added after compiling is refused too.
    """
    hooks = [*optimizer._optimizer_step_pre_hooks.values(), *optimizer._optimizer_step_post_hooks.values()]
    if not hooks:
        return

    def where(hook) -> str:
        defined = defined_at(hook)
        return f"{getattr(hook, '__qualname__', repr(hook))}" + (f" ({defined})" if defined else "")
    raise ConfigError(
        f"the optimizer has {len(hooks)} step hook(s) (register_step_pre_hook / register_step_post_hook): "
        f"{', '.join(where(h) for h in hooks)}\n"
        "  why: the compiled step runs the optimizer's traced update, not optimizer.step(), so such a hook would "
        "not run at each step as it does in eager.\n"
        "  fix: remove the hook and do its work between steps, after `loss = step(...)` returns (the model's "
        "buffers are then the step's own: an MoE's expert-bias update written there is what the next step "
        "reads); for gradient clipping pass clip_grad_norm= to zerocc.compile.")


def requires_grad_of(model: torch.nn.Module) -> tuple[tuple[torch.nn.Parameter, bool], ...]:
    """Each parameter and its ``requires_grad``: which ones the step trains and which it keeps frozen."""
    return tuple((p, p.requires_grad) for p in model.parameters())


def module_tensors_of(model: torch.nn.Module) -> dict[str, tuple[tuple[tuple[str, ...], torch.Tensor], ...]]:
    """The model's parameters and buffers (each with all its names), by kind: what the slots were made from."""
    return {kind: tuple(named_tensors(model, kind)) for kind in ("param", "buffer")}


class ModuleTree:
    """Every module of a model with its children, parameters and buffers as registered at one moment (the keys
    and objects of the three dicts). ``unchanged()`` compares them by identity, in C (``map(operator.is_, ...)``):
    where a walk of the tree by names builds every name (``check_module_tensors_unchanged``'s fast path, taken
    at every call: on a GPU the host's time per call is step time)."""

    def __init__(self, model: torch.nn.Module):
        self.entries = [(registered, list(registered), list(registered.values())) for module in model.modules()
                        for registered in (module._modules, module._parameters, module._buffers)]

    def unchanged(self) -> bool:
        is_ = operator.is_
        return all(len(registered) == len(keys) and all(map(is_, registered, keys))
                   and all(map(is_, registered.values(), values)) for registered, keys, values in self.entries)


def check_module_tensors_unchanged(state: "StepState", model: torch.nn.Module) -> None:
    """A parameter or buffer registered, removed, renamed or replaced by another tensor after the first call is
    refused, naming each: the step's slots hold the tensors of its first call, by their names then.

    The program would have gone on reading its own copy of a replaced buffer (a new mask: eager reads the new
    tensor), never read a newly registered one, and a renamed parameter (``prune.l1_unstructured`` moves
    ``weight`` to ``weight_orig``) failed with a KeyError. Checked at every call: ``state.module_tree`` first (no
    registration changed since it was taken), then, where one did, a walk of the module tree by names.
    """
    if state.module_tree is not None and state.module_tree.unchanged():
        return
    compiled_for = state.module_tensors
    now = module_tensors_of(model)
    if all(len(now[kind]) == len(compiled_for[kind])
           and all(names == old_names and tensor is old for (names, tensor), (old_names, old)
                   in zip(now[kind], compiled_for[kind])) for kind in now):
        state.module_tree = ModuleTree(model)   # a change that names the same tensors (a module without any added)
        return
    changes = []
    for kind, word in (("param", "parameter"), ("buffer", "buffer")):
        before = {name: tensor for names, tensor in compiled_for[kind] for name in names}
        after = {name: tensor for names, tensor in now[kind] for name in names}
        where = {id(tensor): name for name, tensor in after.items()}
        for name, tensor in before.items():
            if name not in after:
                moved = where.get(id(tensor))
                changes.append(f"{word} '{name}' " + (f"now named '{moved}'" if moved is not None
                                                      else "removed"))
            elif after[name] is not tensor:
                changes.append(f"{word} '{name}' replaced by another tensor")
        old_ids = {id(tensor) for tensor in before.values()}
        changes += [f"{word} '{name}' added" for name, tensor in after.items()
                    if name not in before and id(tensor) not in old_ids]
    changes = changes or ["the order or sharing of parameters and buffers"]
    raise ConfigError(
        f"the model's parameters or buffers changed after the step's first call: {'; '.join(changes[:6])}"
        f"{'; ...' if len(changes) > 6 else ''}. The step holds the tensors of its first call in its own slots, by "
        "their names then, and would go on training those (a replaced buffer's new values or a new buffer would "
        "never be read). To set a buffer's values, write them in place (model.mask.copy_(new_mask)); after changing "
        "the model (torch.nn.utils.prune, parametrize, a buffer registered or removed, a parameter replaced), compile "
        "the model and optimizer again: zerocc.compile(model, optimizer, ...) takes them over from this step, "
        "trained as they are")


def check_requires_grad_unchanged(compiled_for: tuple[tuple[torch.nn.Parameter, bool], ...],
                                  model: torch.nn.Module) -> None:
    """Freezing or unfreezing a parameter after the first step is refused: the step would go on as it was compiled.

    Every call reads the flags of the parameters listed at the first call (no walk of the module tree); the
    names are looked up only for the error."""
    if all(p.requires_grad == before for p, before in compiled_for):
        return
    names = {id(p): name for name, p in model.named_parameters()}
    changed = [f"'{names.get(id(p), '?')}' ({'trained' if before else 'frozen'} then, requires_grad={p.requires_grad} "
               "now)" for p, before in compiled_for if p.requires_grad != before]
    raise ConfigError(
        f"requires_grad changed after the step's first call for {len(changed)} parameter(s): "
        f"{', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''}. The step trains the parameters that "
        "required grad at its first call and would go on training them (eager would skip a frozen one). To "
        "freeze a parameter for a while, put it in its own param group from the start and set that group's lr "
        "to 0 (it then stays as it is, but a stateful optimizer's moments go on taking its gradients, which eager's "
        "would not); to change which parameters train as eager does, compile the model and optimizer again (after "
        "add_param_group for newly trained ones): zerocc.compile(model, optimizer, ...) takes them over from this step, "
        "trained as they are")
