"""Stage 3 with gradient accumulation: what keeping the gathered parameters across micro-batches costs.

Plans (``zerocc.plan``, fake tensors, no devices) the benchmark GPT at stage 3
on N ranks with K micro-batches of the same size (the batch grows with K) and
prints, per K: the gathered-parameter pool's peak (its lower bound: the most
gathered bytes alive at once), the step's live peak, and the bytes all-gathered
per step, with ``gather_per_micro_batch`` on (the default: every micro-batch
gathers again) and off (one gather for all forwards, one for all backwards).

    PYTHONPATH=. python benchmarks/accumulation_gathers.py --layers 6 --world-size 8
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import zerocc  # noqa: E402
from gpt import GPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accumulation", default="1,2,4")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(layers=args.layers)
    rows = []
    for k, per_micro_batch in [(int(x), mode) for x in args.accumulation.split(",") for mode in (True, False)]:
        if k == 1 and not per_micro_batch:
            continue
        tokens = torch.zeros(args.micro_batch * k, 128, dtype=torch.long)
        plan = zerocc.plan(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=3,
                           world_size=args.world_size, example_inputs=(tokens, tokens), grad_accumulation=k,
                           gather_per_micro_batch=per_micro_batch, memory_pools=False)
        # pools off: under memory pools (the default) gathered parameters share one arena with activations and
        # buckets, and no pool of that name is left to read (the column read 0 when pools became the default)
        memory = plan.memory_plan
        gathered = next(p.lower_bound_bytes for p in memory.pools if p.name == "gathered parameters")
        report = plan.report()
        rows.append((k, per_micro_batch, gathered, memory.live_peak_bytes, report["comm_bytes_per_step"]["all_gather"],
                     report["param_bytes"]))
    print(f"GPT {args.layers} layers, stage 3, {args.world_size} ranks, micro-batch {args.micro_batch} x 128 tokens")
    print("| K | gather_per_micro_batch | gathered parameters peak | live peak | all_gather bytes / step | parameter bytes |")
    print("|---:|---|---:|---:|---:|---:|")
    for k, per_micro_batch, gathered, live, moved, params in rows:
        print(f"| {k} | {per_micro_batch} | {gathered:,} | {live:,} | {moved:,} | {params:,} |")


if __name__ == "__main__":
    main()
