"""Python's and NumPy's global random generators drawn in the step: refused while it is traced.

A trace runs the step's Python once. A number drawn there from Python's ``random`` module or NumPy's
global generator (``np.random.beta`` for a mixup lambda, ``random.random() < p`` for a LayerDrop or stochastic
depth, the time masks of transformers' wav2vec2 with ``mask_time_prob > 0``) would become a constant of the
program, the same at every step, where eager draws a new one each step: the step would train silently
differently. ``refused_host_random()`` patches the module-level drawing functions of both generators for the
trace, so such a call raises at once, naming its line, and compares the generators' states after the trace,
which also catches a function imported by name before the trace (``from random import random``). A generator
object of the model's modules or of the loss function (``self.rng = np.random.default_rng(0)``, a
``random.Random``) is checked the same way, by its state, and named by its attribute. torch's
own generator is what the program draws from at run time, as eager does (``torch.rand``,
``torch.distributions``).
"""
from __future__ import annotations

import contextlib
import os
import random
import sys

from .errors import _LIBRARY_DIRS, CaptureError, user_frame_here

_NOT_DRAWS = {"seed", "getstate", "setstate", "get_state", "set_state", "get_bit_generator", "set_bit_generator"}
_FIX = ("draw it with torch's generator inside the step (torch.rand, torch.randint, "
        "torch.distributions.Beta(a, b).sample(), a torch.Generator of your own), which the program draws at every "
        "step as eager does, or draw it "
        "in the training loop and pass it to the step as a tensor. A library model's own draw (transformers' "
        "wav2vec2 masks time steps with NumPy when mask_time_prob > 0) is turned off by its option "
        "(mask_time_prob=0, mask_feature_prob=0)")


def _global_generators():
    """(module, name shown, the global generator object, how to read its state) of each loaded generator."""
    found = [(random, "random", random._inst, random.getstate)]
    numpy_random = sys.modules.get("numpy.random")
    state = getattr(numpy_random, "mtrand", None) and getattr(numpy_random.mtrand, "_rand", None)
    if state is not None:
        found.append((numpy_random, "np.random", state, lambda: _numpy_state(state)))
    return found


def _numpy_state(generator):
    kind, keys, position, has_gauss, gauss = generator.get_state()
    return kind, keys.tobytes(), position, has_gauss, gauss


def _refusing(shown, name, original):
    def draw(*args, **kwargs):
        caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
        if caller.startswith(_LIBRARY_DIRS):   # torch's or zerocc's own use, not the step's
            return original(*args, **kwargs)
        raise CaptureError(
            f"{shown}.{name}() at {user_frame_here() or '(no user frame found)'} draws a random number while the "
            f"step is traced: the trace runs your Python once, so that number would be a constant of the compiled "
            f"program, the same at every step, where eager draws a new one each step. Instead, {_FIX}")
    draw.__wrapped__ = original
    return draw


def _state_reader(value):
    """How to read the state of a Python or NumPy generator object; None for anything else."""
    if isinstance(value, random.Random):
        return value.getstate
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and isinstance(value, numpy_random.Generator):
        return lambda: repr(value.bit_generator.state)
    if numpy_random is not None and isinstance(value, numpy_random.RandomState):
        return lambda: _numpy_state(value)
    return None


def _held_generators(model, loss_fn):
    """(name, how to read its state) of each generator object the model's modules or the loss function hold."""
    owners = [(f"model.{name}." if name else "model.", module) for name, module in model.named_modules()]
    if loss_fn is not None:
        owners.append(("loss_fn.", loss_fn))
    found = []
    for prefix, owner in owners:
        for attribute, value in list(getattr(owner, "__dict__", {}).items()):
            read = _state_reader(value)
            if read is not None:
                found.append((prefix + attribute, read))
    return found


@contextlib.contextmanager
def refused_host_random(model=None, loss_fn=None):
    """Refuse draws from Python's and NumPy's generators in the step (see the module's docstring)."""
    generators = _global_generators()
    before = [read() for _, _, _, read in generators]
    held = _held_generators(model, loss_fn) if model is not None else []
    held_before = [read() for _, read in held]
    patched = []
    for module, shown, generator, _ in generators:
        for name in dir(module):
            value = getattr(module, name, None)
            if name in _NOT_DRAWS or name.startswith("_") or getattr(value, "__self__", None) is not generator:
                continue
            patched.append((module, name, value))
            setattr(module, name, _refusing(shown, name, value))
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)
    for (module, shown, _, read), state in zip(generators, before):
        if read() != state:
            raise CaptureError(
                f"the step drew from {shown}'s global generator while it was traced (a function imported by name, "
                f"such as `from {module.__name__} import random`): the trace runs your Python once, so that number "
                f"would be a constant of the compiled program, the same at every step, where eager draws a new one "
                f"each step. Instead, {_FIX}")
    for (name, read), state in zip(held, held_before):
        if read() != state:
            raise CaptureError(
                f"the step drew from the random generator {name} while it was traced: the trace runs your Python "
                f"once, so that number would be a constant of the compiled program, the same at every step, where "
                f"eager draws a new one each step. Instead, {_FIX}")
