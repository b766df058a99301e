"""The programs a ``CompiledStep`` keeps, by what they were compiled for, least recently used first.

A program is compiled for a ``CacheKey``: the batch's signature (shapes,
dtypes, devices, Python values), the optimizer state's structure (none yet,
or the steady state's), the hyper-parameters baked into the graph and the
caller's ``torch.autocast`` state (``zerocc/autocast.py``) and attention kernels, which modules
are in training mode (``model.train()``/``model.eval()``: dropout, batch norm),
the Python values and tensors forward and the loss read as constants (``values_read``) and
the saved-tensor hooks around the call (``user_tooling.saved_tensors_hooks_state``). Each
``CacheEntry`` holds the program, the decisions the passes made (``ctx``),
the graph after every pass, and the peak of live bytes its first run
measured. A key keeps one program per side of its data guards
(``zerocc/data_guards.py``) that a batch took. At most ``max_programs``
distinct programs are kept (the least recently used is dropped with a
warning); ``static_shapes`` makes a new batch signature an error instead.
"""
from __future__ import annotations

import collections
import dataclasses
import dis
import operator
import functools
import itertools
import types
import warnings
from typing import Any, Sequence

import torch

from .batch import BatchLayout, python_value_text
from .context import CompileContext
from .data_guards import all_hold
from .errors import ConfigError, RecompileWarning, user_stacklevel
from .pipeline import GraphSnapshot
from .runtime.program import Program

# The optimizer-state part of the key of a program traced before the step holds any state.
INITIAL_STATE = ("initial",)


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """What a program is compiled for."""
    signature: tuple          # input_signature of the batch
    state: tuple              # the optimizer-state slots the program reads (INITIAL_STATE before the first step)
    hyperparameters: tuple    # optimizer_step.hyperparameter_signature: values baked into the graph
    autocast: tuple = ()      # autocast.autocast_state() at the call: the casts traced into forward and loss
    training: tuple = ()      # training_modes(model) at the call: dropout and batch norm are traced per mode
    hooks: tuple = ()         # hook_ids(model) at the call: the hooks on its modules and parameters are traced
    python: tuple = ()        # values_read(...)[0] at the call: numbers and flags traced as constants
    saved_tensors_hooks: tuple = ()   # user_tooling.saved_tensors_hooks_state() at the call: traced into backward
    default_dtype: torch.dtype | None = None   # torch.get_default_dtype() at the call: factories in forward read it
    tensors: tuple = ()       # values_read(...)[1] at the call: tensor objects traced as constants
    attention: tuple = ()     # attention_backends() at the call: SDPA's kernel is chosen when traced


@dataclasses.dataclass
class CacheEntry:
    """One compiled program and what its compilation decided."""
    program: Program
    ctx: CompileContext
    history: list[GraphSnapshot]
    measured_peak_bytes: int | None = None   # live tensor bytes at the peak of its first run
    reads_initial_state: bool = False   # compiled before the first step over the optimizer state the step made
    stored_as: str | None = None        # its entry in the compile cache on disk (zerocc/disk_cache.py), if any


# the scaled-dot-product attention settings torch.nn.attention.sdpa_kernel and torch.backends.cuda.enable_*_sdp set
_ATTENTION_SETTINGS = ("_get_flash_sdp_enabled", "_get_mem_efficient_sdp_enabled", "_get_math_sdp_enabled",
                       "_get_cudnn_sdp_enabled", "_get_overrideable_sdp_enabled", "_get_fa3_sdp_enabled",
                       "_get_math_sdp_allow_fp16_bf16_reduction", "_get_sdp_priority_order")


def attention_backends() -> tuple:
    """Which kernels ``F.scaled_dot_product_attention`` may pick now (``with sdpa_kernel(SDPBackend.MATH):``).

    SDPA chooses its kernel where it is called, so a trace holds the one chosen then (the CPU flash kernel and
    the math path round differently): a call under other settings gets its own program, as eager would compute
    with another kernel. Settings this torch lacks are left out. It also holds
    ``torch.backends.mha.get_fastpath_enabled()``, which decides whether an eval-mode ``nn.TransformerEncoderLayer``
    or ``nn.MultiheadAttention`` runs its fused kernel (``tracing.fast_paths_as_eager``)."""
    getters = (getattr(torch._C, name, None) for name in _ATTENTION_SETTINGS)
    return (*(tuple(value) if isinstance(value := getter(), list) else value for getter in getters if getter),
            torch.backends.mha.get_fastpath_enabled())


def training_modes(modules: Sequence[torch.nn.Module]) -> tuple[bool, ...]:
    """Each module's ``training`` flag (the model's ``modules()``, listed once): a mode switch gets its own program."""
    return tuple(module.training for module in modules)


def hook_ids(modules: Sequence[torch.nn.Module], parameters: Sequence[torch.Tensor], own: frozenset) -> tuple:
    """The ids of the hooks registered on the model's modules and parameters, but for zerocc's ``own``.

    Hooks are traced into the program (``zerocc/user_tooling.py``): one registered or removed between steps
    gets its own program, as a mode switch does, where a program traced without it would silently skip it.
    """
    on_modules = tuple((index, ids) for index, module in enumerate(modules)
                       for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks,
                                     module._backward_hooks)
                       if hooks and (ids := tuple(key for key in hooks if key not in own)))
    on_parameters = tuple((index, tuple(hooks)) for index, parameter in enumerate(parameters)
                          for hooks in (parameter._backward_hooks, getattr(parameter, "_post_accumulate_grad_hooks", None))
                          if hooks)
    return on_modules, on_parameters


try:   # a schedule computed with numpy gives numpy scalars (np.float64 is a float, np.float32 is not)
    from numpy import generic as _numpy_scalar
except ImportError:   # pragma: no cover
    _numpy_scalar = complex
_PLAIN = (bool, int, float, complex, str, type(None), _numpy_scalar)
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))   # nn.Module's own bookkeeping (hooks, parameters, training)
# what a settings object keeps of its own identity, which changes in a new process: Hugging Face's GenerationConfig
# keeps hash(self), a hash of its JSON text with the process's string-hash seed (the cache on disk would miss)
_IDENTITIES = frozenset({"_original_object_hash"})


def _plain(value, nested: bool = False) -> bool:
    """A value a trace may bake in: a number, string or flag; at the top, also a list, tuple, set or dict of them
    (``self.relu_layers = {0, 2}``, ``self.loss_weights = {"mse": 1.0}``; a dict's values may be lists of them)."""
    if isinstance(value, _PLAIN):
        return True
    if nested:
        return type(value) in (tuple, list) and all(isinstance(v, _PLAIN) for v in value)
    if type(value) in (tuple, list, set, frozenset):
        return all(isinstance(v, _PLAIN) for v in value)
    return type(value) is dict and all(isinstance(k, _PLAIN) and _plain(v, True) for k, v in value.items())


class DictItems(tuple):
    """A dict's items as the key holds them (hashable, compared in order), shown as the dict."""

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self) + "}"


def _key_value(value):
    """``value`` (``_plain``) as a key holds it now: hashable, a copy of a container the loop may change in place."""
    if type(value) in (list, set):
        return tuple(value) if type(value) is list else frozenset(value)
    if type(value) is dict:
        return DictItems((k, tuple(v) if type(v) is list else v) for k, v in value.items())
    return value


def _contents(value) -> list:
    """What ``ValuesReader`` compares of a container read as a value, by identity: its items (a dict's keys and
    values), which the loop may change in place (``model.relu_layers.add(1)``, ``model.weights["a"] = 2.0``)."""
    return [*value.keys(), *value.values()] if type(value) is dict else list(value)


def _settings_object(value) -> bool:
    """A settings object a module holds, whose attributes forward may read: a Hugging Face config
    (``self.config.use_cache``, ``config._attn_implementation``), a dataclass or another ``...Config`` object.
    Not any object: one the training loop updates (a logger's counter) would compile every step."""
    return not isinstance(value, type) and hasattr(value, "__dict__") and (dataclasses.is_dataclass(value)
                                            or any(c.__name__.endswith("Config") for c in type(value).__mro__))


def python_sources(model: torch.nn.Module, loss_fn, metrics_fn=None) -> tuple:
    """Where forward and the loss read Python values a trace bakes in, for ``values_read``: (label, namespace,
    names) for each of the model's modules' attributes (``names`` None: every one), the module globals each
    module's ``forward`` names, the attributes of the settings objects the modules hold (a Hugging Face config,
    a dataclass; listed once however many modules hold it), and ``loss_fn``'s attributes, closure, globals and
    ``functools.partial`` keywords, and ``metrics_fn``'s alike (``metrics_fn=``: traced into the step too).
    A closure's namespace is None and its names (name, cell) pairs. Helpers those functions call are not looked
    into."""
    sources, seen = [], set()

    def add_function(label, function):
        code = getattr(function, "__code__", None)
        if code is None or id(code) in seen:
            return
        seen.add(id(code))
        sources.append((f"{label} global", function.__globals__, _globals_read(code)))
        if function.__closure__:
            sources.append((f"{label} closure", None, tuple(zip(code.co_freevars, function.__closure__))))

    def add_object(label, thing):
        if isinstance(thing, torch.nn.Module):
            for name, module in thing.named_modules():
                where = f"{label}.{name}" if name else label
                sources.append((where, vars(module), None))
                add_function(f"{where}.forward", type(module).forward)
                for attribute, value in vars(module).items():   # a config object forward reads (self.config.x)
                    if _settings_object(value) and id(value) not in seen:
                        seen.add(id(value))
                        sources.append((f"{where}.{attribute}", vars(value), None))
        elif hasattr(thing, "__dict__"):
            sources.append((label, vars(thing), None))

    def add_callable(label, function):
        if isinstance(function, functools.partial):
            sources.append((f"{label} keyword", function.keywords, None))   # the live dict (args are a tuple)
            add_callable(label, function.func)
        elif hasattr(function, "__func__"):   # a bound method: its object's attributes and its function
            add_object(label, function.__self__)
            add_function(label, function.__func__)
        elif hasattr(function, "__code__"):
            add_function(label, function)
        else:   # a module or another object with __call__
            add_object(label, function)
            add_function(label, getattr(type(function).__call__, "__func__", type(function).__call__))
            if isinstance(function, torch.nn.Module):   # a loss module's tensors (class weights) are not the step's
                for name, module in function.named_modules():
                    where = f"{label}.{name}" if name else label
                    sources.append((f"{where} buffers", module._buffers, None))
                    sources.append((f"{where} parameters", module._parameters, None))

    add_object("model", model)
    for label, function in (("loss_fn", loss_fn), ("metrics_fn", metrics_fn)):
        if function is not None:
            add_callable(label, function)
    return tuple(sources)


def values_read(sources: tuple, skipped: frozenset = frozenset()) -> tuple[tuple, tuple]:
    """What forward and the loss may read at the places ``python_sources`` lists, now, in one walk over them.

    First the plain Python values (numbers, strings, flags, tuples of them): a trace bakes them into the program
    as constants (dropout's ``p``, a temperature, a loss weight a loop anneals), so a changed value gets its own
    program, as a mode switch does, where a program traced with the old one would silently train with it. Then
    the tensors, by identity: a trace reads the tensor object it finds (a loss module's class weights, a plain
    tensor attribute, a global) as a constant, so one replaced by another object (``loss_fn.weight = new``) gets
    a program of its own; writing into the same tensor (``weight.mul_(2)``) needs none, the program reads its
    current values. A ``torch.Generator`` is read the same way (``torch.randn(..., generator=self.gen)`` draws
    from the object traced in): one replaced (``self.gen = torch.Generator().manual_seed(s)``) gets a program
    of its own, where the old program would go on drawing from the old generator; reseeding the same one
    (``self.gen.manual_seed(s)``) needs none. Identities mean nothing in another process: the compile cache on disk keys on the values
    only. ``skipped`` are the (label, name) pairs forward itself writes (a call counter), which would otherwise
    compile every step.
    """
    values, tensors = [], []
    for label, namespace, names in sources:
        for name, value in source_items(namespace, names):
            if (label, name) in skipped:
                continue
            if isinstance(value, torch.Tensor):
                tensors.append((label, name, id(value)))
            elif isinstance(value, torch.Generator):   # the graph holds another Python object for the same generator
                tensors.append((label, name, value._cdata))
            elif name not in _MODULE_INTERNALS and name not in _IDENTITIES and _plain(value):
                # 1 and 1.0 trace differently; a list, set or dict as it is now
                values.append((label, name, type(value), _key_value(value)))
            elif name not in _MODULE_INTERNALS and (held := tensors_held(value)):
                tensors.append((label, name, held))
    return tuple(values), tuple(tensors)


def tensors_held(value, nested: bool = False) -> tuple:
    """The identities of the tensors a module forward reads outside the model holds (its parameters and buffers:
    a frozen reference model in a global, a closure or an attribute the model does not register, such as
    ``object.__setattr__(self, "ref", ref)`` or ``self.refs = [ref]``), or a list, tuple or dict holds (their
    modules' too). The trace reads those tensors as constants: a module replaced by another (``REF =
    copy.deepcopy(policy)``) gets a program of its own, where the old program would silently go on reading the
    old module's weights; copying into the same module (``ref.load_state_dict(sd)``) needs none."""
    if isinstance(value, torch.Tensor):
        return (id(value),)
    if isinstance(value, torch.nn.Module):
        return tuple(id(tensor) for tensor in itertools.chain(value.parameters(), value.buffers()))
    if nested or type(value) not in (list, tuple, dict):
        return ()
    return tuple(held for item in (value.values() if type(value) is dict else value) for held in tensors_held(item, True))


class ValuesReader:
    """``values_read`` of fixed ``sources``, remembered between calls (it runs at every call of the step; on a GPU
    the host's time per call is step time, and a 12-layer model's modules hold thousands of attributes).

    The last result stands while every namespace holds the same keys with the same objects (compared by identity,
    in C: ``map(operator.is_, ...)``), every closure cell the same object, and every list among the values the same
    items (a list is read by its contents); otherwise ``values_read`` reads everything again. Identity is stricter
    than what ``values_read`` compares (an equal float in a new object reads again), never looser.
    """

    def __init__(self, sources: tuple):
        self.sources = sources
        self._result: tuple[tuple, tuple] | None = None
        self._skipped: frozenset | None = None
        self._seen: list = []
        self._lists: list[tuple[list, list]] = []
        self._holders: list[tuple[Any, tuple]] = []

    def __call__(self, skipped: frozenset = frozenset()) -> tuple[tuple, tuple]:
        if self._result is not None and skipped == self._skipped and self._unchanged():
            return self._result
        self._result, self._skipped = values_read(self.sources, skipped), skipped
        self._seen, self._lists, self._holders = [], [], []
        for _, namespace, names in self.sources:
            if namespace is None:   # a closure's cells
                values = [_cell_contents(cell) for _, cell in names]
                self._seen.append((None, names, values, None))
            elif names is None:
                values = list(namespace.values())
                self._seen.append((namespace, None, values, list(namespace)))
            else:
                values = [namespace.get(name, _ABSENT) for name in names]
                self._seen.append((namespace, names, values, None))
            self._lists += [(value, _contents(value)) for value in values
                            if type(value) is list or type(value) in (set, dict) and _plain(value)]
            # a module (or container) holding tensors: one of its parameters replaced leaves the holder the same object
            self._holders += [(value, held) for name, value in source_items(namespace, names)
                              if name not in _MODULE_INTERNALS and isinstance(value, (torch.nn.Module, list, tuple, dict))
                              and (held := tensors_held(value))]
        return self._result

    def _unchanged(self) -> bool:
        for namespace, names, values, keys in self._seen:
            if namespace is None:
                now = [_cell_contents(cell) for _, cell in names]
            elif names is None:
                if len(namespace) != len(values) or not all(map(operator.is_, namespace, keys)):
                    return False
                now = namespace.values()
            else:
                now = [namespace.get(name, _ABSENT) for name in names]
            if not all(map(operator.is_, now, values)):
                return False
        return all(len(now := _contents(value)) == len(items) and all(map(operator.is_, now, items))
                   for value, items in self._lists) \
            and all(tensors_held(value) == held for value, held in self._holders)


_ABSENT = object()


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:   # a closure variable not assigned yet
        return _ABSENT


def _globals_read(code) -> tuple[str, ...]:
    """The global names ``code`` loads (and its nested functions and comprehensions do): ``co_names`` also holds
    every attribute name (``outputs.logits``), which would tie the key to a script's global of that name."""
    names = {instruction.argval for instruction in dis.get_instructions(code)
             if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names.update(_globals_read(constant))
    return tuple(sorted(names))


def source_items(namespace: dict | None, names) -> list[tuple[str, Any]]:
    """The (name, value) pairs one of ``python_sources``' entries holds now: a namespace's every item (``names``
    None), or the names it lists that it has, or a closure's (``namespace`` None, ``names`` its (name, cell) pairs)
    variables that are assigned."""
    if namespace is None:
        return [(name, value) for name, cell in names if (value := _cell_contents(cell)) is not _ABSENT]
    if names is None:
        return list(namespace.items())
    return [(name, namespace[name]) for name in names if name in namespace]


def changed_python_values(old: tuple, new: tuple) -> list[str]:
    """The values that differ between two ``values_read(...)[0]``, as 'model.dropout p: 0.1 -> 0.2'."""
    before = {(label, name): value for label, name, _, value in old}
    after = {(label, name): value for label, name, _, value in new}

    def shown(values, key):   # an attribute set since (``self.cache = None``) is not one that was None
        return repr(values[key]) if key in values else "(not set)"
    return [f"{label} {name}: {shown(before, (label, name))} -> {shown(after, (label, name))}"
            for label, name in dict.fromkeys([*before, *after]) if shown(before, (label, name)) != shown(after, (label, name))
            or type(before.get((label, name))) is not type(after.get((label, name)))]


def memory_layout(value: torch.Tensor) -> tuple:
    """How a batch tensor lies in memory, where not contiguous: ``("channels_last",)``, or its strides.

    A program is traced on the first batch's strides, and eager's kernels read them: a convolution of a
    channels-last batch rounds otherwise, and ``reshape`` is traced as a view where the first batch allowed
    one (a contiguous batch's, which a permuted batch's ``reshape`` must copy instead: the program failed with
    "view size is not compatible"). A batch laid out otherwise gets a program of its own. Strides of
    dimensions of size 1 are left out: no kernel reads them.
    """
    if value.is_contiguous():
        return ()
    for name, layout in (("channels_last", torch.channels_last), ("channels_last_3d", torch.channels_last_3d)):
        if value.dim() == (4 if layout is torch.channels_last else 5) and value.is_contiguous(memory_format=layout):
            return (name,)
    return (tuple(stride if size > 1 else None for size, stride in zip(value.shape, value.stride())),)


def input_signature(batch, layout: BatchLayout) -> tuple:
    """What a program is compiled for: each entry's shape, dtype and ``memory_layout`` (or Python value),
    keywords by name."""
    signature = []
    for index, value in enumerate(batch):
        if isinstance(value, torch.Tensor):
            entry = (tuple(value.shape), value.dtype, str(value.device), value.requires_grad, *memory_layout(value))
        elif isinstance(value, torch.Generator):   # the generator itself: the program holds another Python object
            entry = ("python", "Generator", f"<torch.Generator {value._cdata:#x}>")   # for it, so an id is reused
        else:
            entry = ("python", type(value).__name__, python_value_text(value))   # exact: numpy's repr elides
        if layout.spec is not None:   # containers: each leaf by its name ('argument 0['ids']', 'extra[1]=')
            entry = ("leaf", layout.name_of(index), entry)
        elif index >= layout.positional:
            entry = ("keyword", layout.keywords[index - layout.positional], entry)
        signature.append(entry)
    if layout.spec is not None:
        signature.append(("structure", layout.structure()))
    return tuple(signature)


def _holds_python_value(entry: tuple) -> bool:
    """An ``input_signature`` entry of a Python value (not a tensor), a keyword's or a container's leaf too."""
    return entry[0] == "python" or entry[0] in ("keyword", "leaf") and _holds_python_value(entry[2])


def changed_batch_values(old: tuple, new: tuple) -> list[str]:
    """The Python values of the batch that differ between two ``input_signature``s whose tensors, keywords and
    structure are the same, as 'num_items_in_batch=int 30 -> int 32' (empty where anything else differs)."""
    if len(old) != len(new):
        return []
    changed = []
    for index, (before, after) in enumerate(zip(old, new)):
        if before == after:
            continue
        if not (_holds_python_value(before) and _holds_python_value(after) and before[:2] == after[:2]):
            return []   # a tensor, a keyword or the structure changed: not a value alone
        named = {"keyword": f"{before[1]}=", "leaf": f"{before[1]}: "}.get(before[0], f"argument {index}: ")
        while before[0] != "python":
            before, after = before[2], after[2]
        changed.append(f"{named}{before[1]} {before[2]} -> {after[1]} {after[2]}")
    return changed


def changed_batch_entries(old: tuple, new: tuple) -> list[str]:
    """The entries of the batch that one ``input_signature`` has and the other lacks, or that are a tensor in one and
    a Python value (``None``) in the other: "no argument 0['token_type_ids'] (the first batch had a tensor)".

    A collator leaves a key out of some batches (``token_type_ids``, an optional ``pixel_values``), or sets it to
    ``None``: forward then skips the layer that reads it, and the loss reaches other parameters than it did.
    """
    def named(signature):
        entries = {}
        for index, entry in enumerate(signature):
            if entry[0] == "structure":
                continue
            name = f"{entry[1]}=" if entry[0] == "keyword" else entry[1] if entry[0] == "leaf" else f"argument {index}"
            entries[name] = entry[2] if entry[0] in ("keyword", "leaf") else entry
        return entries

    def kind(entry):
        return ("None" if entry[1] == "NoneType" else f"{entry[1]} {entry[2]}") if entry[0] == "python" else "a tensor"
    before, after = named(old), named(new)
    changes = [f"no {name} (the first batch had {kind(entry)})" for name, entry in before.items() if name not in after]
    changes += [f"{name}, which the first batch had not" for name in after if name not in before]
    changes += [f"{name} is {kind(after[name])} (the first batch had {kind(entry)})" for name, entry in before.items()
                if name in after and (entry[0] == "python") != (after[name][0] == "python")]
    return changes


def _differ_in_python_values_only(signature: tuple, other: tuple) -> bool:
    """Whether two batch signatures are alike but for Python values (a Hugging Face ``use_cache=True``)."""
    def python(entry):
        return entry[0] == "python" or (entry[0] in ("keyword", "leaf") and python(entry[2]))
    return len(signature) == len(other) and all(a == b or (python(a) and python(b)) for a, b in zip(signature, other))


def describe_signature(signature: tuple) -> str:
    """A batch signature as a person reads it: 'shapes (8, 12) float32, (8, 5) float32'."""
    def describe(entry):
        if entry[0] == "keyword":
            return f"{entry[1]}={describe(entry[2])}"
        if entry[0] == "leaf":
            return f"{entry[1]}: {describe(entry[2])}"
        if entry[0] == "python":
            return f"{entry[1]} {entry[2]}"
        shape, dtype = entry[0], str(entry[1]).replace("torch.", "")
        laid_out = "" if len(entry) < 5 else f" {entry[4]}" if isinstance(entry[4], str) else f" strides {entry[4]}"
        return f"{shape} {dtype}{laid_out}"
    return "shapes " + ", ".join(describe(entry) for entry in signature if entry[0] != "structure")


class ProgramCache:
    """Programs by key, keys least recently used first; ``last`` is the entry the last call ran.

    A key holds one program per side of its data guards (``zerocc/data_guards.py``) that a batch took: a branch on
    batch values whose sides both train (no side raises) compiles each side once, and batches alternating between
    them run the two programs, most recently used last in the key's list.
    """

    def __init__(self, max_programs: int, static_shapes: bool):
        self.max_programs = max_programs
        self.static_shapes = static_shapes
        self.entries: collections.OrderedDict[CacheKey, list[CacheEntry]] = collections.OrderedDict()
        self.last: CacheEntry | None = None

    def lookup(self, key: CacheKey, batch) -> CacheEntry | None:
        """The entry compiled for ``key`` whose data guards hold on ``batch`` (zerocc/data_guards.py), or None:
        the batch takes a side of a branch decided on values that no program was traced on yet."""
        for entry in reversed(self.entries.get(key, ())):
            if all_hold(entry.program.guards, batch):
                return entry
        return None

    def add(self, key: CacheKey, entry: CacheEntry, batch) -> None:
        """Keep ``entry`` for ``key`` and the side of the data guards ``batch`` takes, in place of the entry
        ``batch`` found there before, if any."""
        kept = self.entries.setdefault(key, [])
        kept[:] = [e for e in kept if e is not entry and not all_hold(e.program.guards, batch)]
        kept.append(entry)
        self.entries.move_to_end(key)

    def use(self, key: CacheKey, entry: CacheEntry) -> None:
        """``entry`` (kept for ``key``) runs now: most recently used, and the last one run."""
        kept = self.entries[key]
        kept[:] = [e for e in kept if e is not entry] + [entry]
        self.entries.move_to_end(key)
        self.last = entry

    def programs(self) -> list[CacheEntry]:
        """Every distinct entry (one program may be kept under several keys; a key may keep several)."""
        return list({id(entry.program): entry for kept in self.entries.values() for entry in kept}.values())

    def check_static_shapes(self, signature: tuple) -> None:
        """static_shapes=True: a batch unlike the one compiled is an error, not a new program."""
        compiled = {key.signature for key in self.entries}
        if self.static_shapes and compiled and signature not in compiled:
            unlike = (f"static_shapes=True, but this batch is {describe_signature(signature)} and the step was "
                      f"compiled for {' and '.join(describe_signature(s) for s in compiled)}")
            if all(_differ_in_python_values_only(signature, other) for other in compiled):
                raise ConfigError(
                    f"{unlike}: a Python value of the batch changed, and each value traces another program; pass "
                    "the value the step was compiled with on every call, or compile with static_shapes=False to "
                    "compile a program per value")
            raise ConfigError(
                f"{unlike}; pad or cut the batch to the compiled "
                "shape (the last batch of an epoch: drop_last=True) and lay it out as the compiled batch (a "
                "permuted or channels-last batch: .contiguous(memory_format=...)), or compile with "
                "static_shapes=False to compile a program per shape and layout")

    def evict_beyond_limit(self, key: CacheKey, keep: CacheEntry) -> None:
        """Keep at most ``max_programs`` programs, ``keep`` (the one just compiled, for ``key``) among them, dropping
        the least recently used with a warning (the least recently used of the least recently used key's).

        A first step's program (kept only for ``INITIAL_STATE``: SGD's momentum, made from the first gradient) is
        dropped first and silently once ``key`` is a steady state's: the step holds state now and would not run it
        again (a state-less checkpoint loaded later compiles it again). Dropped with the warning, max_programs=1
        warned at the second call of a step of one batch shape that "a new batch" of that same shape had come.
        """
        signature = key.signature
        while len(self.programs()) > self.max_programs:
            candidates = [(old_key, entry) for old_key, kept in self.entries.items() for entry in kept
                          if entry.program is not keep.program]
            done = [(old_key, entry) for old_key, entry in candidates if key.state != INITIAL_STATE and all(
                k.state == INITIAL_STATE for k, kept in self.entries.items() if any(e.program is entry.program
                                                                                    for e in kept))]
            old_key, old = (done or candidates)[0]
            for kept_key in list(self.entries):
                self.entries[kept_key] = [entry for entry in self.entries[kept_key] if entry.program is not old.program]
                if not self.entries[kept_key]:
                    del self.entries[kept_key]
            if done:
                continue
            warnings.warn(
                f"zerocc: more than max_programs={self.max_programs} compiled programs (a new batch of "
                f"{describe_signature(signature)}); dropped the least recently used, compiled for "
                f"{describe_signature(old_key.signature)}. "
                + ("Each new shape costs a compilation: pad batches to a few shapes, raise max_programs, or set "
                   "static_shapes=True to make a new shape an error" if old_key.signature != signature else
                   "The shapes are the same: values the trace read from the batch, a branch on them, or settings "
                   "differ (an earlier RecompileWarning names them); raise max_programs if a few such programs "
                   "alternate")
                + (". Each Python value in the batch (a string, a number) is compiled into the program: pass one "
                   "that changes every batch (file names, sample ids) outside the step, or as a tensor"
                   if any(_holds_python_value(entry) for entry in signature) else ""), RecompileWarning,
                stacklevel=user_stacklevel())

    def clear(self) -> None:
        self.entries.clear()
        self.last = None
