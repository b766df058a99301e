"""The memory plan: where every tensor of one step lives, as plain frozen data a person can read.

``passes/plan_memory.py`` decides it; this module holds the data, the
allocator it uses (greedy best-fit over lifetimes, as XLA's heap simulator
does) and the ways to look at it: a table (``str(plan)``), one summary line
per pool (``plan.summary()``), a dict (``plan.to_dict()``) and a picture of
memory over the step (``plan.plot(path)``, needs matplotlib).

Positions are indices into the schedule (the graph's node order when the
plan was made); a buffer's ``start`` and ``end`` are inclusive positions. A
buffer occupies ``[offset, offset + bytes)`` of its pool from ``start`` to
``end``; no two buffers of a pool that are alive at the same position share
a byte.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy

# Offsets and sizes inside a pool are multiples of this, as the caching
# allocators of CPU and CUDA hand out (64 bytes covers AVX-512 and a cache line).
ALIGNMENT_BYTES = 64
DEFAULT_PLOT_PATH = "memory_plan.png"   # MemoryPlan.plot() without a path writes here

# Roles, grouped by the pool that holds them, in the order pools are printed and stacked.
POOLS: dict[str, tuple[str, ...]] = {
    "persistent": ("parameters", "optimizer state", "buffers", "inputs", "updated state"),
    "gathered parameters": ("gathered parameters",),
    # the optimizer step's own temporaries (what AdamW computes per parameter before writing it) share the
    # activations' pool and arena, but are not activations: recomputation cannot shrink them, the update's sharding can
    "activations": ("activations", "optimizer temporaries"),
    "gradient buckets": ("gradient buckets",),
    "communication": ("communication",),
}
POOL_OF_ROLE = {role: pool for pool, roles in POOLS.items() for role in roles}
ROLES = tuple(role for roles in POOLS.values() for role in roles)


def align(size: int, alignment: int = ALIGNMENT_BYTES) -> int:
    return (size + alignment - 1) // alignment * alignment


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """What the allocator needs to know of one buffer: its size and the positions it is alive at."""
    name: str
    bytes: int      # already aligned
    start: int      # inclusive
    end: int        # inclusive

    def overlaps(self, other: "Lifetime") -> bool:
        return self.start <= other.end and other.start <= self.end


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One storage of the step (a tensor and every view of it) and where it is placed."""
    name: str            # the node that allocates it (``op[i]`` for output i of a multi-output op)
    role: str
    pool: str
    bytes: int           # aligned size: what it occupies in its pool
    offset: int          # bytes from the start of its pool
    start: int
    end: int
    aliases: tuple[str, ...] = ()   # nodes whose values are views of it

    def to_dict(self) -> dict:
        return {"name": self.name, "offset": self.offset, "bytes": self.bytes, "start": self.start, "end": self.end}


@dataclasses.dataclass(frozen=True)
class Unplanned:
    """A storage of the step that no pool holds: PyTorch's allocator gives it memory when it runs."""
    name: str
    role: str
    bytes: int | None    # aligned size; None when it depends on the data (known only when the step runs)
    start: int
    end: int
    reason: str

    def to_dict(self) -> dict:
        return {"name": self.name, "role": self.role, "bytes": self.bytes, "start": self.start, "end": self.end,
                "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class Pool:
    """One arena: buffers of related roles at fixed offsets."""
    name: str
    bytes: int                  # planned size: the highest byte any buffer reaches
    lower_bound_bytes: int      # the most bytes its buffers hold at any one position
    order: str                  # which greedy order gave the smallest pool (and how many promotions)
    buffers: tuple[Buffer, ...]

    @property
    def ratio(self) -> float:
        return self.bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def summary(self) -> str:
        return (f"{self.name}: {megabytes(self.bytes)} planned, lower bound {megabytes(self.lower_bound_bytes)}, "
                f"{self.ratio:.2f}x ({len(self.buffers)} buffers)")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every buffer of one step, placed in pools, with the bound no placement can beat."""
    pools: tuple[Pool, ...]
    positions: tuple[str, ...]      # the schedule: node name at each position
    phases: tuple[str, ...]         # the phase of the node at each position ("" where untagged)
    alignment: int = ALIGNMENT_BYTES
    unplanned: tuple[Unplanned, ...] = ()   # storages no pool holds, each with the reason
    arenas: tuple[str, ...] = ()    # pools the runtime allocates once and places outputs in (place_buffers)
    placed: bool = False            # laid out by place_buffers: what is in no arena is allocated as the step runs

    @property
    def planned_bytes(self) -> int:
        """What the pools reserve together: the step's planned peak if each pool is one arena."""
        return sum(p.bytes for p in self.pools)

    @property
    def lower_bound_bytes(self) -> int:
        """Sum over pools of each pool's peak of live bytes: the least any pool-by-role layout needs."""
        return sum(p.lower_bound_bytes for p in self.pools)

    @property
    def live_peak_bytes(self) -> int:
        """The most bytes alive at any one position, all pools together (what one shared heap could reach)."""
        return max(self.live_bytes_by_role().total(), default=0)

    @property
    def arena_bytes(self) -> int:
        """What the runtime allocates once for the arenas (0 without them)."""
        return sum(p.bytes for p in self.pools if p.name in self.arenas)

    @property
    def unplanned_bytes(self) -> int:
        """Bytes of the unplanned storages whose size is known, added up (not all alive at once)."""
        return sum(u.bytes or 0 for u in self.unplanned)

    @property
    def outside_peak_bytes(self) -> int:
        """The most bytes alive at one position outside the arenas: non-arena pools' buffers and unplanned ones."""
        deltas = [0] * (len(self.positions) + 1)
        outside = [(b.bytes, b.start, b.end) for p in self.pools if p.name not in self.arenas for b in p.buffers]
        outside += [(u.bytes or 0, u.start, u.end) for u in self.unplanned]
        for size, start, end in outside:
            deltas[start] += size
            deltas[end + 1] -= size
        peak = running = 0
        for delta in deltas:
            running += delta
            peak = max(peak, running)
        return peak

    @property
    def planned_peak_bytes(self) -> int:
        """The most bytes this rank is planned to hold during the step.

        With arenas: the arenas (held all step) plus the most bytes alive at
        once outside them (the slots, the values that replace them, unplanned
        storages); laid out for arenas of which none was made (no op could write into one: a plan of a model on
        the meta device), the same with no arena. Without: every pool's planned size, as if each were an arena.
        """
        if not self.arenas and not self.placed:
            return self.planned_bytes
        return self.arena_bytes + self.outside_peak_bytes

    @property
    def lower_bound_peak_bytes(self) -> int:
        """``planned_peak_bytes`` with every arena at its lower bound: what no layout of the same arenas beats."""
        if not self.arenas and not self.placed:
            return self.lower_bound_bytes
        return sum(p.lower_bound_bytes for p in self.pools if p.name in self.arenas) + self.outside_peak_bytes

    def buffers(self) -> list[Buffer]:
        return [b for p in self.pools for b in p.buffers]

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool named {name!r}; the pools are: {', '.join(p.name for p in self.pools)}")

    def live_bytes_by_role(self) -> "LiveBytes":
        """Live bytes at every position, per role."""
        by_role = {role: [0] * (len(self.positions) + 1) for role in ROLES}
        for buffer in [*self.buffers(), *self.unplanned]:
            by_role[buffer.role][buffer.start] += buffer.bytes or 0
            by_role[buffer.role][buffer.end + 1] -= buffer.bytes or 0
        for role, deltas in by_role.items():
            running = 0
            for i, delta in enumerate(deltas):
                running += delta
                deltas[i] = running
            deltas.pop()
        return LiveBytes(by_role)

    def alive_at_live_peak(self) -> tuple[tuple[str, int], ...]:
        """(role, bytes) of what is alive where the live bytes peak (``live_peak_bytes``), roles with none left out."""
        live = self.live_bytes_by_role()
        totals = live.total()
        if not totals:
            return ()
        at = max(range(len(totals)), key=totals.__getitem__)
        return tuple((role, values[at]) for role, values in live.by_role.items() if values[at])

    # -- reading it ------------------------------------------------------------------
    def summary(self) -> str:
        """One line per pool and one for the whole plan."""
        lines = [pool.summary() + (", an arena" if pool.name in self.arenas else "") for pool in self.pools]
        if self.unplanned:
            reasons = {}
            for u in self.unplanned:
                reasons[u.reason] = reasons.get(u.reason, 0) + 1
            unknown = sum(u.bytes is None for u in self.unplanned)
            lines.append(f"unplanned: {len(self.unplanned)} buffers, {megabytes(self.unplanned_bytes)}"
                         + (f" and {unknown} of a size known only at run time" if unknown else "") + " ("
                         + "; ".join(f"{count} {reason}" for reason, count in sorted(reasons.items())) + ")")
        ratio = self.planned_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        # the pools' sum leaves the unplanned buffers out, which the live peak counts: said, as it can be the smaller
        lines.append(f"pools together: {megabytes(self.planned_bytes)} planned, lower bound "
                     f"{megabytes(self.lower_bound_bytes)}, {ratio:.2f}x; at most {megabytes(self.live_peak_bytes)} "
                     f"alive at once{', unplanned buffers included' if self.unplanned else ''}, "
                     f"{len(self.positions)} positions")
        if self.arenas:
            lines.append(f"arenas: {megabytes(self.arena_bytes)} allocated once; planned peak "
                         f"{megabytes(self.planned_peak_bytes)} with at most {megabytes(self.outside_peak_bytes)} "
                         "outside them")
        return "\n".join(lines)

    def table(self) -> str:
        header = ("tensor", "role", "bytes", "offset", "live range", "pool")
        rows = [header]
        for pool in self.pools:
            for b in sorted(pool.buffers, key=lambda b: (b.start, b.offset)):
                rows.append((b.name, b.role, f"{b.bytes:,}", f"{b.offset:,}", f"{b.start}-{b.end}", pool.name))
        for u in sorted(self.unplanned, key=lambda u: u.start):
            size = "?" if u.bytes is None else f"{u.bytes:,}"
            rows.append((u.name, u.role, size, "-", f"{u.start}-{u.end}", f"unplanned: {u.reason}"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        right = {2, 3}
        return "\n".join("  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                                   for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows)

    def __str__(self) -> str:
        return self.table() + "\n\n" + self.summary()

    def to_dict(self) -> dict:
        return {
            "pools": [{"name": p.name, "bytes": p.bytes, "lower_bound_bytes": p.lower_bound_bytes,
                       "buffers": [b.to_dict() for b in p.buffers]} for p in self.pools],
            "lower_bound_bytes": self.lower_bound_bytes,
            "planned_bytes": self.planned_bytes,
            "live_peak_bytes": self.live_peak_bytes,
            "positions": len(self.positions),
            "arenas": list(self.arenas),
            "planned_peak_bytes": self.planned_peak_bytes,
            "unplanned": [u.to_dict() for u in self.unplanned],
        }

    def plot(self, path: str = DEFAULT_PLOT_PATH, title: str | None = None) -> str:
        """Write a PNG of memory over the step: live bytes stacked by role, and where each buffer sits.

        Returns the path written (``memory_plan.png`` in the working directory unless given).
        """
        return _plot(self, path, title)


@dataclasses.dataclass(frozen=True)
class LiveBytes:
    by_role: dict[str, list[int]]

    def total(self) -> list[int]:
        columns = list(self.by_role.values())
        return [sum(values) for values in zip(*columns)] if columns else []


def megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 1e5 else f"{count / 1e3:.1f} kB"


# -- the allocator ------------------------------------------------------------------

def lower_bound(lifetimes: Iterable[Lifetime]) -> int:
    """The most bytes alive at one position: no placement without overlap can use fewer."""
    events: dict[int, int] = {}
    for life in lifetimes:
        events[life.start] = events.get(life.start, 0) + life.bytes
        events[life.end + 1] = events.get(life.end + 1, 0) - life.bytes
    peak = running = 0
    for position in sorted(events):
        running += events[position]
        peak = max(peak, running)
    return peak


ORDERS = {
    # XLA's GlobalDecreasingSizeBestFitHeap: big buffers first, they are the hardest to fit
    "size": lambda life: (-life.bytes, life.start, -life.end, life.name),
    # the same, buffers of one size by the latest end first: a recurrent model's many same-sized gates then
    # stack without gaps. Measured with zerocc.plan at world size 1: tests/architectures.py's Recurrent arena
    # 1.000x its lower bound (1.059x with the two orders above alone), the tiny GPT's activations 1.025x (1.049x)
    "size, latest end": lambda life: (-life.bytes, -life.end, life.start, life.name),
    # the order a running program allocates in
    "start": lambda life: (life.start, -life.bytes, -life.end, life.name),
    # bytes times positions alive first: what holds the most memory for the longest goes at the bottom.
    # tests/architectures.py's FrozenAndCustom at stage 3, 2 ranks: 1.000x its lower bound (1.089x without)
    "size x lifetime": lambda life: (-life.bytes * (life.end - life.start + 1), life.start, life.name),
}


# Rounds of promotion per greedy order in ``place``, and how many rounds without a smaller pool end them.
# On the pools of tests/models.py and tests/architectures.py at stages 0 and 3 on 2 ranks (plain and pooled),
# 24 and 6 brought the worst pool from 1.069x its lower bound to 1.021x (most to 1.000x); fewer rounds or
# less patience left the encoder-decoder's activations at 1.04x. Each round is one best-fit pass.
PROMOTION_ROUNDS = 24
PROMOTION_PATIENCE = 6
# At most this many (buffer, buffer alive beside it) pairs visited by ``place``'s rounds, all orders together
# (each round visits every pair once), but never fewer rounds than one per order. A round of the 98M GPT's
# arena (1,145 buffers, 160k pairs) takes 20 ms: 49 rounds were a second of each compile and of each plan
# place_remat measures. With this bound it takes 12 rounds there (the 1,008-buffer activations pool 15 instead
# of 31), and every pool of the test models above and of both benchmark GPTs keeps its size: the rounds that
# made them smaller were all within it.
PROMOTION_PAIRS = 2_000_000


def best_fit(lifetimes: Sequence[Lifetime], order: str) -> dict[str, int]:
    """Offsets for ``lifetimes`` placed one by one in ``order``, each into the smallest gap that fits it."""
    return _best_fit_in_sequence(sorted(lifetimes, key=ORDERS[order]), _neighbours(lifetimes))


# At most this many (buffer, buffer alive beside it) pairs are listed by ``_neighbours`` (a few MB of lists);
# above it ``_best_fit_in_sequence`` finds each buffer's neighbours as it places it (one vectorized test each)
NEIGHBOUR_PAIRS = 2_000_000
# A buffer with at least this many neighbours finds its gap with numpy (``_smallest_gap_in_columns``), one with
# fewer in plain Python (``_smallest_gap``): numpy's dozen calls cost about 5 us whatever the count, Python's
# gather and sort about 80 ns a neighbour. On the 98M GPT's activations arena (1,145 buffers, a median of 81
# neighbours) a round took 15 ms in Python alone, 7 ms with this (``place`` 0.19 -> 0.10 s); on the 5M GPT's
# (median 29) numpy for every buffer was 1.6x slower than Python, and this bound keeps its rounds as they were.
# Bounds of 96 and up left the 98M GPT at 0.14 s.
VECTORIZED_NEIGHBOURS = 64


@dataclasses.dataclass(frozen=True)
class _Neighbours:
    """One buffer's neighbours: the buffers with bytes alive at one of its positions (itself left out)."""
    position: int                        # its position in the lifetimes ``_neighbours`` was given
    alive: list[int]                     # the neighbours' positions there
    columns: numpy.ndarray | None        # the same as an array, for buffers with ``VECTORIZED_NEIGHBOURS`` or more


def _neighbours(lifetimes: Sequence[Lifetime]) -> dict[int, _Neighbours] | None:
    """For each buffer with bytes, by ``id``: its position in ``lifetimes`` and the positions of the other
    buffers with bytes alive at the same time. None where that is over ``NEIGHBOUR_PAIRS`` pairs or a buffer is
    given twice. Lifetimes do not change between ``place``'s rounds: found once, not per buffer per round."""
    if len({id(life) for life in lifetimes}) != len(lifetimes):
        return None
    sized = numpy.array([life.bytes != 0 for life in lifetimes], dtype=bool)
    positions = numpy.flatnonzero(sized)
    starts = numpy.array([life.start for life in lifetimes], dtype=numpy.int64)[sized]
    ends = numpy.array([life.end for life in lifetimes], dtype=numpy.int64)[sized]
    # how many are alive beside each: those started by its end less those ended before its start
    pairs = (numpy.searchsorted(numpy.sort(starts), ends, side="right")
             - numpy.searchsorted(numpy.sort(ends), starts, side="left"))
    if int(pairs.sum()) > NEIGHBOUR_PAIRS:
        return None
    found = {}
    for k, i in enumerate(positions.tolist()):
        alive = positions[(starts <= ends[k]) & (ends >= starts[k])]   # Lifetime.overlaps
        alive = alive[alive != i]
        found[id(lifetimes[i])] = _Neighbours(i, alive.tolist(), alive if len(alive) >= VECTORIZED_NEIGHBOURS else None)
    return found


def _best_fit_in_sequence(sequence: Sequence[Lifetime], neighbours: dict[int, _Neighbours] | None) -> dict[str, int]:
    """Offsets for ``sequence`` placed one by one as given, each into the smallest gap that fits it.

    A gap is a range of bytes that no already-placed buffer alive at the same
    time occupies. Where no gap fits, the buffer goes on top of the highest
    such buffer. ``neighbours``: ``_neighbours`` of the same lifetimes in any
    order, or None.
    """
    if neighbours is None:
        return _best_fit_testing_each(sequence)
    count = max((n.position for n in neighbours.values()), default=-1) + 1
    # where each placed buffer is, by its position in neighbours' lists: (offset, offset + bytes), None while
    # unplaced, for _smallest_gap; the same as two columns, (0, 0) while unplaced, for _smallest_gap_in_columns
    placed: list[tuple[int, int] | None] = [None] * count
    lows = numpy.zeros(count, dtype=numpy.int64)
    highs = numpy.zeros(count, dtype=numpy.int64)
    offsets: dict[str, int] = {}
    for life in sequence:
        if life.bytes == 0:
            offsets[life.name] = 0
            continue
        found = neighbours[id(life)]
        if found.columns is None:
            busy = sorted([placed[j] for j in found.alive if placed[j] is not None])
            offset = _smallest_gap(busy, life.bytes)
        else:
            offset = _smallest_gap_in_columns(lows[found.columns], highs[found.columns], life.bytes)
        offsets[life.name] = offset
        placed[found.position] = (offset, offset + life.bytes)
        lows[found.position], highs[found.position] = offset, offset + life.bytes
    return offsets


def _smallest_gap(busy: list[tuple[int, int]], size: int) -> int:
    """The lowest offset of the smallest gap of at least ``size`` bytes below or between the ``busy`` ranges
    (sorted), else the top of the highest."""
    best, best_gap, cursor = -1, -1, 0
    for low, high in busy:
        if low - cursor >= size and (best < 0 or low - cursor < best_gap):
            best, best_gap = cursor, low - cursor
        if high > cursor:
            cursor = high
    return cursor if best < 0 else best


_NO_GAP = numpy.iinfo(numpy.int64).max


def _smallest_gap_in_columns(lows: numpy.ndarray, highs: numpy.ndarray, size: int) -> int:
    """``_smallest_gap`` of the ranges ``[lows[k], highs[k])`` (any order; (0, 0) stands for no range), with
    the lows and the highs sorted apart, which numpy does in two calls where sorting pairs would take many.

    Why sorting apart gives the same gaps: number the ranges by their lows, L[0] <= L[1] <= ..., and sort the
    highs, H[0] <= H[1] <= ... ``_smallest_gap`` looks for a gap below L[i] from its cursor, the highest top
    of ranges 0..i-1 (0 for i = 0). Ranges i, i+1, ... start at or above L[i] and have bytes, so they end
    above it (where L[i] > 0; a gap below L[i] = 0 is empty either way): the highs at or below L[i] all come
    from ranges 0..i-1. So H[i-1] <= L[i] exactly when all of those end by L[i], and then H[i-1] is the highest of
    them, the cursor: the same gap, L[i] - H[i-1]. Otherwise one of them covers L[i], and both gaps are
    negative, which nothing fits. (0, 0) ranges sort first on both sides and make only gaps of 0; ``size`` is
    at least 1. The smallest gap that fits, the first of equals, and else the top, H[-1], follow as there.
    """
    if not len(lows):
        return 0
    lows.sort()
    highs.sort()
    gaps = lows.copy()
    gaps[1:] -= highs[:-1]   # the i-th gap: from the (i - 1)-th lowest high (0 for the first) to the i-th low
    gaps[gaps < size] = _NO_GAP
    best = int(gaps.argmin())   # the first of the smallest: the lowest offset, as _smallest_gap takes
    if gaps[best] == _NO_GAP:
        return int(highs[-1])
    return int(highs[best - 1]) if best else 0


def _best_fit_testing_each(sequence: Sequence[Lifetime]) -> dict[str, int]:
    """``_best_fit_in_sequence`` without a list of neighbours: the placed buffers as columns (start, end,
    offset, offset + bytes), which of them overlap the next one in time is one vectorized test per buffer."""
    placed = numpy.zeros((4, len(sequence)), dtype=numpy.int64)
    count = 0
    offsets: dict[str, int] = {}
    for life in sequence:
        if life.bytes == 0:
            offsets[life.name] = 0
            continue
        start, end = life.start, life.end
        starts, ends, lows, highs = placed[:, :count]
        alive = (starts <= end) & (ends >= start)   # Lifetime.overlaps
        below, above = lows[alive], highs[alive]   # copies: sorted in place by _smallest_gap_in_columns
        # numpy's gap search where there are many neighbours, as in _best_fit_in_sequence: this path is taken for the
        # largest graphs, whose buffers alive at once grow with depth (the 96-layer GPT at 1024 ranks: Python's
        # sorted pairs were 1.6 of the plan's 40 CPU seconds)
        offset = offsets[life.name] = _smallest_gap_in_columns(below, above, life.bytes) \
            if len(below) >= VECTORIZED_NEIGHBOURS else _smallest_gap(sorted(zip(below.tolist(), above.tolist())), life.bytes)
        placed[:, count] = (start, end, offset, offset + life.bytes)
        count += 1
    return offsets


def place(lifetimes: Sequence[Lifetime]) -> tuple[dict[str, int], int, str]:
    """The smallest placement found: (offsets, pool bytes, how it was found).

    Best-fit in each of the ``ORDERS``, then each improved by promotion (an
    iterated greedy): the buffers that reach the top of the pool are placed
    first in the next round, the others keeping their order, for up to
    ``PROMOTION_ROUNDS`` rounds, until ``PROMOTION_PATIENCE`` rounds in a row
    bring no smaller pool, the rounds have visited ``PROMOTION_PAIRS`` pairs
    of buffers alive together, or the pool is at its lower bound.
    """
    bound = lower_bound(lifetimes)
    neighbours = _neighbours(lifetimes)
    pairs = sum(len(n.alive) for n in neighbours.values()) if neighbours is not None else len(lifetimes) ** 2
    rounds_allowed = max(len(ORDERS), PROMOTION_PAIRS // max(pairs, 1))
    rounds = 0
    best: tuple[dict[str, int], int, str] | None = None

    def best_fit_round(order: str, sequence: list[Lifetime], promotions: int) -> tuple[dict[str, int], int]:
        nonlocal best, rounds
        offsets = _best_fit_in_sequence(sequence, neighbours)
        rounds += 1
        size = max((offsets[life.name] + life.bytes for life in lifetimes), default=0)
        if best is None or size < best[1]:
            best = (offsets, size, f"{order}, promoted {promotions}x" if promotions else order)
        return offsets, size

    first_rounds = {}
    for order in ORDERS:
        sequence = sorted(lifetimes, key=ORDERS[order])
        first_rounds[order] = sequence, best_fit_round(order, sequence, 0)
        if best[1] == bound:
            return best
    for order, (sequence, (offsets, size)) in first_rounds.items():
        smallest, stale = size, 0
        for promotions in range(1, PROMOTION_ROUNDS):
            if rounds >= rounds_allowed:
                return best
            on_top = [life for life in sequence if offsets[life.name] + life.bytes == size]
            sequence = on_top + [life for life in sequence if offsets[life.name] + life.bytes != size]
            offsets, size = best_fit_round(order, sequence, promotions)
            if best[1] == bound:
                return best
            if size < smallest:
                smallest, stale = size, 0
            else:
                stale += 1
                if stale >= PROMOTION_PATIENCE:
                    break
    return best


def overlapping_pairs(buffers: Sequence[Buffer]) -> list[tuple[str, str]]:
    """Pairs of buffers of the same pool alive at the same position that share a byte (should be none)."""
    clashes = []
    by_pool: dict[str, list[Buffer]] = {}
    for buffer in buffers:
        if buffer.bytes:
            by_pool.setdefault(buffer.pool, []).append(buffer)
    for members in by_pool.values():
        members.sort(key=lambda b: b.start)
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if b.start > a.end:
                    break
                if a.offset < b.offset + b.bytes and b.offset < a.offset + a.bytes:
                    clashes.append((a.name, b.name))
    return clashes


# -- the picture ----------------------------------------------------------------------

ROLE_COLORS = {
    "parameters": "#4c72b0", "optimizer state": "#8172b3", "buffers": "#937860", "inputs": "#b8b8b8",
    "updated state": "#9ecae1", "gathered parameters": "#dd8452", "activations": "#55a868",
    "optimizer temporaries": "#8c8c3c",
    "gradient buckets": "#c44e52", "communication": "#da8bc3",
}


def _plot(plan: MemoryPlan, path: str, title: str | None) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.collections import PolyCollection
    except ImportError as error:
        raise ImportError("MemoryPlan.plot needs matplotlib (pip install matplotlib); "
                          "print(plan) or plan.to_dict() need nothing") from error
    megabyte = 1e6
    steps = list(range(len(plan.positions)))
    live = plan.live_bytes_by_role()
    roles = [r for r in ROLES if any(live.by_role[r])]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True, height_ratios=(1, 1.3))

    # phases of the step as background bands, on both panels
    spans = _phase_spans(plan.phases)
    for axis in (top, bottom):
        for k, (phase, first, last) in enumerate(spans):
            axis.axvspan(first - 0.5, last + 0.5, color="#000000", alpha=0.05 if k % 2 == 0 else 0.0, lw=0)
    for phase, first, last in spans:
        top.text((first + last) / 2, 1.01, phase, transform=top.get_xaxis_transform(), ha="center", va="bottom",
                 fontsize=9, color="#555555")

    # top: bytes alive at each position, stacked by role
    top.stackplot(steps, [[v / megabyte for v in live.by_role[r]] for r in roles],
                  colors=[ROLE_COLORS[r] for r in roles], labels=roles, step="mid", linewidth=0)
    top.axhline(plan.planned_bytes / megabyte, color="black", ls="--", lw=1)
    top.text(0, plan.planned_bytes / megabyte, f" planned, all pools: {megabytes(plan.planned_bytes)}",
             va="bottom", fontsize=8)
    peak = plan.live_peak_bytes
    top.axhline(peak / megabyte, color="black", ls=":", lw=1)
    top.text(len(steps) - 1, peak / megabyte, f"most alive at once: {megabytes(peak)} ", va="bottom", ha="right",
             fontsize=8)
    top.set_ylim(0, plan.planned_bytes / megabyte * 1.12)
    top.set_ylabel("live MB")
    top.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)

    # bottom: where each buffer sits, pool above pool; a pool's top line is its planned size
    base = 0
    for pool in plan.pools:
        polygons, colors = [], []
        for b in pool.buffers:
            if not b.bytes:
                continue
            low, high = (base + b.offset) / megabyte, (base + b.offset + b.bytes) / megabyte
            polygons.append([(b.start - 0.5, low), (b.end + 0.5, low), (b.end + 0.5, high), (b.start - 0.5, high)])
            colors.append(ROLE_COLORS[b.role])
        bottom.add_collection(PolyCollection(polygons, facecolors=colors, edgecolors="white", linewidths=0.2))
        bottom.axhline(base / megabyte, color="black", lw=0.8)
        bottom.text(len(steps) + 0.5, (base + pool.bytes / 2) / megabyte,
                    f" {pool.name}\n {megabytes(pool.bytes)} ({pool.ratio:.2f}x bound)", va="center", fontsize=8)
        base += pool.bytes
    bottom.axhline(base / megabyte, color="black", lw=0.8)
    bottom.set_xlim(-0.5, len(steps) - 0.5)
    bottom.set_ylim(0, base / megabyte * 1.02)
    bottom.set_ylabel("offset in pools (MB)")
    bottom.set_xlabel("position in the schedule (node of the final graph)")
    top.set_title(title or f"memory plan: {megabytes(plan.planned_bytes)} in {len(plan.pools)} pools, "
                           f"lower bound {megabytes(plan.lower_bound_bytes)}", loc="left", pad=18)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _phase_spans(phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """Runs of forward / backward / optimizer positions; communication and untagged nodes join the run they are in."""
    runs: list[list] = []
    for i, phase in enumerate(phases):
        if phase not in ("forward", "backward", "optimizer"):
            continue
        if runs and runs[-1][0] == phase:
            runs[-1][2] = i
        else:
            runs.append([phase, i, i])
    # a few nodes tagged with another phase inside a long run (a view made where it is first used) are not a phase
    shortest = max(1, len(phases) // 50)
    merged: list[list] = []
    for run in runs:
        if merged and (run[0] == merged[-1][0] or run[2] - run[1] + 1 < shortest):
            merged[-1][2] = run[2]
        else:
            merged.append(run)
    for before, after in zip(merged, merged[1:]):
        before[2] = after[1] - 1
    if merged:
        merged[-1][2] = len(phases) - 1
    return [tuple(run) for run in merged]


def memory_plan_entries(memory_plan: "MemoryPlan | None") -> dict:
    """A report's entries (a compiled step's, a plan's) read from the memory plan; None each when no plan was made."""
    if memory_plan is None:
        return {"memory_pools": False, "planned_peak_bytes": None, "lower_bound_bytes": None,
                "unplanned_bytes": None, "live_peak_bytes": None}
    return {"memory_pools": bool(memory_plan.arenas), "planned_peak_bytes": memory_plan.planned_peak_bytes,
            "lower_bound_bytes": memory_plan.lower_bound_peak_bytes, "unplanned_bytes": memory_plan.unplanned_bytes,
            "live_peak_bytes": memory_plan.live_peak_bytes}
