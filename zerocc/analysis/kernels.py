"""Kernel capabilities: which ops can write their results into given memory (``out=``) on a device's backend.

An analysis that passes read (``place_buffers`` points ops at arena
offsets through these overloads; ``gradients_into_buckets`` points a
gradient's op at its bucket); it changes no graph.
"""
from __future__ import annotations

import functools

import torch

from .. import ops

c10d = torch.ops._c10d_functional

# Collectives whose functional form has a twin writing into a given tensor (the one inductor uses).
COLLECTIVE_OUT = {
    c10d.all_gather_into_tensor.default: c10d.all_gather_into_tensor_out.default,
    c10d.reduce_scatter_tensor.default: c10d.reduce_scatter_tensor_out.default,
    c10d.all_to_all_single.default: ops.all_to_all_single_out,   # zerocc's own (gloo: passes/scatter_by_all_to_all.py)
}

_BACKEND_KEY = {"cpu": "CPU", "cuda": "CUDA"}

aten = torch.ops.aten

# Ops whose out= kernel resizes its ``out`` to the inputs' shape as scratch before reducing into it (PyTorch's
# "An output with one or more elements was resized" warning). Given a view of an arena, that resize grows the
# arena's storage when the view sits near its end: the whole arena moves, and memory that collectives in flight
# still write is freed. Their results go to PyTorch's allocator instead. tests/test_memory_pools.py checks the
# list against the kernels: each still resizes, and the other loss and reduction kernels tried do not.
SCRATCH_OUT = frozenset({
    aten.mse_loss.default, aten.smooth_l1_loss.default, aten.huber_loss.default, aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
})


@functools.cache
def reduces_in_its_scratch(op: torch._ops.OpOverload, device_type: str) -> bool:
    """Does ``op`` (of ``SCRATCH_OUT``), reducing, return its result in the elementwise scratch it computed?

    On CPU ``F.mse_loss(x, y)`` of 1000x1000 floats is a 0-dim tensor holding a 4 MB storage: the kernel reduces
    into its scratch and shrinks it, keeping its memory, for as long as the loss lives (the whole step and after).
    Asked of the kernel itself, once per op and device, on two elements."""
    if op not in SCRATCH_OUT:
        return False
    try:   # a device this process cannot run on (a plan of a CUDA job made on a CPU machine): counted as its value
        x = torch.zeros(2, device=device_type)
        return op(x, x, reduction=1).untyped_storage().nbytes() > x.element_size()
    except (RuntimeError, AssertionError):   # AssertionError: "Torch not compiled with CUDA enabled"
        return False


# Ops whose out= kernel tells its outputs apart by storage (``Tensor.is_alias_of``) instead of by the memory they
# cover: given outputs that are views of one arena, ``linalg_qr.out`` (reduced mode, the default) factors into Q,
# takes R for the tensor it factored in, and never writes R, which keeps whatever the arena held (a user's
# ``torch.linalg.qr`` trained to inf). Their results go to PyTorch's allocator. tests/test_memory_pools.py
# checks the kernels: each of these still misbehaves so, and the other multi-output kernels tried do not.
STORAGE_COMPARING_OUT = frozenset({aten.linalg_qr.default})


def has_backend(device: torch.device) -> bool:
    """Does ``device`` run kernels that write into memory (CPU, CUDA), not only compute shapes (meta)?"""
    return device.type in _BACKEND_KEY


@functools.cache
def has_backend_kernel(op: torch._ops.OpOverload, device: torch.device) -> bool:
    """Does ``op`` have a kernel of ``device``'s backend (not only the generated out= that calls the functional
    op and copies, which would allocate anyway)?"""
    key = _BACKEND_KEY.get(device.type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)


@functools.cache
def out_variant(op: torch._ops.OpOverload) -> tuple[torch._ops.OpOverload, tuple[str, ...]] | None:
    """The overload of ``op`` that writes its results into given tensors, and the names of those arguments.

    It must take the same arguments as ``op`` (names and types) plus one
    ``out`` argument per result, as ``aten.mm.out`` does for ``aten.mm``;
    ops in ``SCRATCH_OUT`` and ``STORAGE_COMPARING_OUT`` have none to use.
    A fact of the op, kept: ``place_buffers`` asks it about every placed node, two or three times (each answer
    reads the schemas of every overload: a tenth of the pass on the 98M GPT).
    """
    if op in COLLECTIVE_OUT:
        return COLLECTIVE_OUT[op], ("out",)
    if op in SCRATCH_OUT or op in STORAGE_COMPARING_OUT:
        return None
    schema = op._schema
    if not schema.returns or any(r.alias_info is not None or str(r.type) != "Tensor" for r in schema.returns):
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments]
    packet = getattr(getattr(torch.ops, op.namespace), schema.name.split("::")[-1])
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        arguments = candidate._schema.arguments
        outs = [a.name for a in arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in arguments if not a.is_out]
        if outs and rest == wanted and len(outs) == len(schema.returns):
            return candidate, tuple(outs)
    return None
