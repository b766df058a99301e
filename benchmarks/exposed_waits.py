"""Time each zerocc system spends blocked in ``wait_tensor`` per step, systems interleaved step by step.

    torchrun --standalone --nproc_per_node 2 benchmarks/exposed_waits.py --systems zerocc-3,zerocc-3-overlap_updates

Builds each system as ``benchmarks/compare.py`` does (same GPT, same data;
``zerocc-3-overlap_updates`` is zerocc-3 with that pass disabled), then runs
its programs under an ``fx.Interpreter`` that times every wait: the time a
rank sits in a wait is communication the schedule did not hide (or the other
rank being behind). Steps alternate between the systems (the order flips
every round) so machine load falls on all of them. Rank 0 prints, per
system, the median step time (slower than compare.py's: the interpreter adds
Python overhead per node), the median total wait per step, and every wait
whose median is at least ``--show-ms``.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (puts zerocc and examples on the path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.fx as fx  # noqa: E402

from zerocc import graph as g  # noqa: E402
from zerocc.runtime.release import releases_slots  # noqa: E402


class TimedWaits(fx.Interpreter):
    """Runs a program node by node, adding up the seconds spent in each wait (keyed by collective and bucket)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.seconds: dict[tuple, float] = {}

    def run_node(self, node):
        started = time.perf_counter()
        result = super().run_node(node)
        if g.is_wait(node):
            key = (g.short_name(node.args[0].target), node.meta.get(g.BUCKET))
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - started
        return result


class TimedProgram:
    """Stands for a program's GraphModule in ``Program.run``: the same calling convention, run by a ``TimedWaits``.

    A releasing program is called as ``gm(arguments, release_slots)``; the
    interpreter takes the arguments one by one and releases nothing early
    (timing, not memory, is measured here).
    """

    def __init__(self, gm: fx.GraphModule):
        self.graph, self.timer = gm.graph, TimedWaits(gm)

    def __call__(self, *arguments):
        if releases_slots(self):
            boxed, _ = arguments
            arguments = tuple(boxed)
            boxed.clear()
        return self.timer.run(*arguments, enable_io_processing=False)

    forward = __call__   # Program.run calls ``gm.forward`` (skipping nn.Module's call machinery)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--systems", default="zerocc-3,zerocc-3-overlap_updates")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--show-ms", type=float, default=2.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    data = [compare.model_batch(generator) for _ in range(args.warmup + args.rounds)]
    names = args.systems.split(",")
    steps, timers = {}, {}
    for name in names:
        if not name.startswith("zerocc"):
            raise SystemExit(f"{name}: only zerocc systems run as one graph whose waits can be timed")
        step = compare.system(name)()
        for i in range(args.warmup):
            step(*data[i])
        timers[name] = []
        for program in [entry.program for entry in step.__self__.cache.programs()]:
            program.gm = TimedProgram(program.gm)     # Program.run calls it as it calls the GraphModule
            timers[name].append(program.gm.timer)
        steps[name] = step
    walls, waits = collections.defaultdict(list), collections.defaultdict(list)
    each = collections.defaultdict(lambda: collections.defaultdict(list))
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            for timer in timers[name]:
                timer.seconds = {}
            dist.barrier()
            started = time.perf_counter()
            steps[name](*data[args.warmup + round_])
            walls[name].append(time.perf_counter() - started)
            found = collections.Counter()
            for timer in timers[name]:
                found.update(timer.seconds)
            waits[name].append(sum(found.values()))
            for key, seconds in found.items():
                each[name][key].append(seconds)
    if rank == 0:
        for name in names:
            shown = {f"{kind} bucket {bucket}": round(statistics.median(v) * 1e3, 1)
                     for (kind, bucket), v in each[name].items() if statistics.median(v) * 1e3 >= args.show_ms}
            print(f"{name}: step {statistics.median(walls[name]) * 1e3:.1f} ms, in waits "
                  f"{statistics.median(waits[name]) * 1e3:.1f} ms per step; waits >= {args.show_ms} ms: {shown}",
                  flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
