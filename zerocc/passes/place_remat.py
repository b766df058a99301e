"""place_remat: under a memory budget, the fastest plan that fits: forward gathers kept, forward values recomputed.

Requires: ``shard`` (parameters are views of buckets behind ``ops.unshard``
markers, not yet lowered to gathers). Runs before ``insert_collectives``.
Establishes: ``ctx.remat_plan`` (a ``decisions.RematPlan``, which
``schedule`` reads), and a graph whose step peaks at most ``memory_budget``
bytes once the later passes have run, the fastest such by the cost model.
Without a budget it does nothing.

The graph is the joint step, so remat (recomputation) is a rewrite: a forward value
that backward reads is either kept (it lives from forward into backward) or
recomputed: the forward nodes that produce it are copied into backward just
before its first backward use, backward reads the copies, and the forward
value dies at its last forward use. Copies are tagged ``PHASE`` backward and
``RECOMPUTED``; at stage 3 a copy that reads a parameter reads a view of the
bucket like any backward node, so ``insert_collectives`` re-derives it from
the backward gather: the forward gather is not kept alive by a recomputation.

What may be recomputed, and the candidate plans, come from
``zerocc/analysis/remat.py``: split-node min-cuts by bytes over the
forward->backward boundary, random ops, collectives, markers and mutating ops
uncuttable-through, swept over the price of recomputing (cheap ops first,
then matmuls and attention by FLOPs saved per byte). Plans are ordered from
least to most recomputation.

How it chooses: every candidate is *measured*, the rewrite applied to a
copy, then the passes after this one in the pipeline being built (which the
runner hands over as ``ctx.rest_of_pipeline``: registered passes in, disabled
ones out; no pass is imported here), giving the final memory plan's peak (the
live peak, or with memory pools the pooled layout's; the bytes a cut counts
are only a proxy; a candidate recomputing something whose live peak is already over the budget is not laid
out in arenas, which could only add fragmentation: its peak is the live one) and the final graph's step time by
the cost model
(``zerocc/analysis/step_time.py``) on ``hardware``: this machine's measured
profile for a compile, a named one for ``zerocc.plan``. Peaks and times are
the highest over ranks, so every rank decides alike. Of the candidates that
fit, the one predicted fastest is taken, or of those within 2% of it the one
moving the fewest bytes (``RematPlan.considered`` lists every one measured).
The candidates, at stage 3 across ranks, where backward gathers again what
forward gathered:

  1. every forward gather kept for backward, nothing recomputed
     (``RematPlan.unbounded_schedule``: the budget, not ``prefetch_bytes``,
     bounds the schedule; backward gathers nothing): the fastest plan; when
     it fits, it is the only plan measured;
  2. every forward gather kept, paid for by recomputing cheap ops only
     (element-wise ops, norms: no matmul, convolution or attention), the
     least such recomputation that fits. A bucket gathered once instead of
     twice saves a transfer of the whole bucket; the cheap copies reread
     activations already in memory. Measured on benchmarks/compare.py's
     GPT at a budget of FSDP2's peak: 14 instead of 19 collectives, 38.4
     instead of 53.4 MiB moved, +0.1% of forward's FLOPs, the same peak;
  3. nothing recomputed, the schedule's default, and more of forward's
     gathers kept than ``prefetch_bytes`` allows
     (``RematPlan.keep_extra_bytes``): a ladder of one bucket more at each
     step, in the order backward gathers them, searched for the most that
     fit where the line through the measured peaks crosses the budget
     (``_most_that_fits``);
  4. the default schedule with the least recomputation that fits, by
     binary search (at world size 1 or stages 0-2, the only family).

A family is searched only when one of its plans could still be chosen: its
plans are no faster than its floor, measured first (every gather kept, or
the default schedule, with nothing recomputed: recomputation only adds work)
and move no fewer bytes, so a family is skipped when a plan with its floor's
time and bytes would not be chosen over the plans already found.
When no plan fits, ``MemoryBudgetError`` says the smallest peak measured
and what it is made of (model states against activations); across ranks the
driver then compiles again with buckets and ``prefetch_bytes`` half as
large, while that floor falls (``driver.run_passes``): gathered and gradient
buckets are part of it.

Without ``memory_budget``, the budget is what the device offers
(``device_budget``, ``zerocc/device_budget.py``). A device is usually roomy beside the plan, so nothing is
measured first: at stage 3 across ranks the schedule is unbounded (every
forward gather kept for backward, as in candidate 1) and nothing is recomputed;
the driver checks the final plan's peak against the device and, when it
does not fit, compiles again with the device's bytes as ``memory_budget``
(candidates 1-4). A device budget costs an ordinary compile when the fastest plan
fits, and the measured search only where the default plan would not.

On CPU the budget is the default plan's peak (``device_budget.DEFAULT_PLAN_PEAK``,
bytes None), known only once measured: at stage 3 across ranks the default
schedule is measured first and its peak (the highest over ranks) becomes the
budget. Every default compile pays for what is measured after it, so only the
plan of candidates 1-2 predicted to fit with the least recomputation is
(``_search_at_default_peak``: its live peak predicted from the step as this
pass sees it, not measured), and one more where that prediction was wrong;
the two measured are compared as under any budget (``_choose``). Candidates 3
and 4 are not tried (nothing is to be recomputed on the default schedule, whose
peak is the budget). Elsewhere (one rank, stages 0-2) the default plan is the
fastest and nothing is measured. The compile takes the recorded run of the plan
it chooses, so the cost is one run of the later passes where a plan keeping every
gather is measured, and the default plan's copy and analyses where none is
(docs/guide/memory-budget.md).
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
from typing import Callable

import torch.fx as fx

from .. import graph as g
from .. import ops
from ..analysis.remat import Recomputation, forward_region, is_alias, is_backward
from ..analysis.step_time import HardwareProfile, predict
from ..context import CompileContext
from ..errors import MemoryBudgetError, user_line_of_node
from ..hardware import named_profile
from ..analysis.lifetimes import memory_plan_of
from ..memory_plan import POOL_OF_ROLE
from ..decisions import ConsideredPlan, RecomputedTensor, RematPlan
from ..device_budget import DeviceBudget


def place_remat(gm: fx.GraphModule, ctx: CompileContext, *, memory_budget: int | None,
                device_budget: DeviceBudget | None = None, memory_pools: bool = False,
                hardware: HardwareProfile | Callable[[], HardwareProfile] | None = None) -> fx.GraphModule:
    """Among the plans that fit the budget, the one the cost model predicts fastest (module docstring)."""
    at_default_peak = memory_budget is None and device_budget is not None and device_budget.bytes is None
    if at_default_peak and not _gathers_in_backward(ctx):
        # one rank or stages 0-2: nothing is gathered twice, recomputation only adds work: the default plan
        ctx.notes["place_remat"] = (f"budget: the default plan's peak ({device_budget.source}); nothing gathered "
                                    "in backward, so the default plan is the fastest: every forward value kept")
        return gm
    if memory_budget is None and device_budget is not None and not at_default_peak and _gathers_in_backward(ctx):
        # the fastest plan, unmeasured: the driver checks the final peak against the device (module docstring)
        ctx.remat_plan = RematPlan(
            budget_bytes=device_budget.bytes, peak_before_bytes=0, peak_bytes=0, recomputed=(), saved_bytes=0,
            extra_flops=0, forward_flops=0, candidates=0, evaluations=0, unbounded_schedule=True,
            budget_source=device_budget.source)
        ctx.notes["place_remat"] = (f"device budget {megabytes(device_budget.bytes)} ({device_budget.source}): "
                                    "schedule unbounded, every forward gather kept for backward; nothing recomputed")
        return gm
    if memory_budget is None and not at_default_peak:
        ctx.notes["place_remat"] = "no memory budget: every forward value backward reads is kept" + (
            f" (device budget {megabytes(device_budget.bytes)}: the final plan is checked against it)"
            if device_budget is not None else "")
        return gm
    multi = _gathers_in_backward(ctx)
    if callable(hardware):
        # Without gathers in backward (one rank, stages 0-2) one family is searched and at most one of its plans
        # fits: the choice does not depend on time, so a profile still to be measured is not (the named one predicts)
        hardware = hardware() if multi else None
    profile = hardware or named_profile(DEFAULT_HARDWARE)
    analysis = Recomputation(gm)
    peaks: dict[tuple[frozenset | None, int], _Peak] = {}
    runs: dict[tuple[frozenset | None, int], object] = {}   # the later passes' recorded run of each plan that fits
    considered: dict[tuple[frozenset | None, int], ConsideredPlan] = {}   # in the order measured

    def peak_of(recompute: frozenset | None, keep: int = DEFAULT, laid_out: bool = False,
                live_when_over: bool = False) -> _Peak:
        """The step's peak and predicted time (the highest over ranks) with ``recompute`` recomputed (None:
        nothing) and forward's gathers kept for backward as ``keep`` says (DEFAULT, EVERY, or extra bytes).
        ``laid_out``: the pooled layout's peak even where the live peak is over the budget (``_measure``);
        ``live_when_over``: not even for a plan recomputing nothing (at the default plan's peak)."""
        recompute = recompute or None
        # plans recomputing nothing are laid out whatever their live peak: they bound the searches (could_fit, the
        # keep ladder's line), and the arenas' fragmentation differs most between schedules (the 5M GPT's plan
        # keeping every gather: 79.2 MB live, 102.7 MB laid out)
        laid_out = laid_out or (recompute is None and not live_when_over)
        if (recompute, keep) in peaks and laid_out and not peaks[recompute, keep].laid_out:
            del peaks[recompute, keep]
        if (recompute, keep) not in peaks:
            measured, run = _measure(gm, ctx, recompute, memory_pools, keep, profile,
                                     None if laid_out else memory_budget)
            peak = _highest_over_ranks(measured, ctx)
            peaks[recompute, keep] = peak
            if peak.bytes <= memory_budget and run is not None:
                runs[recompute, keep] = run
            considered[recompute, keep] = ConsideredPlan(_keep_name(keep), len(recompute or ()), peak.bytes,
                                                         peak.seconds, peak.moved_bytes, peak.bytes <= memory_budget)
        return peaks[recompute, keep]

    fitting: list[tuple[float, float, frozenset, int]] = []   # (predicted seconds, bytes moved, recompute, keep)

    def consider(recompute: frozenset | None, keep: int) -> None:
        peak = peak_of(recompute, keep)
        if peak.bytes <= memory_budget:
            fitting.append((peak.seconds, peak.moved_bytes, recompute or frozenset(), keep))

    def could_win(floor: _Peak) -> bool:
        """Whether a plan as fast as ``floor`` and moving its bytes would be chosen over the plans found: a
        family's plans are no faster than its floor and move no fewer bytes, so a family whose floor could not
        win is not searched (the most favourable plan a family could hold, tried against ``_choose``)."""
        probe = (floor.seconds, floor.moved_bytes, None, None)
        return _choose([*fitting, probe]) is probe

    def could_fit(base: _Peak, family: list, i: int) -> bool:
        """Whether ``family[i]`` recomputed on top of the plan measured as ``base`` could fit, unmeasured:
        recomputing a value lowers the peak by at most its bytes (its copies live in backward too), so a plan
        saving less than the excess over the budget cannot fit, and the searches below probe it for free. Not
        used when the family's last plan could not fit either: the budget is likely out of reach, and the
        refusal names the smallest peak measured, which the search then measures as before."""
        return base.bytes - saved(family[-1]) > memory_budget or base.bytes - saved(family[i]) <= memory_budget

    def settled(family: list, keep: int, base: _Peak) -> Callable[[int, int], bool]:
        """For the search of ``family``: whether the plans between ``family[below]``, found not to fit (-1:
        ``base``), and ``family[first]``, which fits, are left unmeasured. They recompute more than the one
        below, so none is predicted faster than it; when the one that fits is within ``NEAR`` of it, ``_choose``
        would not prefer any of them (they move the same bytes), and measuring them would not change the choice."""
        def done(below: int, first: int) -> bool:
            low = base if below < 0 else peaks.get(((family[below] or None), keep))
            high = peaks.get(((family[first] or None), keep))
            return low is not None and high is not None and high.seconds <= low.seconds * (1 + NEAR)
        return done

    kept: dict[frozenset, int] = {}

    def saved(recompute: frozenset | None) -> int:
        """Bytes of forward values backward no longer reads once ``recompute`` is recomputed."""
        for plan in (frozenset(), recompute or frozenset()):
            if plan not in kept:
                kept[plan] = analysis.kept_bytes(plan)
        return kept[frozenset()] - kept[recompute or frozenset()]

    plans: list[frozenset] = []
    if at_default_peak:
        # the default plan's peak is the budget (CPU, device_budget.DEFAULT_PLAN_PEAK): the default plan measured
        # first, the highest over ranks; the compile takes its run of the later passes when it is chosen
        memory_budget = UNBOUNDED   # while the default plan is measured: it fits its own peak
        before = peak_of(None)
        memory_budget = before.bytes
        consider(None, DEFAULT)
        _search_at_default_peak(gm, ctx, analysis, before, memory_budget, peak_of, consider, saved)
    elif multi:
        # 1. every forward gather kept, nothing recomputed: the fastest plan there is; when it fits, nothing
        # else is measured
        consider(None, EVERY)
    if not at_default_peak:
        before = peaks[None, EVERY] if fitting else peak_of(None)
    if not fitting:
        consider(None, DEFAULT)
        # Each family below is searched only when one of its plans could still be chosen (could_win): its plans
        # are no faster than its floor, the schedule every gather kept or the default one, recomputing nothing.
        if multi and could_win(peak_of(None, EVERY)):
            # 2. every gather kept, paid for by recomputing cheap ops only (no matmul, convolution, attention)
            # (skipped unmeasured when even the most it can stop keeping would not bring the peak to the budget:
            # recomputing a value lowers the peak by at most its bytes, as the copies live in backward too)
            plans = analysis.plans()
            cheap = [None, *(plan for plan in plans if not any(analysis.is_expensive(n) for n in plan))]
            most_saved = max(saved(plan) for plan in cheap)
            if peak_of(None, EVERY).bytes - most_saved <= memory_budget:
                every = peak_of(None, EVERY)
                first = _first_fitting(len(cheap), lambda i: could_fit(every, cheap, i) and
                                       peak_of(cheap[i], EVERY).bytes <= memory_budget,
                                       settled(cheap, EVERY, every))
                if first is not None:
                    consider(cheap[first], EVERY)
        if multi and before.bytes <= memory_budget and could_win(peak_of(None, EVERY)):
            # 3. more of forward's gathers kept than prefetch_bytes allows, nothing recomputed: the most that fit
            ladder = _keep_ladder(gm)
            every = peak_of(None, EVERY)
            most = _most_that_fits(ladder, lambda keep: peak_of(None, keep).bytes, (0, before.bytes),
                                   (_gathered_bytes(gm), every.bytes), memory_budget)
            if most is not None:
                consider(None, ladder[most])
        if before.bytes > memory_budget and could_win(before):
            # 4. the default schedule, the least recomputation that fits
            plans = plans or analysis.plans()
            first = _first_fitting(len(plans), lambda i: could_fit(before, plans, i) and
                                   peak_of(plans[i]).bytes <= memory_budget, settled(plans, DEFAULT, before))
            if first is not None:
                consider(plans[first], DEFAULT)
    if not fitting:
        # refusing: the smallest peak it names is measured on plans the budget does not choose, nothing recomputed
        # and family 4's samples from least to most recomputation, each laid out, so every impossible budget names
        # the same peak. It used to be the least over whatever the budget's search had measured, some of them live
        # peaks only (not laid out, over the budget), then laid out: a T5 named 1.40 MB at one budget, 1.33 at
        # another, and 1.33 MB fit. A sampled plan that fits (the searches' bound skipped it) is taken
        plans = plans or analysis.plans()
        floor = [None, *(plans[i] for i in _spread(len(plans) - 1))] if plans else [None]
        smallest = min(floor, key=lambda plan: peak_of(plan, laid_out=True).bytes)
        consider(smallest, DEFAULT)
        if not fitting:
            _refuse(memory_budget, before, peak_of(smallest, laid_out=True), len(analysis.candidates), len(floor))
    seconds, _, recompute, keep = _choose(fitting)
    peak = peaks[recompute or None, keep]
    clones: dict[fx.Node, fx.Node] = {}
    if recompute:
        clones = _recompute(gm, recompute)
        g.eliminate_dead_code(gm)
        gm.graph.lint()
        gm.recompile()
    # the passes after this one ran on a copy of this very graph when the plan was measured: the runner takes that run
    ctx.later_run = runs.get((recompute or None, keep))
    cloned = sorted(clones, key=analysis.position.get)
    recomputed = tuple(RecomputedTensor(node.name, g.short_name(node.target),
                                        analysis.bytes_of(node) if node in analysis.read_by_backward
                                        and not is_alias(node) else 0,
                                        analysis.flops(node), user_line_of_node(node) or "") for node in cloned)
    ctx.remat_plan = RematPlan(
        budget_bytes=memory_budget, budget_source=device_budget.source if at_default_peak else "memory_budget",
        peak_before_bytes=before.bytes, peak_bytes=peak.bytes, recomputed=recomputed,
        saved_bytes=saved(recompute),
        extra_flops=sum(r.flops for r in recomputed), forward_flops=analysis.forward_flops,
        candidates=len(analysis.candidates), evaluations=len(peaks), unbounded_schedule=keep == EVERY,
        keep_extra_bytes=max(keep, 0), predicted_seconds=seconds, hardware=profile.name,
        considered=tuple(considered.values()))
    ctx.notes["place_remat"] = (f"{sum(1 for r in recomputed if r.bytes)} of {len(analysis.candidates)} stored "
                                f"tensors recomputed ({len(recomputed)} nodes copied into backward), "
                                f"{_keep_name(keep)} schedule: peak {megabytes(before.bytes)} -> "
                                f"{megabytes(peak.bytes)}, budget {megabytes(memory_budget)}, predicted step "
                                f"{seconds * 1e3:.1f} ms; {len(peaks)} plans measured")
    return gm


# How forward's gathers are kept for backward, in a candidate plan: as prefetch_bytes allows (the schedule's
# default), every one (the schedule unbounded), or a number of bytes more than prefetch_bytes allows.
DEFAULT, EVERY = 0, -1
# the profile plans are compared on where none is given (zerocc.plan of hardware that is not here)
DEFAULT_HARDWARE = "h100-sxm-bf16"
# plans predicted within this share of the fastest count as fast as it (_choose)
NEAR = 0.02
# with the default plan's peak as the budget (CPU), at most this many plans keeping every gather are measured besides
# the default plan: the one predicted to fit, and the next where its own live peak corrected the prediction
AT_DEFAULT_PEAK_PLANS = 2
UNBOUNDED = 2 ** 62
# at most this many steps in the ladder of bytes kept (each step a measurement in the binary search)
LADDER_STEPS = 16


def _search_at_default_peak(gm: fx.GraphModule, ctx: CompileContext, analysis: Recomputation, default: _Peak,
                            budget: int, peak_of, consider, saved) -> None:
    """Under the default plan's peak (measured as ``default``), a plan keeping every forward gather for backward
    (module docstring). Every default compile pays for what is measured here, so at most one plan is, unless its
    prediction was wrong: the one predicted to fit with the least recomputation, every gather kept and cheap
    ops recomputed (family 2), measured through the later passes and taken by the compile when chosen.

    The prediction is not measured: a plan keeping every gather peaks where backward starts, where each value it
    recomputes is no longer alive, so its live peak is the unbounded schedule's less the bytes it saves (exact on
    the 5M GPT), and the unbounded schedule's live peak is the step's as this pass sees it (the shard pass's
    gathers each read in forward and backward: what that schedule keeps; 108.13 MB on the 5M GPT, as measured
    through the later passes, in 0.02 s instead of 0.2). The arenas' layout adds about what it added to the
    default plan. A plan that does not fit corrects the prediction with its own live peak, and the next is
    measured (``AT_DEFAULT_PEAK_PLANS`` in all); then the default plan, its run kept. Nothing is searched where
    the persistent state and every gathered bucket, alive at once where backward starts, are over the budget
    (the 98M GPT: 980 MB, budget 817 MB), nor where no cheap plan is predicted to fit."""
    persistent = sum(nbytes for role, nbytes in default.by_role if role in ("parameters", "optimizer state", "inputs"))
    # every rank must measure the same plans (the later passes exchange with the other ranks) while each predicts
    # from its own numbers (its optimizer pieces, its shard sizes): the floor, then each plan's predicted live
    # peak, the highest over ranks; ranks whose plans do not line up search nothing, together
    floor = persistent + _gathered_bytes(gm)
    if max(ctx.from_every_rank(floor)) > budget:
        return
    plans = [frozenset(), *analysis.plans(cheap_only=True)]
    live = max(memory_plan_of(gm, placed=False).live_peak_bytes, floor + analysis.kept_bytes(frozenset()))
    every = ctx.from_every_rank([live - saved(plan) for plan in plans])
    if len({len(predicted) for predicted in every}) != 1:
        return
    predicted = [max(values) for values in zip(*every)]
    layout, last = max(default.bytes - default.live_bytes, 0), -1
    for _ in range(AT_DEFAULT_PEAK_PLANS):
        index = next((i for i in range(last + 1, len(plans)) if predicted[i] + layout <= budget), None)
        if index is None:
            return
        peak = peak_of(plans[index] or None, EVERY, live_when_over=True)   # the highest over ranks: the same on each
        if peak.bytes <= budget:
            consider(plans[index] or None, EVERY)
            return
        # the prediction corrected by the plan's measured live peak, for the plans after it
        under = max(peak.live_bytes - predicted[index], 0)
        last, predicted = index, [value + under for value in predicted]
        if peak.laid_out:
            layout = max(layout, peak.bytes - peak.live_bytes)


def _choose(fitting: list[tuple[float, float, frozenset, int]]) -> tuple[float, float, frozenset, int]:
    """The plan predicted fastest; of those within ``NEAR`` of it, the one moving the fewest bytes (then the
    fastest): the model's error is larger than that (``benchmarks/predict.py``), mostly in how much of a
    collective compute hides on a shared CPU, and a collective not issued costs nothing however it overlaps."""
    fastest = min(seconds for seconds, *_ in fitting)
    near = [plan for plan in fitting if plan[0] <= fastest * (1 + NEAR)]
    return min(near, key=lambda plan: (plan[1], plan[0]))


def _keep_name(keep: int) -> str:
    if keep in (DEFAULT, EVERY):
        return "default" if keep == DEFAULT else "unbounded"
    return f"keep +{megabytes(keep)}" if keep >= 1e6 else f"keep +{keep / 1e3:.1f} kB"


def _gathered(gm: fx.GraphModule) -> list[int]:
    """Bytes of each bucket forward gathers, in forward's order."""
    return [g.nbytes(n) for n in gm.graph.nodes if n.op == "call_function" and n.target is ops.unshard]


def _gathered_bytes(gm: fx.GraphModule) -> int:
    """Bytes forward gathers: what the unbounded schedule keeps for backward."""
    return sum(_gathered(gm))


def _keep_ladder(gm: fx.GraphModule) -> list[int]:
    """Extra bytes for the schedule to keep, increasing: one more bucket kept at each step, taken in the order
    backward gathers them (the reverse of forward's), at most ``LADDER_STEPS`` steps."""
    sums = list(itertools.accumulate(reversed(_gathered(gm))))[:-1]   # all of them kept: the unbounded schedule
    if len(sums) > LADDER_STEPS:
        sums = [sums[round(i * (len(sums) - 1) / (LADDER_STEPS - 1))] for i in range(LADDER_STEPS)]
    return sums


# -- the rewrite ---------------------------------------------------------------------------------

def _recompute(gm: fx.GraphModule, recompute: set[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Copy what backward needs of ``recompute`` into backward, before its first use; returns original -> copy."""
    graph = gm.graph
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    region = forward_region(nodes)

    def read_later(user: fx.Node) -> bool:
        return is_backward(user, region)
    roots = [n for n in recompute if any(read_later(u) for u in n.users)]
    copied: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node not in copied:
            copied.add(node)
            stack.extend(i for i in node.all_input_nodes if i in recompute)
    # where each copy is needed: its first backward use, or that of a copy that reads it
    need: dict[fx.Node, int] = {}
    for node in sorted(copied, key=position.get, reverse=True):
        uses = [position[u] for u in node.users if read_later(u)] + [need[u] for u in node.users if u in copied]
        need[node] = min(uses)
    clones: dict[fx.Node, fx.Node] = {}
    for node in sorted(copied, key=lambda n: (need[n], position[n])):
        with graph.inserting_before(nodes[need[node]]):
            clone = graph.node_copy(node, lambda argument: clones.get(argument, argument))
        clone.meta[g.PHASE] = g.BACKWARD
        clone.meta[g.RECOMPUTED] = node.name
        clones[node] = clone
    for node, clone in clones.items():
        for user in list(node.users):
            if read_later(user):
                user.replace_input_with(node, clone)
    return clones


# -- measuring a plan: the rest of the pipeline on a copy, then the memory plan it ends with ------------

@dataclasses.dataclass(frozen=True)
class _Peak:
    bytes: int
    by_role: tuple[tuple[str, int], ...] = ()
    seconds: float = 0.0   # the final graph's predicted step time
    moved_bytes: float = 0.0   # bytes this rank sends or receives per step
    laid_out: bool = True   # False: the live peak of a plan over the budget, not laid out in arenas (_measure)
    live_bytes: int = 0   # the live peak (bytes alive at once), below ``bytes`` by the arenas' fragmentation


class _Unemitted(fx.GraphModule):
    """A copy of the step for the rest of the pipeline to run on: nothing runs it, so no Python is generated."""

    def recompile(self):
        pass


def _measure(gm: fx.GraphModule, ctx: CompileContext, recompute: set[fx.Node] | None, memory_pools: bool,
             keep: int, profile: HardwareProfile, budget: int | None) -> tuple[_Peak, object]:
    """The peak the final memory plan reports once ``recompute`` is recomputed (None: as it is) with forward's
    gathers kept as ``keep`` says, and the final graph's step time on ``profile``; and the later passes' recorded
    run (``pipeline.LaterRun``; None where a registered pass is among them), which the compile takes if this plan
    is chosen. With memory pools, a plan whose live peak is already over ``budget`` (None: laid out whatever
    its peak) is not laid out in arenas (a layout only adds fragmentation: it cannot fit); its peak is then
    the live peak, ``laid_out`` False.

    The passes after this one in the pipeline being built (``ctx.rest_of_pipeline``, handed over by the
    runner: the registered ones in, the disabled ones out) run on a copy with a scratch context; the peak
    is the final plan's: the live peak, or with memory pools the pooled layout's (``place_buffers``: the
    arenas, allocated whole, plus what lives outside them), which fragmentation puts above the live peak.
    """
    if ctx.rest_of_pipeline is None:
        raise RuntimeError("place_remat measures a plan by running the passes after it: run it through "
                           "pipeline.run_pipeline, which hands them over as ctx.rest_of_pipeline")
    from ..pipeline import NodeRecord   # the pipeline imports this pass
    env: dict[fx.Node, fx.Node] = {}
    graph = NodeRecord(gm.graph).build(env)   # the compile's own copy (driver.copy_graph_module), not node_copy's
    copy = _Unemitted(gm, graph, class_name=type(gm).__name__)
    copy.meta = dict(gm.meta)
    if recompute is not None:
        _recompute(copy, {env[n] for n in recompute})
        g.eliminate_dead_code(copy)
    # the schedule reads unbounded_schedule off the plan this pass records; the rest of it is not decided yet
    provisional = RematPlan(budget_bytes=0, peak_before_bytes=0, peak_bytes=0, recomputed=(), saved_bytes=0,
                                 extra_flops=0, forward_flops=0, candidates=0, evaluations=0,
                                 unbounded_schedule=keep == EVERY, keep_extra_bytes=max(keep, 0))
    scratch = dataclasses.replace(ctx, notes={}, remat_plan=provisional, schedule=None, update_order=None,
                                  memory_plan=None)
    run = ctx.rest_of_pipeline.recorded(copy, scratch,
                                        over=lambda done: memory_pools and budget is not None
                                        and done.memory_plan.live_peak_bytes > budget)
    plan = scratch.memory_plan
    peak = plan.planned_peak_bytes if memory_pools and run.stopped_before is None else plan.live_peak_bytes
    step = predict(run.gm, ctx.world_size, profile)
    return (_Peak(peak, plan.alive_at_live_peak(), step.seconds, step.moved_bytes, run.stopped_before is None,
                  plan.live_peak_bytes),
            run if run.shots is not None else None)


def _gathers_in_backward(ctx: CompileContext) -> bool:
    """Stage 3 across ranks: backward gathers again the buckets whose forward copy the schedule does not keep."""
    return ctx.stage == 3 and ctx.world_size > 1


def megabytes(count: int) -> str:
    return f"{count / 1e6:.2f} MB"


def _highest_over_ranks(peak: _Peak, ctx: CompileContext) -> _Peak:
    """The highest of every rank's peak, and the slowest rank's time: ranks own different optimizer pieces, so
    their numbers differ a little, and every rank must make the same decision (the collectives' order depends on
    it) and fit the budget."""
    every = ctx.from_every_rank(peak)
    highest = max(every, key=lambda p: p.bytes)
    return dataclasses.replace(highest, seconds=max(p.seconds for p in every), live_bytes=max(p.live_bytes for p in every),
                               moved_bytes=max(p.moved_bytes for p in every), laid_out=all(p.laid_out for p in every))


def _first_fitting(count: int, fits, settled: Callable[[int, int], bool] | None = None) -> int | None:
    """The first of ``count`` plans that fits, by binary search (None when none of the sampled ones does).

    The peak is not monotone in the plans (copies alive in backward can outweigh what a plan saves): when the
    last plan does not fit, sample the order and search below the first sample that does. ``settled(below,
    first)`` ends the search early with ``first``, which fits, when the plans after ``below``, which does not
    (-1: none below), need no measuring.
    """
    if count == 0:
        return None
    low, high = 0, count - 1
    if not fits(high):
        samples = _spread(count - 1)
        high = next((k for k in samples if fits(k)), None)   # each sample costs a measurement: stop at the first
        if high is None:
            return None
        low = max([k for k in samples if k < high], default=-1) + 1
    while low < high and not (settled and settled(low - 1, high)):   # invariant: plan high fits
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    return high


def _most_that_fits(ladder: list[int], peak: Callable[[int], int], fitting: tuple[int, int],
                    too_large: tuple[int, int], budget: int) -> int | None:
    """The index of the most bytes kept in ``ladder`` (increasing) whose peak fits ``budget`` (None: not even the
    least), ``peak`` measuring each; ``fitting`` and ``too_large`` are measured (bytes kept, peak) points around
    the ladder, the default schedule and every gather kept.

    A bucket kept for backward adds about its bytes to the peak once the kept ones reach it, so the peak is
    nearly a line in the bytes kept: each probe is the step below where the line through the nearest measured
    points on either side crosses the budget, and a bisection when three probes in a row land on the same
    side (a bend in the line). While the point above is still every gather kept (an unbounded schedule, far
    above the line: on the 98M GPT 1658 MB against 1111 at the ladder's top), the probe is at least where a
    line of slope 1 from the point that fits crosses: probing toward that point crept up from below (6
    probes at 1.2x the default peak, 3 now; tests/test_remat.py sweeps the 98M GPT's measured ladder).
    """
    low, high = -1, len(ladder)   # ladder[low] fits (-1: ``fitting``), ladder[high] does not (len: ``too_large``)
    sides: list[bool] = []
    while high - low > 1:
        (kept_low, peak_low), (kept_high, peak_high) = fitting, too_large
        if sides[-3:] in ([True] * 3, [False] * 3) or peak_high <= peak_low:
            probe = (low + high) // 2
        else:
            crossing = kept_low + (budget - peak_low) * (kept_high - kept_low) / (peak_high - peak_low)
            if high == len(ladder):   # the point above is every gather kept, off the line: at least slope 1
                crossing = max(crossing, kept_low + budget - peak_low)
            probe = min(max(bisect.bisect_right(ladder, crossing) - 1, low + 1), high - 1)
        measured = peak(ladder[probe])
        sides.append(measured <= budget)
        if sides[-1]:
            low, fitting = probe, (ladder[probe], measured)
        else:
            high, too_large = probe, (ladder[probe], measured)
    return low if low >= 0 else None


def _spread(count: int, samples: int = 8) -> list[int]:
    return sorted({round(count * i / samples) for i in range(samples + 1)})


def _refuse(budget: int, before: _Peak, best: _Peak, candidates: int, sampled: int) -> None:
    by_pool: dict[str, int] = {}
    for role, nbytes in best.by_role:
        by_pool[POOL_OF_ROLE[role]] = by_pool.get(POOL_OF_ROLE[role], 0) + nbytes
    # the update's temporaries sit in the activations' pool, but what shrinks them is what shrinks model states
    temporaries = sum(nbytes for role, nbytes in best.by_role if role == "optimizer temporaries")
    states = sum(v for k, v in by_pool.items() if k in ("persistent", "gathered parameters", "gradient buckets"))
    states += temporaries
    activations = by_pool.get("activations", 0) - temporaries
    parts = ", ".join(f"{role} {megabytes(nbytes)}" for role, nbytes in sorted(best.by_role, key=lambda r: -r[1]))
    # the roles are the bytes alive at the live peak; with memory pools the peak is the pooled layout's, above it
    layout = best.bytes - sum(nbytes for _, nbytes in best.by_role)
    if layout > 0:
        parts += f"; the memory pools' layout adds {megabytes(layout)}"
    if states >= activations:
        held = f" ({megabytes(temporaries)} of them the update's temporaries: the peak is in the optimizer step)" \
            if temporaries else ""
        why = (f"model states dominate it{held}: a higher ZeRO stage or more ranks shrink them; "
               "recomputing activations cannot")
    else:
        why = ("activations dominate it even with every recomputable value recomputed: a smaller batch or "
               "sequence shrinks them")
    raise MemoryBudgetError(
        f"memory_budget={budget:,} bytes ({megabytes(budget)}) cannot be met: the smallest peak the remat "
        f"planner reaches is {best.bytes:,} bytes ({megabytes(best.bytes)}; {megabytes(before.bytes)} with nothing "
        f"recomputed, {candidates} stored tensors considered;\n  the least of {sampled} plans from none to the most "
        f"recomputation, the same whatever the budget).\n"
        f"  at that peak, alive: {parts}\n"
        f"  model states {megabytes(states)}, activations {megabytes(activations)}: {why}; "
        f"or raise memory_budget to at least {best.bytes:,}.",
        budget_bytes=budget, smallest_peak_bytes=best.bytes)
