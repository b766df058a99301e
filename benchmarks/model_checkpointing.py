"""Planned live peak of a model that checkpoints its own blocks (torch.utils.checkpoint), with and without.

Six residual MLP blocks (256 -> 1024 -> 256, GELU, dropout), batch 512, one
process, stage 3: the step's ``report()["live_peak_bytes"]`` with every block
wrapped in ``checkpoint(block, x, use_reentrant=False)`` against the same model
unwrapped, at dropout 0 and 0.1. With dropout the masks are kept from the
forward to their recomputation (``zerocc/model_recomputation.py``).

    PYTHONPATH=. python benchmarks/model_checkpointing.py
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zerocc


class Blocks(nn.Module):
    def __init__(self, checkpointed: bool, dropout: float):
        super().__init__()
        self.checkpointed = checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Dropout(dropout),
                                                  nn.Linear(1024, 256)) for _ in range(6))
        self.head = nn.Linear(256, 1)

    def forward(self, x, y):
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return F.mse_loss(self.head(x), y)


def live_peak(checkpointed: bool, dropout: float) -> int:
    torch.manual_seed(0)
    model = Blocks(checkpointed, dropout)
    step = zerocc.compile(model, torch.optim.AdamW(model.parameters()), stage=3)
    batch = torch.randn(512, 256), torch.randn(512, 1)
    for _ in range(2):
        step(*batch)
    return step.report()["live_peak_bytes"]


def main() -> None:
    print("| dropout | not checkpointed (MB) | each block checkpointed (MB) |")
    print("|---|---:|---:|")
    for dropout in (0.0, 0.1):
        print(f"| {dropout} | {live_peak(False, dropout) / 1e6:.1f} | {live_peak(True, dropout) / 1e6:.1f} |")


if __name__ == "__main__":
    main()
