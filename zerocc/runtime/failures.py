"""Failures that end cleanly: a dead rank becomes an error within a timeout, diverged ranks an error at compile time.

Two guards around the program the runtime runs:

- ``with_timeout`` gives the step its own process group whose collectives
  time out after ``timeout`` seconds (gloo and NCCL honour a group's
  timeout), and ``collective_failures`` turns the backend's error into a
  ``RankFailureError`` that says which step and what probably happened.
- ``check_ranks_agree`` runs right after compilation, before the program's
  first collective: every rank hashes what must agree across ranks (the
  batch's shapes, the buckets, the sequence of collectives with their sizes)
  and one ``all_gather_object`` compares them. What legitimately differs per
  rank (slice offsets, which pieces a rank owns at stages 1-2) is not hashed.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import os
from typing import Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes
import torch.fx as fx

from .. import graph as g
from ..errors import ConfigError, ZeroccError
from ..batch import PYTHON_VALUE
from ..decisions import ShardPlan
from .process_group import Ranks


class RankFailureError(ZeroccError):
    """A collective did not complete: another rank died, hung or left the step."""


class RankMismatchError(ZeroccError):
    """Ranks compiled programs whose collectives would not match."""


def with_timeout(ranks: Ranks, timeout: float | None) -> Ranks:
    """``ranks`` on a new process group (same members) whose collectives give up after ``timeout`` seconds."""
    if timeout is None or ranks.group is None:
        return ranks
    if timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    members = [dist.get_global_rank(ranks.group, r) for r in range(ranks.world_size)]
    try:   # every rank makes the group: a rank that never reaches zerocc.compile leaves the others waiting here
        group = _new_group(members, datetime.timedelta(seconds=timeout), dist.get_backend(ranks.group))
    except (RuntimeError, dist.DistError) as error:   # a TCP store's DistStoreError, a file store's RuntimeError
        if not is_collective_failure(error):
            raise
        raise _not_reached(ranks, timeout, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                           ) from error
    return Ranks(ranks.world_size, ranks.rank, group, group.group_name)


def _not_reached(ranks: Ranks, timeout: float, what: str) -> RankFailureError:
    return RankFailureError(
        f"rank {ranks.rank} of {ranks.world_size}: the other ranks did not reach zerocc.compile within {timeout:g} "
        f"s ({what})\n"
        "  why: zerocc.compile is a collective: every rank must call it; another rank probably died, hangs, or "
        "runs other code\n  fix: look at the other ranks' output for the first error")


# How many compiles this process began over each set of ranks (``check_same_group``'s meeting places)
_COMPILES: collections.Counter = collections.Counter()
_POLL = datetime.timedelta(seconds=0.5)
_LONGEST_POLL = datetime.timedelta(seconds=8)


def check_same_group(ranks: Ranks, timeout: float | None) -> None:
    """A ``ConfigError`` on every rank where the ranks of one compile passed different groups (``group=`` on some
    ranks only, another ``dist.new_group`` object per rank, groups of other ranks), before any collective over them.

    A rank's collectives over its group pair only with those of the ranks that
    passed the same group object: with ``group=`` on rank 0 alone, each rank
    waited in zerocc.compile's first collective for the other, forever. The
    ranks meet in the default group's store (every rank reaches it, whatever
    group it passed), under the member set of the group each passed and how
    many compiles this process began over it: each counts the ranks that came
    and those that came with its group's name. A rank whose member rank waits in
    another compile over a set that holds this rank (their groups differ) would
    wait for it forever: both raise instead, and mark themselves refused for the
    ranks waiting on them.
    """
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    members = [dist.get_global_rank(ranks.group, r) for r in range(ranks.world_size)]
    place = f"zerocc/compile/{'_'.join(map(str, members))}/{_COMPILES[tuple(members)]}"
    _COMPILES[tuple(members)] += 1
    store.set(f"zerocc/at/{me}", f"waiting|{place}|{','.join(map(str, members))}")
    store.set(f"{place}/group/{me}", ranks.group_name)
    store.add(f"{place}/name/{ranks.group_name}", 1)
    if store.add(f"{place}/arrived", 1) == len(members):
        store.set(f"{place}/all", "1")
    waited, poll = datetime.timedelta(), _POLL
    limit = datetime.timedelta(seconds=timeout) if timeout is not None else dist.default_pg_timeout
    while True:
        try:
            store.wait([f"{place}/all"], poll)
            break
        except (RuntimeError, dist.DistError):   # not yet (a file store's RuntimeError, a TCP store's DistStoreError)
            waited += poll
            poll = min(2 * poll, _LONGEST_POLL)   # a rank still loading data: ask the store less and less often
        problem = _waits_elsewhere(store, me, place, members)
        if problem is None and waited >= limit:
            problem = "timeout"
        if problem is not None:
            store.set(f"zerocc/at/{me}", "refused|" + problem.replace("|", "/"))
            if problem == "timeout":
                raise _not_reached(ranks, limit.total_seconds(), "no rank of its group came to meet it") from None
            raise ConfigError(problem)
    store.set(f"zerocc/at/{me}", f"met|{place}|")
    if store.add(f"{place}/name/{ranks.group_name}", 0) == len(members):
        return
    names = {rank: store.get(f"{place}/group/{rank}").decode() for rank in members}
    raise ConfigError(
        "zerocc.compile was given different process groups on different ranks (each rank's collectives pair only with "
        "those of ranks that passed the same group object, so they would wait for each other forever):\n"
        + "\n".join(f"  rank {rank}: group {name!r}{' (the default group)' if name == dist.group.WORLD.group_name else ''}"
                     for rank, name in names.items())
        + "\n  fix: pass the same group= on every rank of it (the one dist.new_group(ranks) every rank made in the "
        "same order, or mesh.get_group(dim)), or leave group= out on every rank")


def _waits_elsewhere(store, me: int, place: str, members: list[int]) -> str | None:
    """Why this rank would wait forever: a member refused, or waits in a compile over another set of ranks that
    holds this rank (neither comes to the other's). None while the members may still come."""
    others = [rank for rank in members if rank != me]
    at = [f"zerocc/at/{rank}" for rank in others]
    if not store.check(at):
        return None   # a member that has not compiled yet
    for rank, value in zip(others, store.multi_get(at)):   # one request to the store, however many ranks
        state, other_place, other_members = (value.decode().split("|") + ["", ""])[:3]
        if state == "refused":
            return f"zerocc.compile on rank {me}: rank {rank} of its group refused it:\n{other_place}"
        if state == "waiting" and other_place != place and str(me) in other_members.split(","):
            return (f"zerocc.compile was given different process groups on different ranks: rank {me} passed a group "
                    f"of ranks [{', '.join(map(str, members))}], rank {rank} one of ranks [{other_members.replace(',', ', ')}]; "
                    "each waits in its own for the other\n  fix: pass the same group= on every rank of it (the "
                    "one dist.new_group(ranks) every rank made in the same order, or mesh.get_group(dim)), or leave "
                    "group= out on every rank")
    return None


# How many groups this process made over each proper subset of the ranks (``_new_group``'s names)
_SUBGROUPS_MADE: collections.Counter = collections.Counter()


def _new_group(members: list[int], timeout: datetime.timedelta, backend: str):
    """A new group of ``members`` (global ranks), made by them alone.

    ``dist.new_group`` is a collective of every rank of the default group: over
    a subgroup (``group=dist.new_group([0, 1])`` of 4 ranks, a ``DeviceMesh``
    dimension) the ranks outside it (training their own replica over their own
    subgroup, or not compiling at all) never join it in the same order, and
    every rank hung or failed. Made by its members alone
    (``use_local_synchronization``), torch names the group by a hash of the
    members and of how many groups this process holds, which differs on a rank
    that holds another step's group too (two steps over two groups in one
    process): the members then waited for each other under different names.
    Here it is named by the members and how many such groups this process made
    over them, the same on every member.
    """
    if len(members) == dist.get_world_size():
        return dist.new_group(members, timeout=timeout, backend=backend)
    key = tuple(members)
    name = f"zerocc-{'_'.join(map(str, members))}-{_SUBGROUPS_MADE[key]}"
    _SUBGROUPS_MADE[key] += 1
    c10d = dist.distributed_c10d
    torch_names = c10d._process_group_name
    named = getattr(c10d, "GroupName", str)(name)   # a str subtype on torch 2.13, a plain str before
    c10d._process_group_name = lambda ranks, use_hashed_name: named
    try:
        return dist.new_group(members, timeout=timeout, backend=backend, use_local_synchronization=True)
    finally:
        c10d._process_group_name = torch_names


@contextlib.contextmanager
def collective_failures(ranks: Ranks, step_number: int, timeout: float | None, call: str | None = None):
    """Re-raise a failed collective as a ``RankFailureError`` naming the step and the likely cause.

    ``call`` names a method other than the step itself (``eval_forward``) whose collectives failed: the
    likely cause is then that not every rank called it.
    """
    if ranks.group is None:
        yield
        return
    if timeout is not None:   # a round trip to the store per call: only where the user asked for failure detection
        _mark(ranks, f"{call} after step {step_number}" if call else f"step {step_number}")
    try:
        yield
    except RankFailureError:
        raise
    except (RuntimeError, dist.DistError) as error:
        if not is_collective_failure(error):
            raise
        within = f"within {timeout:g} s " if timeout is not None else ""
        what = f"{call} after step {step_number}" if call else f"step {step_number}"
        why = (f"{call} is a collective{_COLLECTIVE_BECAUSE.get(call, '')}: every rank must call it at the same "
               "point of the loop, with batches of the same shapes; another rank probably did not call it (its "
               "loader ran out of batches first?), or died." if call else
               "another rank probably died, hung, is still in other code (its loop ended first: fewer batches on "
               "that rank; a batch slower than the timeout), or is running a different step (different batch "
               "shapes or code on different ranks).")
        raise RankFailureError(
            f"rank {ranks.rank} of {ranks.world_size}: a collective of {what} did not complete {within}"
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})\n"
            + (_where_the_others_are(ranks, what, error) if timeout is not None else "")   # no marks without it
            + f"  why: {why}\n"
            "  fix: look at the other ranks' output for the first error; restart every rank from the last "
            "checkpoint (zerocc.load_checkpoint). compile(..., timeout=seconds) bounds how long ranks wait. "
            "Every rank must make the same calls: give every rank the same number of batches (DistributedSampler "
            "pads; a dataset sharded by hand: stop every rank when the first runs out, zerocc's docs/guide/failures.md)."
        ) from error


def _where_the_others_are(ranks: Ranks, what: str, error: BaseException) -> str:
    """A line naming the ranks that were not in ``what`` when it failed here (the backend's error names no rank), with
    the last call each was in: every call with collectives writes where its rank is (``_mark``). An empty string where
    every rank was in it; where the store does not answer, a line saying so (its node went down)."""
    marks = _marks(ranks)
    if marks is None:   # the store's host is gone: across nodes, the whole node that hosts it (its torchrun agent)
        address = (f" ({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']})"
                   if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ else "")
        return (f"  where: the ranks' store{address} does not answer either: the node that hosts it (its "
                "torchrun agent: the --master-addr or --rdzv-endpoint node, usually rank 0's) is probably down, and "
                "its ranks with it\n")
    elsewhere = {rank: mark for rank, mark in marks.items() if rank != ranks.rank and mark != what}
    if not elsewhere:
        return ""
    text = str(error).lower()
    closed = any(marker in text for marker in ("closed", "reset by peer", "broken pipe", "connection refused"))
    state = ("a process ended: it died, was killed, or its script returned (a loop that ended first)" if closed else
             "in other code (a loop that ended first and went on to a barrier, an all_reduce, an evaluation; a batch "
             "slower than the timeout), or hung")
    last = "; ".join(f"rank {rank}'s last call: {mark or 'none'}" for rank, mark in elsewhere.items())
    return (f"  where: rank{'s' if len(elsewhere) > 1 else ''} {', '.join(map(str, elsewhere))} "
            f"{'were' if len(elsewhere) > 1 else 'was'} not in {what} ({last}): {state}\n")


def _key(ranks: Ranks, rank: int) -> str:
    return f"zerocc/in/{ranks.group_name}/{rank}"


def _mark(ranks: Ranks, what: str) -> None:
    """Write in the default group's store which call with collectives this rank is in (a few microseconds on one
    machine, a network round trip across nodes, and a line appended per call to a ``file://`` store): where a
    collective fails, the ranks left waiting read who was elsewhere. Only under ``timeout=``."""
    with contextlib.suppress(RuntimeError, ValueError, AttributeError, dist.DistError):
        dist.distributed_c10d._get_default_store().set(_key(ranks, ranks.rank), what)


def _marks(ranks: Ranks) -> dict[int, str] | None:
    """Every rank's last ``_mark`` ('' where it wrote none); None where the store does not answer (its host is gone)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        old_timeout = store.timeout
    except (RuntimeError, ValueError, AttributeError):
        return None
    try:
        store.set_timeout(datetime.timedelta(seconds=5))   # a store whose host stopped answers no request
        return {rank: store.get(_key(ranks, rank)).decode() if store.check([_key(ranks, rank)]) else ""
                for rank in range(ranks.world_size)}
    except (RuntimeError, dist.DistError):
        return None
    finally:
        with contextlib.suppress(RuntimeError, dist.DistError):
            store.set_timeout(old_timeout)


_COLLECTIVE_BECAUSE = {"zerocc.compile": " (it broadcasts rank 0's parameters)",
                       "step.eval_forward": " (it gathers the sharded parameters)",
                       "step.full_state_dict": " (it gathers the sharded parameters)",
                       "step.full_model": " (it gathers the sharded parameters)",
                       "step.close": " (it gathers the sharded parameters and optimizer state)",
                       "zerocc.save_checkpoint": " (every rank writes its shards)",
                       "zerocc.load_checkpoint": " (every rank reads its shards)"}

_MARKERS = ("gloo", "nccl", "timed out", "timeout", "connection", "closed", "peer", "socket", "broken pipe",
            "collective", "process group", "store")


def is_collective_failure(error: BaseException) -> bool:
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _MARKERS)


def agreement_lines(gm: fx.GraphModule, plan: ShardPlan | None) -> list[str]:
    """What every rank's program must have in common, one readable line per fact."""
    lines = []
    for node in g.placeholders(gm):
        if node.meta.get(g.ROLE) == g.ROLE_INPUT:
            lines.append(f"input {node.meta.get(g.INDEX)}: {_describe(node.meta.get(g.VAL))}")
    if plan is not None:
        for bucket in plan.buckets:
            segments = ",".join(f"{s.param}@{s.offset}+{s.numel}" for s in bucket.segments)
            lines.append(f"bucket {bucket.index}: {bucket.numel} x {bucket.dtype} over {bucket.shards} ranks [{segments}]")
    number = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_collective(node):
            arguments = [_describe(a.meta.get(g.VAL)) if isinstance(a, fx.Node) else repr(a) for a in node.args]
            lines.append(f"collective {number}: {node.target}({', '.join(arguments)}) -> {_describe(node.meta.get(g.VAL))}")
            number += 1
    return lines


def _is_collective(node: fx.Node) -> bool:
    """A functional collective, or one of zerocc's own (graph.is_collective: the sends and receives of an
    all-gather on gloo, passes/gather_by_send_recv.py)."""
    namespace = getattr(node.target, "namespace", None)
    return g.is_collective(node) or namespace == "_c10d_functional" and "wait_tensor" not in str(node.target)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    return repr(value)


def failed_ranks(ranks: Ranks, message: str | None) -> list[tuple[int, str]]:
    """Each rank's ``message`` (why it refused, None where all went well), exchanged in one ``all_gather_object``:
    the ranks that failed and why. Callers raise their own rank's error first, then name the others' (work one
    rank alone can refuse, before work whose collectives would wait for that rank)."""
    every: list = [message]
    if ranks.group is not None:
        every = [None] * ranks.world_size
        dist.all_gather_object(every, message, group=ranks.group)
    return [(rank, message) for rank, message in enumerate(every) if message is not None]


def raise_if_any_rank_failed(ranks: Ranks, error: BaseException | None, what: str) -> None:
    """``error`` (this rank's, or None) raised here, and a ``RankMismatchError`` naming it on every other rank: for
    work without collectives of its own (``what``), which one rank alone can fail, before work whose collectives
    would wait for that rank."""
    failed = failed_ranks(ranks, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed:
        raise RankMismatchError(
            f"rank {ranks.rank} of {ranks.world_size}: {what} failed on rank(s) {[rank for rank, _ in failed]}, so no "
            "rank compiles this program:\n" + "\n".join(
                f"  rank {rank}: {message if len(message) < 1500 else message[:1500] + ' ...'}"
                for rank, message in failed)
            + "\n  fix: the error above is that rank's own (its batch, its model or optimizer); fix it there")


def check_ranks_agree(ranks: Ranks, gm: fx.GraphModule, plan: ShardPlan | None) -> None:
    """Raise ``RankMismatchError`` on every rank if any rank compiled a program whose collectives differ."""
    if ranks.group is None:
        return
    lines = agreement_lines(gm, plan)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    digests = [None] * ranks.world_size
    dist.all_gather_object(digests, digest, group=ranks.group)   # the lines travel only when a digest differs
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differing:
        return
    gathered = [None] * ranks.world_size
    dist.all_gather_object(gathered, lines, group=ranks.group)   # every rank saw the digests: all gather again
    reference_lines = gathered[0]
    details = []
    for rank in differing[:3]:
        other = gathered[rank]
        for position in range(max(len(other), len(reference_lines))):
            mine = other[position] if position < len(other) else "(nothing)"
            theirs = reference_lines[position] if position < len(reference_lines) else "(nothing)"
            if mine != theirs:
                details.append(f"  - rank {rank} differs from rank 0 first at\n      rank {rank}: {mine}\n"
                               f"      rank 0: {theirs}")
                break
    raise RankMismatchError(
        f"ranks {differing} compiled a different step than rank 0; their collectives would not match and the "
        "step would hang or mix unrelated data:\n" + "\n".join(details) + "\n"
        "  fix: give every rank the same model code, optimizer and compile options (the batches' shapes were "
        "checked equal before compiling). If they are the same, zerocc planned the ranks differently, which is "
        "a bug: set $ZEROCC_DUMP_DIR (each rank writes its programs into rank<r>/ there) and report the two ranks' "
        "programs."
    )


def _control_device(ranks: Ranks):
    """Where the ranks' own small all-reduces run: the CPU where the group has a backend for it (gloo, also when
    named as ``"cpu:gloo"`` or ``"cpu:gloo,cuda:nccl"``), else this rank's GPU (NCCL alone)."""
    devices = {entry.split(":")[0] for entry in dist.get_backend_config(ranks.group).split(",")}
    return "cpu" if "cpu" in devices else torch.device("cuda", torch.cuda.current_device())


def every_rank_has(ranks: Ranks, found: bool) -> bool:
    """Whether every rank found what it looked for (one all-reduce; the compile cache's entry, zerocc/disk_cache.py):
    all load or all compile.

    Every compile across ranks calls it, with a cache or without (``found`` False): a cache folder set on
    some nodes only must not leave the others' compiles out of the collective. Control traffic, as below:
    the user's dispatch modes are off."""
    return bool(smallest_over_ranks(ranks, 1 if found else 0))


def smallest_over_ranks(ranks: Ranks, value: int | None) -> int | None:
    """The smallest of the ranks' ``value``s, None only where no rank has one (one all-reduce; the device budget,
    zerocc/device_budget.py, which every rank must plan against alike). Control traffic: the user's dispatch modes
    are off."""
    if ranks.group is None:
        return value
    unknown = 2 ** 62
    smallest = torch.tensor([unknown if value is None else value], dtype=torch.int64, device=_control_device(ranks))
    with _disable_current_modes():
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=ranks.group)
    return None if smallest.item() == unknown else int(smallest.item())


# What a rank can be calling when it meets the others in check_calls_agree, each with its code: every call that
# runs collectives starts there, so a rank calling another one (an evaluation or a save under `if rank == 0:`)
# fails on every rank, naming what each called, instead of pairing its collectives with the wrong ones and hanging
TRAINING_STEP = "the training step"
CALLS = (TRAINING_STEP, "step.eval_forward", "step.full_state_dict", "step.full_model", "zerocc.save_checkpoint",
         "zerocc.load_checkpoint", "step.close", "step.full_optimizer")


def check_calls_agree(ranks: Ranks, call: str, lines: Sequence[str] = (), missed: bool = False,
                      failed: BaseException | None = None, what: str = "") -> bool:
    """Raise ``RankMismatchError`` on every rank if the ranks are not all making the same ``call`` (one of
    ``CALLS``), or if any rank's batch (``lines``: shapes and dtypes) differs; return whether any rank
    ``missed`` (found no program for its batch: every rank must then compile).

    Costs one all-reduce of five int64 per call: the maximum of each rank's
    code and digest and of their negations are equal and opposite only if
    every rank has the same; the maximum of the flags says whether any rank
    missed (a branch on batch values, ``zerocc/data_guards.py``, may take
    another side on one rank only), and whether any rank ``failed`` at ``what``
    before the call's collectives (its own compile: it raises its error, every
    other rank a ``RankMismatchError`` naming it). Only on the failing path are
    the calls, lines and errors gathered. The all-reduce is control traffic, not the step's:
    it runs with the user's dispatch modes off, so a collective counter
    (``runtime/comm_counter.py``) or a memory tracker sees the step's own
    collectives only.
    """
    if ranks.group is None:
        return missed
    check_group_alive(ranks, call)
    code = CALLS.index(call) + 1
    digest = int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:7], "big")   # fits an int64
    extremes = torch.tensor([code, -code, digest, -digest, int(missed), int(failed is not None)], dtype=torch.int64,
                            device=_control_device(ranks))
    with _disable_current_modes():
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=ranks.group)
    highest_code, negated_lowest_code, highest, negated_lowest, anyone_missed, anyone_failed = extremes.tolist()
    if highest_code == code == -negated_lowest_code and highest == digest == -negated_lowest:
        if anyone_failed:
            raise_if_any_rank_failed(ranks, failed, what)
        return bool(anyone_missed)
    gathered = [None] * ranks.world_size
    dist.all_gather_object(gathered, (call, list(lines)), group=ranks.group)
    calls = [other_call for other_call, _ in gathered]
    if len(set(calls)) > 1:
        by_call: dict[str, list[int]] = {}
        for rank, other_call in enumerate(calls):
            by_call.setdefault(other_call, []).append(rank)
        details = [f"  - rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {c}" for c, r in by_call.items()]
        collective = sorted({c for c in calls if c != TRAINING_STEP})
        raise RankMismatchError(
            "the ranks met in different calls; their collectives would pair with each other's and hang or mix "
            "unrelated data:\n" + "\n".join(details) + "\n"
            f"  fix: {' and '.join(collective)} run{'s' if len(collective) == 1 else ''} collectives here: call "
            f"{'it' if len(collective) == 1 else 'them'} on every rank at the same point of the script, not under "
            "`if rank == 0:` (print or save on one rank only what every rank computed); if a rank's loader ran "
            "out of batches first, give every rank the same number of batches (DistributedSampler pads; "
            "drop_last=True)."
        )
    differing = [rank for rank, (_, other) in enumerate(gathered) if other != gathered[0][1]]
    details = [f"  - rank {rank}: {'; '.join(gathered[rank][1])}" for rank in [0, *differing[:3]]]
    if all(_only_python_values_differ(gathered[0][1], gathered[rank][1]) for rank in differing):
        raise RankMismatchError(
            f"ranks {differing} were called with other Python values in the batch than rank 0's in this call (the "
            "same shapes): a Python value is traced into the program as a constant, and the ranks compile and run "
            "one program together:\n" + "\n".join(details) + "\n"
            "  fix: pass a number that differs between ranks as a tensor (a per-rank token count: "
            "num_items_in_batch=torch.tensor(n), or the count all-reduced over the ranks first, as transformers' "
            "Trainer does with average_tokens_across_devices), and keep values forward does not read (file names, "
            "sample ids) out of the step's arguments."
        )
    raise RankMismatchError(
        f"ranks {differing} were called with a batch of other shapes than rank 0's in this call; the ranks' "
        "programs would not match and the step would hang:\n" + "\n".join(details) + "\n"
        "  fix: give every rank a batch of the same shapes at every call (the same batch size per rank: "
        "drop_last=True or pad a short last batch; the same sequence length: pad to a fixed length)."
    )


def check_group_alive(ranks: Ranks, call: str) -> None:
    """A ``ConfigError`` where the step's process group was destroyed (``dist.destroy_process_group()`` before
    ``step.close()``): torch's collectives over a destroyed group fail with "Invariant encountered: value was None"."""
    try:
        dist.get_process_group_ranks(ranks.group)
    except (KeyError, ValueError, RuntimeError):   # torch 2.13 raises KeyError for a group no longer registered
        raise ConfigError(
            f"{call} after dist.destroy_process_group(): the step's process group is gone, and {call} runs "
            "collectives over it (every rank's shards are needed)\n  fix: call dist.destroy_process_group() last, "
            "after step.close() (which hands the model and optimizer back whole) or after saving with "
            "zerocc.save_checkpoint") from None


def _only_python_values_differ(lines: Sequence[str], other: Sequence[str]) -> bool:
    """Whether two ranks' ``batch.agreement_lines`` differ in Python values alone, their tensors the same."""
    def value_of(line: str) -> str:
        return line.partition(": ")[2]
    return len(lines) == len(other) and all(
        a == b or value_of(a).startswith(PYTHON_VALUE) and value_of(b).startswith(PYTHON_VALUE)
        for a, b in zip(lines, other))


def meet(ranks: Ranks, call: str, step_number: int, timeout: float | None, failed: BaseException | None = None,
         what: str = "") -> None:
    """Before ``call`` (one of ``CALLS``) runs its collectives: every rank makes the same call here, or every rank
    fails naming what each called; a rank that never comes is a ``RankFailureError`` after ``timeout``. A rank
    that ``failed`` at ``what`` on the way (compiling the call's program) raises its error, the others name it."""
    if ranks.group is None:
        if failed is not None:
            raise failed
        return
    with collective_failures(ranks, step_number, timeout, call=call):
        check_calls_agree(ranks, call, failed=failed, what=what)
