"""Memory arenas: one byte tensor per pool of the memory plan, allocated once, outputs placed inside.

``passes/place_buffers.py`` rewrites the program so that each placed op
writes into ``arena_view(arena, offset, size, stride, dtype)`` through its
``out=`` variant; the arenas reach the program as arguments (placeholders
with role ``graph.ROLE_ARENA``). One ``Arenas`` serves every program of a
compiled step (the first step's and the steady state's never run at once),
each arena sized to the program about to run: reallocated only when the
program that runs changes to one planning another size (the first step to
the steady state, a new batch shape). Grown to the largest size any program
planned, the arena put the steady state above its planned peak (the first
step's arena was larger) and a memory budget did not hold.
"""
from __future__ import annotations

import torch


def arena_slot(pool: str) -> str:
    """The name the program's arena placeholder reads (``arena:activations``)."""
    return f"arena:{pool}"


def is_arena_slot(slot: str | None) -> bool:
    return slot is not None and slot.startswith("arena:")


def arena_view(arena: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``size``, ``stride`` and ``dtype`` over the bytes of ``arena`` from ``offset`` on.

    Made once per arena and placement, then kept on the arena: a program places about a thousand outputs per
    step (a 12-layer GPT), and two view ops each were host time at every step (on a GPU, step time). A new
    arena (``Arenas.fit``) starts with none. A kept view whose shape an op changed is made again."""
    views = arena.__dict__.get("_zerocc_views")
    if views is None:
        views = arena.__dict__["_zerocc_views"] = {}
    key = (offset, size, stride, dtype)
    view = views.get(key)
    if view is None or view.shape != size or view.stride() != stride:
        # offsets are multiples of 64 bytes (memory_plan.ALIGNMENT_BYTES): every dtype's element divides them
        view = views[key] = arena.view(dtype).as_strided(size, stride, offset // dtype.itemsize)
    return view


class Arenas:
    """The arenas of one compiled step, by slot name (``arena:activations``), each the size the last program needs."""

    def __init__(self):
        self._tensors: dict[str, torch.Tensor] = {}

    def fit(self, slot: str, nbytes: int, device: torch.device) -> None:
        """Make the arena ``slot`` exactly ``nbytes`` long on ``device``."""
        held = self._tensors.get(slot)
        if held is not None and held.numel() == nbytes and held.device == torch.device(device):
            return
        self._tensors.pop(slot, None)   # let the old one go before the larger one is allocated
        # uninitialized on purpose: every placed op writes its output before anything reads it
        self._tensors[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __getitem__(self, slot: str) -> torch.Tensor:
        return self._tensors[slot]

    def addresses(self) -> dict[str, int]:
        """Where each arena's memory is: an op that resized a view of it past its end would have moved it."""
        return {slot: t.untyped_storage().data_ptr() for slot, t in self._tensors.items()}

    def check_unmoved(self, addresses: dict[str, int]) -> None:
        """Raise if a program's op reallocated an arena (freeing memory collectives in flight may still write)."""
        moved = [slot for slot, address in self.addresses().items() if addresses.get(slot, address) != address]
        if moved:
            raise RuntimeError(
                f"zerocc: an op reallocated the memory arena(s) {', '.join(moved)} while the step ran: an out= kernel "
                "resized its output (a view of the arena) past the arena's end. This is a zerocc bug: the op belongs "
                "in analysis/kernels.py's SCRATCH_OUT. Run with memory_pools=False meanwhile")

    def clear(self) -> None:
        """Let every arena go (``step.close()``: no program of the step runs again)."""
        self._tensors.clear()

    def tensors(self) -> list[torch.Tensor]:
        return list(self._tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())
