"""zerocc's peak-vs-step-time curve under a sweep of memory budgets, beside every configuration a peer user would try.

    pip install torch==2.13.0 -e ".[bench]"
    torchrun --standalone --nproc_per_node 2 benchmarks/frontier.py [--model 5m|98m] [--points 8]

The budgets: ``zerocc.plan`` of the same GPT, optimizer and batch at this
world size (fake tensors, no process group traffic) gives the two ends of what
``memory_budget`` can reach at stage 3: the smallest peak the remat planner
reaches (``MemoryBudgetError.smallest_peak_bytes`` of a 1-byte budget) and the
peak of the fastest plan (a budget no plan reaches: every forward gather kept
for backward, nothing recomputed). ``--points`` budgets are spread evenly
between the two, ends included (the lowest 0.2% above the floor); zerocc-3
without a budget is measured too.

The peers, each as a user would configure it for memory: DDP, with and without
per-block activation checkpointing; FSDP2 with ``reshard_after_forward`` True
and False, each with and without it; DeepSpeed ZeRO 1, 2 and 3. Every system
is built, measured and timed by ``compare.measure`` in one interleaved run:
the same data, the same MemTracker peak of one steady step, the same median of
rotating rounds.

Writes benchmarks/results/frontier-<model>.{md,json,png} on rank 0: the table,
and for every peer the fastest zerocc point at most as large (its step time
as a ratio to the peer's): a ratio above 1, or no zerocc point as lean,
names a peer zerocc's curve does not beat on both axes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare  # noqa: E402  (sets DeepSpeed's CPU environment before torch is imported)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402

PEERS = ("DDP", "DDP+AC", "FSDP2", "FSDP2+AC", "FSDP2-noreshard", "FSDP2-noreshard+AC",
         "DeepSpeed-1", "DeepSpeed-2", "DeepSpeed-3")


def budget_ends(rank: int, world: int) -> tuple[int, int]:
    """(smallest reachable peak, peak of the fastest plan) of zerocc-3 on this model, batch and world size.

    Each rank plans itself (``zerocc.plan(rank=...)``: ranks own different optimizer pieces, so their
    peaks differ by a few KB) and the highest over ranks is taken, as a compiled step decides."""
    model = GPT(**compare.MODEL)
    optimizer = compare.make_optimizer(model.parameters())
    tokens, targets = compare.model_batch(torch.Generator().manual_seed(0))

    def plan(memory_budget):
        return zerocc.plan(model, optimizer, stage=3, world_size=world, rank=rank, example_inputs=(tokens, targets),
                           memory_budget=memory_budget)
    try:
        plan(1)
        raise AssertionError("a 1-byte budget was met")
    except zerocc.MemoryBudgetError as error:
        floor = error.smallest_peak_bytes
    ends = torch.tensor([floor, plan(1 << 50).remat_plan.peak_bytes], dtype=torch.float64)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)
    return int(ends[0]), int(ends[1])


def zerocc_name(budget: int) -> str:
    return f"zerocc-3~{budget / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(compare.MODELS), default="5m")
    parser.add_argument("--points", type=int, default=8, help="budgets between the reachable ends, ends included")
    parser.add_argument("--peers", default=",".join(PEERS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="steps per system per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    args.malloc = "default"
    torch.set_num_threads(args.threads)
    compare.select_model(args.model)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    floor, fastest = budget_ends(rank, world)
    # the lowest budget 0.2% above the floor: a compiled step decides on the highest peak over ranks for every
    # candidate plan, which can land a few KB above the highest of the ranks' own floors
    floor = floor + floor // 500
    budgets = sorted({floor + (fastest - floor) * i // max(args.points - 1, 1) for i in range(args.points)})
    if rank == 0:
        print(f"budgets from {floor:,} (smallest reachable peak) to {fastest:,} bytes (fastest plan): "
              f"{', '.join(f'{b / 2**20:.1f} MiB' for b in budgets)}", flush=True)
    builders = {name: compare.system(name) for name in args.peers.split(",") if name}
    builders["zerocc-3"] = compare.system("zerocc-3")
    for budget in budgets:
        builders[zerocc_name(budget)] = compare.build_zerocc(3, memory_budget=budget)
    results, failed = compare.measure(list(builders), builders, args)
    if rank == 0:
        write(results, failed, {zerocc_name(b): b for b in budgets}, args, world)
    dist.destroy_process_group()


def peak_mib(result) -> float:
    return max(result["peak_live_bytes_per_rank"]) / 2**20


def leanest_faster(results, peer) -> tuple[str, float] | None:
    """The fastest zerocc point whose peak is at most the peer's, and its step time / the peer's."""
    p = results[peer]
    fitting = [n for n in results if n.startswith("zerocc") and peak_mib(results[n]) <= peak_mib(p)]
    if not fitting:
        return None
    best = min(fitting, key=lambda n: results[n]["step_seconds_median"])
    return best, results[best]["step_seconds_median"] / p["step_seconds_median"]


def write(results, failed, budgets, args, world) -> None:
    os.makedirs(args.out, exist_ok=True)
    params = sum(p.numel() for p in GPT(**compare.MODEL).parameters())
    ddp = results.get("DDP")
    lines = [f"GPT {params / 1e6:.2f}M parameters ({args.model}), {compare.BATCH[0]} x "
             f"{compare.MODEL.get('seq', 128)} tokens per rank, AdamW, {world} gloo ranks, {args.threads} thread(s) "
             f"per rank; median of {args.repeats} interleaved rounds of {args.steps} steps after {args.warmup} "
             f"warm-up steps; peak: MemTracker over one steady step (compare.py's method, the same for every "
             f"system).", "",
             "| system | budget MiB | step ms | vs DDP | CPU ms / rank | peak live MiB / rank | comm MiB / step | "
             "collectives / step | final loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in sorted(results.items(), key=lambda item: (not item[0].startswith("zerocc"), peak_mib(item[1]))):
        ratio = f"{r['step_seconds_median'] / ddp['step_seconds_median']:.2f}" if ddp else "-"
        budget = f"{budgets[name] / 2**20:.1f}" if name in budgets else "-"
        lines.append(f"| {name} | {budget} | {r['step_seconds_median'] * 1e3:.1f} | {ratio} | "
                     f"{r['cpu_seconds_per_rank_mean'] * 1e3:.1f} | {peak_mib(r):.1f} | "
                     f"{sum(r['comm_bytes_per_step'].values()) / 2**20:.1f} | "
                     f"{sum(r['collectives_per_step'].values())} | {r['final_loss']:.6f} |")
    for name, why in failed.items():
        lines.append(f"| {name} | | failed: {why[:200]} | | | | | | |")
    lines += ["", "Each peer against zerocc's curve: the fastest zerocc point at most as large as the peer.", "",
              "| peer | peak MiB | step ms | fastest zerocc point at most as large | its step time / the peer's |",
              "|---|---:|---:|---|---:|"]
    unbeaten = []
    for peer in (n for n in results if not n.startswith("zerocc")):
        found = leanest_faster(results, peer)
        r = results[peer]
        point, ratio = found if found else ("none as lean", None)
        lines.append(f"| {peer} | {peak_mib(r):.1f} | {r['step_seconds_median'] * 1e3:.1f} | {point} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}'} |")
        if ratio is None or ratio > 1:
            unbeaten.append(peer)
    lines += ["", f"Peers faster than every zerocc point at most as large, or leaner than all of them: "
                  f"{', '.join(unbeaten) or 'none'}."]
    table = "\n".join(lines) + "\n"
    print(table)
    stem = os.path.join(args.out, f"frontier-{args.model}")
    with open(stem + ".md", "w") as f:
        f.write(table)
    with open(stem + ".json", "w") as f:
        json.dump({"results": results, "failed": failed, "budgets": budgets, "args": vars(args)}, f, indent=1)
    try:
        plot(results, stem + ".png", f"GPT {params / 1e6:.0f}M, AdamW, {world} gloo ranks (CPU)")
    except ImportError as error:
        print(f"no plot ({error}); pip install -e '.[bench]'")


def plot(results, path, title) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axis = plt.subplots(figsize=(8, 5.5))
    curve = sorted((n for n in results if n.startswith("zerocc-3~")), key=lambda n: peak_mib(results[n]))
    axis.plot([peak_mib(results[n]) for n in curve], [results[n]["step_seconds_median"] * 1e3 for n in curve],
              "o-", color="tab:green", label="zerocc-3, memory_budget swept")
    if "zerocc-3" in results:
        r = results["zerocc-3"]
        axis.plot([peak_mib(r)], [r["step_seconds_median"] * 1e3], "*", color="tab:green", markersize=14,
                  label="zerocc-3, no options")
    markers = {"DDP": "s", "FSDP2": "^", "DeepSpeed": "D"}
    for name, r in results.items():
        if name.startswith("zerocc"):
            continue
        family = next(k for k in markers if name.startswith(k))
        axis.plot([peak_mib(r)], [r["step_seconds_median"] * 1e3], markers[family],
                  color="tab:orange" if family == "DeepSpeed" else "tab:blue")
        axis.annotate(name, (peak_mib(r), r["step_seconds_median"] * 1e3), textcoords="offset points",
                      xytext=(5, 4), fontsize=8)
    axis.set_xlabel("peak live tensor MiB per rank (MemTracker)")
    axis.set_ylabel("median step time (ms)")
    axis.set_title(title + ": lower left is better")
    axis.legend(loc="best")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
