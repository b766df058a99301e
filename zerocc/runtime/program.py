"""Runs one emitted program: reads slots and the batch, calls the graph, rebinds slots."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import graph as g


@dataclasses.dataclass
class Program:
    """A compiled step: the final graph and how its arguments and results map to slots."""
    gm: fx.GraphModule
    argument_slots: list[str | None]     # per placeholder: the slot it reads, or None for a batch input
    input_positions: list[int | None]    # per placeholder: index into the batch's tensors, or None
    output_slots: list[str]              # per output after the loss: the slot it replaces

    @classmethod
    def from_graph(cls, gm: fx.GraphModule) -> "Program":
        slots, positions = [], []
        for node in g.placeholders(gm):
            if node.meta[g.ROLE] == g.ROLE_INPUT:
                slots.append(None)
                positions.append(node.meta[g.INDEX])
            else:
                slots.append(node.meta[g.SLOT])
                positions.append(None)
        return cls(gm, slots, positions, list(gm.meta[g.OUTPUT_SLOTS]))

    def run(self, slots: dict[str, torch.Tensor], batch: list) -> torch.Tensor:
        arguments = [slots[slot] if slot is not None else batch[position]
                     for slot, position in zip(self.argument_slots, self.input_positions)]
        loss, *results = self.gm(*arguments)
        del arguments
        for slot, value in zip(self.output_slots, results):
            slots[slot] = value
        return loss
