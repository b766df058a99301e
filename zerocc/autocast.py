"""A step called under ``torch.autocast``: forward and loss cast as eager casts them, the rest as traced.

Users coming from automatic mixed precision write ``with torch.autocast("cpu",
dtype=torch.bfloat16): loss = step(x, y)``. Eager PyTorch casts, under that
context, the ops of the forward and the loss; backward runs outside it (as
PyTorch recommends) in the dtypes forward chose, and the optimizer's
elementwise update is not cast. So capture traces the model and the loss
under the caller's autocast state (``autocast_as``) and everything else
outside it (``outside_autocast``); the casts become ops of the program. The
program then runs outside autocast, so it runs exactly what was traced (under
autocast every aten call it makes would be cast again, its backward's fp32
matmuls included). The state is part of what a program is compiled for
(``program_cache.CacheKey``): a call outside autocast after calls inside it
compiles its own program, as eager would compute in fp32.

``param_dtype=`` is zerocc's own mixed precision (low-precision parameters,
fp32 masters, see ``zerocc/precision.py``); the two can be combined.
"""
from __future__ import annotations

import contextlib

import torch

DEVICE_TYPES = ("cpu", "cuda")


def autocast_state() -> tuple:
    """The caller's autocast state: ``(device type, dtype, cache enabled)`` for each device type it is on for."""
    return tuple((device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
                 for device in DEVICE_TYPES if torch.is_autocast_enabled(device))


@contextlib.contextmanager
def autocast_as(state: tuple):
    """Autocast as in ``state`` (from ``autocast_state``); nothing when it is empty."""
    with contextlib.ExitStack() as stack:
        for device, dtype, cache_enabled in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache_enabled))
        yield


@contextlib.contextmanager
def outside_autocast():
    """Autocast off for every device type it is on for (nothing to do, and no cost, when it is off)."""
    with contextlib.ExitStack() as stack:
        for device in DEVICE_TYPES:
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield
