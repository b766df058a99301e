"""Runs one emitted program: reads slots, arenas and the batch, calls the graph, rebinds slots.

A program that releases slots (``runtime/release.py``) takes its arguments
in a list it clears, and a callback: at the release point the runtime drops
its references to the old values of the released slots, so each dies at its
last use. Before that point a failure leaves every slot as it was (the
slots are rebound only after the call returns); after it, the error says
which slots were lost.
"""
from __future__ import annotations

import dataclasses
import functools
import linecache
import operator
import weakref

import torch
import torch.fx as fx
import torch.fx.graph_module as fx_graph_module
from torch.fx._lazy_graph_module import _LazyGraphModule

from .. import graph as g
from ..autocast import outside_autocast
from ..errors import note_failing_node
from .arenas import Arenas, arena_view, is_arena_slot
from .release import releases_slots


_BATCH, _ARENA, _SLOT = "batch", "arena", "slot"


def forget_source_when_freed(gm: fx.GraphModule) -> None:
    """Drop ``gm``'s generated Python from torch's caches once ``gm`` is freed.

    torch.fx keeps the source of every module it generates code for (``_loader.eval_cache``, and an entry in
    ``linecache``), so that tracebacks show it, and never lets it go: each program a step compiles left its
    source behind (about 330 kB for a 6-layer toy GPT, megabytes for a real model) though ``max_programs``,
    an evicted ``eval_forward`` program or ``step.close()`` dropped the program, and a run whose batches
    take many shapes grew without bound. Generated now (it would be at the first run), so its name is known.
    """
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    forward = vars(type(gm)).get("forward")
    name = getattr(getattr(forward, "__code__", None), "co_filename", None)
    if name in fx_graph_module._loader.eval_cache:
        weakref.finalize(gm, _forget_source, name)


def _forget_source(name: str) -> None:
    fx_graph_module._loader.eval_cache.pop(name, None)
    linecache.cache.pop(name, None)


@dataclasses.dataclass
class Program:
    """A compiled step: the final graph and how its arguments and results map to slots."""
    gm: fx.GraphModule
    argument_slots: list[str | None]     # per placeholder: the slot (or arena) it reads, or None for a batch input
    input_positions: list[int | None]    # per placeholder: index into the batch's tensors, or None
    output_slots: list[str]              # per output after the loss: the slot it replaces
    arenas: Arenas | None = None         # where placed outputs live (passes/place_buffers.py), if any
    released_slots: tuple[str, ...] = () # slots dropped at the release point (passes/release_slots.py)
    arena_sizes: tuple = ()              # (slot, bytes, device) of each arena this program writes into
    guards: tuple = ()                   # data guards (zerocc/data_guards.py): the batches this program is for

    def __post_init__(self):
        forget_source_when_freed(self.gm)

    @functools.cached_property
    def _argument_sources(self) -> list[tuple[object, object]]:
        """Per placeholder, where its argument comes from (``_BATCH``, ``_ARENA`` or a slot) and its key there:
        decided once, not at every call."""
        return [(_BATCH, position) if slot is None else (_ARENA, slot) if is_arena_slot(slot) else (_SLOT, slot)
                for slot, position in zip(self.argument_slots, self.input_positions)]

    @classmethod
    def from_graph(cls, gm: fx.GraphModule, arenas: Arenas | None = None) -> "Program":
        """The program for ``gm``; its arenas are sized in ``arenas`` (shared by a step's programs)."""
        slots, positions, sizes = [], [], []
        for node in g.placeholders(gm):
            if node.meta[g.ROLE] == g.ROLE_INPUT:
                slots.append(None)
                positions.append(node.meta[g.INDEX])
            else:
                slots.append(node.meta[g.SLOT])
                positions.append(None)
            if node.meta[g.ROLE] == g.ROLE_ARENA:
                value = node.meta[g.VAL]
                arenas = arenas if arenas is not None else Arenas()
                sizes.append((node.meta[g.SLOT], value.numel(), value.device))
        released = tuple(n.meta[g.SLOT] for n in g.placeholders(gm) if n.meta.get(g.RELEASED)) \
            if releases_slots(gm) else ()
        program = cls(gm, slots, positions, list(gm.meta[g.OUTPUT_SLOTS]), arenas, released, tuple(sizes))
        program.fit_arenas()
        return program

    def constants(self) -> list[torch.Tensor]:
        """The tensors the program reads as constants (``get_attr``: a table the model holds that is no buffer):
        alive all along, as ``analysis/lifetimes.py`` plans them, so the first run's measurement counts them from
        the start, not from their first use."""
        return [value for node in self.gm.graph.nodes if node.op == "get_attr"
                and isinstance(value := operator.attrgetter(node.target)(self.gm), torch.Tensor)]

    def fit_arenas(self) -> None:
        """Size each arena this program writes into as it needs it: the step's programs share the arenas, and
        another one may have run (and resized them) since this one last did."""
        for slot, nbytes, device in self.arena_sizes:
            self.arenas.fit(slot, nbytes, device)

    def make_arena_views(self) -> None:
        """Fit the arenas to this program and make every view of them it places outputs in (``arena_view``), as its
        first run would.

        Called before the first run, outside the ``LiveBytesTracker`` that measures it: made inside, each view
        was two more ops through the tracker's Python dispatch (about half the ops of a placed program; a 12-layer
        GPT's first step ran ~0.5 s longer than the next, mostly the tracker). Views only, of memory the arenas
        hold: nothing the measurement counts, no value of the step's.
        """
        self.fit_arenas()
        arena_of = {node: node.meta[g.SLOT] for node in g.placeholders(self.gm) if node.meta[g.ROLE] == g.ROLE_ARENA}
        for node in self.gm.graph.nodes:
            if node.op == "call_function" and node.target is arena_view and node.args[0] in arena_of:
                arena_view(self.arenas[arena_of[node.args[0]]], *node.args[1:])

    def run(self, slots: dict[str, torch.Tensor], batch: list, on_release=None) -> torch.Tensor:
        """Run on ``slots`` and ``batch``; ``on_release()`` is called where the program starts replacing slots (its
        release point, else once it returned): from there a failure loses state (``runtime/release.py``)."""
        try:
            with outside_autocast():   # the casts a caller's autocast asked for are ops of the program (autocast.py)
                return self._run(slots, batch, on_release or (lambda: None))
        except Exception as error:
            note_failing_node(error, self.gm, "step", batch)   # the user's line, not <eval_with_key>
            raise

    def _run(self, slots: dict[str, torch.Tensor], batch: list, on_release) -> torch.Tensor:
        self.fit_arenas()   # another program may have run since
        addresses = self.arenas.addresses()
        arguments = [batch[key] if source is _BATCH else self.arenas[key] if source is _ARENA else slots[key]
                     for source, key in self._argument_sources]
        # gm.forward, not gm(...): the program is no module of the user's, so global module hooks (a user's
        # MemTracker or ModTracker, zerocc/user_tooling.py) must not see it as one called every step
        if not releases_slots(self.gm):
            loss, *results = self.gm.forward(*arguments)
            del arguments
        else:
            dropped: list[str] = []

            def release_slots() -> None:
                on_release()
                for slot in self.released_slots:
                    dropped.append(slot)
                    del slots[slot]
            try:
                loss, *results = self.gm.forward(arguments, release_slots)   # clears ``arguments``
            except BaseException as error:
                if dropped:
                    error.zerocc_lost_slots = tuple(dropped)   # CompiledStep refuses every later call
                    error.add_note(f"zerocc: the step failed after its release point (passes/release_slots.py): the "
                                   f"old values of {len(dropped)} slots ({', '.join(dropped[:3])}"
                                   f"{', ...' if len(dropped) > 3 else ''}) are gone and the step cannot go on; "
                                   "load a checkpoint")
                raise
        self.arenas.check_unmoved(addresses)
        on_release()
        for slot, value in zip(self.output_slots, results):
            slots[slot] = value
        return loss
