"""Trace one block, stamp the rest (issue 21; a prototype, off unless ``ZEROCC_STAMP=1``).

Capture's trace costs ~0.10 CPU s per GPT block, all of it torch's own dispatch (make_fx, fake tensors, node
creation). Most models repeat one block: the 2nd+ call of a structurally identical module (same class, same
parameter and buffer layout, same input metadata, same grad/autocast state, no hooks) computes the same ops on
other tensors. So the first call is traced as always (the *template*), and each later call is traced as one node
(``stamped_block``, emitted by an ``autograd.Function`` whose backward emits ``stamped_block_backward``): two
nodes instead of ~450, made without dispatching an op. After make_fx, ``expand`` replaces each such node by a copy
of the template's node range, its inputs, parameters, buffers (and for backward the incoming gradient and the
copied forward's values) rebound.

Where the template's nodes come from: forward, the nodes make_fx appended during the template's call; backward,
the nodes appended between the moment the gradient of the template's output is complete (a hook on the output)
and the moment the gradient of its input is (a hook on the input): autograd's engine runs a chain of blocks in
reverse creation order, so that range is the block's backward, including the sum of the two gradients of the
block's input (residual and branch). ``expand`` checks that each range reads only the template's own bindings and
refuses (``NotStampable``: capture traces again without stamping) a template that draws random numbers, records
a data guard or Python random draw, or whose ranges reach outside the block.

Copies get fresh fake values (``meta["val"]``) with the template's view structure: zerocc's analyses tell aliases
apart by storage, so a stamped block must not share storages with the template.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot, track_tensor_tree

ENV = "ZEROCC_STAMP"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


class NotStampable(Exception):
    """The template cannot be stamped: capture traces the step again without stamping."""


@dataclass
class _Template:
    fwd: list[fx.Node] = field(default_factory=list)
    x: fx.Node | None = None
    bound: list[fx.Node] = field(default_factory=list)   # parameters then buffers, in named order
    out: fx.Node | None = None
    out_val: Any = None
    grad_out: fx.Node | None = None
    bwd_start: fx.Node | None = None
    bwd: list[fx.Node] = field(default_factory=list)
    grad_x: fx.Node | None = None
    grads: dict[int, fx.Node] = field(default_factory=dict)   # position in ``bound`` -> gradient node
    path: str = ""
    clean: bool = True


LAST: list["Stamper"] = []
_CALLS: dict[int, tuple[_Template, Any, list]] = {}   # index of a stamped call -> its template, x, bound values


def stamped_block(index: int, x: torch.Tensor, bound: list[torch.Tensor]) -> torch.Tensor:
    """The node of a stamped call (``expand`` replaces it by a copy of the template's forward)."""
    raise RuntimeError("a stamped block only exists inside capture's trace")


def stamped_block_backward(index: int, grad: torch.Tensor, x: torch.Tensor, bound: list[torch.Tensor]) -> list:
    """The node of a stamped call's backward (``expand`` replaces it by a copy of the template's backward)."""
    raise RuntimeError("a stamped block only exists inside capture's trace")


def _like(value: torch.Tensor, fake_mode) -> torch.Tensor:
    with _disable_current_modes():   # a meta tensor made under the trace's modes would be a fake op and a node
        meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return FakeTensor(fake_mode, meta, value.device)


def _emit(target, args: tuple, outputs):
    """One node calling ``target`` on ``args``, its value ``outputs``, made without dispatching an op: the op a
    custom operator would be costs as much in torch's dispatch (its autograd wrapper, fake kernel, arguments'
    flattening) as a tenth of the block it stands for."""
    tracer = get_proxy_mode().tracer
    proxy_args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: get_proxy_slot(t, tracer).proxy, args)
    proxy = tracer.create_proxy("call_function", target, proxy_args, {})
    track_tensor_tree(outputs, proxy, constant=None, tracer=tracer)   # sets meta["val"]: detached, as make_fx's
    return outputs


class _Stamped(torch.autograd.Function):
    """A stamped call as autograd sees it: one node forward, one node backward."""

    @staticmethod
    def forward(ctx, index, x, *bound):
        ctx.index = index
        ctx.save_for_backward(x, *bound)
        return _emit(stamped_block, (index, x, list(bound)), _like(_CALLS[index][0].out_val, x.fake_mode))

    @staticmethod
    def backward(ctx, grad):
        x, *bound = ctx.saved_tensors
        # the template's own backward runs after every stamped one (autograd goes in reverse): gradients laid out
        # like their inputs, which ``expand`` checks against what the template's backward made
        grads = _emit(stamped_block_backward, (ctx.index, grad, x, bound), [_like(v, x.fake_mode) for v in (x, *bound)])
        return None, grads[0], *(g if b.requires_grad else None for g, b in zip(grads[1:], bound))


_MODULE_FIELDS = {"_parameters", "_buffers", "_modules", "training", "forward"}
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)


def _attribute(value: Any) -> Any:
    """A plain attribute as it decides the ops (a number, a flag); anything else by identity (a shared function is
    the same code, a tensor of its own per block is another constant)."""
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_attribute(v) for v in value))
    return ("id", id(value))


def _signature(module: nn.Module) -> tuple | None:
    """What makes two modules' calls the same ops: class, tensors' layout, modes, plain attributes (``layer_idx``,
    a per-block flag); None where hooks run."""
    for sub in module.modules():
        if (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
                or "forward" in sub.__dict__):
            return None
    tensors = tuple((name, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, isinstance(t, nn.Parameter))
                    for name, t in (*module.named_parameters(), *module.named_buffers()))
    modes = tuple((name, type(sub), sub.training,
                   tuple(sorted((k, _attribute(v)) for k, v in vars(sub).items()
                                if k not in _MODULE_FIELDS and not k.startswith("_"))))
                  for name, sub in module.named_modules())
    return type(module), tensors, modes


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes(), t.dtype, t.device,
            t.requires_grad)


def _global_hooks() -> bool:
    from torch.nn.modules import module as m
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _tail(graph: fx.Graph) -> fx.Node:
    return graph._root.prev


def _range(graph: fx.Graph, after: fx.Node, last: fx.Node) -> list[fx.Node]:
    nodes, node = [], after.next
    while node is not graph._root and node is not last.next:
        nodes.append(node)
        node = node.next
    return nodes if after is not last else []


def _node_of(value: torch.Tensor, tracer) -> fx.Node:
    return get_proxy_slot(value, tracer).proxy.node


class Stamper:
    """Patches the 2nd+ calls of look-alike blocks inside ``model`` for one trace (``active``), then ``expand``s."""

    def __init__(self, model: nn.Module, watch: Callable[[], Any] = lambda: None, gradient_hooks: bool = False):
        self.watch = watch
        self.groups: dict[int, tuple] = {}   # id(module) -> (signature, path, module)
        self.templates: dict[tuple, _Template] = {}
        self.used = False
        self.tracing = False   # the hooks on the template's tensors outlive the trace: they act only inside it
        self.stamped = 0       # calls replaced by copies in the last trace
        self.refused = ""      # why the last trace was not stamped (traced again whole)
        LAST[:] = [self]       # what the last capture did, for tests and benchmarks
        if _global_hooks() or gradient_hooks:   # a parameter's hook would run in the template's copies and again
            return
        by_signature: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for path, module in model.named_modules():
            if isinstance(module, nn.ModuleList):
                for name, child in module.named_children():
                    signature = _signature(child)
                    if signature is not None:
                        by_signature.setdefault(signature, []).append((f"{path}.{name}" if path else name, child))
        for signature, members in by_signature.items():
            if len(members) > 1:
                for path, child in members:
                    self.groups[id(child)] = (signature, path, child)
        # a group inside a stamped block (heads in a ModuleList of a layer) would be copied unexpanded: outer only
        inner = {id(sub) for _, _, member in self.groups.values() for sub in member.modules() if sub is not member}
        self.groups = {key: value for key, value in self.groups.items() if key not in inner}

    @contextlib.contextmanager
    def active(self):
        _CALLS.clear()
        self.templates = {}
        patched = []
        self.tracing = True
        try:
            for signature, path, module in self.groups.values():
                module.forward = self._forward(module, signature, path, type(module).forward.__get__(module))
                patched.append(module)
            yield self
        finally:
            self.tracing = False
            for module in patched:
                del module.__dict__["forward"]

    def _forward(self, module, signature, path, original):
        def stamped(*args, **kwargs):   # not named forward: make_fx keeps only forward frames in stack traces
            mode = get_proxy_mode()
            if mode is None or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor) \
                    or not args[0].requires_grad or not torch.is_grad_enabled():
                return original(*args, **kwargs)
            x = args[0]
            bound = [t for _, t in (*module.named_parameters(), *module.named_buffers())]
            # views read their offsets from the template's storages: the same layouts, offsets and sizes
            key = (signature, *(_layout(t) for t in (x, *bound)), torch.is_autocast_enabled("cpu"),
                   torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cpu"), torch.get_autocast_dtype("cuda"))
            template = self.templates.get(key)
            if template is None:
                return self._record(key, mode.tracer, original, x, bound, path)
            if not template.clean:
                return original(x)
            index = len(_CALLS)
            _CALLS[index] = (template, x, bound, path)
            self.used = True
            return _Stamped.apply(index, x, *bound)
        return stamped

    def _record(self, key, tracer, original, x, bound, path):
        template = self.templates[key] = _Template(path=path)
        graph = tracer.graph
        before, watched = _tail(graph), self.watch()
        out = original(x)
        template.fwd = _range(graph, before, _tail(graph))
        template.clean = watched == self.watch() and isinstance(out, torch.Tensor) and out.requires_grad
        if not template.clean:
            return out
        template.x = _node_of(x, tracer)
        template.bound = [_node_of(b, tracer) for b in bound]
        template.out = _node_of(out, tracer)
        template.out_val = template.out.meta["val"]

        def output_grad(grad):
            if not self.tracing:
                return
            template.grad_out, template.bwd_start = _node_of(grad, tracer), _tail(graph)

        def input_grad(grad):
            if not self.tracing:
                return
            template.grad_x = _node_of(grad, tracer)
            template.bwd = _range(graph, template.bwd_start, _tail(graph))

        def bound_grad(position):
            def hook(grad):   # the parameters are the next micro-batch's too: only inside the template's backward
                if not self.tracing or template.bwd_start is None or template.bwd or position in template.grads:
                    return
                template.grads[position] = _node_of(grad, tracer)
            return hook

        out.register_hook(output_grad)
        x.register_hook(input_grad)
        for position, value in enumerate(bound):
            if value.requires_grad:
                value.register_hook(bound_grad(position))
        return out

    def expand(self, gm: fx.GraphModule, fake_mode) -> fx.GraphModule:
        """Replace every stamped call's opaque nodes by copies of its template's nodes (``NotStampable`` if unsafe)."""
        if not self.used:
            return gm
        for template in self.templates.values():
            _check(template)
        graph = gm.graph
        forward_env: dict[int, dict] = {}
        with unset_fake_temporarily():
            for node in list(graph.nodes):
                if node.op != "call_function":
                    continue
                if node.target is stamped_block:
                    index = node.args[0]
                    template, _, _, path = _CALLS[index]
                    env = {template.x: node.args[1], **dict(zip(template.bound, node.args[2]))}
                    storages = _bindings(env)
                    storages[_storage(template.out_val)] = node.meta["val"].untyped_storage()
                    with graph.inserting_before(node):
                        _copy(graph, template.fwd, env, storages, fake_mode, template.path, path,
                              {template.out: node.meta["val"]})
                    self._replace(node, env[template.out])
                    forward_env[index] = env
                elif node.target is stamped_block_backward:
                    index, grad, x, bound = node.args
                    template, _, _, path = _CALLS[index]
                    env = {**forward_env[index], template.x: x, **dict(zip(template.bound, bound)), template.grad_out: grad}
                    getitems = {user.args[1]: user for user in node.users}
                    storages = _bindings(env)
                    outputs = {}
                    wanted = [template.grad_x, *(template.grads.get(i) for i in range(len(bound)))]
                    for position, user in getitems.items():
                        if wanted[position] is None:
                            raise NotStampable("a stamped block's input has no gradient in the template")
                        made, like = wanted[position].meta["val"], user.meta["val"]
                        if (made.shape, made.stride(), made.dtype) != (like.shape, like.stride(), like.dtype):
                            raise NotStampable("a gradient of the template is laid out otherwise than its input")
                        storages[_storage(made)] = like.untyped_storage()
                        outputs[wanted[position]] = user.meta["val"]
                    with graph.inserting_before(node):
                        _copy(graph, template.bwd, env, storages, fake_mode, template.path, path, outputs)
                    for position, user in getitems.items():
                        self._replace(user, env[wanted[position]])
                    graph.erase_node(node)
        gm.recompile()
        self.stamped = len(_CALLS)
        return gm


    def _replace(self, old: fx.Node, new: fx.Node) -> None:
        """``old``'s uses read ``new``; a template bound to ``old`` (its input or incoming gradient came from a
        stamped call: the next micro-batch's template is the previous one's) is bound to ``new`` from now on."""
        old.replace_all_uses_with(new)
        old.graph.erase_node(old)
        for template in self.templates.values():
            template.x = new if template.x is old else template.x
            template.grad_out = new if template.grad_out is old else template.grad_out
            template.bound = [new if b is old else b for b in template.bound]


def _check(template: _Template) -> None:
    if not template.clean:
        return
    if template.grad_x is None or template.bwd_start is None:
        raise NotStampable("the template's backward was not seen")
    fwd, bwd = set(template.fwd), set(template.bwd)
    if template.out not in fwd or template.grad_x not in bwd or any(g not in bwd for g in template.grads.values()):
        raise NotStampable("the template's outputs lie outside its ranges")
    for nodes, allowed in ((template.fwd, fwd | {template.x, *template.bound}),
                           (template.bwd, bwd | fwd | {template.x, *template.bound, template.grad_out})):
        for node in nodes:
            target = node.target
            if node.op not in ("call_function", "get_attr"):
                raise NotStampable(f"{node.op} inside the template")
            if _symbolic(node.meta.get("val")):
                raise NotStampable(f"a value of the template has a symbolic size ({node})")
            if _draws(node):
                raise NotStampable(f"the template draws random numbers ({target})")
            for read in node.all_input_nodes:
                if read not in allowed and read.op != "get_attr":
                    raise NotStampable(f"the template reads {read} from outside the block")


def _symbolic(value: Any) -> bool:
    """A size or number read from data (``.item()``): its symbol would be shared by the copies."""
    if isinstance(value, (tuple, list)):
        return any(_symbolic(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))


def _draws(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (attention kernels are tagged so for their dropout: not at p=0)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    names = [argument.name for argument in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    p = node.args[position] if position < len(node.args) else node.kwargs.get("dropout_p", 0.0)
    return p != 0.0


def _storage(value):
    return value.untyped_storage()._cdata if isinstance(value, torch.Tensor) else None


def _bindings(env: dict) -> dict:
    return {_storage(old.meta.get("val")): new.meta.get("val").untyped_storage()
            for old, new in env.items() if isinstance(old.meta.get("val"), torch.Tensor)}


def _fresh(value: Any, storages: dict, fake_mode) -> Any:
    """A fake like ``value`` whose storage is the one its storage maps to (a new one the first time).

    Made from a meta tensor outside the fake mode: a fake op per value (``set_``) would cost as much as the
    trace it replaces."""
    if isinstance(value, (tuple, list)):
        return type(value)(_fresh(v, storages, fake_mode) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    key = value.untyped_storage()._cdata
    storage = storages.get(key)
    if storage is None:
        storage = storages[key] = torch.empty(value.untyped_storage().nbytes(), dtype=torch.uint8,
                                              device="meta").untyped_storage()
    meta = torch.empty(0, dtype=value.dtype, device="meta").set_(storage, value.storage_offset(), value.shape,
                                                                 value.stride())
    return FakeTensor(fake_mode, meta, value.device)


def _copy(graph: fx.Graph, nodes: list[fx.Node], env: dict, storages: dict, fake_mode, old_path: str, new_path: str,
          outputs: dict) -> None:
    for node in nodes:
        new = graph.node_copy(node, lambda n: env.get(n, n))
        val = node.meta.get("val")
        new.meta["val"] = outputs[node] if node in outputs else _fresh(val, storages, fake_mode)
        stack = node.meta.get("nn_module_stack")
        if stack:
            new.meta["nn_module_stack"] = {k: (v[0].replace(old_path, new_path, 1), v[1]) for k, v in stack.items()}
        env[node] = new
