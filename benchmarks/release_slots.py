"""The step's and the optimizer phase's live peak with and without ``release_slots``, stages 0-3 (zerocc.plan).

    PYTHONPATH=. python benchmarks/release_slots.py --layers 2 --batch 4 --world-size 2

Prints a markdown table (bytes; docs/guide/memory-pools.md, "The old state dies at its last use").
Planned with memory pools off: under pools (the default) the arena's layout, not the slots' lifetimes, sets the
peaks, and both columns read the same. At stage 3 ``overlap_updates`` runs most bucket updates before the release
point (the last wait), where the old state is still held: ``--disable overlap_updates`` shows the pass alone.
"""
from __future__ import annotations

import argparse

import torch

import zerocc
from examples.gpt import GPT, random_batch


def peaks(model, optimizer, batch, stage, world_size, disable) -> tuple[int, int]:
    """(the step's live peak, the optimizer phase's) in the memory plan."""
    plan = zerocc.plan(model, optimizer, stage=stage, world_size=world_size, example_inputs=batch,
                       disable=disable, memory_pools=False).memory_plan
    total = plan.live_bytes_by_role().total()
    return plan.live_peak_bytes, max(v for v, phase in zip(total, plan.phases) if phase == "optimizer")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--disable", default="", help="passes disabled in both columns, comma-separated")
    args = parser.parse_args()
    also = tuple(name for name in args.disable.split(",") if name)
    torch.manual_seed(0)
    model = GPT(layers=args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = random_batch(torch.Generator().manual_seed(0), args.batch)
    print("| stage | step peak before | after | change (MB) | optimizer-phase peak before | after | change (MB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for stage in (0, 1, 2, 3):
        (step_before, phase_before), (step_after, phase_after) = (
            peaks(model, optimizer, batch, stage, args.world_size, also + disable) for disable in (("release_slots",), ()))
        print(f"| {stage} | {step_before:,} | {step_after:,} | {(step_after - step_before) / 1e6:+.1f} | "
              f"{phase_before:,} | {phase_after:,} | {(phase_after - phase_before) / 1e6:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
