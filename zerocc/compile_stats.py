"""Where a compilation's time goes: seconds per phase, one record per compiled program.

Capture (``zerocc/capture.py``) times its parts (tracing, functionalization,
the optimizer's traces), the pass runner (``zerocc/pipeline.py``) each pass
and its own bookkeeping (the program kept after every pass), the compile
driver (``zerocc/driver.py``) starts each program's record from its
capture's, and the step (``zerocc/api.py``) adds what follows the passes
(the ranks' agreement, code generation, the first program's slots).
``step.compile_stats`` (a record per compiled program) and
``plan.compile_stats`` hold the records; ``report()["compile_seconds_by_phase"]``
sums them by phase.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

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


def by_phase(records: list[CompileStats]) -> dict[str, float]:
    """Seconds per phase summed over ``records`` (rounded to milliseconds), phases in first-seen order."""
    summed: dict[str, float] = {}
    for record in records:
        for phase, seconds in record.seconds.items():
            summed[phase] = summed.get(phase, 0.0) + seconds
    return {phase: round(seconds, 3) for phase, seconds in summed.items()}
