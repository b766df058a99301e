"""Python's and NumPy's random generators drawn in the step: refused where the program depends on the draw.

A trace runs the step's Python once. A number drawn there from Python's ``random`` module or NumPy's
generator (``np.random.beta`` for a mixup lambda, ``random.random() < p`` for a LayerDrop or stochastic
depth, the time masks of transformers' wav2vec2 with ``mask_time_prob > 0``) would become a constant of the
program, the same at every step, where eager draws a new one each step: the step would train silently
differently. ``HostDraws`` records such draws while the step is traced: the module-level drawing functions of
both global generators are patched to note their caller's line, and the states of the global generators and
of the generator objects the model's modules or the loss function hold (``self.rng =
np.random.default_rng(0)``, a ``random.Random``) are compared across the trace (which also catches a function
imported by name, ``from random import random``). When the step drew, capture traces it twice again from
advanced generators, with the uniform draws of the patched functions (``random.random()``,
``np.random.random()``, ``np.random.rand``) at either end of [0, 1): a draw that changes nothing in the program
(transformers' wav2vec2 adapter compares ``np.random.random()`` with a LayerDrop probability of 0; BigBird
seeds NumPy's generator itself before its random attention) is accepted, any other is refused, naming it. A
Python branch on another kind of draw (``if np.random.beta(a, b) > 0.5``) can pass both retraces by chance.
torch's own generator is what the program draws from at run time, as eager does (``torch.rand``,
``torch.distributions``).
"""
from __future__ import annotations

import contextlib
import os
import random
import sys

import torch

from .errors import _LIBRARY_DIRS, CaptureError, user_frame_here

# uniform draws in [0, 1): a retrace gives them the ends of the interval, so that a threshold a draw is compared
# with (LayerDrop's `random.random() < p`) is passed on one side of the two and not on the other unless it is 0 or 1
_UNIFORM = {"random", "random_sample", "rand", "ranf", "sample"}
EXTREMES = (2.0 ** -53, 1.0 - 2.0 ** -53)
_NOT_DRAWS = {"seed", "getstate", "setstate", "get_state", "set_state", "get_bit_generator", "set_bit_generator"}
_FIX = ("draw it with torch's generator inside the step (torch.rand, torch.randint, "
        "torch.distributions.Beta(a, b).sample(), a torch.Generator of your own), which the program draws at every "
        "step as eager does, or draw it in the training loop and pass it to the step as a tensor. A library model's "
        "own draw (transformers' wav2vec2 masks time steps with NumPy when mask_time_prob > 0) is turned off by its "
        "option (mask_time_prob=0, mask_feature_prob=0)")


class _Generator:
    """One Python or NumPy generator: how to name, read, set and advance it."""

    def __init__(self, name, generator, module=None):
        self.name, self.generator, self.module = name, generator, module

    def state(self):
        generator = self.generator
        if isinstance(generator, random.Random):
            return generator.getstate()
        if hasattr(generator, "bit_generator"):   # numpy.random.Generator
            return repr(generator.bit_generator.state)
        kind, keys, position, has_gauss, gauss = generator.get_state()   # numpy.random.RandomState
        return kind, keys.tobytes(), position, has_gauss, gauss

    def saved(self):
        generator = self.generator
        if isinstance(generator, random.Random):
            state = generator.getstate()
            return lambda: generator.setstate(state)
        if hasattr(generator, "bit_generator"):
            state = generator.bit_generator.state
            return lambda: setattr(generator.bit_generator, "state", state)
        state = generator.get_state()
        return lambda: generator.set_state(state)

    def advance(self):
        for _ in range(7):
            self.generator.random()


def _generators(model, loss_fn) -> list[_Generator]:
    """The global generators of ``random`` and (if loaded) ``numpy.random``, and those the model or loss holds."""
    found = [_Generator("random's global generator", random._inst, random)]
    numpy_random = sys.modules.get("numpy.random")
    global_numpy = getattr(getattr(numpy_random, "mtrand", None), "_rand", None)
    if global_numpy is not None:
        found.append(_Generator("np.random's global generator", global_numpy, numpy_random))
    kinds = (random.Random,) + ((numpy_random.Generator, numpy_random.RandomState) if numpy_random else ())
    owners = [(f"model.{name}." if name else "model.", module) for name, module in model.named_modules()]
    if loss_fn is not None:
        owners.append(("loss_fn.", loss_fn))
    for prefix, owner in owners:
        for attribute, value in list(getattr(owner, "__dict__", {}).items()):
            if isinstance(value, kinds) and not any(value is known.generator for known in found):
                found.append(_Generator(f"the random generator {prefix}{attribute}", value))
    return found


class HostDraws:
    """What the traced step drew from Python's and NumPy's generators, and whether the program depends on it."""

    def __init__(self, model, loss_fn):
        self.generators = _generators(model, loss_fn)
        self.where: list[str] = []      # 'random.random() at file:line: code' of each patched function's draw
        self.changed: list[str] = []    # the generators whose state a trace changed
        self.extreme: float | None = None   # in a retrace: what uniform draws in [0, 1) give instead

    @property
    def drew(self) -> bool:
        return bool(self.where or self.changed)

    @contextlib.contextmanager
    def recording(self):
        """While the step is traced: note each draw's line, and each generator the trace advanced."""
        before = [generator.state() for generator in self.generators]
        patched = []
        try:   # patched inside: Ctrl-C between two setattr left Python's own random functions patched for good
            for generator in self.generators:
                module = generator.module
                if module is None:
                    continue
                shown = "random" if module is random else "np.random"
                for name in dir(module):
                    value = getattr(module, name, None)
                    if name in _NOT_DRAWS or name.startswith("_") or getattr(value, "__self__", None) is not generator.generator:
                        continue
                    patched.append((module, name, value))
                    setattr(module, name, self._noting(f"{shown}.{name}()", value, name in _UNIFORM))
            yield
        finally:
            for module, name, original in patched:
                setattr(module, name, original)
            for generator, state in zip(self.generators, before):
                if generator.state() != state and generator.name not in self.changed:
                    self.changed.append(generator.name)

    def _noting(self, shown, original, uniform):
        def draw(*args, **kwargs):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if caller.startswith(_LIBRARY_DIRS):   # torch's or zerocc's own use
                return original(*args, **kwargs)
            where = f"{shown} at {user_frame_here() or '(no user frame found)'}"
            if where not in self.where:
                self.where.append(where)
            drawn = original(*args, **kwargs)
            if uniform and self.extreme is not None:   # a retrace: either end of [0, 1)
                drawn = self.extreme if isinstance(drawn, float) else drawn * 0 + self.extreme
            return drawn
        draw.__wrapped__ = original
        return draw

    @contextlib.contextmanager
    def advanced(self, extreme: float):
        """For a retrace: every generator moved on, and uniform draws at ``extreme``; put back afterwards."""
        restores = [generator.saved() for generator in self.generators]
        for generator in self.generators:
            generator.advance()
        self.extreme = extreme
        try:
            yield
        finally:
            self.extreme = None
            for restore in restores:
                restore()

    def error(self) -> CaptureError:
        drawn = "; ".join(self.where) or ", ".join(
            name + (" (a function imported by name, such as `from random import random`?)"
                    if name.endswith("global generator") else "") for name in self.changed)
        return CaptureError(
            f"the step draws random numbers from Python's or NumPy's generators while it is traced, and the "
            f"program depends on them: {drawn}. The trace runs your Python once, so these numbers would be "
            f"constants of the compiled program, the same at every step, where eager draws new ones each step. "
            f"Instead, {_FIX}")


def same_program(first, second) -> bool:
    """Whether two traces of the step are one program: the same code and the same tensor constants."""
    if first.code != second.code:
        return False
    def constants(gm):
        return {node.target: getattr(gm, node.target) for node in gm.graph.nodes
                if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.Tensor)}
    ours, theirs = constants(first), constants(second)
    return ours.keys() == theirs.keys() and all(
        ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape and torch.equal(ours[k], theirs[k])
        for k in ours)
