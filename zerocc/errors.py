"""Every error zerocc raises on purpose.

Messages say what is wrong, where (parameter name, the user's source line),
why, and what to do. Internal invariants use ``assert`` instead.
"""
from __future__ import annotations

import linecache
import os
import traceback

_LIBRARY_DIRS = (
    os.path.dirname(os.path.abspath(__file__)),
    os.path.dirname(os.path.abspath(__import__("torch").__file__)),
)


class ZeroccError(Exception):
    """Base class of every error zerocc raises for bad input."""


class ConfigError(ZeroccError, ValueError):
    """An argument to ``compile`` is out of range or inconsistent."""


class CaptureError(ZeroccError):
    """The training step could not be traced into one graph."""


class UnsupportedOptimizerError(ZeroccError):
    """The optimizer's update is not elementwise per parameter."""


class RecompileWarning(UserWarning):
    """A step compiled more programs (batch shapes) than ``max_programs`` keeps."""


class MemoryBudgetError(ZeroccError):
    """``memory_budget`` cannot be met by recomputing activations; the message says what can."""


class PassError(ZeroccError):
    """A pass of the pipeline failed; the message names it."""


def user_frame(tb) -> str | None:
    """The innermost frame of a traceback that is the user's code, as 'file:line: code'."""
    found = None
    for frame in traceback.extract_tb(tb):
        path = os.path.abspath(frame.filename)
        if path.startswith(_LIBRARY_DIRS) or frame.filename.startswith("<"):
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        found = f"{frame.filename}:{frame.lineno}: {code}"
    return found


def raised_by_user_code(error: BaseException) -> bool:
    """Whether ``error`` was raised by the user's own code (a ``raise`` in a model), not inside a library."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and not (os.path.abspath(frames[-1].filename).startswith(_LIBRARY_DIRS)
                                 or frames[-1].filename.startswith("<"))


def user_line_of_node(node) -> str | None:
    """The user's source line recorded on an FX node's stack trace, if any."""
    stack = node.meta.get("stack_trace")
    if not stack:
        return None
    lines = [line.strip() for line in stack.strip().splitlines()]
    # stack traces read outermost first; 'File "...", line N, in f' then the code line
    best = None
    for i, line in enumerate(lines):
        if line.startswith("File ") and ", line " in line:
            filename = line.split('"')[1]
            path = os.path.abspath(filename)
            if path.startswith(_LIBRARY_DIRS) or filename.startswith("<"):
                continue
            lineno = line.split(", line ")[1].split(",")[0]
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            best = f"{filename}:{lineno}: {code}"
    return best


class CheckpointError(ZeroccError):
    """Reading or writing a checkpoint failed (torch.distributed.checkpoint's own error is its cause)."""
