"""``explain()``: what every pass decided, in a few lines a person can read.

Reads only plain data: the plans passes left on ``ctx`` (shard plan, and,
when those passes exist, a schedule, a checkpoint plan, a memory plan), the
per-pass notes and counts, and the report. Plans it does not know are shown
by their own ``summary()`` or ``str()``.
"""
from __future__ import annotations

GB = 1e9   # decimal, as the ZeRO paper counts


def human(nbytes: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{int(nbytes)} B"


def explain(ctx, history, report: dict) -> str:
    lines = [f"stage {report['stage']}, world size {report['world_size']}, rank {report['rank']}: "
             f"{report['param_count']:,} parameters ({human(report['param_bytes'])})"]
    plan = ctx.shard_plan
    if plan is not None:
        sizes = [b.nbytes for b in plan.buckets]
        lines.append(f"buckets: {len(sizes)} (target {human(plan.bucket_bytes)}; smallest {human(min(sizes))}, "
                     f"largest {human(max(sizes))}), {plan.padding_elements:,} padding elements, "
                     f"{sum(1 for _ in plan.owned_pieces())} parameter pieces updated on this rank")
    comm = report["comm_bytes_per_step"]
    counts = report.get("collectives_per_step", {})
    moved = ", ".join(f"{counts.get(kind, 0)} {kind} ({human(nbytes)})" for kind, nbytes in comm.items() if nbytes)
    lines.append(f"collectives per step: {moved or 'none'}; {human(sum(comm.values()))} in all"
                 + (f" = {sum(comm.values()) / report['param_bytes']:.2f}x the parameter bytes" if report["param_bytes"] else ""))
    for attribute, title in (("schedule", "schedule"), ("remat_plan", "recomputed tensors"),
                             ("memory_plan", "memory plan")):
        decided = getattr(ctx, attribute, None)
        if decided is not None:
            summary = decided.summary() if hasattr(decided, "summary") else str(decided)
            lines.append(f"{title}: {summary}")
    lines.append("passes:")
    for shot in history:
        changes = ", ".join(f"{'+' if v > 0 else ''}{v} {k}" for k, v in sorted(shot.changes.items()) if k in _INTERESTING)
        detail = "; ".join(part for part in (shot.note, changes) if part)
        timing = f" [{shot.seconds:.1f} s]" if shot.seconds else ""
        lines.append(f"  {shot.index:02d} {shot.name}{timing}: {detail or 'no change'}")
    held = report["model_state_bytes_per_rank"]
    lines.append("model states per rank: " + ", ".join(f"{k} {human(v)}" for k, v in held.items())
                 + f"; total {human(sum(held.values()))}")
    if report.get("accounting", "as compiled") != "as compiled":
        lines.append(f"  ({report['accounting']})")
    memory_plan = getattr(ctx, "memory_plan", None)
    if memory_plan is not None:
        lines.append(f"predicted peak memory: {human(memory_plan.planned_peak_bytes)} planned; at the live peak "
                     f"({human(memory_plan.live_peak_bytes)}): " + _alive_at_live_peak(memory_plan))
    return "\n".join(lines)


_INTERESTING = {"all_gather_into_tensor", "all_gather_by_send_recv", "reduce_scatter_tensor", "all_to_all_single", "all_reduce", "broadcast",
                "wait_tensor", "unshard", "reduce_gradient"}


def _alive_at_live_peak(memory_plan) -> str:
    """The roles alive where the plan's live bytes peak, largest first."""
    alive = sorted(memory_plan.alive_at_live_peak(), key=lambda item: -item[1])
    return ", ".join(f"{role} {human(nbytes)}" for role, nbytes in alive) or "nothing"
