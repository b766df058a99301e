"""How long a step takes: its final graph played against a hardware profile (``zerocc/hardware.py``).

A read-only analysis, the cost model the issue 19 planner is to choose by;
what it predicts is compared with measured steps in
``benchmarks/predict.py``. The model, in graph order:

- a compute node takes ``op_overhead_s`` (Python, dispatch, launch) plus
  the longer of its matmul FLOPs at ``matmul_flops_per_s`` (matmuls,
  convolutions, attention: the flop counter's formulas) and the bytes it
  reads and writes at ``memory_bytes_per_s``; views (of arenas too) and
  ``getitem`` cost nothing;
- a collective starts when it is issued and the link is free (collectives
  run one at a time, in issue order), and takes ``link_latency_s`` plus the
  bytes this rank sends or receives over ``link_bytes_per_s``: ring
  algorithms' (N-1)/N of the gathered or scattered bytes, twice that for an
  all-reduce; gloo's all-to-all stand-in for a reduce-scatter sends the
  same, its sends and receives stand-in for an all-gather receives the same;
- a wait holds compute until its collective is done;
- compute runs beside a collective only in part: ``overlap`` is the share
  of a collective's time compute goes on (1 on GPUs, whose copy engines
  and NCCL's kernels leave the compute units alone; on gloo the ranks'
  cores do the sending, and ``zerocc.measure_hardware`` measures it by
  running a matmul loop beside all-gathers); the rest holds compute.

The step's time is when both compute and the link are done. It predicts a
steady step: no compile, no first-touch of memory.
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from .. import graph as g
from .remat import flops_of, is_alias, is_expensive_op


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """What one rank's device and link do per second (``zerocc/hardware.py`` measures one or names one)."""
    name: str
    matmul_flops_per_s: float      # matmuls, convolutions, attention
    memory_bytes_per_s: float      # every other op: bytes read plus bytes written
    op_overhead_s: float           # per op run: Python, dispatch, kernel launch
    link_latency_s: float          # per collective
    link_bytes_per_s: float        # bytes one rank sends (or receives) per second
    overlap: float                 # share of a collective's time compute goes on beside it (GPU: 1; gloo: measured)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A predicted step: its seconds, and what they are made of."""
    seconds: float
    compute_seconds: float         # every compute node's time, end to end
    communication_seconds: float   # every collective's time on the link
    exposed_seconds: float         # of that, what compute waited for or gave up to it
    by_phase: dict[str, float]     # compute seconds per phase (forward, backward, optimizer, ...)
    profile: str
    moved_bytes: float = 0.0       # bytes this rank sends or receives per step, every collective's

    def __str__(self) -> str:
        phases = ", ".join(f"{phase} {seconds * 1e3:.1f}" for phase, seconds in self.by_phase.items())
        return (f"predicted step {self.seconds * 1e3:.1f} ms on {self.profile}: compute {self.compute_seconds * 1e3:.1f} "
                f"ms ({phases}), communication {self.communication_seconds * 1e3:.1f} ms of which "
                f"{self.exposed_seconds * 1e3:.1f} exposed")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def predict(gm: fx.GraphModule, world_size: int, profile: HardwareProfile) -> StepTime:
    """The step's predicted time on ``profile`` (module docstring)."""
    compute = link = compute_total = link_total = exposed = moved = 0.0
    finished: dict[fx.Node, float] = {}
    by_phase: dict[str, float] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if g.is_collective(node):
            start = max(compute, link)
            sent = moved_bytes(node, world_size)
            moved += sent
            took = profile.link_latency_s + sent / profile.link_bytes_per_s
            link = finished[node] = start + took
            link_total += took
            held = (1 - profile.overlap) * took   # the share of the collective compute cannot run beside
            exposed += held
            compute += held
        elif g.is_wait(node):
            done = finished.get(node.args[0], 0.0)
            if done > compute:
                exposed += done - compute
                compute = done
        elif node.target is not operator.getitem and not is_alias(node) and not _views_an_arena(node):
            took = op_seconds(node, profile)
            compute += took
            compute_total += took
            phase = node.meta.get(g.PHASE, "other")
            by_phase[phase] = by_phase.get(phase, 0.0) + took
    return StepTime(max(compute, link), compute_total, link_total, exposed, by_phase, profile.name, moved)


def op_seconds(node: fx.Node, profile: HardwareProfile) -> float:
    """One compute node: overhead plus the longer of its matmul work and its memory traffic."""
    work = flops_of(node) / profile.matmul_flops_per_s if is_expensive_op(node) else 0.0
    written = node.kwargs.get("out")   # with memory pools: a view of an arena, the output itself
    read = [a for a in node.all_input_nodes if a is not written]
    traffic = (sum(_bytes(a) for a in read) + _bytes(node)) / profile.memory_bytes_per_s
    return profile.op_overhead_s + max(work, traffic)


def _views_an_arena(node: fx.Node) -> bool:
    """``runtime.arenas.arena_view`` (memory pools): a view of the arena, no work."""
    return any(i.op == "placeholder" and i.meta.get(g.ROLE) == g.ROLE_ARENA for i in node.all_input_nodes)


def moved_bytes(node: fx.Node, world_size: int) -> float:
    """Bytes one rank sends or receives for the collective ``node`` (ring algorithms)."""
    share = (world_size - 1) / world_size
    if g.is_all_gather(node):
        return share * _bytes(node)
    if g.is_reduce_scatter(node):
        return share * _bytes(node.args[0])
    if g.is_all_reduce(node):
        return 2 * share * _bytes(node)
    return float(_bytes(node))   # broadcast


def _bytes(node: fx.Node) -> int:
    return g.known_bytes(node.meta.get(g.VAL))
