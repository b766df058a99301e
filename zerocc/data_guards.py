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
flow, naming the user's line; so does a decided value that ends up in a
tensor's shape (the pipeline plans static shapes only).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from typing import Any, Sequence

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.utils._python_dispatch import _disable_current_modes

from . import graph as g
from .errors import _LIBRARY_DIRS
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
    where: str                             # the user's source line of the branch

    def holds(self, batch: Sequence[Any]) -> bool:
        """Whether ``batch`` takes the branch the program was traced with."""
        with torch.no_grad():
            values = self.graph(*[batch[i] for i in self.batch_indices])
        substitution = {symbol: int(value) if is_bool else value
                        for (symbol, is_bool), value in zip(self.symbols, values)}
        return bool(self.condition.xreplace(substitution)) == self.expected


def all_hold(guards: Sequence[DataGuard], batch: Sequence[Any]) -> bool:
    return all(guard.holds(batch) for guard in guards)


class GuardRecorder:
    """What one capture needs to decide branches: the real batch, by placeholder position; the guards found."""

    def __init__(self, batch: Sequence[Any], batch_of_position: dict[int, int]):
        self.batch = list(batch)
        self.batch_of_position = batch_of_position   # flat placeholder position -> batch index
        self.guards: list[DataGuard] = []

    def decide(self, condition: sympy.Basic) -> bool | None:
        """The value of ``condition`` on the real batch, recording its guard; None if it reads more than the batch."""
        mode = get_proxy_mode()
        if mode is None:
            return None
        graph = mode.tracer.graph
        sources = _symbol_sources(graph, condition.free_symbols)
        if sources is None:
            return None
        guard_graph, batch_indices = self._graph_over_batch(mode.tracer.root, graph, [n for n, _ in sources.values()])
        if guard_graph is None or not all(_is_real(self.batch[i]) for i in batch_indices):
            return None   # planning (zerocc/planning.py) traces meta or fake batches: no values to decide on
        with _disable_current_modes(), torch.no_grad():
            values = guard_graph(*[self.batch[i] for i in batch_indices])
        symbols = tuple((symbol, is_bool) for symbol, (_, is_bool) in sources.items())
        substitution = {symbol: int(value) if is_bool else value for (symbol, is_bool), value in zip(symbols, values)}
        decided = condition.xreplace(substitution)
        if decided not in (sympy.true, sympy.false):
            return None
        taken = bool(decided)
        if batch_indices:   # one read of no batch entry (transformers' packed-sequence check on its own arange) is
            # the same every step: checking it again would cost a host read per step for nothing
            self.guards.append(DataGuard(guard_graph, batch_indices, symbols, condition, taken,
                                         user_frame_of_stack() or "(no user frame found)"))
        return taken

    def can_decide_on(self, tensor: torch.Tensor) -> bool:
        """Whether a branch on ``tensor``'s values can be decided: it is computed from the real batch alone."""
        mode = get_proxy_mode()
        slot = get_proxy_slot(tensor, mode.tracer, None) if mode is not None else None
        if slot is None:
            return False
        guard_graph, batch_indices = self._graph_over_batch(mode.tracer.root, mode.tracer.graph, [slot.proxy.node])
        return guard_graph is not None and all(_is_real(self.batch[i]) for i in batch_indices)

    def _graph_over_batch(self, root, graph: fx.Graph, outputs: list[fx.Node]):
        """A copy of ``outputs``' ancestors whose placeholders are batch entries; (None, ()) if any is not."""
        needed = g.ancestors(outputs)
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
        copy.output(tuple(copied[n] for n in outputs))
        return fx.GraphModule(root, copy), tuple(batch_indices)


def _is_real(value) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return not isinstance(value, torch.Tensor) or not (is_fake(value) or value.is_meta)


def _symbol_sources(graph: fx.Graph, symbols) -> dict[sympy.Symbol, tuple[fx.Node, bool]] | None:
    """Per unbacked symbol, the node that read it from a tensor (``.item()``, ``bool(tensor)``)."""
    found: dict[sympy.Symbol, tuple[fx.Node, bool]] = {}
    for node in graph.nodes:
        value = node.meta.get(g.VAL)
        if not isinstance(value, _SYMBOLIC):
            continue
        expr = value.node.expr
        if isinstance(expr, sympy.Symbol):
            found.setdefault(expr, (node, False))
        elif (isinstance(value, torch.SymBool) and isinstance(expr, sympy.Eq)
              and isinstance(expr.args[0], sympy.Symbol) and expr.args[1] == 1):
            found.setdefault(expr.args[0], (node, True))   # bool(tensor) reads u as 0/1 and tests u == 1
    if not symbols <= found.keys():
        return None
    return {symbol: found[symbol] for symbol in sorted(symbols, key=str)}


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
            return sympy.true if taken else sympy.false


@contextlib.contextmanager
def recording(fake_mode, recorder: GuardRecorder):
    """Decide data-dependent branches with ``recorder`` while tracing under ``fake_mode``, transformers' attention
    mask shortcuts among them (``_masks_decided_on_the_batch``)."""
    shape_env = fake_mode.shape_env
    assert isinstance(shape_env, GuardedShapeEnv), "make the fake mode with tracing.make_fake_mode"
    shape_env.recorder = recorder
    try:
        with _masks_decided_on_the_batch(recorder):
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


def user_frame_of_stack() -> str | None:
    """The innermost frame of the current stack that is the user's code, as 'file:line: code'."""
    found = None
    for frame in traceback.extract_stack():
        path = os.path.abspath(frame.filename)
        if path.startswith(_LIBRARY_DIRS) or frame.filename.startswith("<"):
            continue
        found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found
