"""Run a user's real ``torch.optim`` optimizer over tensors we choose, under tracing.

Capture traces it over whole parameters; the shard pass traces it again over
the pieces of parameters each rank owns. Both go through ``optimizer_update``
so the update in the graph is always the optimizer's own ``step()``, never a
re-implementation.
"""
from __future__ import annotations

import collections
import copy
import numbers
import operator
from typing import Sequence

import torch
import torch.fx as fx

from . import graph as g
from .tracing import record_source_lines_of
from .errors import ConfigError, UnsupportedOptimizerError, user_line_of_node

aten = torch.ops.aten

# Hyper-parameters read from the param groups at every step (as graph inputs),
# so a scheduler changing them needs no recompilation.
LIVE_HYPERPARAMETERS = ("lr",)


def hyperparameter_signature(optimizer: torch.optim.Optimizer) -> tuple:
    """The group settings baked into a traced update; a change means re-capture."""
    signature = []
    for group in optimizer.param_groups:
        items = []
        for key, value in sorted(group.items()):
            if key == "params" or key in LIVE_HYPERPARAMETERS:
                continue
            if isinstance(value, torch.Tensor):
                value = ("tensor", tuple(value.shape), value.flatten().tolist())
            items.append((key, value))
        signature.append(tuple(items))
    return tuple(signature)


def live_hyperparameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This step's learning rates, one float64 scalar tensor per group (exact as Python floats)."""
    values = []
    for index, group in enumerate(optimizer.param_groups):
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.item()
        if not isinstance(lr, numbers.Real):
            raise ConfigError(f"param group {index} has lr={lr!r}; zerocc needs a number")
        values.append(torch.tensor(float(lr), dtype=torch.float64))
    return values


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
    record_source_lines_of(type(optimizer).step)
    shadow = copy.copy(optimizer)
    shadow.state = collections.defaultdict(dict)
    shadow.param_groups = []
    for index, group in enumerate(optimizer.param_groups):
        settings = {key: value for key, value in group.items() if key != "params"}
        settings["params"] = [p for p, owner in zip(params, group_of) if owner == index]
        settings["lr"] = learning_rates[index].item()
        shadow.param_groups.append(settings)
    for param, grad, state in zip(params, grads, states):
        param.grad = grad
        shadow.state[param].update(state)
    name = type(optimizer).__name__
    try:
        with torch.no_grad():
            shadow.step()
    except TypeError as error:
        if "closure" not in str(error):
            raise
        raise UnsupportedOptimizerError(
            f"{name}.step() needs a closure: it re-evaluates the loss itself (as LBFGS does), while zerocc "
            "traces one forward and backward per step.\n  fix: use an optimizer whose step() takes no closure."
        ) from error
    except Exception as error:
        if isinstance(error, UnsupportedOptimizerError):
            raise
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


# Ops an elementwise update may use besides those tagged pointwise.
_ELEMENTWISE_EXTRAS = {
    aten._local_scalar_dense.default, aten.clone.default, aten.copy.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten._to_copy.default, aten.lift_fresh_copy.default, aten.scalar_tensor.default,
    aten.zeros.default, aten.full.default, aten.detach.default, aten.alias.default,
    aten.view_as_real.default, aten.view_as_complex.default,
}


def check_elementwise(nodes: Sequence[fx.Node], optimizer: torch.optim.Optimizer) -> None:
    """Refuse an update that mixes elements of a parameter (a norm, a matmul, a row mean).

    zerocc runs the update on the slice of each parameter a rank owns, which is
    only the same computation if every element is updated on its own.
    """
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
    if offenders:
        by_op: dict[str, list[fx.Node]] = {}
        for node in offenders:
            by_op.setdefault(g.short_name(node.target), []).append(node)
        lines = []
        for op, nodes in by_op.items():
            where = user_line_of_node(nodes[0]) or f"graph node {nodes[0].name}"
            lines.append(f"  - aten.{op}, {len(nodes)} call(s), first at {where}")
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__}.step() is not elementwise per parameter:\n" + "\n".join(lines) + "\n"
            "  why: at stages 1-3 zerocc runs the update on the 1/N slice of each parameter a rank owns, "
            "which computes the same thing only if every element is updated on its own.\n"
            "  fix: use an elementwise optimizer (SGD, Adam, AdamW, Adagrad, RMSprop, ...), or stage=0, "
            "which updates whole parameters."
        )
