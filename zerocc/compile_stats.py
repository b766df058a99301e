"""Where a compilation's time goes: seconds per phase, one record per compiled program.

Capture (``zerocc/capture.py``) times its parts (tracing, functionalization,
the optimizer's traces), the pass runner (``zerocc/pipeline.py``) each pass
and its own bookkeeping (the program kept after every pass), the compile
driver (``zerocc/driver.py``) starts each program's record from its
capture's, and the step (``zerocc/api.py``) adds what follows the passes
(the ranks' agreement, code generation, the first program's slots).
``step.compile_stats`` (a ``CompileHistory``: the last ``KEPT_RECORDS``
compiles' records, the earlier ones summed) and ``plan.compile_stats`` hold
the records; ``report()["compile_seconds_by_phase"]`` sums them by phase.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Iterable, Iterator

# The phase names other modules write; the passes are timed under their own names as "pass <name>".
TRACE = "capture: trace"                      # make_fx over forward + backward
FUNCTIONALIZE = "capture: functionalize"      # the replay that removes in-place writes (skipped when none)
OPTIMIZER_TRACE = "capture: optimizer"        # the optimizer's step, traced and spliced in
CAPTURE_REST = "capture: tag and check"       # the rest of capture: tags, refusals, dead code, codegen
SNAPSHOTS = "snapshots"                       # the copy of the program kept after every pass (step.graph(name))
VERIFY = "verify"                             # verify=True's checks after every pass
AGREE = "agree across ranks"                  # every rank compiled the same collectives
CODEGEN = "program"                           # the runtime's program from the final graph
SLOTS = "slots"                               # the first program only: parameters and state moved into buckets
CACHE_FIND = "disk cache: look up"            # the fingerprint, its entry's source files, the ranks' agreement
CACHE_LOAD = "disk cache: load"               # a stored compile read instead of capture and passes
CACHE_STORE = "disk cache: store"             # a compile written for later processes


def pass_phase(name: str) -> str:
    return f"pass {name}"


@dataclasses.dataclass
class CompileStats:
    """Seconds per phase of one compiled program, in the order the phases ran."""
    program: str                                   # "first step", "steady state", "plan"
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - started)

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def table(self) -> str:
        """A markdown table: phase, seconds, share of the total."""
        total = self.total or 1.0
        lines = [f"| {self.program}: phase | s | share |", "|---|---:|---:|"]
        lines += [f"| {phase} | {seconds:.2f} | {seconds / total:.0%} |" for phase, seconds in self.seconds.items()]
        lines.append(f"| total | {self.total:.2f} | 100% |")
        return "\n".join(lines)


# how many compiles' records a step keeps whole: a long run compiling a program per new shape (or per side of a data
# guard) kept a record of about 1 kB per compile for as long as the step lived
KEPT_RECORDS = 64


class CompileHistory:
    """A step's compile records: the last ``KEPT_RECORDS`` whole (iterating and indexing read those, oldest first),
    the seconds per phase of the earlier ones summed (``by_phase`` adds them). ``len`` counts every compile."""

    def __init__(self, kept: int | None = None):
        self._recent: collections.deque[CompileStats] = collections.deque(maxlen=kept or KEPT_RECORDS)
        self._count = 0
        self.dropped_seconds: dict[str, float] = {}   # per phase, over the records no longer kept

    def append(self, record: CompileStats) -> None:
        if len(self._recent) == self._recent.maxlen:
            for phase, seconds in self._recent[0].seconds.items():
                self.dropped_seconds[phase] = self.dropped_seconds.get(phase, 0.0) + seconds
        self._recent.append(record)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[CompileStats]:
        return iter(self._recent)

    def __getitem__(self, index):
        return list(self._recent)[index]

    def __repr__(self) -> str:
        return f"CompileHistory({self._count} compiles, the last {len(self._recent)} kept: {list(self._recent)!r})"


def by_phase(records: Iterable[CompileStats]) -> dict[str, float]:
    """Seconds per phase summed over ``records`` (a ``CompileHistory``'s dropped records too; rounded to
    milliseconds), phases in first-seen order."""
    summed: dict[str, float] = dict(getattr(records, "dropped_seconds", {}))
    for record in records:
        for phase, seconds in record.seconds.items():
            summed[phase] = summed.get(phase, 0.0) + seconds
    return {phase: round(seconds, 3) for phase, seconds in summed.items()}
