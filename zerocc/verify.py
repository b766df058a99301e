"""Invariant checks run after every pass when ``verify=True`` (see ``zerocc/pipeline.py``).

  - the graph lints (FX's own checks: topological order, well-formed nodes);
  - every collective is waited before its value is used: its only users are
    ``wait_tensor`` nodes, and it has one;
  - every rank issues the same collectives in the same order: a hash of the
    collective sequence (kind, shape, dtype, bucket) is compared across the
    ranks of the process group when one exists. Without one (world size 1,
    or planning) the hash is computed twice from a fresh walk of the graph,
    which catches an order that depends on anything but the graph.

Violations are collected and raised once, as a bullet list.
"""
from __future__ import annotations

import hashlib

import torch.fx as fx

from . import graph as g
from .errors import without_graph_printout


class VerificationError(AssertionError):
    """An invariant of the graph does not hold after a pass."""


def collective_fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the collectives in program order: what every rank must agree on."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        if g.is_collective(node):
            value = g.tensor_meta(node)
            shape = tuple(value.shape) if value is not None else ()
            dtype = str(value.dtype) if value is not None else ""
            digest.update(f"{g.short_name(node.target)}|{shape}|{dtype}|{node.meta.get(g.BUCKET)};".encode())
    return digest.hexdigest()


def verify_graph(gm: fx.GraphModule, ctx) -> None:
    problems = []
    try:
        gm.graph.lint()
    except Exception as error:   # FX raises RuntimeError with its own message
        problems.append(f"graph lint: {without_graph_printout(str(error))}")
    for node in gm.graph.nodes:
        if not g.is_collective(node):
            continue
        waits = [u for u in node.users if g.is_wait(u)]
        others = [u for u in node.users if not g.is_wait(u)]
        if not waits:
            problems.append(f"collective {node.name} ({g.short_name(node.target)}) is never waited")
        for user in others:
            problems.append(f"{user.name} uses collective {node.name} before it is waited")
    fingerprint = collective_fingerprint(gm)
    group = _process_group(ctx)
    if group is not None:
        import torch.distributed as dist
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, fingerprint, group=group)
        if len(set(everyone)) != 1:
            differing = [rank for rank, value in enumerate(everyone) if value != everyone[0]]
            problems.append(f"ranks {differing} issue different collectives (or in a different order) than rank 0")
    elif collective_fingerprint(gm) != fingerprint:
        problems.append("the collective order is not deterministic: two walks of the same graph disagree")
    if problems:
        raise VerificationError("the graph breaks invariants:\n" + "\n".join(f"  - {p}" for p in problems))


def _process_group(ctx):
    """The real process group of the compilation, or None (world size 1, or a planning placeholder)."""
    if ctx.world_size <= 1 or not ctx.group_name or getattr(ctx, "planning", False):
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group
    try:
        return _resolve_process_group(ctx.group_name)
    except Exception:
        return None
