"""Per-rank model-state bytes of each ZeRO stage, from zerocc's report, next to the ZeRO paper's formulas.

    torchrun --standalone --nproc_per_node 2 benchmarks/model_states.py

fp32 training with Adam holds, per parameter, 4 bytes of parameter, 4 of
gradient and 8 of optimizer state (K = 8: exp_avg, exp_avg_sq). The paper's
formulas, in fp32 terms: stage 0: 16P, stage 1: 8P + 8P/N, stage 2: 4P + 12P/N,
stage 3: 16P/N. Adam's per-piece step counters (4 bytes each) and padding are
the only extra bytes.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import zerocc  # noqa: E402
from gpt import GPT, random_batch  # noqa: E402


def formula(stage: int, params: int, world: int) -> int:
    p, n = params, world
    return {0: 16 * p, 1: 8 * p + 8 * p // n, 2: 4 * p + 12 * p // n, 3: 16 * p // n}[stage]


def main() -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    rows = []
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = GPT()
        step = zerocc.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), stage=stage)
        generator = torch.Generator().manual_seed(rank)
        for _ in range(2):   # the second step compiles the steady state (optimizer state exists)
            step(*random_batch(generator, 2))
        report = step.report()
        held = report["model_state_bytes_per_rank"]
        total = sum(held.values())
        expected = formula(stage, report["param_count"], world)
        rows.append((stage, held["params"], held["grads"], held["optimizer"], total, expected, total / expected))
    if rank == 0:
        print(f"GPT with {report['param_count']:,} parameters (P), fp32, AdamW, {world} ranks; bytes per rank\n")
        print("| stage | params | grads | optimizer | total | paper formula | ratio |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        names = {0: "16P", 1: "8P + 8P/N", 2: "4P + 12P/N", 3: "16P/N"}
        for stage, params, grads, optimizer, total, expected, ratio in rows:
            print(f"| {stage} | {params:,} | {grads:,} | {optimizer:,} | {total:,} | {expected:,} ({names[stage]}) | {ratio:.4f} |")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
