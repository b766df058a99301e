"""Data guards: Python branches on batch values, decided on the real batch and re-checked every step.

Part of capture (``zerocc/capture.py``). Models validate their inputs with
Python branches on tensor values, e.g. wav2vec2's CTC head::

    if labels.max() >= self.config.vocab_size:
        raise ValueError(...)

Tracing on fake tensors cannot decide such a branch (the value is unknown),
so torch's ShapeEnv raises ``GuardOnDataDependentSymNode``. ``GuardedShapeEnv``
catches that one moment: when every tensor the condition reads is computed
from the batch alone (no parameter, buffer, optimizer state or activation),
it evaluates the condition's own ops on the real batch, lets the trace take
that side, and records a ``DataGuard``: the small graph that recomputes the
condition's scalars from the batch, the condition (a sympy expression over
them), the side taken and the user's source line.

The guard is correct without knowing what the other side does: the program
compiled for one side is only ever run on batches whose guards all hold
(``DataGuard.holds``, a few small ops on the batch before each step, which
read a scalar to the host). When a later batch takes the other side, the
step traces again on that batch: if the other side raises (the validation
case), the trace raises the user's own exception, before any state was
touched, and the program compiled before is kept for the next good batch;
if it does not raise, the new trace is the program for that side, kept
beside the first side's (``ProgramCache``, ``zerocc/program_cache.py``: one
program per side a batch took, for the same shapes). A condition that reads parameters or activations cannot be
decided before the step runs, so it still fails as data-dependent control
flow, naming the user's line.

Values read to the host (``.item()``, ``.tolist()``: ``_local_scalar_dense``,
which ``ZeroccFakeTensorMode`` hands to ``GuardRecorder.read``) of a tensor
computed from the batch alone are read on the real batch: the trace goes on
with Python numbers (Qwen2-VL's ``torch.split(patches, lengths.tolist())``
and its ``itertools.groupby`` over token types), and a ``ValueGuard`` checks
that the tensor read has the same values before each step. A size an op
computes from values (``repeat_interleave``) that a shape needs as a number
(``F.pad`` of it) is decided the same way, as a ``DataGuard`` that the size
is the same. Sizes read from activations (an MoE's routing counts) stay
unbacked symbols: one program serves every routing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import sys
import traceback
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._python_dispatch import _disable_current_modes

from . import graph as g
from .errors import _LIBRARY_DIRS, generated
from .analysis.remat import is_random

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


@dataclasses.dataclass(frozen=True)
class DataGuard:
    """One branch decided on the batch's values: recompute ``condition`` and compare with ``expected``."""
    graph: fx.GraphModule                  # batch tensors -> the scalars the condition reads, one per symbol
    batch_indices: tuple[int, ...]         # which batch entries the graph's placeholders read
    symbols: tuple[tuple[sympy.Symbol, bool], ...]   # (symbol, read from a bool tensor) per graph output
    condition: sympy.Basic
    expected: bool
    where: str                             # the user's source line of the branch (or of the size)
    number: bool = False                   # a size decided as a number (each value its own program), not a branch

    def holds(self, batch: Sequence[Any]) -> bool:
        """Whether ``batch`` takes the branch the program was traced with."""
        with torch.no_grad():
            values = self.graph(*[batch[i] for i in self.batch_indices])
        substitution = {symbol: int(value) if is_bool else value
                        for (symbol, is_bool), value in zip(self.symbols, values)}
        return bool(self.condition.xreplace(substitution)) == self.expected


@dataclasses.dataclass(frozen=True)
class ValueGuard:
    """Values read to the host from the batch alone (``.tolist()``, ``.item()``): recompute them, compare with
    ``expected``."""
    graph: fx.GraphModule                  # batch tensors -> the tensor whose values were read
    batch_indices: tuple[int, ...]
    expected: torch.Tensor                 # its values on the batch the program was traced on
    where: str                             # the user's source line that read them
    needed_at: str = ""                    # where the trace with them as symbols failed: why they were read

    def holds(self, batch: Sequence[Any]) -> bool:
        with torch.no_grad():
            value, = self.graph(*[batch[i] for i in self.batch_indices])
        return value.dtype == self.expected.dtype and torch.equal(value, self.expected)


def all_hold(guards: Sequence[DataGuard], batch: Sequence[Any]) -> bool:
    return all(guard.holds(batch) for guard in guards)


def values_that_differ(guards: Sequence[DataGuard | ValueGuard], batch: Sequence[Any]) -> list[str]:
    """The guards on values read from the batch as numbers (not on a branch's side) that ``batch`` does not meet,
    described by the user's lines: each distinct value of theirs compiles a program of its own."""
    described = []
    for guard in guards:
        if isinstance(guard, ValueGuard) and not guard.holds(batch):
            described.append(f"read at {guard.where}" + (f", needed as a Python number at {guard.needed_at}"
                                                         if guard.needed_at and guard.needed_at != guard.where else ""))
        elif isinstance(guard, DataGuard) and guard.number and not guard.holds(batch):
            described.append(f"a size decided at {guard.where}")
    return list(dict.fromkeys(described))


class GuardRecorder:
    """What one capture needs to decide branches: the real batch, by placeholder position; the guards found."""

    def __init__(self, batch: Sequence[Any], batch_of_position: dict[int, int], read_values: bool = False,
                 needed_at: str = ""):
        self.batch = list(batch)
        self.batch_of_position = batch_of_position   # flat placeholder position -> batch index
        self.guards: list[DataGuard | ValueGuard] = []
        self.read_from: dict[fx.Node, ValueGuard] = {}   # per tensor whose values were read, its guard
        # ``read``: values read from the batch alone become numbers (True), or stay symbols, one program serving
        # every batch (False: first; ``unread_batch_values`` says whether a trace that failed so should read them)
        self.read_values = read_values
        self.unread_batch_values = False
        self.needed_at = needed_at   # the user's line where the trace with them as symbols failed
        self.random_branch = False   # a branch on a random draw (torch.rand([]) < layerdrop) could not be decided

    def decide(self, condition: sympy.Basic) -> bool | int | None:
        """The value of ``condition`` on the real batch, recording its guard; None if it reads more than the batch.

        A branch (a condition) gives True or False and the guard re-checks that side. A number (an unbacked
        size a shape needs as an integer: ``F.pad`` of a length that ``repeat_interleave`` of the batch's values
        decides) gives its value, and the guard re-checks that the number is the same (``Eq(size, value)``).
        """
        tracer = _current_tracer()
        if tracer is None:
            return None
        sources = _symbol_sources(tracer.graph, condition.free_symbols)
        if sources is None:
            return None
        guard_graph, batch_indices = self._graph_over_batch(tracer.root, tracer.graph, list(sources.values()))
        if guard_graph is None or not all(_is_real(self.batch[i]) for i in batch_indices):
            # planning (zerocc/planning.py) traces meta or fake batches: no values to decide on
            taken = _checked_in_the_program(tracer.graph, condition, sources)
            read = g.ancestors([node for node, _ in sources.values()])
            if taken is None and any(is_random(node) for node in read) and not self._reads_state(tracer.graph, read):
                self.random_branch = True   # the error says so: LayerDrop, turned off by its option
            return taken
        values = _run_on_real_values(guard_graph, [self.batch[i] for i in batch_indices])
        symbols = tuple((symbol, read == _BOOL) for symbol, (_, read) in sources.items())
        substitution = {symbol: int(value) if is_bool else value for (symbol, is_bool), value in zip(symbols, values)}
        decided = sympy.sympify(condition.xreplace(substitution))
        if decided in (sympy.true, sympy.false):
            taken, expected, number = bool(decided), bool(decided), False
        elif decided.is_Integer:   # a number: the program is traced for this value of it
            taken, condition, expected, number = int(decided), sympy.Eq(condition, decided), True, True
        else:
            return None
        if batch_indices:   # one read of no batch entry (transformers' packed-sequence check on its own arange) is
            # the same every step: checking it again would cost a host read per step for nothing
            guard = DataGuard(guard_graph, batch_indices, symbols, condition, expected,
                              user_frame_of_stack() or "(no user frame found)", number)
            if not any(_same_guard(guard, known) for known in self.guards):   # the functionalizing replay
                self.guards.append(guard)   # (tracing.trace_functional) meets the same sizes again
        return taken

    def read(self, tensor: torch.Tensor) -> bool | int | float | None:
        """The value ``.item()`` reads of a 0-dim ``tensor`` (``.tolist()`` reads each element so), on the real batch,
        recording a guard that the values read are the same; None if it is computed from more than the batch.

        The trace then goes on with a Python number where it had an unbacked symbol: a size (``torch.split``'s),
        a key (Qwen2-VL's ``itertools.groupby`` over its token types), a count of loop iterations. The guard is on
        the tensor the elements came from (``.tolist()`` unbinds it): one comparison per tensor read, each step.
        Only with ``read_values``: a step is first traced with such values as symbols, so that one program serves
        every batch where it can (split sizes read from the batch), and traced again reading them where that
        trace failed (``capture.trace_step``).
        """
        tracer = _current_tracer()
        slot = get_proxy_slot(tensor, tracer, None) if tracer is not None else None
        if slot is None:
            return None
        node = slot.proxy.node
        graph, batch_indices = self._graph_over_batch(tracer.root, tracer.graph, [(node, _SCALAR)])
        if graph is None or not all(_is_real(self.batch[i]) for i in batch_indices):
            return None   # planning (zerocc/planning.py) traces meta or fake batches: no values to read
        if not self.read_values:
            self.unread_batch_values = self.unread_batch_values or bool(batch_indices)
            return None
        value, = _run_on_real_values(graph, [self.batch[i] for i in batch_indices])
        if not batch_indices:   # computed from constants alone: the same every step, nothing to check
            return value.item()
        source = node
        while (source.target is operator.getitem and isinstance(source.args[0], fx.Node)
               and source.args[0].target is torch.ops.aten.unbind.int):
            source = source.args[0].args[0]   # .tolist(): the tensor it unbinds
        if source not in self.read_from:
            if source is not node:
                graph, batch_indices = self._graph_over_batch(tracer.root, tracer.graph, [(source, _SCALAR)])
            expected, = _run_on_real_values(graph, [self.batch[i] for i in batch_indices])
            guard = ValueGuard(graph, batch_indices, expected.clone(), user_frame_of_stack() or "(no user frame found)",
                               self.needed_at)
            self.read_from[source] = guard
            if not any(isinstance(known, ValueGuard) and _same_values_guard(guard, known) for known in self.guards):
                self.guards.append(guard)   # the functionalizing replay (tracing.trace_functional) reads them again
        return value.item()

    def can_decide_on(self, tensor: torch.Tensor) -> bool:
        """Whether a branch on ``tensor``'s values can be decided: it is computed from the real batch alone."""
        mode = get_proxy_mode()
        slot = get_proxy_slot(tensor, mode.tracer, None) if mode is not None else None
        if slot is None:
            return False
        guard_graph, batch_indices = self._graph_over_batch(mode.tracer.root, mode.tracer.graph,
                                                            [(slot.proxy.node, _SCALAR)])
        return guard_graph is not None and all(_is_real(self.batch[i]) for i in batch_indices)

    def _reads_state(self, graph: fx.Graph, nodes) -> bool:
        """Whether ``nodes`` read a placeholder that is no batch entry (a parameter, buffer or optimizer state): a
        branch on activations, which a random draw among its ancestors (wav2vec2's Gumbel-softmax codebook before
        ``if neg_is_pos.any()``) does not make a LayerDrop."""
        positions = {node: i for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder")}
        return any(node.op == "placeholder" and positions[node] not in self.batch_of_position for node in nodes)

    def _graph_over_batch(self, root, graph: fx.Graph, outputs: list[tuple[fx.Node, Any]]):
        """A copy of the ancestors of ``outputs`` ((node, what is read of it), as ``_symbol_sources`` gives) whose
        placeholders are batch entries, returning the node's value or, for a dimension, its size; (None, ()) if
        any placeholder is not a batch entry."""
        needed = g.ancestors([node for node, _ in outputs])
        positions = {node: i for i, node in enumerate(n for n in graph.nodes if n.op == "placeholder")}
        if any(node.op == "placeholder" and positions[node] not in self.batch_of_position for node in needed):
            return None, ()
        # A random draw (LayerDrop's ``torch.rand([]) < p``) is no check on the batch: re-drawing it in a guard
        # would take the generator's numbers from the step, and the branch changes the computation.
        if any(is_random(node) for node in needed):
            return None, ()
        copy = fx.Graph()
        copied: dict[fx.Node, fx.Node] = {}
        batch_indices = []
        for node in graph.nodes:   # graph order is a topological order
            if node not in needed:
                continue
            if node.op == "placeholder":
                copied[node] = copy.placeholder(node.name)
                batch_indices.append(self.batch_of_position[positions[node]])
            else:
                copied[node] = copy.node_copy(node, lambda n: copied[n])
        copy.output(tuple(_read_in(copy, copied[node], read) for node, read in outputs))
        return fx.GraphModule(root, copy), tuple(batch_indices)


def _read_in(graph: fx.Graph, node: fx.Node, read) -> fx.Node:
    """What a guard reads of ``node`` (``_symbol_sources``' second element), as a node of ``graph``."""
    aten = torch.ops.aten
    if isinstance(read, int):
        return graph.call_function(aten.sym_size.int, (node, read))
    if read == _COUNT:
        return graph.call_function(aten._local_scalar_dense.default, (graph.call_function(aten.sum.default, (node,)),))
    return node


def _run_on_real_values(graph: fx.GraphModule, inputs: list) -> tuple:
    """``graph`` run on real tensors while tracing, from inside an op too (where fake tensor kernels make every op
    dispatch to its meta kernel): its ``forward``, as make_fx traces calls of modules."""
    meta = torch._C._meta_in_tls_dispatch_include()
    torch._C._set_meta_in_tls_dispatch_include(False)
    try:
        with _disable_current_modes(), torch.no_grad():
            return graph.forward(*inputs)
    finally:
        torch._C._set_meta_in_tls_dispatch_include(meta)


def _current_tracer():
    """The tracer make_fx is tracing with, or None. Inside an op (a decomposition's size: ``F.pad``'s
    ``constant_pad_nd``) the proxy mode is off the mode stack, so make_fx's own record of its tracer is read."""
    mode = get_proxy_mode()
    if mode is not None:
        return mode.tracer
    current = getattr(proxy_tensor, "_CURRENT_MAKE_FX_TRACER", None)
    return getattr(current, "fx_tracer", None)


def _is_real(value) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return not isinstance(value, torch.Tensor) or not (is_fake(value) or value.is_meta)


_SCALAR, _BOOL, _COUNT = "scalar", "bool", "count"   # what a guard reads of a node: its value (or bool(tensor)), its
# number of True elements (a boolean mask's); an int is a dimension


def _symbol_sources(graph: fx.Graph, symbols) -> dict[sympy.Symbol, tuple[fx.Node, Any]] | None:
    """Per unbacked symbol, the node that read it from a tensor (``.item()``, ``bool(tensor)``), or the node whose
    output has it as a size (an op whose output size depends on values: ``repeat_interleave``, ``nonzero``), with
    what is read of that node (``_SCALAR``, ``_BOOL``, ``_COUNT`` or the dimension).

    Indexing by a boolean mask (``hidden[~mask]``: ``aten.index.Tensor``, whose kernel counts the mask's True
    elements inside) gives its output a size that the mask alone decides, however the indexed tensor was computed:
    the symbol is read as the mask's count (VideoMAE keeps the patches its batch's ``bool_masked_pos`` leaves
    visible, and transformers' SDPA attention then branches on their number); so is ``masked_select``'s."""
    found: dict[sympy.Symbol, tuple[fx.Node, Any]] = {}
    for node in graph.nodes:
        value = node.meta.get(g.VAL)
        if isinstance(value, torch.Tensor):
            for dim, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node._expr, sympy.Symbol):
                    found.setdefault(size.node._expr, _boolean_mask_of(node, dim) or (node, dim))
            continue
        if not isinstance(value, _SYMBOLIC):
            continue
        expr = value.node._expr   # not the replaced expression: a size decided before is a number there
        if isinstance(expr, sympy.Symbol):
            found.setdefault(expr, (node, _SCALAR))
        elif (isinstance(value, torch.SymBool) and isinstance(expr, sympy.Eq)
              and isinstance(expr.args[0], sympy.Symbol) and expr.args[1] == 1):
            found.setdefault(expr.args[0], (node, _BOOL))   # bool(tensor) reads u as 0/1 and tests u == 1
    if not symbols <= found.keys():
        return None
    return {symbol: found[symbol] for symbol in sorted(symbols, key=str)}


def _boolean_mask_of(node: fx.Node, dim: int) -> tuple[fx.Node, str] | None:
    """``(mask, _COUNT)`` where dimension ``dim`` of ``node`` is the count of one boolean mask's True elements:
    ``x[mask]`` with that mask the only tensor index, at position ``dim``, or ``x.masked_select(mask)`` with a mask
    of ``x``'s shape (SpeechT5's loss selects its spectrogram and its labels by the labels' padding mask)."""
    aten = torch.ops.aten
    if node.target is aten.index.Tensor and len(node.args) >= 2:
        given = [(position, index) for position, index in enumerate(node.args[1]) if index is not None]
        if len(given) != 1 or given[0][0] != dim:
            return None
        mask = given[0][1]
    elif node.target is aten.masked_select.default:
        mask = node.args[1]
        if not (isinstance(mask, fx.Node) and isinstance(node.args[0], fx.Node)
                and _shape_of(node.args[0]) == _shape_of(mask) is not None):
            return None
    else:
        return None
    value = mask.meta.get(g.VAL) if isinstance(mask, fx.Node) else None
    return (mask, _COUNT) if isinstance(value, torch.Tensor) and value.dtype == torch.bool else None


def _shape_of(node: fx.Node) -> tuple[int, ...] | None:
    """``node``'s shape where every size is a number (comparing symbolic ones would itself guard)."""
    value = node.meta.get(g.VAL)
    if not isinstance(value, torch.Tensor) or not all(isinstance(size, int) for size in value.shape):
        return None
    return tuple(value.shape)


def _checked_in_the_program(graph: fx.Graph, condition: sympy.Basic, sources: dict) -> bool | None:
    """A branch on activations that only guards against values a healthy step never has, traced on its usual side
    and checked by the program as an op (``aten._assert_async``), which raises where eager would take the other side,
    as ``_distribution_checks_in_the_program`` does; None for any other branch. Two such branches are known:

    - whether activations are all finite, ``if not torch.isfinite(hidden_states).all(): hidden_states =
      torch.clamp(...)`` (transformers' DETR family, Mask2Former and time-series encoders in training): the finite
      side is taken;
    - ``nn.GaussianNLLLoss``'s ``elif torch.any(var < 0): raise ValueError`` (``F.gaussian_nll_loss``): the side
      with no negative variance is taken, and the program raises where eager raises. Only inside that function: a
      user's own ``if (x < 0).any():`` may take either side in training, and stays refused.
    """
    if len(sources) != 1:
        return None
    (symbol, (node, read)), = sources.items()
    if read != _BOOL or condition != sympy.Eq(symbol, 1) or node.target is not torch.ops.aten._local_scalar_dense.default:
        return None
    reduced = node.args[0]
    if not isinstance(reduced, fx.Node):
        return None
    where = user_frame_of_stack() or "(no user frame found)"
    if reduced.target is torch.ops.aten.all.default and _is_isfinite(reduced.args[0]):
        graph.call_function(torch.ops.aten._assert_async.msg, (reduced, (
            f"non-finite values (inf or nan) in the branch at {where} -- eager takes its other side, which the "
            "program, traced with finite values, does not compute")))
        return True
    if reduced.target is torch.ops.aten.any.default and _is_negative_test(reduced.args[0]) and _inside_gaussian_nll():
        valid = graph.call_function(torch.ops.aten.logical_not.default, (reduced,))
        fake = reduced.meta["val"]
        with _disable_current_modes(), fake.fake_mode:
            valid.meta["val"] = torch.logical_not(fake)
        graph.call_function(torch.ops.aten._assert_async.msg, (valid, (
            f"nn.GaussianNLLLoss's var has negative entries at {where} -- eager raises ValueError('var has negative "
            "entry/entries') there")))
        return False
    return None


def _is_negative_test(node) -> bool:
    """Whether ``node`` is ``x < 0``."""
    return isinstance(node, fx.Node) and node.target is torch.ops.aten.lt.Scalar and node.args[1] == 0


def _inside_gaussian_nll() -> bool:
    """Whether the branch being decided is asked inside ``torch.nn.functional.gaussian_nll_loss``."""
    return any(frame.name == "gaussian_nll_loss" and os.path.normpath(frame.filename).endswith(
        os.path.join("torch", "nn", "functional.py")) for frame in traceback.extract_stack())


def _is_isfinite(node) -> bool:
    """Whether ``node`` is ``torch.isfinite(x)``: the op, or as traced, ``(x == x) * (x.abs() != inf)``."""
    aten = torch.ops.aten
    if not isinstance(node, fx.Node):
        return False
    if node.target is aten.isfinite.default:
        return True
    if node.target is not aten.mul.Tensor or not all(isinstance(a, fx.Node) for a in node.args):
        return False
    same, bounded = node.args
    return (same.target is aten.eq.Tensor and same.args[0] is same.args[1] and bounded.target is aten.ne.Scalar
            and bounded.args[1] == float("inf") and isinstance(bounded.args[0], fx.Node)
            and bounded.args[0].target is aten.abs.default and bounded.args[0].args[0] is same.args[0])


def _same_values_guard(a: ValueGuard, b: ValueGuard) -> bool:
    return (a.batch_indices == b.batch_indices and a.expected.dtype == b.expected.dtype
            and torch.equal(a.expected, b.expected) and a.graph.code == b.graph.code)


def _same_guard(a, b) -> bool:
    if not isinstance(a, DataGuard) or not isinstance(b, DataGuard):
        return False
    return (a.batch_indices, a.symbols, a.condition, a.expected) == (b.batch_indices, b.symbols, b.condition, b.expected
                                                                     ) and a.graph.code == b.graph.code


class GuardedShapeEnv(ShapeEnv):
    """A ShapeEnv that, while a ``GuardRecorder`` is active, decides data-dependent branches on the real batch."""

    recorder: GuardRecorder | None = None

    def _evaluate_expr(self, orig_expr, *args, **kwargs):
        try:
            return super()._evaluate_expr(orig_expr, *args, **kwargs)
        except GuardOnDataDependentSymNode:
            taken = self.recorder.decide(orig_expr) if self.recorder is not None else None
            if taken is None:
                raise
            if isinstance(taken, bool):
                return sympy.true if taken else sympy.false
            if isinstance(orig_expr, sympy.Symbol):   # the program is traced for this size: every later shape
                self._set_replacement(orig_expr, sympy.Integer(taken), "zerocc: decided on the batch")   # of it too
            return sympy.Integer(taken)


@contextlib.contextmanager
def recording(fake_mode, recorder: GuardRecorder):
    """Decide data-dependent branches with ``recorder`` while tracing under ``fake_mode``, transformers' attention
    mask shortcuts among them (``_masks_decided_on_the_batch``)."""
    shape_env = fake_mode.shape_env
    assert isinstance(shape_env, GuardedShapeEnv), "make the fake mode with tracing.make_fake_mode"
    shape_env.recorder = recorder
    try:
        with _masks_decided_on_the_batch(recorder), _tensors_of_values_read(), \
                _distribution_checks_in_the_program(recorder):
            yield recorder
    finally:
        shape_env.recorder = None


@contextlib.contextmanager
def _masks_decided_on_the_batch(recorder: GuardRecorder):
    """transformers' mask helpers take eager's shortcut on a batch value (no causal mask when the attention mask is all
    ones: SDPA's ``is_causal`` instead) unless ``is_tracing(mask)``, which a fake tensor is: the traced step ran the
    masked kernel, which rounds otherwise (in bf16, weights apart within a step). While capture records guards,
    ``transformers.masking_utils`` sees a fake computed from the real batch alone as no trace, so its branch
    becomes a data guard and the program computes what eager computes; a batch on the other side compiles that side.
    """
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "is_tracing", None)
    if original is None:
        yield
        return

    def is_tracing(tensor=None):
        if isinstance(tensor, torch.Tensor) and recorder.can_decide_on(tensor):
            return original()   # torch.compile or torch.jit around the model still count
        return original(tensor)

    masking.is_tracing = is_tracing
    try:
        yield
    finally:
        masking.is_tracing = original


@contextlib.contextmanager
def _tensors_of_values_read():
    """``torch.tensor([t0, t1])`` of 0-dim tensors reads their values in C++, which a fake tensor has none of
    (Qwen2-VL's ``torch.tensor(mrope_position_deltas)``): where each is read on the batch (``GuardRecorder.read``),
    the tensor is made of the values read, in their dtype, as eager makes it. Other data goes to torch as is."""
    original = torch.tensor

    def tensor(data, *args, **kwargs):
        from torch._subclasses.fake_tensor import is_fake
        leaves = data if isinstance(data, (list, tuple)) else ()
        if leaves and all(isinstance(t, torch.Tensor) and is_fake(t) and t.dim() == 0 for t in leaves) \
                and len({t.dtype for t in leaves}) == 1 and not args:
            values = [t.item() for t in leaves]
            if not any(isinstance(v, _SYMBOLIC) for v in values):
                return original(values, **{"dtype": leaves[0].dtype, **kwargs})
        return original(data, *args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


@contextlib.contextmanager
def _distribution_checks_in_the_program(recorder: GuardRecorder):
    """``torch.distributions`` checks its arguments and samples against their constraints (``validate_args``, on by
    default) with ``if not torch._is_all_true(valid): raise ValueError``: a branch on activations (a VAE's scale,
    a policy's logits) that no trace can decide. Where the batch alone does not decide it, the program checks it
    instead, as an op (``aten._assert_async``) that raises when a value breaks the constraint, as eager raises
    there, before the step changes anything; the trace goes on on the valid side."""
    original = torch._is_all_true

    def is_all_true(valid):
        from torch._subclasses.fake_tensor import is_fake
        if not is_fake(valid) or get_proxy_mode() is None or recorder.can_decide_on(valid):
            return original(valid)
        where = user_frame_of_stack() or "(no user frame found)"
        torch._assert_async(valid.all(), f"a torch.distributions argument or sample broke its constraint "
                                         f"(validate_args) at {where}: eager raises ValueError there")
        return True

    torch._is_all_true = is_all_true
    try:
        yield
    finally:
        torch._is_all_true = original


def user_frame_of_stack() -> str | None:
    """The innermost frame of the current stack that is the user's code, as 'file:line: code'."""
    found = None
    for frame in traceback.extract_stack():
        path = os.path.abspath(frame.filename)
        if path.startswith(_LIBRARY_DIRS) or generated(frame.filename):
            continue
        found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found
