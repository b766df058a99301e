"""What a long compile says while it runs (``compile(progress=...)``): a line per phase.

A compile of a large model takes tens of seconds (issue 21: the 705M GPT's first step compiled for about 40 s
on 2 gloo ranks), and a user who sees nothing cannot tell a compile from a hang. By default (``progress=None``)
a compile says nothing for its first ``QUIET_SECONDS``; from then on each phase that ends (the trace, each
pass, the program) prints one line on rank 0's stderr. ``True`` prints every phase from the start, ``False``
nothing; a function gets each line instead, on every rank.
"""
from __future__ import annotations

import sys
import time
from typing import Callable

from .errors import ConfigError

QUIET_SECONDS = 10.0


def check_progress(progress) -> None:
    if progress is not None and not isinstance(progress, bool) and not callable(progress):
        raise ConfigError(f"progress must be None (say what a compile does once it runs {QUIET_SECONDS:.0f} s), "
                          f"True, False or a function taking each line, got {progress!r}")


class CompileProgress:
    """Said as one compile goes: ``progress(line)`` at the end of each phase."""

    def __init__(self, setting: bool | Callable[[str], None] | None, rank: int):
        self.setting, self.rank = setting, rank
        self.started = time.perf_counter()

    def __call__(self, line: str) -> None:
        if self.setting is False:
            return
        elapsed = time.perf_counter() - self.started
        text = f"{line} ({elapsed:.1f} s into the compile)"
        if callable(self.setting) and self.setting is not True:
            self.setting(text)
        elif self.rank == 0 and (self.setting is True or elapsed >= QUIET_SECONDS):
            print(f"[zerocc] {text}", file=sys.stderr, flush=True)
