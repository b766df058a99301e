"""The calling convention that lets a step free the old parameters and optimizer state as it replaces them.

The step is functional: it reads the old value of every slot and returns
the new one. Called as ``gm(*arguments)``, the argument tuple and the
runtime's slot dict keep every old value alive until the call returns, so
the optimizer phase holds the old and the new state at once. A program
marked by ``passes/release_slots.py`` is generated with ``ReleasingCodeGen``
instead:

    def forward(self, arguments, release_slots):
        bucket0, state_bucket0_piece0_exp_avg, ..., = arguments
        arguments.clear()
        ...                        # forward, backward, every collective and its wait
        release_slots()            # after the node marked graph.RELEASE_POINT
        ...                        # the optimizer's update

Placeholders are locals that fx's code sets to None after their last use,
and the argument list is cleared at once, so after ``release_slots()`` (the
runtime drops its own references to the slots marked ``graph.RELEASED``) an
old value dies at its last use, or at the release point if that comes later:
the lifetimes ``passes/plan_memory.py`` plans.
"""
from __future__ import annotations

import signal
import threading

import torch.fx as fx

from .. import graph as g

RELEASE_CALL = "release_slots"


class ReleasingCodeGen(fx.graph.CodeGen):
    """``forward(self, arguments, release_slots)``: a boxed argument list, cleared on entry, and a release call."""

    def gen_fn_def(self, free_vars, maybe_return_annotation, *, expanded_def: bool = False) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        lines = [f"def {self._func_name}(self, arguments, {RELEASE_CALL}){maybe_return_annotation}:"]
        if names:
            lines += [f"    {', '.join(names)}, = arguments", "    arguments.clear()"]
        return "\n".join(lines)

    def _gen_python_code(self, nodes, *args, **kwargs):
        marked = [i for i, node in enumerate(nodes) if node.meta.get(g.RELEASE_POINT)]
        assert len(marked) == 1, f"a releasing program has one release point, found {len(marked)}"
        previous = self._body_transformer

        def insert_release(body: list[str]) -> list[str]:
            body = _with_release_after(body, marked[0])
            return previous(body) if previous is not None else body
        self._body_transformer = insert_release
        try:
            return super()._gen_python_code(nodes, *args, **kwargs)
        finally:
            self._body_transformer = previous


def _with_release_after(body: list[str], index: int) -> list[str]:
    """``body`` (fx code: a ``# COUNTER: i`` line before node i's code) with the release call after node ``index``."""
    following = f"# COUNTER: {index + 1}\n"
    position = body.index(following)
    # the summary of the next node's source line, if any, stays with that node
    while position > 0 and body[position - 1].lstrip("\n").startswith("#") \
            and not body[position - 1].startswith("# COUNTER"):
        position -= 1
    call = f"{RELEASE_CALL}()  # the old values of the slots the step replaces die at their last use from here on\n"
    return [*body[:position], call, *body[position:]]


def releases_slots(gm: fx.GraphModule) -> bool:
    """Is ``gm`` generated with ``ReleasingCodeGen`` (called as ``gm(arguments, release_slots)``)?"""
    return isinstance(gm.graph._codegen, ReleasingCodeGen)


class HeldInterrupt:
    """Ctrl-C held from a step's release point until the call has its new state (then raised), so that an
    interrupt cannot land between dropping the old parameters and optimizer state and keeping the new.

    Python raises ``KeyboardInterrupt`` between any two bytecodes: in the optimizer's update, after
    ``release_slots()``, it left the step without the slots it had dropped (stage 3: ``KeyError: 'bucket:0'`` at
    the next call; stage 0: the next call traced a first step again and trained on from fresh optimizer state).
    Eager's ``optimizer.step()`` interrupted there leaves a usable model. The hold covers the update only (no
    Ctrl-C is held while forward and backward run) and only where Python's handler can be swapped (the main
    thread, a Python handler)."""

    def __init__(self, let_through: int | None = None):
        self.previous = None
        self.received = None
        self.count = 0
        self.let_through = let_through   # this many interrupts received: the next one is raised at once

    def hold(self) -> None:
        if self.previous is not None or threading.current_thread() is not threading.main_thread():
            return
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            self.previous = handler
            signal.signal(signal.SIGINT, self._receive)

    def _receive(self, signum, frame) -> None:
        self.received, self.count = (signum, frame), self.count + 1
        if self.let_through is not None and self.count > self.let_through:   # the user insists: a hang, say
            self.release(deliver=True)

    def release(self, deliver: bool) -> None:
        """Put the handler back; with ``deliver``, call it on an interrupt received meanwhile (it raises)."""
        previous, self.previous = self.previous, None
        if previous is None:
            return
        signal.signal(signal.SIGINT, previous)
        received, self.received = self.received, None
        if deliver and received is not None:
            previous(*received)
