"""How planning time grows with depth: the ZeRO paper's GPT shape (d_model 4096) at 12 to 96 layers.

    python benchmarks/plan_scaling.py [--layers 12,24,48,96] [--world-size 1024] [--plot plan_scaling.png]

Each point is one fresh ``zerocc.plan`` (capture included) of stage 3 at
1024 ranks with bf16 mixed-precision accounting, on the meta device. Prints
a table (layers, parameters, capture s, passes s, total s, s per layer, and
the process's CPU seconds for the plan and per layer: on a shared machine
wall seconds count the other processes' too) and plots total seconds
against layers.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402


def plan_once(layers: int, world_size: int):
    with torch.device("meta"):
        model = GPT(layers=layers, d_model=4096, heads=32, seq=1024, vocab=60197)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tokens = torch.zeros(1, 1024, dtype=torch.long, device="meta")
    started, cpu = time.perf_counter(), time.process_time()
    plan = zerocc.plan(model, optimizer, stage=3, world_size=world_size, example_inputs=(tokens, tokens),
                       accounting_dtype=torch.bfloat16)   # the accounting its README numbers were taken with
    return plan, time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="12,24,48,96")
    parser.add_argument("--world-size", type=int, default=1024)
    parser.add_argument("--plot", default="plan_scaling.png")
    args = parser.parse_args()
    rows = []
    print("| layers | parameters | capture s | passes s | total s | s per layer | CPU s | CPU s per layer "
          "| model states per rank (GB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for layers in [int(x) for x in args.layers.split(",")]:
        plan, seconds, cpu = plan_once(layers, args.world_size)
        report = plan.report()
        held = sum(report["model_state_bytes_per_rank"].values()) / 1e9
        rows.append((layers, seconds))
        print(f"| {layers} | {report['param_count']:,} | {plan.seconds['capture']:.1f} | {plan.seconds['passes']:.1f} "
              f"| {seconds:.1f} | {seconds / layers:.2f} | {cpu:.1f} | {cpu / layers:.3f} | {held:.3f} |", flush=True)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, axis = plt.subplots(figsize=(5, 3.5))
        axis.plot([r[0] for r in rows], [r[1] for r in rows], marker="o")
        axis.set_xlabel("layers (d_model 4096)")
        axis.set_ylabel("planning time (s)")
        axis.set_title(f"zerocc.plan, stage 3, {args.world_size} ranks")
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        figure.tight_layout()
        figure.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
