"""A model's own activation checkpointing, traced as eager runs it.

``torch.utils.checkpoint`` (and Hugging Face's ``activation_checkpointing_enable``,
built on it) saves the generator's state before a checkpointed forward and,
when backward recomputes that forward, sets the state back, draws the same
dropout masks again, and restores it. Those ``get_rng_state`` /
``set_rng_state`` calls are Python: a trace does not see them, so the traced
recomputation would draw *new* masks, and the gradients would belong to a
forward that never ran.

While the step is traced, ``traced_recomputation()`` models the generator as the
sequence of random ops the trace records. ``torch.get_rng_state()`` (CPU or
the accelerator's) returns the real state and remembers the position in that
sequence; ``set_rng_state`` with such a state moves the position back. A
random op at a position already recorded draws nothing: the program copies the
recorded draw, bit for bit what eager's rewound generator draws again, and the
generator advances at run time exactly as in eager. The cost is memory: each
rewound draw (a dropout mask) is kept from the forward to its recomputation,
where eager keeps the generator's 5 KB state.

Reentrant checkpointing (``use_reentrant=True``) delivers the gradients of the
parameters inside the checkpointed function by a backward of its own, which
``torch.autograd.grad`` (how capture differentiates the step) cannot collect:
PyTorch refuses the combination in backward, where no user line is on the
stack; the trace refuses it at the ``checkpoint`` call instead, naming it.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as checkpointing
from torch.utils._python_dispatch import TorchDispatchMode

from .analysis.remat import draws_random_numbers
from .errors import CaptureError, user_frame_here

aten = torch.ops.aten


@dataclass
class _Draw:
    """One random op of the trace and a copy of what it drew (taken before anything can write to it)."""
    func: torch._ops.OpOverload
    drawn: Any             # the op's result with its tensors copied; for an op writing in place, its written tensors
    where: str


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes in place (``bernoulli_``'s self, an ``out=`` argument)."""
    values = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    return [values[a.name] for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write and a.name in values]


def _copied(tree):
    return pytree.tree_map_only(torch.Tensor, aten.clone.default, tree)


class _Sequence(TorchDispatchMode):
    """The random ops of a trace as a sequence a position can be moved back in."""

    def __init__(self):
        super().__init__()
        self.draws: list[_Draw] = []
        self.position = 0
        self.reseeded: str | None = None   # where the model called torch.manual_seed / torch.seed, if it did

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not draws_random_numbers(func, args, kwargs):
            return func(*args, **kwargs)
        if self.reseeded is not None:
            raise CaptureError(
                f"the step reseeds the random generator at {self.reseeded} and then draws with {func} at {_where()}: "
                f"the compiled program draws from the generator as the step runs and cannot reseed it in the "
                f"middle of a step, so these random numbers would not be eager's (and a backward that reseeds to "
                f"recompute its forward, as Reformer's reversible layers do, would not see the forward's dropout "
                f"masks). Seed before calling the step, or draw nothing after the seed (dropout probability 0)")
        written = _written(func, args, kwargs)
        if self.position == len(self.draws):   # a new draw: run it, keep a copy for a rewind to replay
            result = func(*args, **kwargs)
            self.draws.append(_Draw(func, _copied(written or result), _where()))
            self.position += 1
            return result
        recorded = self.draws[self.position]
        self.position += 1
        if func is not recorded.func:
            raise CaptureError(
                f"a recomputation rewound the random generator (torch.utils.checkpoint's preserve_rng_state) and "
                f"then drew with {func} at {_where()}, where the forward drew with {recorded.func} at "
                f"{recorded.where}: zerocc replays the forward's draws and needs the same random ops in the same "
                f"order. Recompute the same code, or pass preserve_rng_state=False if new draws are intended")
        if not written:   # no draw: the recorded one stands in
            return _copied(recorded.drawn)
        for target, drawn in zip(written, recorded.drawn):
            aten.copy_.default(target, drawn)
        return written[0] if len(written) == 1 else tuple(written)


def _refuse_reentrant(*args, **kwargs):
    raise CaptureError(
        f"torch.utils.checkpoint with use_reentrant=True at {_where()}: reentrant checkpointing computes the "
        f"gradients of the parameters it recomputes by a backward of its own, which zerocc's differentiation of the "
        f"step (torch.autograd.grad) cannot collect. Pass use_reentrant=False (PyTorch's recommendation; Hugging "
        f"Face: activation_checkpointing_enable(activation_checkpointing_kwargs={{'use_reentrant': False}}), its "
        f"default)")


def _where() -> str:
    return user_frame_here() or "(no user frame found)"


@contextlib.contextmanager
def traced_recomputation():
    """Refuse reentrant checkpointing; trace ``get_rng_state``/``set_rng_state`` as positions among the random ops.

    A ``torch.manual_seed`` or ``torch.seed`` in the step is refused at the first random op drawn after it.
    """
    sequence = _Sequence()
    saved: dict[int, tuple[torch.Tensor, int]] = {}   # id of a state handed out -> (the state, its position)
    entered = []
    patched = [(torch, "get_rng_state"), (torch, "set_rng_state")]
    if hasattr(torch, "cuda"):
        patched += [(torch.cuda, "get_rng_state"), (torch.cuda, "set_rng_state")]
    originals = {(module, name): getattr(module, name) for module, name in patched}

    def getter(original):
        def get_rng_state(*args, **kwargs):
            state = original(*args, **kwargs)
            if not entered:   # draws are recorded from the first saved state on: only they can be rewound to
                sequence.__enter__()
                entered.append(sequence)
            saved[id(state)] = (state, sequence.position)
            return state
        return get_rng_state

    def setter(original):
        def set_rng_state(state, *args, **kwargs):
            if id(state) in saved and saved[id(state)][0] is state:
                sequence.position = saved[id(state)][1]
                return None
            return original(state, *args, **kwargs)
        return set_rng_state

    def reseeder(original):
        def reseed(*args, **kwargs):
            if not entered:
                sequence.__enter__()
                entered.append(sequence)
            sequence.reseeded = sequence.reseeded or _where()
            return original(*args, **kwargs)
        return reseed

    for (module, name), original in originals.items():
        setattr(module, name, getter(original) if name.startswith("get") else setter(original))
    # torch.manual_seed / torch.seed inside the step: allowed while nothing draws after them (_Sequence)
    reseeding = {(module, name): getattr(module, name) for module in (torch, torch.random) for name in ("manual_seed", "seed")}
    for (module, name), original in reseeding.items():
        setattr(module, name, reseeder(original))
    originals.update(reseeding)
    reentrant = checkpointing.CheckpointFunction.__dict__.get("apply")   # None: Function's classmethod, inherited
    checkpointing.CheckpointFunction.apply = _refuse_reentrant
    # selective checkpointing (context_fn=create_selective_checkpoint_contexts) caches every op's output under a
    # proxy mode, for torch.compile's partitioner to read the policy from the graph, and hands the cached outputs
    # back in the recomputation: the step then recomputed nothing, and a dropout in the block failed ("Tensor cached
    # during selective activation checkpoint has been mutated": its bernoulli_ writes a cached empty_like). The step
    # is traced as eager runs it: the policy's saved ops are kept, the others recomputed in the traced backward
    is_compiling = checkpointing._is_compiling
    checkpointing._is_compiling = lambda func, args, kwargs: False
    try:
        yield
    finally:
        checkpointing._is_compiling = is_compiling
        if reentrant is None:
            del checkpointing.CheckpointFunction.apply
        else:
            checkpointing.CheckpointFunction.apply = reentrant
        for (module, name), original in originals.items():
            setattr(module, name, original)
        if entered:
            sequence.__exit__(None, None, None)
