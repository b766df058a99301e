"""Every error zerocc raises on purpose.

Messages say what is wrong, where (parameter name, the user's source line),
why, and what to do. Internal invariants use ``assert`` instead.
"""
from __future__ import annotations

import inspect
import linecache
import os
import sys
import traceback

import torch
import torch.fx

from . import graph as g

_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(__import__("torch").__file__)),
)



_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# the frame ``torch.compiler.disable`` puts around zerocc's entry points (``compile``, the step's ``__call__``)
_DISABLE_WRAPPER = os.path.join(_LIBRARY_DIRS[1], "_dynamo", "eval_frame.py")


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` in the caller that names the user's line that called into zerocc
    (``loss = step(x, y)``, ``zerocc.compile(...)``): the frame outside zerocc's outermost one, however deep in
    zerocc the warning is raised and whatever runs between (a ``with`` block's contextlib frames, torch's
    tracing). A fixed count named one frame too far out on some paths, and the first frame outside zerocc was
    contextlib's on others; the frame torch.compiler.disable wraps an entry point in counts as zerocc's."""
    frame, level, outermost = sys._getframe(1), 1, 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE_DIR + os.sep) or (level == outermost + 1 and path == _DISABLE_WRAPPER):
            outermost = level
        frame, level = frame.f_back, level + 1
    return outermost + 1


class ZeroccError(Exception):
    """Base class of every error zerocc raises for bad input."""


class ConfigError(ZeroccError, ValueError):
    """An argument to ``compile`` is out of range or inconsistent."""


class CaptureError(ZeroccError):
    """The training step could not be traced into one graph."""


class UnsupportedOptimizerError(ZeroccError):
    """The optimizer's update is not elementwise per parameter."""


class RecompileWarning(UserWarning):
    """A step compiled more programs (batch shapes) than ``max_programs`` keeps, or compiled again because a
    Python value its forward or loss reads changed."""


class CompileCacheError(ZeroccError):
    """A loaded program's stored graphs (``step.graph(name)``) could not be read from the compile cache."""


class ObservedValueWarning(UserWarning):
    """The step's Python (forward, a hook, the loss function) stored a tensor it computes outside the step."""


class ReplicaWarning(UserWarning):
    """Parameters that differed across the step's ranks were replaced by its first rank's, and the step's own
    collectives run between those ranks: a model split across them (tensor parallelism) trains as replicas."""


class CompileCacheWarning(UserWarning):
    """The compile cache on disk (``zerocc/disk_cache.py``) missed an entry it had for this model, or could not
    read or write one; the step compiles, and loses nothing."""


class MemoryBudgetWarning(UserWarning):
    """A program's first run held more bytes at its peak than ``memory_budget``: tensors whose size the data decides
    (an MoE's tokens per expert) are left out of the plan the budget was met by."""


class MemoryBudgetError(ZeroccError):
    """``memory_budget`` cannot be met by recomputing activations; the message says what can.

    ``budget_bytes`` is the budget asked for, ``smallest_peak_bytes`` the lowest peak the planner
    reaches (the budget to ask for instead): a script sweeping budgets reads them, not the message."""

    def __init__(self, message: str, *, budget_bytes: int | None = None, smallest_peak_bytes: int | None = None):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.smallest_peak_bytes = smallest_peak_bytes


class PassError(ZeroccError):
    """A pass of the pipeline failed; the message names it."""


def defined_at(function) -> str | None:
    """Where ``function`` is defined, as 'file:line': a plain function, a ``functools.partial``'s, a decorated
    function's (``__wrapped__``), or a callable object's ``__call__``; None where Python does not say."""
    function = inspect.unwrap(getattr(function, "func", function))
    call = vars(type(function)).get("__call__") if not hasattr(function, "__code__") else None
    code = getattr(function, "__code__", None) or getattr(call, "__code__", None)
    return None if code is None else f"{code.co_filename}:{code.co_firstlineno}"


def user_frame(tb) -> str | None:
    """The innermost frame of a traceback that is the user's code, as 'file:line: code'."""
    return innermost_frame(traceback.extract_tb(tb), is_users)


def user_frame_here() -> str | None:
    """The innermost frame of the running stack that is the user's code, as 'file:line: code'."""
    return innermost_frame(traceback.extract_stack(), is_users)


def is_users(path: str) -> bool:
    return not (path.startswith(_LIBRARY_DIRS) or generated(path))


# the names Python's interactive shells give the code typed into them: a notebook cell under terminal IPython
# (``<ipython-input-3-1f2e...>``; Jupyter's kernel writes ``/tmp/ipykernel_<pid>/<hash>.py``, a path), the plain REPL,
# IDLE. They are the user's code, though no file holds it (IPython keeps each cell's lines in ``linecache``)
INTERACTIVE_SOURCES = ("<ipython-input-", "<stdin>", "<pyshell#")


def generated(filename: str) -> bool:
    """Whether ``filename`` names code a program generated (``<string>``: exec, dataclasses' methods; fx's
    ``<eval_with_key>``; ``<frozen ...>``), not the user's: a frame there is never the one an error names. A model
    defined in a notebook cell is the user's: its errors named "(no user frame found)" where the same model in a
    file named its line."""
    return filename.startswith("<") and not filename.startswith(INTERACTIVE_SOURCES)


def innermost_frame(frames, wanted) -> str | None:
    """The innermost of ``frames`` whose absolute file path ``wanted`` accepts, as 'file:line: code'."""
    found = None
    for frame in frames:
        if generated(frame.filename) or not wanted(os.path.abspath(frame.filename)):
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        found = f"{frame.filename}:{frame.lineno}: {code}"
    return found


def raised_by_user_code(error: BaseException) -> bool:
    """Whether ``error`` was raised by the user's own code (a ``raise`` in a model), not inside a library."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and not (os.path.abspath(frames[-1].filename).startswith(_LIBRARY_DIRS)
                                 or generated(frames[-1].filename))


def user_line_of_node(node, wanted=None) -> str | None:
    """The user's source line recorded on an FX node's stack trace, if any: the innermost frame outside the
    libraries, or whose absolute file path ``wanted`` accepts (an optimizer's own files, inside torch)."""
    stack = node.meta.get(g.STACK_TRACE)
    if not stack:
        return None
    lines = [line.strip() for line in stack.strip().splitlines()]
    # stack traces read outermost first; 'File "...", line N, in f' then the code line
    best = None
    for i, line in enumerate(lines):
        if line.startswith("File ") and ", line " in line:
            filename = line.split('"')[1]
            path = os.path.abspath(filename)
            if generated(filename) or not (wanted(path) if wanted else not path.startswith(_LIBRARY_DIRS)):
                continue
            lineno = line.split(", line ")[1].split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            best = f"{filename}:{lineno}: {code}"
    return best


class CheckpointError(ZeroccError):
    """Reading or writing a checkpoint failed (torch.distributed.checkpoint's own error is its cause)."""


def failing_node(gm, tb):
    """The node of ``gm`` whose generated line raised, from a traceback through ``gm.forward``; None if not there."""
    code = getattr(type(gm).forward, "__code__", None)
    lineno_map = getattr(gm, "_lineno_map", None)
    if code is None or not lineno_map:
        return None
    found = None
    for frame, lineno in traceback.walk_tb(tb):
        if frame.f_code is code:
            found = lineno_map.get(lineno - code.co_firstlineno)
    if found is None:
        return None
    nodes = list(gm.graph.nodes)
    return nodes[found] if 0 <= found < len(nodes) else None


def without_graph_printout(message: str) -> str:
    """An FX lint error's message without the whole graph printed after it (thousands of lines for a real model)."""
    return message.split("\ngraph():")[0]


def _floating_dtypes(node) -> list:
    """The distinct dtypes of ``node``'s floating tensor arguments (from their fake values), in order."""
    arguments: list = []
    torch.fx.node.map_arg((node.args, node.kwargs), arguments.append)
    dtypes = []
    for argument in arguments:
        value = argument.meta.get(g.VAL)
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point and value.dtype not in dtypes:
            dtypes.append(value.dtype)
    return dtypes


def note_failing_node(error: BaseException, gm, what: str, batch: list) -> None:
    """Add to ``error`` (kept as is, type included) where in the user's code the program raised, and a hint.

    A run-time error inside a compiled program otherwise points at
    ``<eval_with_key>``: generated code the user never wrote.
    """
    node = failing_node(gm, error.__traceback__)
    if node is None:
        return
    where = user_line_of_node(node)
    place = f"at {where} (graph node {node.name})" if where else f"at graph node {node.name} (no line of yours)"
    shapes = ", ".join(f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" if hasattr(value, "shape")
                       else repr(value) for value in batch)
    if isinstance(error, IndexError):
        hint = ("an index out of range at run time comes from the batch's values (a token id >= the embedding's "
                "num_embeddings, a label >= the number of classes): check the data, e.g. ids.max() < vocab size")
    elif "dtype" in str(error) and len(dtypes := _floating_dtypes(node)) > 1:
        hint = (f"the op's floating operands are {' and '.join(str(d).removeprefix('torch.') for d in dtypes)}, as "
                "eager would give them: under compile(param_dtype=...) the parameters are in param_dtype, and a floating "
                "tensor that is not (a batch input under cast_forward_inputs=False, a tensor the model holds or makes "
                "in float32) meets them: cast it in forward (or leave cast_forward_inputs=True for the batch)")
    else:
        hint = "to debug, run the same model code eagerly on this batch"
    error.add_note(f"zerocc: {type(error).__name__} raised by the compiled {what} {place}, on a batch of {shapes}; "
                   f"{hint}")
