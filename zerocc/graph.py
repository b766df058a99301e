"""Names and predicates for the FX graphs every pass reads and writes.

All ``node.meta`` keys zerocc uses are constants here, so a reader can find
every producer and consumer of a tag with one search.
"""
from __future__ import annotations

import collections
from typing import Iterable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.fx.immutable_collections import immutable_list

from . import ops  # noqa: F401  registers torch.ops.zerocc, whose gather the predicates below name

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

# node.meta keys -------------------------------------------------------------
ROLE = "zerocc_role"          # placeholders: one of the ROLE_* values below
PHASE = "zerocc_phase"        # every compute node: forward / backward / optimizer / communication
INDEX = "zerocc_index"        # placeholders: index into the list of their role
BUCKET = "zerocc_bucket"      # nodes created for one bucket: its index
SLOT = "zerocc_slot"          # placeholders: the runtime's persistent tensor they read (None for inputs)
RECOMPUTED = "zerocc_recomputed"  # backward copies of forward nodes (place_remat): the node recomputed
OUTPUT_SLOTS = "zerocc_output_slots"  # gm.meta: for each output after the loss, the slot it replaces
VAL = "val"                   # FakeTensor (or SymFloat) of the node's value, as make_fx writes it
RELEASED = "zerocc_released"  # placeholders: the runtime drops the old slot value during the step (release_slots)
RELEASE_POINT = "zerocc_release_point"  # the node after which the runtime drops the RELEASED slots' old values
PRECISION_CAST = "zerocc_precision_cast"  # casts mixed precision adds: "param" (master -> param_dtype), ...
COMPLEX_AS_REAL = "zerocc_complex_as_real"  # the real views a complex tensor is communicated as (insert_collectives)
GRAD_OF = "zerocc_grad_of"    # gradient nodes (capture): indices of the parameters it is the gradient of
UNUSED = "zerocc_unused"      # parameter placeholders (capture): the step does not read the parameter
STATE_KEY = "zerocc_state_key"  # optimizer-state placeholders: the key in the optimizer's per-parameter state
STACK_TRACE = "stack_trace"   # the user's frames where make_fx recorded the node (torch.fx's own key)
WRITTEN_INPUTS = "zerocc_written_inputs"  # gm.meta (tracing): {placeholder position: the first node writing it in place}
WRITTEN_CONSTANTS = "zerocc_written_constants"  # gm.meta (tracing): {id of a tensor constant: the first node writing it}
SOURCE_FILES = "zerocc_source_files"  # gm.meta (tracing): every file whose code was running when an op was traced
TRACING_META = (WRITTEN_INPUTS, WRITTEN_CONSTANTS)   # gm.meta capture reads and nothing after: nodes of another graph

# placeholder roles
ROLE_PARAM = "param"                  # a trainable parameter (before shard) or a flat bucket (after)
ROLE_FROZEN = "frozen"                # a parameter that is not trained in this step
ROLE_BUFFER = "buffer"                # a module buffer (BatchNorm running stats, ...)
ROLE_STATE = "optimizer_state"        # one tensor of optimizer state
ROLE_HYPER = "hyperparameter"         # a per-param-group scalar read each step (lr, betas, momentum...: optimizer_step.live_layout)
ROLE_INPUT = "input"                  # the user's batch
ROLE_LOSS_SCALE = "loss_scale"        # the dynamic loss scale and its growth tracker (zerocc/precision.py)
ROLE_ARENA = "arena"                  # a memory arena the runtime allocates once (passes/place_buffers.py)

# phases
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"
COMMUNICATION = "communication"


def placeholders(gm: fx.GraphModule, role: str | None = None) -> list[fx.Node]:
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if role is not None:
        nodes = [n for n in nodes if n.meta.get(ROLE) == role]
    return nodes


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


# The collectives' targets, looked up once: the predicates below run for every node several times per pass (the
# lifetime analysis, the schedule), and resolving ``torch.ops`` attributes on each call was most of their time.
_ALL_GATHERS = (c10d.all_gather_into_tensor.default, c10d.all_gather_into_tensor_out.default,
                torch.ops.zerocc.all_gather_by_send_recv.default)
_REDUCE_SCATTERS = (c10d.reduce_scatter_tensor.default, c10d.reduce_scatter_tensor_out.default,
                    c10d.all_to_all_single.default, torch.ops.zerocc.all_to_all_single_out.default)
_ALL_REDUCE = c10d.all_reduce.default
_BROADCAST = c10d.broadcast.default
_WAIT = c10d.wait_tensor.default
_COLLECTIVES = (*_ALL_GATHERS, *_REDUCE_SCATTERS, _ALL_REDUCE, _BROADCAST)
# a tuple, not a set: ``in`` compares by identity first, where a set would hash each OpOverload in Python


def is_all_gather(node: fx.Node) -> bool:
    """An all-gather, or the sends and receives that stand for one on gloo (passes/gather_by_send_recv.py)."""
    return node.op == "call_function" and node.target in _ALL_GATHERS


def is_reduce_scatter(node: fx.Node) -> bool:
    """A reduce-scatter, or the all-to-all that stands for one on gloo (passes/scatter_by_all_to_all.py)."""
    return node.op == "call_function" and node.target in _REDUCE_SCATTERS


def is_all_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _ALL_REDUCE


def is_broadcast(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _BROADCAST


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is _WAIT


def wait_of(collective: fx.Node) -> fx.Node:
    """The wait of a collective (each has exactly one)."""
    (wait,) = [u for u in collective.users if is_wait(u)]
    return wait


def is_parameter_shard(node: fx.Node) -> bool:
    """A bucket's persistent shard (a placeholder), its cast to the compute dtype under mixed precision, or the real
    view of a complex one that a collective sends."""
    if node.op == "call_function" and node.meta.get(COMPLEX_AS_REAL):
        node = node.args[0]
    if node.op == "call_function" and node.meta.get(PRECISION_CAST) == "param":
        node = node.args[0]
    return node.op == "placeholder"


def is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _COLLECTIVES


def reads_inputs_until_wait(node: fx.Node) -> bool:
    """A collective that reads its inputs while it runs, until its wait: not ``all_reduce`` and ``broadcast``,
    which clone their input when called and run on the clone (c10d's functional ops), so the input may die
    there (planned until the wait, stage 0 held every bucket's gradients twice through backward)."""
    return node.op == "call_function" and node.target in _COLLECTIVES and node.target is not _ALL_REDUCE \
        and node.target is not _BROADCAST


def tensor_meta(node: fx.Node) -> torch.Tensor | None:
    value = node.meta.get(VAL)
    return value if isinstance(value, torch.Tensor) else None


def nbytes(node: fx.Node) -> int:
    value = tensor_meta(node)
    return 0 if value is None else value.numel() * value.element_size()


def is_data_dependent(value) -> bool:
    """Is ``value`` a tensor whose size depends on the data (boolean-mask indexing, ``nonzero``, ``.tolist()`` sizes)?

    Its size is an unbacked symbol, known only when the step runs: the memory plan leaves it unplanned, and the
    cost model counts it as no bytes and no work.
    """
    # a tensor without symbolic sizes (almost every one) answers from one flag: testing each size and stride
    # was a tenth of a lifetime analysis, which asks for every node (several per pass, per plan measured)
    if not isinstance(value, torch.Tensor) or not value._has_symbolic_sizes_strides:
        return False
    return not all(is_concrete_int(x) for x in (*value.shape, *value.stride()))


def values_of(value) -> tuple:
    """A node's value as a tuple of what it holds: its outputs (a tuple or list of them), or the one value."""
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def known_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (one, or a tuple of them), those whose size depends on the data left out.

    A size may be a SymInt whose expression is a number (``torch.bincount(x, minlength=E)`` traces its length so):
    ``int`` makes it one, where the product would otherwise stay a SymInt and the cost model's seconds a SymFloat.
    """
    return sum(int(v.numel()) * v.element_size() for v in values_of(value)
               if isinstance(v, torch.Tensor) and not is_data_dependent(v))


def span_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage ``tensor``'s elements span (its strides may skip elements); 0 if it has none. What the
    memory plan counts for a fresh tensor (``analysis/lifetimes.py``) and the first run measures for a batch input
    (``runtime/memory.py``)."""
    if tensor.numel() == 0:
        return 0
    span = 1 + sum((int(size) - 1) * abs(int(stride)) for size, stride in zip(tensor.shape, tensor.stride()))
    return span * tensor.element_size()


def ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    """Every node the roots depend on, the roots included."""
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return seen


def count_targets(gm: fx.GraphModule) -> collections.Counter:
    """How many call_function nodes call each target, by a short name ('all_gather_into_tensor')."""
    # counted per target object first (by id: an OpOverload's hash is Python), named once per target: a snapshot
    # after every pass counts the 98M GPT's ~8,000 nodes; the names come in the order of their first node, as before
    by_id: dict[int, list] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            entry = by_id.get(id(node.target))
            if entry is None:
                by_id[id(node.target)] = [node.target, 1]
            else:
                entry[1] += 1
    counts: collections.Counter = collections.Counter()
    for target, count in by_id.values():
        counts[short_name(target)] += count
    return counts


def short_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def set_val(node: fx.Node, value) -> fx.Node:
    node.meta[VAL] = value
    return node


def call(graph: fx.Graph, fake_mode, target, *args, **kwargs) -> fx.Node:
    """Add ``target(*args, **kwargs)`` at the graph's insertion point, with its fake value in meta."""
    fake_args, fake_kwargs = fake_arguments(args, kwargs)
    value = _plain_fake_value(fake_mode, target, fake_args, fake_kwargs)
    if value is None:
        with fake_mode:
            value = target(*fake_args, **fake_kwargs)
    node = add_node(graph, "call_function", target, args, kwargs)
    node.meta[VAL] = value
    return node


def add_node(graph: fx.Graph, op: str, target, args: tuple = (), kwargs: dict | None = None, name: str | None = None,
             type_expr=None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)``, less its scan of the arguments for raw
    SymInts (a warning only; torch's pytree walk of every argument was a fifth of the passes' cost of adding a
    node: shard's optimizer copy, place_buffers' ~1,200 arena views of the 98M GPT). The node is made without
    arguments and given them after, as ``Node.__init__`` would: the same users, in the same order."""
    node = graph.create_node(op, target, name=name, type_expr=type_expr)
    if args:
        node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """``graph.node_copy(node, arg_transform)`` through ``add_node``."""
    copied = add_node(graph, node.op, node.target, fx.map_arg(node.args, arg_transform),
                      fx.map_arg(node.kwargs, arg_transform), node.name, node.type)
    copied.meta = node.meta.copy()
    return copied


# the argument types ``fake_arguments`` passes through as they are: pytree's leaves
_PLAIN_ARGUMENTS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
                              torch.layout})


class _NotPlain(Exception):
    pass


def fake_arguments(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with each node replaced by its fake value, as ``pytree.tree_map`` makes them.

    The passes' own calls (shard's views and concatenations, the collectives) hold nodes, numbers and lists of
    them: mapped here without pytree's per-leaf type dispatch, a sixth of ``call``'s cost on the 98M GPT's
    1,100 calls (and of the optimizer copies' views, ``optimizer_step._propagate_fake``); anything else (a dict,
    a named tuple) goes through pytree.
    """
    def fake(arg):
        kind = type(arg)
        if kind is fx.Node:
            return arg.meta[VAL]
        if kind in _PLAIN_ARGUMENTS:
            return arg
        if kind is list:
            return [fake(a) for a in arg]
        if kind is immutable_list:   # a list in a node's arguments
            return immutable_list(fake(a) for a in arg)
        if kind is tuple:
            return tuple(fake(a) for a in arg)
        raise _NotPlain
    try:
        return tuple(fake(a) for a in args), {k: fake(v) for k, v in kwargs.items()}
    except _NotPlain:
        import torch.utils._pytree as pytree
        return pytree.tree_map(lambda arg: arg.meta[VAL] if isinstance(arg, fx.Node) else arg, (args, kwargs))


# The ops passes build most (``shard``'s bucket views and gradient concatenations: 750 nodes on the 98M GPT at
# stage 3), whose fake value ``_plain_fake_value`` makes without the fake mode's dispatch.
_PLAIN_VIEWS = frozenset({aten.slice.Tensor, aten.view.default, aten.reshape.default})
# and ops whose meta kernel makes a new tensor from sizes alone: the collectives and waits ``insert_collectives``
# and ``scatter_by_all_to_all`` build per bucket (73 buckets on the 98M GPT at stage 3; the all-to-all, its wait
# and the sum of its chunks were 0.05 s of the pass's 0.16 s CPU, dispatched)
_PLAIN_NEW = frozenset({c10d.all_to_all_single.default, c10d.wait_tensor.default, aten.sum.dim_IntList,
                        c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default})


def _plain_fake_value(fake_mode, target, args: tuple, kwargs: dict):
    """The fake value of a view (``_PLAIN_VIEWS``), of an op that makes a new tensor from sizes alone
    (``_PLAIN_NEW``: all-to-all, wait, sum over dims) or of a ``cat`` of flat tensors, made without the fake mode's
    dispatch; None for any other call, which dispatches.

    Dispatching through the fake mode (its Python, its cache's key and the output rebuilt from its entry) cost
    about 0.5 ms an op, most of ``shard``; the meta kernel run on the inputs' meta tensors, as the fake mode runs
    it inside (``in_kernel_invocation_manager``), and wrapped as a FakeTensor of the input's device, is the same
    value (shape, strides, storage offset, and a view keeps its input's storage, a new tensor has one of its own) at
    a fifth of that; a ``cat`` of 1-d tensors of one dtype and device is a new contiguous tensor of their summed
    length. Only for static sizes,
    inputs of this fake mode that neither require grad nor hold a constant (the fake mode's own business);
    ``tests/test_plain_fake_values.py`` checks the values against the dispatched ones.
    """
    def plain(tensor) -> bool:
        return (type(tensor) is FakeTensor and tensor.fake_mode is fake_mode and tensor.constant is None
                and not tensor.requires_grad and type(tensor.storage_offset()) is int
                and all(type(n) is int for n in (*tensor.shape, *tensor.stride())))

    if kwargs:
        return None
    if target in _PLAIN_VIEWS or target in _PLAIN_NEW:
        if not args or not plain(args[0]) or not all(
                type(a) is int or type(a) is str and target is not aten.sum.dim_IntList
                or isinstance(a, (list, tuple)) and all(type(n) is int for n in a) for a in args[1:]):
            return None
        from torch._subclasses.fake_tensor import in_kernel_invocation_manager
        with in_kernel_invocation_manager(fake_mode):
            meta = target(*args)
        return FakeTensor(fake_mode, meta, args[0].fake_device)
    if target is aten.cat.default and len(args) == 1 and isinstance(args[0], (list, tuple)) and args[0]:
        tensors = args[0]
        first = tensors[0]
        if not all(plain(t) and t.dim() == 1 and t.dtype == first.dtype and t.fake_device == first.fake_device
                   for t in tensors):
            return None
        return empty_fake(fake_mode, (sum(t.shape[0] for t in tensors),), (1,), first.dtype, first.fake_device)
    return None


def empty_fake(fake_mode: FakeTensorMode, shape, stride, dtype: torch.dtype, device) -> FakeTensor:
    """A new fake tensor of this layout: what ``torch.empty_strided`` under ``fake_mode`` makes, at a tenth of its cost.

    The meta tensor is made by the C++ meta kernel and wrapped, instead of dispatching through the fake mode's
    Python (about 9 against 76 us here); the passes make one for each node they copy. Symbolic sizes go the
    dispatching way.
    """
    if not all(isinstance(n, int) for n in (*shape, *stride)):
        with fake_mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(fake_mode, meta, torch.device(device))


def topological_index(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {node: i for i, node in enumerate(gm.graph.nodes)}


def is_communication(node: fx.Node) -> bool:
    """A collective, its wait, or a marker standing for one: work every rank must do."""
    return node.meta.get(PHASE) == COMMUNICATION or is_collective(node) or is_wait(node)


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    """Remove unused nodes, but never communication.

    A rank that owns no piece of a bucket has no use for the bucket's reduced
    gradient, yet must still take part in the reduce-scatter: dropping it on
    one rank would leave the others waiting (or mismatched) forever.
    """
    # torch's Graph.eliminate_dead_code lints the graph and asks every node whether it is impure; only a node
    # nothing reads can go, so only those are asked (a tenth of the time on a GPT's step)
    graph = gm.graph
    for node in reversed(graph.nodes):
        if not node.users and not node.is_impure() and not is_communication(node):
            graph.erase_node(node)
    read = {node.target for node in graph.nodes if node.op == "get_attr"}
    for name, child in gm.named_children():   # as torch's: subgraphs the graph still reads, cleaned too
        if name in read and isinstance(child, fx.GraphModule):
            child.graph.eliminate_dead_code()
            child.recompile()


def drop_unread_constants(gm: fx.GraphModule) -> None:
    """Delete the tensor constants registered on ``gm`` that no ``get_attr`` node reads any more.

    A replaced optimizer trace (capture's, which ``shard`` re-traces per
    piece, or a discarded per-class trace) leaves its constants behind
    otherwise, held for the step's life.
    """
    read = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for name in [name for name, _ in gm.named_buffers(recurse=False) if name not in read]:
        delattr(gm, name)


def unique_attribute(gm: fx.GraphModule, prefix: str) -> str:
    """A name for a new attribute of ``gm``: ``prefix``, or ``prefix_1``, ``prefix_2``... if taken."""
    name, i = prefix, 0
    while hasattr(gm, name):
        i += 1
        name = f"{prefix}_{i}"
    return name
