"""Compiling under the user's debugging tools: their dispatch modes and global hooks sit out the trace.

Used around compilation (``zerocc/api.py``, ``zerocc/capture.py``,
``zerocc/eval.py``). Users turn on tools that watch every op or every module
call: ``torch.distributed._tools.mem_tracker.MemTracker`` and ``ModTracker``,
profilers and debug modes are ``TorchDispatchMode``s plus hooks registered for
all modules (``nn.modules.module.register_module_forward_hook``) and all
optimizers (``torch.optim.optimizer.register_optimizer_step_post_hook``).
Tracing runs the model and the optimizer on fake tensors, so such a tool
would see fake ops and a second forward, backward and step per compile, and
some refuse that (MemTracker raises on "multiple iterative calls").

So while zerocc traces, the user's dispatch modes are taken off the mode
stack and the global hooks are emptied; all are put back as they were after,
whatever happened. The compiled program then runs under the user's modes
like any other code, so a MemTracker or profiler active around the step sees
its real ops and memory. A global hook is taken to be a tool that observes
(it is registered for every module of every model): a global hook that
changed outputs would be left out of the compiled step.

Hooks registered on the user's own modules (``module.register_forward_hook``,
``register_forward_pre_hook``) stay: they are part of the model's computation
and are traced into the step, so a hook that changes an output trains as in
eager. They run while tracing, on fake tensors, not at every step: a hook
that only observes (logs, keeps activations) sees the trace, not the steps.
Saved-tensor hooks around the call stay too (they are traced into backward);
``saved_tensors_hooks_state`` keys the program on them. Step hooks registered
on the optimizer instance are refused at every call
(``step_state.check_no_optimizer_step_hooks``): the traced update would not run them.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from .errors import defined_at, user_stacklevel

# The registries of hooks that fire for every module or every optimizer, by module and name.
GLOBAL_HOOKS = (
    (module_hooks, "_global_forward_pre_hooks"),
    (module_hooks, "_global_forward_hooks"),
    (module_hooks, "_global_forward_hooks_always_called"),
    (module_hooks, "_global_forward_hooks_with_kwargs"),
    (module_hooks, "_global_backward_pre_hooks"),
    (module_hooks, "_global_backward_hooks"),
    (optimizer_hooks, "_global_optimizer_pre_hooks"),
    (optimizer_hooks, "_global_optimizer_post_hooks"),
)


@contextlib.contextmanager
def suspended_user_tooling():
    """Trace without the user's dispatch modes, global module / optimizer hooks and autograd anomaly detection;
    restore them after."""
    saved = [(registry, dict(registry)) for registry in (getattr(owner, name) for owner, name in GLOBAL_HOOKS)]
    full_backward = module_hooks._global_is_full_backward_hook
    modes = contextlib.nullcontext() if not _get_current_dispatch_mode_stack() else _disable_current_modes()
    anomaly = contextlib.nullcontext()
    if torch.is_anomaly_enabled():
        # its NaN check reads every backward output's values: a fake tensor has none, so the trace failed as
        # data-dependent control flow. The compiled backward is one program autograd does not run: no check there
        _warn_anomaly_once()
        anomaly = torch.autograd.set_detect_anomaly(False)
    try:
        for registry, _ in saved:
            registry.clear()
        with modes, anomaly:
            yield
    finally:
        for registry, hooks in saved:
            registry.clear()
            registry.update(hooks)
        module_hooks._global_is_full_backward_hook = full_backward


@functools.cache
def _warn_anomaly_once() -> None:
    warnings.warn("zerocc: torch.autograd anomaly detection is on; it is off while zerocc traces the step, and the "
                  "compiled backward is one program it does not see into: no NaN check runs inside a compiled step. "
                  "To find the op that makes a NaN, run the model eagerly under detect_anomaly", stacklevel=user_stacklevel())


def saved_tensors_hooks_state() -> tuple:
    """The saved-tensor hooks autograd applies at the call (``torch.autograd.graph.saved_tensors_hooks`` or
    ``save_on_cpu`` around the step), as a key: ``(pack, unpack)`` named by where they are defined, or ().

    A trace runs forward and backward under them, so the program packs and unpacks as they do (a lossy pack, to
    bf16, changes the gradients as in eager): a program is compiled per pair. By their code, not their identity:
    a context entered anew around every step (its functions new closures each time) reuses its program.
    """
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return ()
    return tuple(_defined_at(hook) for hook in hooks)


def _defined_at(function) -> str:
    return f"{defined_at(function) or ''} {getattr(function, '__qualname__', type(function).__qualname__)}"
