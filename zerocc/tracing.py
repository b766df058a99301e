"""Tracing helpers shared by capture and the passes that trace subgraphs.

``trace_functional`` turns a Python function over (pytrees of) fake tensors
into a flat, functional aten graph: every in-place update becomes an
out-of-place op whose result is returned, so passes see pure dataflow.

It traces twice. The first trace runs autograd and records in-place ops as
they happen (functionalization cannot sit under autograd's
``requires_grad`` leaves); the second replays that graph under
``torch.func.functionalize`` and removes the mutations. Scalars read with
``.item()`` (the optimizer's step count, the learning rate) become symbolic
floats whose arithmetic is recorded as Python operators, so at run time they
are computed in double precision exactly as eager PyTorch does.
"""
from __future__ import annotations

import collections
import contextlib
import operator
import sys
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental import symbolic_shapes
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.overrides import TorchFunctionMode

from . import compile_stats, fake_kernels
from . import graph as g
from .compile_stats import CompileStats
from .autocast import autocast_state
from .data_guards import GuardedShapeEnv
from .errors import CaptureError, ObservedValueWarning, defined_at, user_line_of_node, user_stacklevel
from .ops import batch_norm_with_stats, bernoulli_in_layout, binary_cross_entropy_with_logits

aten = torch.ops.aten


# Nodes that only profile and would keep the graph impure.
_PROFILER_OPS = {
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
}


def record_source_lines_of(fn) -> None:
    """Keep stack traces of ops called from ``fn`` (make_fx keeps only ``forward`` frames by default).

    The optimizer's ``step`` and a loss function are user code too; their
    source lines make the error messages and the printed graphs point there.
    """
    import inspect
    from torch.fx import proxy
    register = getattr(proxy, "_register_stack_trace_anchor", None)
    if register is not None and callable(fn):
        register(inspect.unwrap(fn))


# Ops for which PyTorch registers a Python decomposition that tracing would use
# but eager execution does not (eager runs the C++ composite kernel). The two
# can order floating-point work differently, so while tracing we hide the
# Python version: the graph then holds what eager runs, bit for bit.
_EAGER_COMPOSITES = [
    aten.lstm.input, aten.lstm.data, aten.gru.input, aten.gru.data,
    aten.rnn_tanh.input, aten.rnn_tanh.data, aten.rnn_relu.input, aten.rnn_relu.data,
    aten.dropout.default, aten.matmul.default,
]


LIVE_STACKS = True   # False: torch's CapturedTraceback (the tests compare both); off where torch lacks its filter's parts


@contextlib.contextmanager
def recording_source_files(files: set[str]):
    """Add to ``files`` the file of every frame inside the traced function when an op is recorded.

    make_fx keeps only ``forward`` frames in a node's stack trace: a helper function in another file (an
    activation, an attention function, Hugging Face's loss) is on the stack while its ops are traced but in
    no trace. The compile cache on disk (``zerocc/disk_cache.py``) must see those files: an edit to one
    changes the program. Frames up to ``trace_functional``'s ``flat_fn`` (the script calling the step) are not
    part of what is traced.

    The stack is read from the live frames (``_LiveStack``) and only the frames make_fx keeps become
    ``FrameSummary`` objects, with the same filter (``_kept_frames``): torch's ``CapturedTraceback`` turns
    every frame of a deep stack into one for each node and then keeps a few, a third of a trace's time.
    """
    from torch.fx import proxy
    tracer_base = proxy.TracerBase
    original_filter, original_traceback = tracer_base._filter_traceback_frames, proxy.CapturedTraceback
    anchors = getattr(proxy, "_STACK_TRACE_ANCHORS", None)
    live = LIVE_STACKS and anchors is not None and hasattr(tracer_base, "_record_forward_stack_traces_only")

    def filter_and_record(tracer, summary):
        frames = summary.frames if isinstance(summary, _LiveStack) else [(f.filename, f.lineno, f.name) for f in summary]
        inside = False
        for filename, _, name in frames:
            if inside:
                files.add(filename)
            elif name == "flat_fn" and filename == __file__:
                inside = True
        if isinstance(summary, _LiveStack):
            return _kept_frames(tracer, frames, anchors)
        return original_filter(tracer, summary)

    tracer_base._filter_traceback_frames = filter_and_record
    if live:
        proxy.CapturedTraceback = _LiveStack
    try:
        yield files
    finally:
        tracer_base._filter_traceback_frames = original_filter
        proxy.CapturedTraceback = original_traceback


@contextlib.contextmanager
def loaded_uninteresting_files():
    """While tracing, torch's ``uninteresting_files`` answers from the modules already imported.

    make_fx's stack-trace filter and the ShapeEnv's source location of each ``.item()`` read (the
    optimizer's step count, a learning rate: ``create_unbacked_symfloat``) both call it, and its first call
    imports every module it names: torch.export and AOTAutograd, with networkx and inductor behind them
    (0.2-0.5 s of a first step, for files no traced frame can come from).
    """
    uninteresting = symbolic_shapes.uninteresting_files
    symbolic_shapes.uninteresting_files = _uninteresting_files_loaded
    try:
        yield
    finally:
        symbolic_shapes.uninteresting_files = uninteresting


class _LiveStack:
    """What make_fx's ``create_node`` takes from ``CapturedTraceback.extract().summary()``: the Python frames
    on the stack, outermost first, as (file, line, function), for ``filter_and_record`` alone to read."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[tuple[str, int, str]]):
        self.frames = frames

    @staticmethod
    def extract(**_) -> "_LiveStack":
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        frames.reverse()
        return _LiveStack(frames)

    def summary(self) -> "_LiveStack":
        return self

    def __len__(self) -> int:
        return len(self.frames)


def _kept_frames(tracer, frames: list[tuple[str, int, str]], anchors) -> traceback.StackSummary:
    """torch's ``TracerBase._filter_traceback_frames`` over (file, line, function) tuples: a ``FrameSummary``
    (which reads its source line) only for the frames it keeps."""
    if tracer._record_forward_stack_traces_only:
        kept = [f for f in frames if f[2] == "forward" or f[0].endswith("torch/__init__.py") or (f[0], f[2]) in anchors]
    else:
        first = next((i for i, f in enumerate(frames) if f[2] == "forward"), None)
        kept = frames[first:] if first is not None else []
    leave_out = symbolic_shapes.uninteresting_files()
    return traceback.StackSummary.from_list(
        [traceback.FrameSummary(filename, line, name) for filename, line, name in kept if filename not in leave_out])


# The modules whose frames make_fx and the ShapeEnv leave out of a stack (torch's ``uninteresting_files``).
# Its first call imports every one of them; a frame can only come from a module already imported, so while
# tracing, the files of those loaded stand for the whole set (``loaded_uninteresting_files``).
_UNINTERESTING_MODULES = (
    "torch", "torch.fx.experimental.symbolic_shapes", "torch.export._trace", "torch.fx.experimental.recording",
    "torch.fx.experimental.sym_node", "torch.fx.interpreter", "torch.fx._symbolic_trace", "torch._compile",
    "torch._dynamo.eval_frame", "torch._inductor.sizevars", "torch._library.custom_ops",
    "torch._library.fake_impl", "torch._subclasses.meta_utils", "torch._subclasses.fake_tensor",
    "torch._logging._internal", "torch._logging.structured",
)


def _uninteresting_files_loaded() -> set[str]:
    real = _REAL_UNINTERESTING_FILES
    info = getattr(real, "cache_info", None)   # an lru_cache in torch 2.13; another torch: its own set
    if info is None or info().currsize:   # computed already (torch.compile ran in this process): the real set
        return real()
    modules = sys.modules
    key = len(modules)
    cached = _loaded_files_cache.get(key)
    if cached is None:
        cached = {m.__file__ for name in _UNINTERESTING_MODULES
                  if (m := modules.get(name)) is not None and getattr(m, "__file__", None)}
        cached |= {getattr(m, "__file__", None) for name, m in list(modules.items())
                   if name == "torch._higher_order_ops" or name.startswith("torch._higher_order_ops.")} - {None}
        guards = modules.get("torch._dynamo.guards")
        if guards is not None:
            cached |= guards.uninteresting_files()
        cached.add("<string>")
        _loaded_files_cache.clear()
        _loaded_files_cache[key] = cached
    return cached


_REAL_UNINTERESTING_FILES = symbolic_shapes.uninteresting_files
_loaded_files_cache: dict[int, set[str]] = {}


@contextlib.contextmanager
def eager_composites():
    """Trace these ops through their C++ composite kernels, as eager PyTorch runs them."""
    from torch._C import DispatchKey
    hidden = []
    for op in _EAGER_COMPOSITES:
        for key in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd):
            if key in op.py_kernels:
                hidden.append((op, key, op.py_kernels.pop(key)))
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, key, kernel in hidden:
            op.py_kernels[key] = kernel
            op._dispatch_cache.clear()


def _subclass_with_torch_function(value: Any) -> bool:
    """Whether eager's ``torch.overrides.has_torch_function`` would say so of ``value`` (a fake tensor stands for a
    plain one)."""
    return (isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor)
            and type(value) not in (torch.Tensor, torch.nn.Parameter)
            and type(value).__torch_function__ is not torch._C._disabled_torch_function_impl)


def _nested_fast_path(*args, **kwargs):
    from .errors import user_frame_here
    raise CaptureError(
        f"nn.TransformerEncoder at {user_frame_here() or '(no user frame found)'} takes PyTorch's nested-tensor fast "
        "path here, as eager would (eval mode, no gradient through it, a src_key_padding_mask)\n"
        "  why: eager runs the layers on a nested tensor and returns zeros at the padded positions; a compiled step "
        "cannot trace nested tensors\n"
        "  fix: build it with enable_nested_tensor=False (the padded positions are then computed, in eager and in the "
        "step alike), or turn the fast path off for both with torch.backends.mha.set_fastpath_enabled(False)")


@contextlib.contextmanager
def fast_paths_as_eager():
    """``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` take their fused inference kernels where eager would.

    In eval mode with nothing requiring grad (``eval_forward``, a frozen encoder in a training step) eager runs
    ``aten._transformer_encoder_layer_fwd`` / ``aten._native_multi_head_attention``, which round otherwise than
    the composite path. The modules decide by ``torch.overrides.has_torch_function`` (true of fake tensors, and
    of every tensor under the trace's own torch-function mode) and, for attention, by whether make_fx is tracing:
    both are answered here, for those modules only, as eager answers them, so the program holds the fused op and
    computes what eager computes. ``nn.TransformerEncoder``'s nested-tensor path cannot be traced and is refused, naming the line.
    """
    from torch.nn.modules import activation
    has_torch_function, tracing, nested = (torch.overrides.has_torch_function, activation._is_make_fx_tracing,
                                           torch._nested_tensor_from_mask)
    checking = {activation.__name__, torch.nn.modules.transformer.__name__}   # the fast-path checks, not others

    def as_eager(args):
        if sys._getframe(1).f_globals.get("__name__") in checking:
            return any(_subclass_with_torch_function(a) for a in args)
        return has_torch_function(args)

    torch.overrides.has_torch_function = as_eager
    activation._is_make_fx_tracing = lambda: False
    torch._nested_tensor_from_mask = _nested_fast_path
    try:
        yield
    finally:
        torch.overrides.has_torch_function, activation._is_make_fx_tracing = has_torch_function, tracing
        torch._nested_tensor_from_mask = nested


def release_earlier_traces() -> None:
    """Empty the caches torch keeps of earlier traces on its classes, which grew with every compile.

    ``ShapeEnv``'s methods (``simplify``, ``_maybe_evaluate_static``, ``_find``...) are cached on the class, keyed on
    the ShapeEnv itself, and emptied only when a call comes from an env whose version counter differs from the
    last call's: every trace of a step makes a ShapeEnv that ends at the same count, so none was ever emptied, and
    each compile (a new sequence length under dynamic padding, an eval_forward shape) kept its ShapeEnv, with its
    guards, sympy expressions and captured tracebacks, though ``max_programs`` dropped its program.
    ``FakeTensorMode.cache``, the fake kernels' results by op and concrete shapes, shared by every fake mode,
    gained an entry per op and shape of each trace (about 0.5 MB per compile of a small Llama). Emptied before
    each trace, they hold the last one's; a trace still reuses its own entries (layers alike), and the rest are
    computed again as needed."""
    for method in vars(symbolic_shapes.ShapeEnv).values():
        if callable(getattr(method, "cache_clear", None)):
            method.cache_clear()
    FakeTensorMode.cache.clear()


def make_fake_mode() -> FakeTensorMode:
    """A fake mode whose ``.item()`` yields symbolic scalars instead of failing, and whose ops accept what the CPU kernels do.

    Its ShapeEnv decides branches on batch values while capture records data
    guards (``zerocc/data_guards.py``); otherwise it is torch's own.
    """
    release_earlier_traces()
    fake_mode = fake_kernels.ZeroccFakeTensorMode(shape_env=GuardedShapeEnv(allow_scalar_outputs=True),
                                                 allow_non_fake_inputs=True)
    fake_kernels.register()
    fake_kernels.mark_zerocc_fake_mode(fake_mode)
    return fake_mode


@contextlib.contextmanager
def no_traced_values_left(model: torch.nn.Module, *functions: Callable | None):
    """Attributes a traced forward set to traced values (a cache built on first call) are put back after the trace.

    ``self.cache = torch.arange(n)`` in forward runs on fake tensors while tracing and would leave a fake tensor
    on the user's module, which a later eager call would compute with. Each such attribute gets back the value
    it had before the trace, or is removed if the trace created it; the program holds what the trace computed.
    So are the module's parameters and buffers: the trace swaps them for its own with torch's
    ``_reparametrize_module``, which restores each *name* in turn, and a module registered under two names (``self.b
    = self.a``; Hugging Face's ``set_input_embeddings`` puts one embedding at three places) got the traced tensor
    back from the second name's restore. The step then built its buckets from fake tensors' garbage and trained to
    inf, where eager trains.

    Containers a module holds (``self.stats["mean"] = h.mean()``) and those the model's hooks and ``functions``
    (the loss function) reach through their closures and globals (``norms.append(out.norm())`` in a forward
    hook) get their contents back too: the step runs that Python once, while tracing, so they would keep
    placeholders (FakeTensors) that no later step updates. Writes into containers, which are what logging code
    does, are named in an ``ObservedValueWarning``; an attribute set to a tensor is put back without a word, as
    most are caches a model keeps for itself (Qwen2-VL's ``self.rope_deltas``, position tables).
    """
    before = {id(module): (dict(vars(module)), dict(module._parameters), dict(module._buffers))
              for module in model.modules()}
    containers = _containers_reached(model, functions)
    snapshots = [(where, _snapshot(container)) for where, container in containers]
    traced = False
    # (qualified name, the real tensor it held) of each attribute the trace set to another tensor: the caller
    # refuses those the program read (``reassigned_state_read``), state that eager carries to the next call
    reassigned: list[tuple[str, torch.Tensor]] = []
    try:
        yield reassigned
        traced = True
    finally:
        written = []
        for module_name, module in model.named_modules():
            old, old_parameters, old_buffers = before.get(id(module), ({}, {}, {}))
            for name, value in list(vars(module).items()):
                if _holds_fake(value) and value is not old.get(name, _ABSENT):   # not named: most are caches
                    if isinstance(old.get(name), torch.Tensor) and not isinstance(old[name], FakeTensor):
                        reassigned.append((f"{module_name}.{name}" if module_name else name, old[name]))
                    if name in old:
                        setattr(module, name, old[name])
                    else:
                        delattr(module, name)
            for table, old_table in ((module._parameters, old_parameters), (module._buffers, old_buffers)):
                for name, value in list(table.items()):
                    if isinstance(value, FakeTensor) and name in old_table:
                        table[name] = old_table[name]
        for where, snapshot in snapshots:
            if _holds_fake(snapshot[0]):
                written.append(where)
                _restore(snapshot)
        if written and traced:
            warnings.warn(
                f"zerocc: the step's Python stored tensors it computed in {', '.join(written[:4])}"
                f"{', ...' if len(written) > 4 else ''}: the compiled step runs forward, hooks and the loss function "
                "once, while compiling, on placeholder tensors, so these were taken out again and later calls do "
                "not update them. "
                "To log a value every step, write it into a buffer with copy_ (self.register_buffer('mean', "
                "torch.zeros(()), persistent=False); self.mean.copy_(hidden.mean())): the step updates buffers",
                ObservedValueWarning, stacklevel=user_stacklevel())


_ABSENT = object()
_CONTAINERS = (list, dict, set, collections.deque)
_LARGEST_CONTAINER = 4096   # larger ones (a dataset a loss function names) are not copied to be put back
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))   # _parameters, _buffers, _modules, the hook tables, ...


def _holds_fake(value: Any, depth: int = 4) -> bool:
    if isinstance(value, FakeTensor):
        return True
    if depth == 0 or not isinstance(value, (*_CONTAINERS, tuple)) or len(value) > _LARGEST_CONTAINER:
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(_holds_fake(item, depth - 1) for item in list(items))


def _containers_reached(model: torch.nn.Module, functions) -> list[tuple[str, Any]]:
    """(a description, the container) for the containers modules hold and the hooks' and ``functions``' closures
    and globals name: where a traced forward, hook or loss can leave a traced value by writing into one."""
    found, seen = [], set()

    def add(where, value):
        if isinstance(value, _CONTAINERS) and len(value) <= _LARGEST_CONTAINER and id(value) not in seen:
            seen.add(id(value))
            found.append((where, value))

    def reached_by(function, what):
        function = getattr(function, "func", function)   # functools.partial; a bound method reads as its function
        owner = getattr(function, "__self__", None)
        if owner is not None and not isinstance(owner, torch.nn.Module):   # a logger object's method
            for name, value in vars(owner).items() if hasattr(owner, "__dict__") else ():
                add(f"self.{name} (of {what})", value)
        code = getattr(function, "__code__", None)
        if code is None:
            return
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                add(f"{name} (named by {what})", cell.cell_contents)
            except ValueError:   # an empty cell
                pass
        for name in code.co_names:
            add(f"{name} (named by {what})", function.__globals__.get(name))

    def described(hook):
        where = defined_at(hook)
        return f"the hook {getattr(hook, '__qualname__', type(hook).__name__)}" + (f" at {where}" if where else "")

    for module_name, module in model.named_modules():
        for name, value in vars(module).items():
            if name not in _MODULE_INTERNALS:
                add(f"{type(module).__name__}{f' ({module_name})' if module_name else ''}.{name}", value)
        for table in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                      module._backward_pre_hooks):
            for hook in list(table.values()):
                reached_by(hook, described(hook))
    for parameter in model.parameters():
        for hook in list((parameter._backward_hooks or {}).values()):
            reached_by(hook, described(hook))
    for function in functions:
        if function is not None:
            reached_by(function, f"the loss function {getattr(function, '__qualname__', function)!r}")
    return found


def _snapshot(container: Any, depth: int = 3) -> tuple:
    """(the container, a copy of its items, the snapshots of the containers among them), to put back in place."""
    items = dict(container) if isinstance(container, dict) else list(container)
    inner = [_snapshot(item, depth - 1) for item in (items.values() if isinstance(items, dict) else items)
             if depth > 0 and isinstance(item, _CONTAINERS) and len(item) <= _LARGEST_CONTAINER]
    return container, items, inner


def _restore(snapshot: tuple) -> None:
    container, items, inner = snapshot
    if isinstance(container, dict):
        container.clear()
        container.update(items)
    elif isinstance(container, list):
        container[:] = items
    else:   # a set or a deque
        container.clear()
        (container.update if isinstance(container, set) else container.extend)(items)
    for snapshot_of_item in inner:
        _restore(snapshot_of_item)


@contextlib.contextmanager
def module_conversions_as_eager():
    """``module.to(x.device)``, ``module.float()`` in forward convert nothing in eager when the module already is so.

    Models call them every step (Switch Transformers' router: ``self.classifier = self.classifier.to(self.dtype)``).
    While tracing, the module holds the trace's fake tensors, which torch's ``Module._apply`` swaps instead of
    leaving alone, and fails. Here a conversion that returns every parameter and buffer unchanged returns the
    module, as eager does; one that would change a tensor (its dtype or device) is refused, naming the line: it
    would replace the parameter, which the program owns.
    """
    apply = torch.nn.Module._apply

    def converted_as_eager(module, fn, recurse=True):
        tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
        with torch.no_grad():
            changed = [t for t in tensors if fn(t) is not t]
        if not changed:
            return module
        from .errors import CaptureError, user_frame_here
        raise CaptureError(
            f"the step converts a module's parameters or buffers at {user_frame_here() or '(no user frame found)'}\n"
            f"  why: the conversion changes a {changed[0].dtype} tensor on {changed[0].device}, which would replace a "
            "parameter the compiled step holds\n"
            "  fix: convert the model once before zerocc.compile (model.to(dtype)), or convert tensors, not the module "
            "(F.linear(x.float(), linear.weight.float()))")

    torch.nn.Module._apply = converted_as_eager
    try:
        yield
    finally:
        torch.nn.Module._apply = apply


def fakeify(fake_mode: FakeTensorMode, tree: Any) -> Any:
    """Fake copies of every tensor in a pytree (requires_grad kept, shapes static)."""
    def convert(value):
        if isinstance(value, FakeTensor):
            return value
        if isinstance(value, torch.Tensor):
            return fake_mode.from_tensor(value, static_shapes=True)
        return value
    return pytree.tree_map(convert, tree)


def trace_functional(fn: Callable[..., Any], args: tuple, fake_mode: FakeTensorMode,
                     stats: CompileStats | None = None,
                     check_written_constants: Callable[[dict[int, fx.Node]], None] | None = None,
                     stamper=None) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """Trace ``fn(*args)`` into a flat functional graph; returns it and the output tree spec.

    The graph's placeholders are ``pytree.tree_leaves(args)`` in order; its
    output is the flat list of ``fn``'s output leaves. ``stats`` gets the
    seconds of the trace and of the functionalizing replay.
    ``check_written_constants`` is called with the tensor constants the
    first trace writes in place (``written_constants``), before the replay:
    a write that reads a traced value would fail there inside
    functionalization ("mutating a non-functional tensor with a functional
    tensor"), so the caller refuses it first, naming the tensor.
    """
    stats = stats if stats is not None else CompileStats("trace")
    flat_args, in_spec = pytree.tree_flatten(args)
    out_spec_box: list[pytree.TreeSpec] = []

    def flat_fn(*leaves):
        with _UsersOpsAutocast():
            out = fn(*pytree.tree_unflatten(list(leaves), in_spec))
        flat_out, spec = pytree.tree_flatten(out)
        out_spec_box.append(spec)
        return flat_out

    # lazy graph modules (zerocc/pipeline.py's deferring_codegen): capture and every pass call recompile(),
    # and the step's Python is made once, when it first runs
    # a module the user wrapped in torch.compile runs its own code inside the trace (dynamo inlines it)
    with stats.timed(compile_stats.TRACE), fake_mode, eager_composites(), fast_paths_as_eager(), \
            _use_lazy_graph_module(True), torch._dynamo.config.patch(error_on_nested_fx_trace=False), \
            loaded_uninteresting_files(), recording_source_files(set()) as files:
        first = _traced_once(flat_fn, flat_args, fake_mode, stamper, out_spec_box)
    first.meta[g.SOURCE_FILES] = frozenset(files)
    if check_written_constants is not None:
        check_written_constants(written_constants(first))
    if _is_functional(first):   # nothing to remove: the replay would rebuild the same graph (half the cost)
        _run_users_ops_under_autocast(first)
        _storage_offsets_relative_to_their_tensor(first)
        _remove_profiler_nodes(first)
        first.graph.eliminate_dead_code()
        first.recompile()
        return first, out_spec_box[0]

    def replay(*leaves):
        with fx_traceback.preserve_node_meta():
            return _VisibleMutations(first).run(*leaves)

    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in flat_args]
    with stats.timed(compile_stats.FUNCTIONALIZE), fake_mode, _use_lazy_graph_module(True), loaded_uninteresting_files():
        gm = make_fx(torch.func.functionalize(replay, remove="mutations"))(*detached)
    _run_written_copies_as_a_function(gm)
    _run_users_ops_under_autocast(gm)
    gm.meta[g.WRITTEN_INPUTS] = written_inputs(first)
    gm.meta[g.WRITTEN_CONSTANTS] = written_constants(first)
    gm.meta[g.SOURCE_FILES] = first.meta[g.SOURCE_FILES]
    _draw_masks_in_layout(gm, fake_mode)
    _storage_offsets_relative_to_their_tensor(gm)
    _remove_trailing_input_copies(gm)
    _remove_profiler_nodes(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, out_spec_box[0]


def _traced_once(flat_fn, flat_args, fake_mode, stamper, out_spec_box) -> fx.GraphModule:
    """make_fx of ``flat_fn``; with a ``stamper`` (zerocc/stamping.py), the 2nd+ calls of look-alike blocks are
    copies of the first's nodes (``NotStampable`` where that cannot be done exactly: capture traces again)."""
    if stamper is None or not stamper.groups:
        return make_fx(flat_fn, record_stack_traces=True)(*flat_args)
    with stamper.active():
        first = make_fx(flat_fn, record_stack_traces=True)(*flat_args)
        return stamper.expand(first, fake_mode)


def written_inputs(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Placeholders (by position) that an op writes in place, directly or through a view of them."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return written_values(gm, {node: position for position, node in enumerate(placeholders)})


def reassigned_state_read(gm: fx.GraphModule, reassigned: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse a plain tensor attribute forward reads and then sets to a new tensor (``self.center = self.center * m
    + c * (1 - m)`` on an attribute that is no buffer): eager carries the new tensor to the next call, the program
    keeps the one it read as a constant and would compute with it at every step (DINO's center, silently wrong).
    A cache forward rebuilds without reading the old one (a position table made longer) is left alone."""
    constants = {id(getattr(gm, node.target)) for node in gm.graph.nodes
                 if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)}
    read = [name for name, tensor in reassigned if id(tensor) in constants]
    if read:
        short = read[0].rsplit(".", 1)[-1]
        raise CaptureError(
            f"forward reads the tensor attribute(s) {', '.join(map(repr, read))} and assigns them a new tensor, "
            "which is neither a parameter nor a buffer\n"
            "  why: eager's next call reads the new tensor; the compiled step carries only parameters, buffers and "
            "optimizer state from one step to the next, so it would read the value it was compiled with at every step\n"
            f"  fix: register it as a buffer in the module's __init__ (self.register_buffer({short!r}, tensor), "
            "persistent=False keeps it out of state_dict): the step carries a buffer forward assigns")


def written_constants(gm: fx.GraphModule) -> dict[int, fx.Node]:
    """Tensor constants (by ``id`` of the tensor, the object tracing found) that an op writes in place."""
    constants = {node: id(getattr(gm, node.target)) for node in gm.graph.nodes
                 if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)}
    return written_values(gm, constants)


def written_values(gm: fx.GraphModule, root: dict[fx.Node, Any]) -> dict[Any, fx.Node]:
    """Of the nodes keyed in ``root``, the first op writing each in place (directly or through a view), by key."""
    root = dict(root)
    written: dict[Any, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for argument, value in zip(schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and value in root:
                written.setdefault(root[value], node)
        returns = schema.returns
        if (returns and returns[0].alias_info is not None and not returns[0].alias_info.is_write
                and node.args and node.args[0] in root):
            root[node] = root[node.args[0]]   # a view of an input: writing it writes the input
    return written


def _writes_its_first_argument(node: fx.Node) -> bool:
    """An op that updates its first argument in place and returns it (``add_``, ``sigmoid_``)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    schema = node.target._schema
    return (bool(schema.arguments) and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
            and len(schema.returns) == 1 and schema.returns[0].alias_info is not None
            and bool(node.args) and isinstance(node.args[0], fx.Node))


def _updates_a_fresh_tensor(node: fx.Node) -> bool:
    """``node`` updates in place a tensor an op made, no view of another and no input of the graph.

    Functionalization rebinds such a tensor alone; an input or a view is written back to its base, which a
    copy in another layout would not follow.
    """
    if not _writes_its_first_argument(node):
        return False
    while _writes_its_first_argument(node):
        node = node.args[0]
    if node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    return all(r.alias_info is None for r in node.target._schema.returns)


def _is_functional(gm: fx.GraphModule) -> bool:
    """No op writes to an input (schema alias marked as written) and none hides a write (batch norm stats)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        if node.target is aten.native_batch_norm.default or node.target._schema.is_mutable:
            return False
        if any(r.alias_info is not None and r.alias_info.is_write for r in node.target._schema.returns):
            return False
    return True


def _draw_masks_in_layout(gm: fx.GraphModule, fake_mode: FakeTensorMode) -> None:
    """``bernoulli.p`` of a strided tensor -> ``zerocc::bernoulli_in_layout``: the mask drawn in eager's memory order.

    Functionalization replays eager's in-place ``empty_like(x).bernoulli_(q)`` as ``bernoulli.p``, whose
    result is contiguous; where ``x`` is not, eager's numbers fill another order (``zerocc/ops.py``).
    """
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.bernoulli.p:
            continue
        like = node.args[0].meta.get(g.VAL) if isinstance(node.args[0], fx.Node) else None
        if isinstance(like, torch.Tensor) and not like.is_contiguous():
            node.target = bernoulli_in_layout
            with fake_mode:
                node.meta[g.VAL] = torch.empty_like(like)


def _storage_offsets_relative_to_their_tensor(gm: fx.GraphModule) -> None:
    """``as_strided(x, size, stride, offset)`` with ``offset`` x's own storage offset -> ``as_strided(x, size, stride)``.

    ``as_strided`` counts an explicit storage offset from the start of x's storage, not from x. Autograd
    (``as_strided_backward``, the backward of overlapping windows such as Longformer's chunks) and
    functionalization's view replays write the offset x had while tracing, usually 0. The passes then move
    x: ``place_buffers`` writes it into an arena at some offset, ``shard`` makes a parameter a slice of its
    bucket, and the runtime passes batches that are views. With the offset traced, the view read another
    tensor's memory (wrong gradients, or an overlap error in a later ``out=`` kernel); without it, as_strided
    takes x's own offset, the same view of x wherever x lies. An offset ahead of x's becomes a flat view of x
    sliced there; one before x's start counts from the tensor x is a view of, and is refused if none is in
    the graph (what lies before a placeholder at run time is not what lay there while tracing).
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.as_strided.default or len(node.args) < 4:
            continue
        x, size, stride, offset = node.args[:4]
        value = x.meta.get(g.VAL) if isinstance(x, fx.Node) else None
        if not isinstance(value, torch.Tensor) or type(offset) is not int or type(value.storage_offset()) is not int:
            continue
        delta = offset - value.storage_offset()
        while delta < 0 and _is_view_of_its_first_argument(x):   # reaching before x: count from x's base instead
            x = x.args[0]
            value = x.meta[g.VAL]
            delta = offset - value.storage_offset()
        if delta < 0:
            where = user_line_of_node(node) or "(no line of yours)"
            raise CaptureError(f"the step cannot be traced at {where}: as_strided with storage_offset={offset} starts "
                               f"{-delta} elements before its tensor (storage offset {value.storage_offset()}); zerocc "
                               "places tensors in its own memory, where what lies before a tensor is not what lay "
                               "there in eager. Take the view from the tensor you reach into, offset from its start")
        if delta > 0:   # x's own offset plus delta: a flat view from x's start, sliced at delta
            with gm.graph.inserting_before(node):
                flat = gm.graph.call_function(aten.as_strided.default, (x, [delta + 1], [1]))
                flat.meta.update(node.meta, **{g.VAL: value.as_strided([delta + 1], [1])})
                x = gm.graph.call_function(aten.slice.Tensor, (flat, 0, delta, delta + 1))
                x.meta.update(node.meta, **{g.VAL: flat.meta[g.VAL][delta:]})
        node.args = (x, size, stride)


def _is_view_of_its_first_argument(node: fx.Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
            and bool(node.args) and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[0].meta.get(g.VAL), torch.Tensor)
            and type(node.args[0].meta[g.VAL].storage_offset()) is int)


def _remove_trailing_input_copies(gm: fx.GraphModule) -> None:
    """Drop the ``copy_(input, new)`` write-backs functionalize appends.

    Our traced functions return every value they update, so the write-back
    into the placeholder is redundant: the runtime rebinds to the output.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.copy_.default and node.args[0].op == "placeholder":
            assert not node.users, "a write-back copy_ is used"
            gm.graph.erase_node(node)


def _remove_profiler_nodes(gm: fx.GraphModule) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target in _PROFILER_OPS:
            for user in list(node.users):
                if user.op == "call_function" and user.target in _PROFILER_OPS:
                    gm.graph.erase_node(user)
            if not node.users:
                gm.graph.erase_node(node)


_AUTOCAST = "zerocc_autocast"   # in node.meta["custom"], which the functionalizing replay copies to its nodes


class _UsersOpsAutocast(TorchFunctionMode):
    """Marks the node of each call of a user's custom op made under ``torch.autocast`` with that autocast state.

    Eager runs a custom op's own code under the caller's autocast (the op has no autocast rule: its inputs are not
    cast, but a reference implementation calling ``F.linear`` inside computes in bf16), while the program runs
    outside autocast. The state is read where the op is called: under the trace's dispatch modes every autocast
    key is excluded, so ``torch.is_autocast_enabled()`` is false there whatever the caller's state."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if not isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            # before any other use of ``func``: dynamo traces this method where a higher-order op (flex_attention,
            # torch.cond) compiles itself inside the trace, and cannot wrap the operator as a value of its own
            return result
        packet = getattr(func, "overloadpacket", func)
        if isinstance(packet, torch._ops.OpOverloadPacket) and fake_kernels.users_op(packet):
            state = autocast_state()
            tracer = getattr(get_proxy_mode(), "tracer", None)
            if state and tracer is not None:
                node = next((n for n in reversed(tracer.graph.nodes)
                             if getattr(n.target, "overloadpacket", None) is packet), None)
                if node is not None:
                    node.meta["custom"] = {**node.meta.get("custom", {}), _AUTOCAST: state}
        return result


def _run_users_ops_under_autocast(gm: fx.GraphModule) -> None:
    """Run each node ``_UsersOpsAutocast`` marked (or the copy-and-run of it, ``_written_back``) under its
    autocast state (``ops.under_autocast``)."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized_dense
    from .ops import under_autocast, written_copies_under_autocast
    for node in gm.graph.nodes:
        state = (node.meta.get("custom") or {}).get(_AUTOCAST)
        if not state or node.op != "call_function":
            continue
        if fake_kernels.users_op(node.target):
            node.args = (state, node.target, *node.args)
            node.target = under_autocast
        elif node.target is auto_functionalized_dense:
            node.args = (state, *node.args)
            node.target = written_copies_under_autocast


def _writes_arguments_of_users_op(target) -> bool:
    """A custom op (``torch.library.custom_op(..., mutates_args=...)``) that writes into some of its arguments."""
    from torch._higher_order_ops.auto_functionalize import can_auto_functionalize
    return isinstance(target, torch._ops.OpOverload) and can_auto_functionalize(target)


def _written_back(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """``op(*args, **kwargs)`` for a custom op that writes into its arguments, as functionalization can take it.

    ``torch.func.functionalize`` refuses such an op ("a custom operator whose output has alias annotations");
    ``auto_functionalized`` runs it on copies of the arguments it writes and returns them: copied back into the
    arguments (``copy_``, which functionalization turns into new values, as it does for aten's in-place ops), the
    write reaches a buffer it updates (a running statistic) as eager's does."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, get_mutable_args
    schema = op._schema
    named = dict(kwargs)
    for argument, value in zip(schema.arguments, args):
        named[argument.name] = value
    out = auto_functionalized(op, **named)
    written, _ = get_mutable_args(op)
    returned = len(schema.returns) or 1   # an op returning nothing gives None in that place
    for name, new in zip(written, out[returned:]):
        if isinstance(named.get(name), torch.Tensor):
            named[name].copy_(new)
        elif isinstance(named.get(name), (list, tuple)):
            for tensor, value in zip(named[name], new):
                tensor.copy_(value)
    if not schema.returns:
        return None
    return out[0] if len(schema.returns) == 1 else tuple(out[:returned])


def _run_written_copies_as_a_function(gm: fx.GraphModule) -> None:
    """Run ``auto_functionalized`` nodes (``_written_back``) by its plain function: copy the arguments the custom op
    writes, run the op on the copies, return them. A higher-order op finds its rule by the dispatch mode's exact
    class, which a mode active around the step (a profiler's, the user's own) does not have; the function's ops
    (the copies, the custom op itself) are plain ops every mode sees."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_dense
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is auto_functionalized:
            node.target = auto_functionalized_dense


class _VisibleMutations(fx.Interpreter):
    """Replays a graph, rewriting ops whose schema hides an in-place update.

    ``native_batch_norm`` updates its running statistics in place although its
    schema does not say so; replayed as ``batch_norm_with_stats`` plus an
    explicit ``copy_``, functionalization sees the update and returns it. In
    eval mode (``training`` false) it only reads them and stays as it is.
    ``binary_cross_entropy_with_logits`` is replayed under zerocc's name for it, which
    ``torch.func.functionalize`` does not replace with functorch's formula (zerocc/ops.py).

    An in-place op keeps its tensor's strides; functionalization computes it out of place, whose result is
    laid out afresh. On a tensor with gaps between its rows (a chunk of ``unsafe_chunk``, as in the CPU GRU
    cell's ``gates.unsafe_chunk(3, 1)[0].add_(...).sigmoid_()``) the new value is contiguous, and the next
    vectorized kernel (``sigmoid``) runs over other chunks of elements than eager's and rounds some of them
    differently. Such a value is copied back into eager's layout (``empty_strided`` + ``copy``): the later
    ops then see what eager's saw, bit for bit.
    """

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        eager = n.meta.get(g.VAL)
        # plain sizes first: comparing symbolic strides (a CTC loss's log alpha, sized by an unbacked symbol of
        # the first trace) would evaluate the first trace's symbols in this one's tracer, which does not know them
        if (n.op == "call_function" and isinstance(result, torch.Tensor) and isinstance(eager, torch.Tensor)
                and all(type(x) is int for x in (*eager.shape, *eager.stride(), *result.stride()))
                and result.stride() != eager.stride() and _updates_a_fresh_tensor(n)):
            result = torch.empty_strided(eager.shape, eager.stride(), dtype=result.dtype,
                                         device=result.device).copy_(result)
            node = n
            while True:   # the updated tensor under every name the graph gives it, as eager's in-place op returns self
                if node in self.env or node is n:
                    self.env[node] = result
                if not _writes_its_first_argument(node):
                    break
                node = node.args[0]
        return result

    def call_function(self, target, args, kwargs):
        if target is aten.native_batch_norm.default and args[3] is not None and args[4] is not None and args[5]:
            input, weight, bias, running_mean, running_var, training, momentum, eps = args
            out, save_mean, save_invstd, new_mean, new_var = batch_norm_with_stats(
                input, weight, bias, running_mean, running_var, training, momentum, eps
            )
            running_mean.copy_(new_mean)
            running_var.copy_(new_var)
            return out, save_mean, save_invstd
        if target is aten.binary_cross_entropy_with_logits.default:   # functorch would swap in its own formula
            return binary_cross_entropy_with_logits(*args, **kwargs)
        if _writes_arguments_of_users_op(target):
            return _written_back(target, args, kwargs)
        if any(isinstance(a, torch.SymFloat) for a in args) and any(
                isinstance(a, torch.Tensor) and a.is_complex() for a in args):
            # a complex tensor times a traced Python float (AdamW's decay of a complex parameter by
            # 1 - lr * weight_decay): the functional op's fake kernel converts the float to complex, which a
            # symbolic float cannot be; as a 0-dim float64 tensor it promotes and rounds as the Python float does
            args = tuple(torch.scalar_tensor(a, dtype=torch.float64) if isinstance(a, torch.SymFloat) else a
                         for a in args)
        return super().call_function(target, args, kwargs)
