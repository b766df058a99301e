"""Pickling a compilation (``fx`` graphs, their fake tensors, the passes' decisions) to disk and back.

``zerocc/disk_cache.py`` stores what a compile made so that a later process
loads it instead of compiling. Python's pickle handles most of it; this
module teaches it the rest:

- an ``fx.Graph`` is pickled as its nodes in order (op, target, name, type,
  arguments, meta), with the arguments' nodes written by name, and rebuilt
  node by node (a node named anywhere else, in meta or a pass's decision,
  is refused);
- an ``fx.GraphModule`` is its constants, graph and meta (torch's own
  pickling regenerates the module from its code and drops the meta), and
  its Python when ``keep_code`` wrote it: loading compiles that instead of
  writing it again (half a second for the 98M GPT's step);
- a fake tensor is its shape, strides, dtype and device, made again under
  the loading process's fake mode; the fake mode itself is that mode;
- an operator (``torch.ops.aten.mm.default``, a higher-order op: ``torch.cond``, ``flex_attention``) is its name;
- the caller's own objects (its optimizer, its modules, the ``torch.Generator``
  objects its modules hold) are written as names and resolved to the loading
  process's objects, never copied; another generator the program draws from
  (a global, the loss function's) is not written: the compile is not cached.

Meta used only while tracing (torch.fx's ``from_node``, ``unbacked_bindings``
and symbolic scalars, zerocc's ``graph.TRACING_META``) is not kept. Anything else pickle cannot write raises
``NotPicklable``: the compile is then not cached, and nothing is lost.
"""
from __future__ import annotations

import dataclasses
import importlib
import io
import pickle
import types
from typing import Any

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import PythonCode

from . import graph as g
from .pipeline import GraphSnapshot, NodeRecord

# meta torch.fx keeps for tracing and provenance, meaningless in another process
_DROPPED_META = ("from_node", "unbacked_bindings", "source_fn_stack", "nn_module_stack", "fwd_source_fn_stack",
                 "fwd_nn_module_stack")


@dataclasses.dataclass(frozen=True)
class HeldTensor:
    """In ``dumps``' ``names``: a tensor the caller holds outside the model (a global, a plain attribute, a frozen
    reference model forward reads but the model does not register, a loss module's class weights), which the
    program reads as a constant. It is not written: a copy would keep this process's values in the entry, and a
    later process (a run resumed with another reference model) would load them. The compile is not cached."""
    where: str


class NotPicklable(Exception):
    """Part of a compilation pickle cannot write (a lambda traced into the graph, a user object in meta)."""


def _is_symbolic(value) -> bool:
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _plain_meta(meta: dict) -> dict:
    kept = {}
    for key, value in meta.items():
        if key in _DROPPED_META:
            continue
        if key == "val" and (_is_symbolic(value) or (isinstance(value, (list, tuple)) and any(map(_is_symbolic, value)))):
            continue
        kept[key] = value
    return kept


def identity(thing) -> int | tuple:
    """What ``dumps``' ``names`` knows a caller's object by: its id(), or for a ``torch.Generator`` the generator
    itself (a traced program holds another Python object for the module's generator)."""
    return ("generator", thing._cdata) if isinstance(thing, torch.Generator) else id(thing)


class _Writer(pickle.Pickler):
    """Pickles a compilation; ``names`` maps the ``identity`` of the caller's objects to the names they load as."""

    def __init__(self, file, names: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names = names
        self._stand_ins: dict[str, _NodeName] = {}
        self._mapped: dict[int, tuple] = {}   # id(args) -> (args, the nodes' names, args with stand-ins)

    def _rows(self, rows) -> list[tuple]:
        """A graph's or a snapshot's rows (node, op, target, name, type, args, kwargs, meta), each node in the
        arguments replaced by a stand-in named as in these rows (a later pass may have renamed a snapshot's node).

        Consecutive snapshots share most nodes' argument tuples (a pass gives a node new ones only when
        it rewrites it): an unchanged tuple maps to the object mapped for an earlier snapshot, which pickle
        then writes as a reference. A rename in between maps it again.
        """
        rows = list(rows)
        names = {row[0]: row[3] for row in rows}

        def stand_in(node: fx.Node) -> _NodeName:
            name = names[node]
            found = self._stand_ins.get(name)
            if found is None:
                found = self._stand_ins[name] = _NodeName(name)
            return found

        def mapped(args):
            if not args:
                return args
            known = self._mapped.get(id(args))
            if known is not None and known[0] is args:
                nodes, before, after = known[1], known[2], known[3]
                if all(names[n] == name for n, name in zip(nodes, before)):
                    return after
            nodes = []
            after = fx.map_arg(args, lambda n: (nodes.append(n), stand_in(n))[1])
            self._mapped[id(args)] = (args, nodes, [names[n] for n in nodes], after)
            return after

        return [(stand_in(node), op, target, name, type_expr, mapped(args), mapped(kwargs), _plain_meta(meta))
                for node, op, target, name, type_expr, args, kwargs, meta in rows]

    # Called for every object but atomic ones (not for ints, strings, tuples, dicts: a persistent_id, called for
    # every object, was most of a dump); what it returns is memoized, so a value shared by snapshots is made once
    def reducer_override(self, obj):
        name = self.names.get(identity(obj))
        if isinstance(name, HeldTensor):   # a copy would stand in for what the loading process holds there
            raise NotPicklable(f"the step reads {name.where}, a tensor outside the model's parameters and buffers, "
                               "as it is at each call")
        if name is not None:
            return _caller_object, (name,)
        if isinstance(obj, FakeTensorMode):
            return _loading_fake_mode, ()
        if isinstance(obj, FakeTensor):
            return _fake, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, str(obj.device), obj.requires_grad)
        if isinstance(obj, OpOverload):
            return _operator, (obj._schema.name, obj._overloadname)
        if isinstance(obj, OpOverloadPacket):
            return _operator, (obj._qualified_op_name, None)
        if isinstance(obj, HigherOrderOperator):   # torch.cond, flex_attention: its instance holds closures (its
            # autograd rule), which pickle cannot write; its subgraphs are the graph's get_attr modules. Node meta
            # (``original_aten``) may hold a copy torch.fx made (``copy.copy``): the registered op stands for it
            if type(getattr(torch.ops.higher_order, obj.name(), None)) is not type(obj):
                raise NotPicklable(f"the higher-order op {obj.name()!r} is not torch.ops.higher_order.{obj.name()}: "
                                   "a loading process could not find it by its name")
            return _higher_order_operator, (obj.name(),)
        if isinstance(obj, types.ModuleType):   # a generated program's globals name torch and pytree
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, fx.GraphModule):
            constants = {n.target: getattr(obj, n.target) for n in obj.graph.nodes if n.op == "get_attr"}
            code = obj.graph.python_code
            code = (code.code.src, code.code.globals, code.code._lineno_map, code.code._prologue_start) \
                if isinstance(code, _StoredCode) else None
            return _graph_module, (constants, obj.graph, _plain_graph_meta(obj.meta), type(obj).__name__, code)
        if isinstance(obj, GraphSnapshot):
            fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
            return _snapshot, ({**fields, "meta": _plain_graph_meta(obj.meta)},)
        if isinstance(obj, fx.Graph):
            return _graph, (obj._codegen, self._rows((n, n.op, n.target, n.name, n.type, n.args, n.kwargs, n.meta)
                                                     for n in obj.nodes))
        if isinstance(obj, NodeRecord):   # a pass's snapshot: its rows as they are, its graph still built on demand
            return _record, (obj.codegen, self._rows(obj.nodes))
        if isinstance(obj, fx.Node):
            raise NotPicklable(f"node {obj.name} is named outside its graph's arguments (in meta or a decision)")
        if isinstance(obj, torch.Generator):   # a copy would draw in place of the caller's generator
            raise NotPicklable("the step draws from a torch.Generator that is no attribute of the model's modules")
        return NotImplemented


class _NodeName:
    """A node in a pickled graph's arguments, by name (resolved when the graph is rebuilt)."""
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return _NodeName, (self.name,)


class _LoadedRecord(NodeRecord):
    """A snapshot's record read from disk: its arguments name stand-ins, not nodes."""

    def __init__(self, codegen, rows: list[tuple]):   # the rows are the record: no graph to read
        self.codegen, self.nodes = codegen, rows

    def build(self) -> fx.Graph:
        return _graph(self.codegen, [(*row[:7], dict(row[7])) for row in self.nodes])   # the record keeps its meta


def _record(codegen, rows: list[tuple]) -> NodeRecord:
    return _LoadedRecord(codegen, rows)


def _operator(name: str, overload: str | None):
    namespace, _, op = name.partition("::")
    packet = getattr(getattr(torch.ops, namespace), op)
    return packet if overload is None else getattr(packet, overload or "default")


def _higher_order_operator(name: str) -> HigherOrderOperator:
    return getattr(torch.ops.higher_order, name)


_loading: list[tuple[FakeTensorMode, dict[str, Any]]] = []   # the load under way: its fake mode, the caller's objects


def _loading_fake_mode() -> FakeTensorMode:
    return _loading[-1][0]


def _caller_object(name: str):
    return _loading[-1][1][name]


def _fake(shape, stride, dtype, device, requires_grad) -> FakeTensor:
    # the constructor, not empty_strided under the mode: a dispatch per value was most of a load
    value = FakeTensor(_loading_fake_mode(), torch.empty_strided(shape, stride, dtype=dtype, device="meta"),
                       torch.device(device))
    return value.requires_grad_(requires_grad) if requires_grad else value


def _graph(codegen, rows: list[tuple]) -> fx.Graph:
    """The graph of ``_Writer._rows``' rows; arguments' stand-ins resolved by name."""
    graph = fx.Graph()
    graph.set_codegen(codegen)
    env: dict[str, fx.Node] = {}

    def resolve(value):
        return env[value.name] if isinstance(value, _NodeName) else value

    for _, op, target, name, type_expr, args, kwargs, meta in rows:
        node = graph.create_node(op, target, name=name, type_expr=type_expr)
        node.args = fx.node.map_aggregate(args, resolve)
        if kwargs:
            node.kwargs = fx.node.map_aggregate(kwargs, resolve)
        node.meta = meta
        env[name] = node
        if node.name != name:
            raise pickle.UnpicklingError(f"node {name} came back as {node.name}")
    return graph


def _plain_graph_meta(meta: dict) -> dict:
    return {key: value for key, value in meta.items() if key not in g.TRACING_META}


def _snapshot(fields: dict) -> GraphSnapshot:
    return GraphSnapshot(**fields)


def _graph_module(constants: dict, graph: fx.Graph, meta: dict, class_name: str, code: tuple | None
                  ) -> fx.GraphModule:
    """The module of a stored graph: its stored Python compiled, or, with none stored (the captured step's graph,
    which a loaded compile never runs), its Python written only if it is run or read (``_LazyGraphModule``):
    writing and compiling the 98M GPT's captured step was a tenth of a warm first step's CPU time."""
    if code is not None:
        graph.python_code = _StoredCode(PythonCode(*code))
        gm = fx.GraphModule(constants, graph, class_name=class_name)
    else:
        gm = _LazyGraphModule(constants, graph, class_name=class_name)
    gm.meta = meta
    return gm


class _StoredCode:
    """A graph's ``python_code``, made once: the module built from the graph compiles it instead of writing it."""

    def __init__(self, code: PythonCode):
        self.code = code

    def __call__(self, root_module: str, *args, **kwargs) -> PythonCode:
        if root_module != "self":
            raise ValueError(f"stored code was written for root_module 'self', not {root_module!r}")
        return self.code


def keep_code(gm: fx.GraphModule) -> None:
    """Write ``gm``'s Python now and keep it with its graph: pickling stores it, and its own first run (its
    code is written lazily, ``pipeline.deferring_codegen``) uses it instead of writing it a second time.
    The graph must not change after this."""
    if not isinstance(gm.graph.python_code, _StoredCode):
        gm.graph.python_code = _StoredCode(gm.graph.python_code(root_module="self"))


def dumps(obj, names: dict) -> bytes:
    """``obj`` pickled; ``names``: the ``identity`` of each caller's object that is written by name instead."""
    buffer = io.BytesIO()
    try:
        _Writer(buffer, names).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError) as error:
        raise NotPicklable(str(error)) from error
    return buffer.getvalue()


def loads(data: bytes, objects: dict[str, Any], fake_mode: FakeTensorMode):
    """What ``dumps`` wrote, with the caller's objects from ``objects`` and fake tensors made in ``fake_mode``."""
    _loading.append((fake_mode, objects))
    try:
        return pickle.loads(data)
    finally:
        _loading.pop()
