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

A size the data decides (the tokens an MoE routed to an expert, counted with
``.tolist()`` or made by ``torch.where``) is an unbacked symbol, and the
recomputation counts it again as a new one: checkpoint's check that each saved
tensor was recomputed with the same shape asked whether the two symbols are
equal, a question no trace can answer ("Could not guard on data-dependent
expression Eq(u5, u10)", with no user line). Eager's recomputation gives the
same sizes, so the trace asserts them equal instead (``torch._check``: a
run-time assert in the program), and backward then mixes the two tensors'
sizes as eager does.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint as checkpointing
from torch.utils._python_dispatch import TorchDispatchMode

from .analysis.remat import draws_random_numbers
from .errors import CaptureError, innermost_frame, is_users, user_frame_here

aten = torch.ops.aten


@dataclass
class _Draw:
    """One random op of the trace and a copy of what it drew (taken before anything can write to it)."""
    func: torch._ops.OpOverload
    drawn: Any             # the op's result with its tensors copied; for an op writing in place, its written tensors
    where: str
    signature: Any = None  # _signature of its arguments: a replay must draw as many numbers alike


def _signature(args, kwargs):
    """An op's arguments as a replay compares them: tensors by shape and dtype; None where a size is symbolic."""
    def one(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype)
        return "generator" if isinstance(value, torch.Generator) else value
    signature = pytree.tree_map(one, (args, kwargs))
    symbolic = any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in pytree.tree_leaves(signature))
    return None if symbolic else signature


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
        self.rewound_at: str | None = None   # where the step last set back a state torch.get_rng_state gave

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not draws_random_numbers(func, args, kwargs) or _draws_from_its_own_generator(func, args, kwargs):
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
            self.draws.append(_Draw(func, _copied(written or result), _where(), _signature(args, kwargs)))
            self.position += 1
            return result
        recorded = self.draws[self.position]
        self.position += 1
        signature = _signature(args, kwargs)
        if func is not recorded.func or (None not in (signature, recorded.signature) and signature != recorded.signature):
            at = f" at {self.rewound_at}" if self.rewound_at else ""
            raise CaptureError(
                f"the step rewound the random generator{at} (torch.set_rng_state with a state torch.get_rng_state "
                f"gave: torch.random.fork_rng, torch.utils.checkpoint's preserve_rng_state) and then drew with {func} "
                f"at {_where()}, where the forward drew with {recorded.func} at {recorded.where} before the rewind"
                f"{'' if func is not recorded.func else ' on other sizes or arguments'}: zerocc replays the draws "
                f"made since the saved state and needs the same random ops, on the same sizes, in the same order. "
                f"Draw the same ops again; to draw without disturbing torch's generator, draw from a torch.Generator "
                f"of your own instead of inside fork_rng; in a checkpoint, recompute the same code or pass "
                f"preserve_rng_state=False if new draws are intended")
        if not written:   # no draw: the recorded one stands in
            return _copied(recorded.drawn)
        for target, drawn in zip(written, recorded.drawn):
            aten.copy_.default(target, drawn)
        return written[0] if len(written) == 1 else tuple(written)


# the states the trace gives a generator after each draw from it (manual_seed of these): a state the step's own code
# saved and sets back, or a seed it sets, is then another state at the next draw
_MARKER_SEED = 0x5EED_0F_2E2000CC


def _generator_argument(func, args, kwargs) -> torch.Generator | None:
    for argument, value in zip(func._schema.arguments, args):
        if argument.name == "generator" and value is not None:
            return value
    return kwargs.get("generator")


def _draws_from_its_own_generator(func, args, kwargs) -> bool:
    """Whether a random op draws from a ``torch.Generator`` of the user's (``generator=self.gen``), which
    ``torch.set_rng_state`` and ``torch.manual_seed`` leave alone: a recomputation draws from it anew, as eager."""
    generator = _generator_argument(func, args, kwargs)
    if generator is None:
        return False
    defaults = (torch.default_generator, *(torch.cuda.default_generators if torch.cuda.is_available() else ()))
    return all(generator._cdata != default._cdata for default in defaults)


def generator_of(func, args, kwargs) -> torch.Generator | None:
    """The generator a random op draws from: its ``generator`` argument, else its device's default one."""
    generator = _generator_argument(func, args, kwargs)
    if generator is not None:
        return generator
    device = kwargs.get("device")
    if device is None:
        device = next((t.device for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)), torch.device("cpu"))
    device = torch.device(device)
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None


def generators_reached(model, loss_fn, inputs) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the step may draw from besides the default ones: those the model's modules,
    the globals their ``forward`` names and the loss function hold (where ``program_cache.python_sources`` looks
    for the values a trace reads), and those in the batch."""
    from .program_cache import python_sources, source_items
    found = [value for value in pytree.tree_leaves(list(inputs)) if isinstance(value, torch.Generator)]
    for _, namespace, names in python_sources(model, loss_fn):
        found += [value for _, value in source_items(namespace, names) if isinstance(value, torch.Generator)]
    return found


class _SetGenerators:
    """Refuses a draw from a generator the step itself seeded or set (``self.gen.manual_seed(0)``,
    ``torch.default_generator.set_state(saved)``, ``torch.set_rng_state`` with a state of its own).

    A trace runs such a call once, before the program first runs, and the program's draws do not advance the
    real generator while it is traced: the program would draw on from where the generator was, every step, where
    eager draws from the state just set. Python cannot patch a generator's methods, so the states tell: after each
    draw the trace gives the generator a state of its own (``_MARKER_SEED``), and a draw that finds another state
    was preceded by a set. Each generator gets back its state from before the trace.

    It sees the draws from inside the trace's fake mode (``fake_kernels.ZeroccFakeTensorMode.draw_observer``), which
    every op passes anyway: a dispatch mode of its own had every op of the trace pass one more Python frame (the 98M
    GPT's trace took 0.15 s longer).
    """

    def __init__(self, known):
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}   # _cdata -> (generator, state before)
        self.expected: dict[int, torch.Tensor] = {}   # the state each should have at its next draw
        self.last_draw: dict[int, str] = {}
        self.draws = 0
        for generator in known:
            self._know(generator, mark=True)

    def _know(self, generator, mark=False):
        if generator._cdata not in self.generators:
            self.generators[generator._cdata] = (generator, generator.get_state())
            if mark:   # known before the step: a set before its first draw then changes its state, whatever it sets
                self._mark(generator)
            else:
                self.expected[generator._cdata] = generator.get_state()

    def _mark(self, generator):
        self.draws += 1
        generator.manual_seed(_MARKER_SEED + self.draws)
        self.expected[generator._cdata] = generator.get_state()

    def _error(self, key, where):
        since = f"the draw at {self.last_draw[key]}" if key in self.last_draw else "the step's start"
        return CaptureError(
            f"the step seeds or sets the state of a random generator between {since} and {where}: the compiled "
            f"program draws from the generator as the step runs, and a seed or state set inside the step "
            f"(Generator.manual_seed, Generator.set_state, torch.default_generator.set_state, torch.set_rng_state "
            f"with a state of your own) runs once, while tracing, so the draws would not be eager's. Seed or set the "
            f"generator before calling the step; to draw without disturbing a generator, draw from a torch.Generator "
            f"of your own")

    def draw(self, func, args, kwargs, run):
        """``run()``, the fake mode's dispatch of ``func``, an op tagged as seeded: checked first if it draws."""
        if not draws_random_numbers(func, args, kwargs):
            return run()
        generator = generator_of(func, args, kwargs)
        if generator is None:
            return run()
        self._know(generator)
        key = generator._cdata
        if not torch.equal(generator.get_state(), self.expected[key]):
            raise self._error(key, _where())
        result = run()
        self._mark(generator)
        self.last_draw[key] = _where()
        return result

    def finish(self, failed: bool) -> None:
        """Give each generator its state from before the trace back, but one the step set and never drew from
        (a ``torch.manual_seed`` in forward with nothing drawn after it); refuse a set after a generator's last
        draw."""
        changed = []
        for key, (generator, state) in self.generators.items():
            if not torch.equal(generator.get_state(), self.expected[key]):
                changed.append(key)
                if key not in self.last_draw:
                    continue
            generator.set_state(state)
        drawn = [key for key in changed if key in self.last_draw]
        if drawn and not failed:
            raise self._error(drawn[0], "the step's end")


class _RecomputedShape(tuple):
    """A saved tensor's shape as checkpoint compares it with the recomputed one's: sizes the data decides are
    asserted equal (``torch._check``), not guarded on; any other difference is one, as in eager."""

    def __eq__(self, other):
        if not isinstance(other, tuple) or len(self) != len(other):
            return False
        for saved, recomputed in zip(self, other):
            if isinstance(saved, torch.SymInt) or isinstance(recomputed, torch.SymInt):
                torch._check(saved == recomputed, lambda: "a size the data decides changed in the recomputation")
            elif saved != recomputed:
                return False
        return True

    def __ne__(self, other):
        return not self == other

    __hash__ = tuple.__hash__


def _recomputation_metadata(tensor: torch.Tensor) -> dict:
    """``torch.utils.checkpoint``'s default determinism check (shape, dtype, device), its shape a
    ``_RecomputedShape``."""
    return {"shape": _RecomputedShape(tensor.shape), "dtype": tensor.dtype, "device": tensor.device}


def _refuse_reentrant(*args, **kwargs):
    raise CaptureError(
        f"torch.utils.checkpoint with use_reentrant=True (PyTorch's default where use_reentrant is not passed) at "
        f"{_where()}: reentrant checkpointing computes the "
        f"gradients of the parameters it recomputes by a backward of its own, which zerocc's differentiation of the "
        f"step (torch.autograd.grad) cannot collect. Pass use_reentrant=False (PyTorch's recommendation; Hugging "
        f"Face: activation_checkpointing_enable(activation_checkpointing_kwargs={{'use_reentrant': False}}), its "
        f"default)")


def _outside_python(path: str) -> bool:
    from .disk_cache import _in_python_itself
    return is_users(path) and not _in_python_itself(path)


def _where() -> str:
    return user_frame_here() or "(no user frame found)"


@contextlib.contextmanager
def traced_recomputation(fake_mode, generators=()):
    """Refuse reentrant checkpointing; trace ``get_rng_state``/``set_rng_state`` as positions among the random ops.

    A ``torch.manual_seed`` or ``torch.seed`` in the step is refused at the first random op drawn after it; a
    draw from a generator the step seeded or set otherwise (``_SetGenerators``; ``generators``: those the step may
    reach besides the default ones, whose states before the step tell a set before their first draw) too; the
    draws are seen in ``fake_mode``, the trace's.
    """
    defaults = [torch.default_generator]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        defaults += list(torch.cuda.default_generators)
    set_generators = _SetGenerators([*defaults, *generators])
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
                # the user's line, not contextlib's (fork_rng sets the state back in its generator's exit)
                sequence.rewound_at = innermost_frame(traceback.extract_stack(), _outside_python)
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

    # torch.manual_seed / torch.seed inside the step: allowed while nothing draws after them (_Sequence)
    reseeding = {(module, name): getattr(module, name) for module in (torch, torch.random) for name in ("manual_seed", "seed")}
    reentrant = checkpointing.CheckpointFunction.__dict__.get("apply")   # None: Function's classmethod, inherited
    is_compiling = checkpointing._is_compiling
    checks = checkpointing._allowed_determinism_checks_to_fns
    default_check = checks[checkpointing._DEFAULT_DETERMINISM_MODE]
    failed = True
    try:   # every patch inside: Ctrl-C between two of them left torch's functions patched for the rest of the session
        for (module, name), original in originals.items():
            setattr(module, name, getter(original) if name.startswith("get") else setter(original))
        for (module, name), original in reseeding.items():
            setattr(module, name, reseeder(original))
        checkpointing.CheckpointFunction.apply = _refuse_reentrant
        # selective checkpointing (context_fn=create_selective_checkpoint_contexts) caches every op's output under a
        # proxy mode, for torch.compile's partitioner to read the policy from the graph, and hands the cached outputs
        # back in the recomputation: the step then recomputed nothing, and a dropout in the block failed ("Tensor
        # cached during selective activation checkpoint has been mutated": its bernoulli_ writes a cached
        # empty_like). The step is traced as eager runs it: the policy's saved ops are kept, the others recomputed in
        # the traced backward
        checkpointing._is_compiling = lambda func, args, kwargs: False
        checks[checkpointing._DEFAULT_DETERMINISM_MODE] = _recomputation_metadata
        # in the fake mode, below _Sequence (entered at the first saved state): a draw it replays draws nothing
        fake_mode.draw_observer = set_generators
        yield
        failed = False
    finally:
        checkpointing._is_compiling = is_compiling
        checks[checkpointing._DEFAULT_DETERMINISM_MODE] = default_check
        if reentrant is not None:
            checkpointing.CheckpointFunction.apply = reentrant
        elif "apply" in checkpointing.CheckpointFunction.__dict__:
            del checkpointing.CheckpointFunction.apply
        for (module, name), original in [*originals.items(), *reseeding.items()]:
            setattr(module, name, original)
        if entered:
            sequence.__exit__(None, None, None)
        fake_mode.draw_observer = None
        set_generators.finish(failed)
