"""The pipeline, top to bottom. Capture produces the graph; each pass rewrites it.

    capture              zerocc/capture.py       whole step -> one functional aten graph, nodes tagged
    shard                passes/shard.py         flat buckets, 1/N per rank; optimizer re-traced on the shards
    mixed_precision      passes/mixed_precision.py   (only with param_dtype/reduce_dtype/loss_scale) casts, loss scaling
    clip_gradients       passes/clip_gradients.py   (only with clip_grad_norm=) global-norm clipping before the update
    place_remat          passes/place_remat.py   under a memory budget: recompute activations in backward
    insert_collectives   passes/insert_collectives.py   all_gather / reduce_scatter / all_reduce + waits
    schedule             passes/schedule.py      issue collectives early, wait late: prefetch and overlap
    overlap_updates      passes/overlap_updates.py   bucket updates in reduction order, before the last reduction's wait
    scatter_by_all_to_all  passes/scatter_by_all_to_all.py  on CPU (gloo): reduce-scatter as all-to-all + sum, half the bytes
    gather_by_send_recv  passes/gather_by_send_recv.py  on CPU (gloo): all-gather as sends + receives into place, no staging copy
    gradients_into_buckets  passes/gradients_into_buckets.py  each gradient's op writes into its bucket (out=): no cat
    release_slots        passes/release_slots.py  old parameters and optimizer state die at their last use, not at the end
    plan_memory          passes/plan_memory.py   lifetimes on the final order -> offsets in pools (graph unchanged)
    place_buffers        passes/place_buffers.py  (memory_pools, on by default) pools become arenas; ops write at their offsets through out=

Every pass is ``(gm, ctx) -> gm`` and writes its decisions onto ``ctx``.
``build_pipeline`` takes ``default_pipeline``, drops the passes the user
disabled (refusing those another pass or the runtime needs) and splices in
the passes registered with ``zerocc.register_pass`` (``zerocc/registry.py``).
The runner keeps the program after every pass so users can read it
(``step.graph(name)``), optionally dumps it to a folder and verifies
invariants after each pass (``zerocc/verify.py``), and re-raises a failure
naming the pass.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import Callable, Sequence

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from . import compile_stats
from . import graph as g
from . import registry
from .compile_stats import CompileStats
from .context import CompileContext
from .device_budget import DeviceBudget
from .errors import ConfigError, MemoryBudgetError, PassError, without_graph_printout
from .runtime.failures import is_collective_failure
from .passes.clip_gradients import clip_gradients
from .passes.gather_by_send_recv import gather_by_send_recv
from .passes.gradients_into_buckets import gradients_into_buckets
from .passes.insert_collectives import insert_collectives
from .passes.overlap_updates import overlap_updates
from .passes.mixed_precision import mixed_precision as cast_for_precision
from .passes.place_remat import place_remat
from .passes.place_buffers import place_buffers
from .passes.plan_memory import plan_memory
from .passes.release_slots import release_slots
from .passes.scatter_by_all_to_all import scatter_by_all_to_all
from .passes.schedule import schedule
from .passes.shard import shard

PassFn = Callable[[fx.GraphModule, CompileContext], fx.GraphModule]

# Passes renamed since: an old name in disable= or register_pass(...) gets an error naming the new one.
# "checkpoint" means saved state (state_dict); recomputing activations is "remat".
RENAMED_PASSES = {"place_checkpoints": "place_remat"}

# The environment variable that turns dumps on without touching the code.
DUMP_DIR_VARIABLE = "ZEROCC_DUMP_DIR"

# The environment variable that sets memory_pools where compile() and plan() are not given it: "1" on, "0" off
# (unset: on).
MEMORY_POOLS_VARIABLE = "ZEROCC_MEMORY_POOLS"


def _raise_pass_error(error: Exception, name: str, before: Sequence["Pass"], verify: bool = False) -> None:
    done = ", ".join(p.name for p in before) or "none"
    # a registered pass that left a broken graph makes a later pass fail: say which ran, and how to catch it there
    users = [p.name for p in before if p.users]
    hint = (f"\n  registered pass(es) {', '.join(map(repr, users))} ran before it: compile with verify=True to "
            "check the graph after every pass" if users and not verify else "")
    raise PassError(f"pass '{name}' failed (passes run before it: capture, {done}): "
                    f"{type(error).__name__}: {_without_graph_printout(str(error))}{hint}") from error


def _without_graph_printout(message: str) -> str:
    """``errors.without_graph_printout``, saying where the graph can be read instead."""
    cut = without_graph_printout(message)
    return message if cut == message else cut + "\n  (the graph printout left out: dump_dir= writes the program " \
                                                "after every pass that ran)"


@dataclasses.dataclass(frozen=True)
class Pass:
    """A named pass, what it needs before it, and why it may not be disabled (empty: it may)."""
    name: str
    run: PassFn
    requires: tuple[str, ...] = ()     # passes that must have run before this one
    essential: str = ""                # why the runtime cannot do without it
    users: bool = False                # registered by the user (register_pass)


# Gathered (or unreduced) bytes a step may have in flight: one 4 MiB bucket ahead. Measured with
# benchmarks/compare.py's GPT on this machine's gloo (README, "Benchmark"): 8 MiB was no faster
# (within noise) and peaked 3.5 MiB higher per rank (91.1 vs 87.6 MiB at stage 3).
DEFAULT_PREFETCH_BYTES = 4 * 1024 * 1024


def default_pipeline(stage: int, *, prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
                     clip: tuple[float, float] | None = None,
                     memory_budget: int | None = None,
                     device_budget: DeviceBudget | None = None,
                     mixed_precision: bool = False,
                     memory_pools: bool = False,
                     hardware=None) -> list[Pass]:
    """The passes for ``stage``, in order. The same list for every stage: the plan differs, not the passes.

    ``clip`` is ``(max_norm, norm_type)`` when ``compile(clip_grad_norm=...)`` asked for clipping;
    ``place_remat`` plans against ``memory_budget`` or, without one, what the device offers (``device_budget``,
    ``zerocc/device_budget.py``; on CPU the default plan's peak), choosing among the plans that fit by
    their step time on ``hardware`` (a ``HardwareProfile``, or a function that measures one when first needed;
    None: ``place_remat.DEFAULT_HARDWARE``);
    ``mixed_precision`` (compile's ``param_dtype``/``reduce_dtype``/``loss_scale``) adds its pass after shard;
    ``memory_pools`` (compile's ``memory_pools``, on by default) adds ``place_buffers`` last.
    """
    clipping = [] if clip is None else [
        Pass("clip_gradients", functools.partial(clip_gradients, max_norm=clip[0], norm_type=clip[1]),
             requires=("shard",), essential="compile(clip_grad_norm=...) asked for clipped gradients")]
    precision = [Pass("mixed_precision", cast_for_precision, requires=("shard",),
                      essential="the captured step computes in param_dtype; the buckets must be cast to it")
                 ] if mixed_precision else []
    pools = [Pass("place_buffers", place_buffers, requires=("plan_memory",),
                  essential="compile(memory_pools=True) asked for arenas (memory_pools=False: none)")] if memory_pools else []
    return [
        Pass("shard", shard, essential="the runtime lays out its tensors by the shard plan"),   # parameters, gradients, optimizer state -> flat per-rank buckets
        *precision,                                                                              # bf16 compute from fp32 master buckets, loss scaling
        *clipping,                                                                               # global-norm clipping between reduction and update
        Pass("place_remat", functools.partial(place_remat, memory_budget=memory_budget, device_budget=device_budget,
                                              memory_pools=memory_pools, hardware=hardware),
             requires=("shard",)),                                                                # spend the budget on speed, recompute to fit it
        Pass("insert_collectives", insert_collectives, requires=("shard",),
             essential="the shard pass's markers cannot run across ranks"),                      # the communication the buckets need
        Pass("schedule", functools.partial(schedule, prefetch_bytes=prefetch_bytes),
             requires=("insert_collectives",)),                                                   # prefetch gathers, overlap reductions
        Pass("overlap_updates", functools.partial(overlap_updates, memory_pools=memory_pools),
             requires=("insert_collectives",)),                                                   # bucket updates while the last reduction is in flight
        Pass("scatter_by_all_to_all", functools.partial(scatter_by_all_to_all, memory_pools=memory_pools),
             requires=("insert_collectives",)),                                                   # gloo: reduce-scatter as all-to-all + sum
        Pass("gather_by_send_recv", functools.partial(gather_by_send_recv, memory_pools=memory_pools),
             requires=("insert_collectives",)),                                                   # gloo: all-gather without a staging copy
        Pass("gradients_into_buckets", functools.partial(gradients_into_buckets, memory_pools=memory_pools),
             requires=("shard",)),                                                                # no copy into the gradient buckets
        Pass("release_slots", release_slots, requires=("shard",)),                               # old state dies at its last use after the last wait
        Pass("plan_memory", functools.partial(plan_memory, placed=not memory_pools),
             requires=("shard",)),                                                                # lifetimes -> offsets in pools; nothing moves nodes after it
        *pools,                                                                                  # outputs into an arena at their offsets
    ]


def build_pipeline(stage: int, disable: Sequence[str] = (), prefetch_bytes: int = DEFAULT_PREFETCH_BYTES,
                   user_passes: Sequence[registry.UserPass] | None = None,
                   clip: tuple[float, float] | None = None,
                   memory_budget: int | None = None,
                   device_budget: DeviceBudget | None = None,
                   mixed_precision: bool = False,
                   memory_pools: bool = False,
                   hardware=None) -> list[Pass]:
    """``default_pipeline(stage)`` with the registered passes spliced in and the ``disable``d ones dropped."""
    passes = default_pipeline(stage, prefetch_bytes=prefetch_bytes, clip=clip, memory_budget=memory_budget,
                              device_budget=device_budget,
                              mixed_precision=mixed_precision, memory_pools=memory_pools, hardware=hardware)
    user_passes = registry.registered() if user_passes is None else list(user_passes)
    every = every_builtin_pass()
    for user in user_passes:
        names = [p.name for p in passes]
        if user.anchor in names:
            position = names.index(user.anchor) + (1 if user.after is not None else 0)
        elif user.anchor in every:
            # an optional pass this compile does not run (mixed_precision without param_dtype, clip_gradients
            # without clip_grad_norm, place_buffers with memory_pools=False): the user's pass goes where it
            # would have run, so that it runs in every compile, as register_pass promises
            here = every.index(user.anchor)
            position = next((i for i, p in enumerate(passes) if not p.users and every.index(p.name) > here),
                            len(passes))
        else:
            raise ConfigError(f"register_pass({user.name!r}): no pass named {user.anchor!r} to go "
                              f"{'after' if user.after is not None else 'before'}; the passes are: "
                              f"{', '.join(['capture', *names])}")
        passes.insert(position, Pass(user.name, user.run, tuple(user.requires), users=True))

    names = [p.name for p in passes]
    renamed = [name for name in disable if name in RENAMED_PASSES]
    if renamed:
        raise ConfigError("cannot disable " + "; ".join(f"{old!r}: the pass was renamed {RENAMED_PASSES[old]!r}"
                                                        for old in renamed)
                          + f"; write disable={tuple(RENAMED_PASSES.get(n, n) for n in disable)!r}")
    if "capture" in disable:   # step.passes lists it first: say why it stays rather than "no such pass"
        raise ConfigError("cannot disable 'capture': it traces the step into the graph every other pass rewrites")
    # place_buffers is absent with pools off (disabling it is how the default turns them off: memory_pools_of)
    unknown = [name for name in disable if name not in names and not (name == "place_buffers" and not memory_pools)]
    if unknown:
        raise ConfigError(f"cannot disable {', '.join(map(repr, unknown))}: no such pass; "
                          f"the passes are: {', '.join(names)}")
    problems = []
    for name in (n for n in disable if n in names):
        dropped = passes[names.index(name)]
        if dropped.essential:
            problems.append(f"  - {name!r} cannot be disabled: {dropped.essential}")
        for other in passes:
            if name in other.requires and other.name not in disable:
                problems.append(f"  - {name!r} is required by {other.name!r} (disable that too, or keep {name!r})")
    if problems:
        raise ConfigError("cannot disable the requested passes:\n" + "\n".join(problems))
    kept = [p for p in passes if p.name not in disable]
    seen = {"capture"}
    for p in kept:
        missing = [r for r in p.requires if r not in seen]
        if missing:
            raise ConfigError(f"pass {p.name!r} requires {', '.join(map(repr, missing))} to run before it; "
                              f"the order is: {', '.join(['capture', *[q.name for q in kept]])}")
        seen.add(p.name)
    return kept


@dataclasses.dataclass
class GraphSnapshot:
    """The program after one pass, printable as Python, with what the pass changed.

    It records the nodes as they are after the pass and builds a graph of
    them, or writes the Python, only when asked: printing a 10k-node graph
    costs seconds, building one a fraction of that, and a compile keeps a
    snapshot after every pass that almost nobody reads.
    """
    index: int
    name: str
    constants: dict[str, torch.Tensor]   # the tensors its get_attr nodes read (shared, not copied)
    meta: dict                           # the graph module's meta after the pass (a shallow copy)
    record: NodeRecord                   # the nodes as the pass left them
    node_counts: collections.Counter
    changes: dict[str, int]
    note: str = ""
    seconds: float = 0.0
    _code: str | None = dataclasses.field(default=None, repr=False)
    _graph: fx.Graph | None = dataclasses.field(default=None, repr=False)

    @property
    def graph(self) -> fx.Graph:
        """The program as a graph of its own, untouched by later passes (built at the first read)."""
        if self._graph is None:
            self._graph = self.record.build()
        return self._graph

    @property
    def graph_module(self) -> fx.GraphModule:
        gm = fx.GraphModule(self.constants, self.graph, class_name="ZeroccStep")
        gm.meta = dict(self.meta)
        return gm

    @property
    def code(self) -> str:
        if self._code is None:
            self._code = self.graph_module.print_readable(print_output=False, include_stride=False,
                                                          include_device=False, colored=False)
        return self._code

    def __str__(self) -> str:
        changed = ", ".join(f"{'+' if v > 0 else ''}{v} {k}" for k, v in sorted(self.changes.items()))
        if self.index == 0:
            changed = "the whole step, traced"
        elif not changed:
            changed = "no node added or removed"
        header = f"# after pass {self.index:02d} '{self.name}': {changed}"
        if self.note:
            header += f"\n# {self.note}"
        return header + "\n" + self.code


class NodeRecord:
    """A graph's nodes as they are now, cheap to take, rebuilt into a graph of their own on demand.

    Each node's fields are kept as they are: a pass that rewrites a node
    gives it new ``args``/``kwargs`` tuples (fx never changes them in
    place) and a node's ``meta`` dict is copied, so what later passes do
    does not reach the record. Arguments still name the live nodes; ``build``
    maps them, by identity, to the new graph's copies (a later rename does
    not matter). Taking a record is a tuple per node; building a graph was
    most of the old per-pass copy, and is paid only for a snapshot someone reads.
    """

    def __init__(self, graph: fx.Graph):
        self.codegen = graph._codegen   # the calling convention (runtime/release.py) goes with the nodes
        # meta.copy(): fx's meta is a plain dict, and copy.copy's dispatch doubled the cost of a record, taken
        # after every pass of every plan place_remat measures
        # _args/_kwargs: the tuples the args/kwargs properties return, read without a Python call each (a record is
        # taken after every pass: 13 of the 98M GPT's ~8,000 nodes a compile)
        self.nodes = [(node, node.op, node.target, node.name, node.type, node._args, node._kwargs, node.meta.copy())
                      for node in graph.nodes]

    def build(self, env: dict[fx.Node, fx.Node] | None = None) -> fx.Graph:
        """The graph; ``env``, when given, is filled with each recorded node's copy (``place_remat`` rewrites
        the copy of a candidate's nodes)."""
        new = fx.Graph()
        new.set_codegen(self.codegen)
        env = {} if env is None else env
        for node, op, target, name, type_expr, args, kwargs, meta in self.nodes:
            # Graph.node_copy, less create_node's scan of the arguments for raw SymInts (a graph's own
            # arguments passed it when they were made)
            copied = new.create_node(op, target, name=name, type_expr=type_expr)
            copied.args = fx.map_arg(args, env.__getitem__)
            if kwargs:
                copied.kwargs = fx.map_arg(kwargs, env.__getitem__)
            copied.meta = meta.copy()
            env[node] = copied
        return new


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """The same nodes and meta (shallow-copied), in a new graph later rewrites do not touch."""
    return NodeRecord(graph).build()


def snapshot(index: int, name: str, gm: fx.GraphModule, before: collections.Counter | None, note: str = "") -> GraphSnapshot:
    counts = g.count_targets(gm)
    changes = {}
    if before is not None:
        for key in set(counts) | set(before):
            delta = counts[key] - before[key]
            if delta:
                changes[key] = delta
    constants = {node.target: getattr(gm, node.target) for node in gm.graph.nodes if node.op == "get_attr"}
    return GraphSnapshot(index, name, constants, dict(gm.meta), NodeRecord(gm.graph), counts, changes, note)


def dump_dir_of(setting: str | os.PathLike | None, rank: int = 0, world_size: int = 1) -> str | None:
    """The dump folder: the ``dump_dir`` setting, else ``$ZEROCC_DUMP_DIR``, else none.

    Across ranks each rank writes into ``rank<r>/`` under it: torchrun gives every rank the same setting, and
    rank-named files in one folder would overwrite each other with no sign of which rank wrote them.
    """
    folder = os.fspath(setting) if setting is not None else os.environ.get(DUMP_DIR_VARIABLE) or None
    if folder and world_size > 1:
        return os.path.join(folder, f"rank{rank}")
    return folder


def memory_pools_of(setting: bool | None, disable: Sequence[str] = ()) -> bool:
    """Whether to place buffers in arenas: the ``memory_pools`` setting, else ``$ZEROCC_MEMORY_POOLS``, else on.

    On by default: the planned peak is then the peak of what runs (one arena plus what lives outside it),
    not a sum of role-segregated pools; ``$ZEROCC_MEMORY_POOLS=0`` turns pools off where not given. By
    default only: ``disable=["plan_memory"]`` or ``["place_buffers"]`` turns them off too (asked for
    explicitly, pools need both passes).
    """
    if setting is None:
        value = os.environ.get(MEMORY_POOLS_VARIABLE, "").strip()
        if value not in ("", "0", "1"):
            raise ConfigError(f"${MEMORY_POOLS_VARIABLE} must be 1 (memory pools on) or 0 (off), got {value!r}")
        if value:
            return value == "1"
        return not any(name in disable for name in ("plan_memory", "place_buffers"))
    if not isinstance(setting, bool):
        raise ConfigError(f"memory_pools must be True or False, got {setting!r}")
    return setting


def run_pipeline(gm: fx.GraphModule, ctx: CompileContext, passes: list[Pass], *, verify: bool = False,
                 dump_dir: str | None = None, progress: Callable[[str], None] | None = None,
                 stats: CompileStats | None = None) -> tuple[fx.GraphModule, list[GraphSnapshot]]:
    """Run ``passes`` over the captured ``gm``; returns the final graph and the program after every pass.

    ``stats`` gets the seconds of each pass, of the snapshots and of the verifier.
    """
    stats = stats if stats is not None else CompileStats("passes")
    phases = collections.Counter(n.meta.get(g.PHASE) for n in gm.graph.nodes if n.op == "call_function")
    note = f"{len(gm.graph.nodes)} nodes: " + ", ".join(f"{phases[p]} {p}" for p in (g.FORWARD, g.BACKWARD, g.OPTIMIZER))
    with stats.timed(compile_stats.SNAPSHOTS):
        history = [snapshot(0, "capture", gm, None, note)]
    gm = deferring_codegen(gm)
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(dump_dir, history[-1])
    for index, step in enumerate(passes, start=1):
        ctx.rest_of_pipeline = LaterPasses(passes[index:], index + 1, passes[:index], verify)
        gm, elapsed = run_pass(step, gm, ctx, passes[: index - 1], verify, stats)
        stats.add(compile_stats.pass_phase(step.name), elapsed)
        with stats.timed(compile_stats.SNAPSHOTS):
            history.append(snapshot(index, step.name, gm, history[-1].node_counts, ctx.notes.get(step.name, "")))
        history[-1].seconds = elapsed
        if progress is not None:
            progress(f"pass {step.name}: {elapsed:.1f} s")
        if dump_dir:
            _dump(dump_dir, history[-1])
        later, ctx.later_run = ctx.later_run, None
        if later is not None and not verify:
            # the pass ran the passes after it on a copy of what it returned, and chose that copy: take their run
            # as this compile's instead of running them again (LaterPasses.recorded)
            gm = later.adopt_into(ctx)
            # their seconds were part of this pass's: counted once, as theirs
            measuring = sum(shot.seconds for shot in later.shots)
            stats.add(compile_stats.pass_phase(step.name), -measuring)
            history[-1].seconds -= measuring
            for shot in later.shots:
                stats.add(compile_stats.pass_phase(shot.name), shot.seconds)
                history.append(shot)
                if progress is not None:
                    progress(f"pass {shot.name}: {shot.seconds:.1f} s (run while {step.name} measured it)")
                if dump_dir:
                    _dump(dump_dir, shot)
            break
    ctx.rest_of_pipeline = None
    if dump_dir:
        write_memory_plan(dump_dir, ctx)
    return gm, history


def run_pass(step: Pass, gm: fx.GraphModule, ctx: CompileContext, before: Sequence[Pass], verify: bool = False,
             stats: CompileStats | None = None) -> tuple[fx.GraphModule, float]:
    """``step`` on ``gm``, checked and its failure named: the graph it returned and its seconds (the check aside).

    One for the runner and for ``LaterPasses`` (the passes a measuring pass runs on a candidate), so that a pass
    is held to the same rules wherever it runs: it returns a graph module, which ``verify=`` checks (the
    seconds into ``stats``' verify phase, where given), and its failure is named after it and the passes
    ``before`` it. Passed on unnamed: the user's budget (``MemoryBudgetError``, whose message says what fits),
    a later pass's failure (``PassError``, named already) and a dead peer met by a pass that agrees across
    ranks (the step reports it: ``RankFailureError``).
    """
    started = time.perf_counter()
    try:
        result = step.run(gm, ctx)
        if not isinstance(result, fx.GraphModule):
            raise TypeError(f"the pass returned {type(result).__name__}, not the torch.fx.GraphModule; "
                            "a pass returns the graph module it was given (or a new one)")
        elapsed = time.perf_counter() - started
        if verify:
            from .verify import verify_graph   # the verifier reads graphs only; imported late as it is optional
            with stats.timed(compile_stats.VERIFY) if stats is not None else contextlib.nullcontext():
                verify_graph(result, ctx)
        return result, elapsed
    except (MemoryBudgetError, PassError):
        raise
    except Exception as error:
        if isinstance(error, (RuntimeError, torch.distributed.DistError)) and is_collective_failure(error):
            raise
        _raise_pass_error(error, step.name, before, verify)


def write_memory_plan(folder: str, ctx) -> None:
    """``memory_plan.json`` in a ``dump_dir``: the memory plan a pass made, if one did."""
    memory_plan = getattr(ctx, "memory_plan", None)
    if memory_plan is not None and hasattr(memory_plan, "to_dict"):
        with open(os.path.join(folder, "memory_plan.json"), "w") as file:
            json.dump(memory_plan.to_dict(), file, indent=1, default=str)


def deferring_codegen(gm: fx.GraphModule) -> fx.GraphModule:
    """The same graph in a module whose ``recompile()`` only marks its Python stale (torch's ``_LazyGraphModule``).

    Every pass calls ``gm.recompile()`` after its rewrite; generating and
    compiling a deep step's Python after each of them was a fifth of the
    7.66B plan's time (benchmarks/compile_time.py), and nothing between
    the passes runs or reads it. The code is made once, when the program
    first runs or someone reads ``gm.code``.
    """
    if isinstance(gm, _LazyGraphModule):
        return gm
    lazy = _LazyGraphModule(gm, gm.graph)
    lazy.meta = gm.meta
    return lazy


class LaterPasses:
    """The passes after the one running, as ``ctx.rest_of_pipeline``: for a pass that measures what they make of
    a candidate rewrite (``place_remat``), on a copy of the graph and a scratch context. The compiler's own list,
    not a copy of part of it: registered passes in, disabled ones out.

    ``later(gm, ctx)`` runs them bare (no snapshots, dumps or checks) and returns the graph. ``recorded(gm,
    ctx)`` runs them taking the program after each as the runner would, and returns a ``LaterRun``: a pass that
    chooses the candidate so measured sets it as ``ctx.later_run``, and the runner takes it as the rest of the
    compile instead of running the same passes again on the same graph (a budgeted compile of the 98M GPT paid
    that run, about a second, on top of its measurements). Not where a registered pass is among them: it may
    read what the scratch context holds only provisionally.
    """

    def __init__(self, passes: Sequence[Pass], first_index: int, before: Sequence[Pass] = (), verify: bool = False):
        self.passes, self.first_index = list(passes), first_index
        self.before, self.verify = list(before), verify   # the passes run before them; check each graph (verify=)

    def __call__(self, gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
        for later in self.passes:
            gm, _ = self._run(later, gm, ctx)
        return gm

    def _run(self, later: Pass, gm: fx.GraphModule, ctx: CompileContext) -> tuple[fx.GraphModule, float]:
        """``run_pass`` of ``later``: checked and named as the runner would (a registered pass leaving a broken
        graph was reported as the measuring pass's own error; one returning None, as the next pass's)."""
        return run_pass(later, gm, ctx, self.before + self.passes[: self.passes.index(later)], self.verify)

    def recorded(self, gm: fx.GraphModule, ctx: CompileContext,
                 over: Callable[[CompileContext], bool] | None = None) -> LaterRun:
        """Run them as ``__call__`` does, keeping the program after each (not where a registered pass is among
        them: a bare run, ``shots`` None). ``over(ctx)``, asked once ``plan_memory`` has run with only
        ``place_buffers`` left, ends the run there when it says the live peak is over what is wanted: a layout in
        arenas only adds fragmentation to it, so the candidate cannot fit (``shots`` None: not to be taken)."""
        if any(later.users for later in self.passes):
            return LaterRun(self(gm, ctx), ctx, None)
        shots: list[GraphSnapshot] = []
        counts = g.count_targets(gm)
        for index, later in enumerate(self.passes, start=self.first_index):
            if (over is not None and later is self.passes[-1] and later.name == "place_buffers" and shots
                    and shots[-1].name == "plan_memory" and over(ctx)):
                return LaterRun(gm, ctx, None, stopped_before="place_buffers")
            gm, elapsed = self._run(later, gm, ctx)
            shots.append(snapshot(index, later.name, gm, counts, ctx.notes.get(later.name, "")))
            shots[-1].seconds, counts = elapsed, shots[-1].node_counts
        return LaterRun(gm, ctx, shots)


@dataclasses.dataclass
class LaterRun:
    """What ``LaterPasses.recorded`` made: the final graph, the scratch context the passes filled in, and the
    program after each pass (None: not recorded, not to be taken)."""
    gm: fx.GraphModule
    ctx: CompileContext
    shots: list[GraphSnapshot] | None
    stopped_before: str | None = None   # the pass the run ended before (``over``), None where it ran them all

    def adopt_into(self, ctx: CompileContext) -> fx.GraphModule:
        """Make ``ctx`` hold what the passes decided on the scratch context; the final graph, its Python deferred.
        The deciding pass's own decisions (on ``ctx`` already: the scratch one held a provisional copy) stay."""
        deciding = {"remat_plan", "rest_of_pipeline", "later_run", "notes"}
        for name, value in vars(self.ctx).items():
            if name not in deciding:
                setattr(ctx, name, value)
        ctx.notes.update(self.ctx.notes)
        return deferring_codegen(self.gm)


def write_dumps(folder: str, history: Sequence[GraphSnapshot]) -> None:
    """Write every snapshot as ``{i:03d}_{pass}.py`` into ``folder``, as a compile with ``dump_dir`` does."""
    os.makedirs(folder, exist_ok=True)
    for shot in history:
        _dump(folder, shot)


def _dump(folder: str, shot: GraphSnapshot) -> None:
    with open(os.path.join(folder, f"{shot.index:03d}_{shot.name}.py"), "w") as file:
        file.write(str(shot) + "\n")


def every_builtin_pass() -> list[str]:
    """The built-in passes in order, the optional ones (mixed_precision, clip_gradients, place_buffers) included."""
    return [p.name for p in default_pipeline(3, clip=(1.0, 2.0), mixed_precision=True, memory_pools=True)]


def register_pass(fn: PassFn, *, after: str | None = None, before: str | None = None, name: str | None = None,
                  requires: Sequence[str] = ()) -> str:
    """Add ``fn``, a ``(graph_module, ctx) -> graph_module`` pass, right after or right before a named pass.

    It runs in every compilation and plan from then on and sees the plans
    decided so far on ``ctx`` (``ctx.shard_plan``, ...). Returns its name
    (``fn.__name__`` unless given); ``zerocc.unregister_pass(name)`` removes it.
    Anchored at an optional pass a compile does not run (``mixed_precision``,
    ``clip_gradients``, ``place_buffers``), it runs where that pass would.
    """
    if (after is None) == (before is None):
        raise ConfigError("register_pass needs exactly one of after=... or before=... (the name of a pass)")
    if not callable(fn):
        raise ConfigError(f"register_pass needs a callable (graph_module, ctx) -> graph_module, got {type(fn).__name__}")
    name = name or getattr(fn, "__name__", "user_pass")
    valid = every_builtin_pass() + [p.name for p in registry.registered()]
    anchor = after if after is not None else before
    for old in (anchor, *requires):
        if old in RENAMED_PASSES:
            raise ConfigError(f"register_pass({name!r}): the pass {old!r} was renamed {RENAMED_PASSES[old]!r}; "
                              f"name it {RENAMED_PASSES[old]!r}")
    if anchor not in valid:
        raise ConfigError(f"register_pass({name!r}): no pass named {anchor!r}; the passes are: {', '.join(valid)}")
    if name in valid or name == "capture":
        raise ConfigError(f"register_pass: a pass named {name!r} exists already; give another name=...")
    unknown = [r for r in requires if r not in valid and r != "capture"]
    if unknown:
        raise ConfigError(f"register_pass({name!r}): requires unknown pass(es) {', '.join(map(repr, unknown))}; "
                          f"the passes are: {', '.join(valid)}")
    registry.add(registry.UserPass(name, fn, after, before, tuple(requires)))
    return name


def unregister_pass(name: str) -> None:
    """Remove a pass added with ``register_pass``."""
    if not registry.remove(name):
        names = [p.name for p in registry.registered()]
        raise ConfigError(f"no registered pass named {name!r}; registered: {', '.join(names) or 'none'}")
