"""A step's batch as the program reads it: positional arguments, then keyword arguments, in one flat list.

``step(ids, mask, labels)`` and ``step(input_ids=ids, attention_mask=mask,
labels=labels)`` both reach the model; the graph has one placeholder per
flat entry. Keyword arguments go to the model, sorted by name so that the
order they are written in does not make a new program; the targets
(``num_targets``) are always the last positional arguments.

``check_batch`` compares each call's batch with the first one before any
program runs: shapes may change from call to call (each new shape compiles
a program), dtypes and devices may not, and no entry may require grad.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping, Sequence

import torch
import torch.utils._pytree as pytree

from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a flat batch splits back into the call's positional and keyword arguments.

    An argument that is a container (a dict of tensors, a nested tuple or list) is flattened into its leaves, as
    the trace flattens it into placeholders: ``spec`` is then the structure of (positional, keyword values) and
    ``names`` names each leaf ('argument 0['ids']', 'extra[1][0]='); without containers both stay empty and each
    argument is one entry.
    """
    positional: int
    keywords: tuple[str, ...] = ()
    spec: Any = dataclasses.field(default=None, compare=False)
    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> "BatchLayout":
        keywords = tuple(sorted(kwargs))
        entries = (tuple(args), tuple(kwargs[name] for name in keywords))
        if all(pytree.tree_structure(entry).is_leaf() for entry in (*entries[0], *entries[1])):
            return cls(len(args), keywords)
        with_paths, spec = pytree.tree_flatten_with_path(entries)
        names = []
        for path, _ in with_paths:
            index, rest = path[1].idx, pytree.keystr(path[2:])
            names.append(f"argument {index}{rest}" if path[0].idx == 0 else f"{keywords[index]}{rest}=")
        return cls(len(args), keywords, spec, tuple(names))

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        entries = [*args, *(kwargs[name] for name in self.keywords)]
        if self.spec is None:
            return entries
        return pytree.tree_leaves((tuple(args), tuple(kwargs[name] for name in self.keywords)))

    def split(self, flat: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        if self.spec is None:
            return list(flat[:self.positional]), dict(zip(self.keywords, flat[self.positional:]))
        args, values = pytree.tree_unflatten(list(flat), self.spec)
        return list(args), dict(zip(self.keywords, values))

    def name_of(self, index: int) -> str:
        """How an error names a flat entry: 'argument 2', 'input_ids=' or, in a container, "argument 0['ids']"."""
        if self.spec is not None:
            return self.names[index]
        return f"argument {index}" if index < self.positional else f"{self.keywords[index - self.positional]}="

    def structure(self) -> str:
        """The containers' structure, for a program's signature: '' without containers."""
        return "" if self.spec is None else str(self.spec)


@dataclasses.dataclass(frozen=True)
class FirstBatch:
    """The dtype and device of each tensor of the step's first batch, by entry name, and how it read."""
    kinds: dict[str, tuple[torch.dtype, torch.device]]
    description: str

    @classmethod
    def of(cls, batch: Sequence[Any], layout: BatchLayout) -> "FirstBatch":
        kinds = {layout.name_of(i): (v.dtype, v.device) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)}
        return cls(kinds, describe_batch(batch, layout))


def describe_batch(batch: Sequence[Any], layout: BatchLayout) -> str:
    """'argument 0: (8, 12) float32 on cpu, labels=(8,) int64 on cpu'."""
    def describe(value):
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {_dtype_name(value.dtype)} on {value.device}"
        return repr(value)

    def named(name):   # a keyword reads as it is passed: 'labels=(8,) ...', not 'labels=: (8,) ...'
        return name if name.endswith("=") else f"{name}: "
    return ", ".join(f"{named(layout.name_of(i))}{describe(v)}" for i, v in enumerate(batch))


def check_batch(batch: Sequence[Any], layout: BatchLayout, first: FirstBatch | None, where: str = "step") -> None:
    """Refuse, before running, a batch the compiled programs cannot take: every problem in one error."""
    problems = []
    for index, value in enumerate(batch):
        if not isinstance(value, torch.Tensor):
            if held := _tensors_inside(value):
                problems.append(_object_holding_tensors(layout.name_of(index), value, held))
            continue
        name = layout.name_of(index)
        if value.is_meta:
            problems.append(f"  - {name} is on the meta device: it holds no values, the step would return a meta "
                            "loss; to plan memory without data use zerocc.plan(model, optimizer, stage=..., "
                            "world_size=..., example_inputs=...)")
        if value.requires_grad:
            problems.append(f"  - {name} requires grad: the step differentiates the loss with respect to the "
                            "model's parameters only; pass it detached (x.detach()), or build it under "
                            "torch.no_grad()")
        if first is None or name not in first.kinds:
            continue
        dtype, device = first.kinds[name]
        if value.dtype != dtype:
            problems.append(f"  - {name} is {_dtype_name(value.dtype)}, the first batch's was {_dtype_name(dtype)}: "
                            f"cast it (.to(torch.{_dtype_name(dtype)})) where the batch is made")
        if value.device != device:
            problems.append(f"  - {name} is on {value.device}, the first batch's was on {device}: "
                            f"move it (.to('{device}')) where the batch is made")
    if problems:
        compared = f" (the first batch was {first.description})" if first is not None else ""
        raise ConfigError(f"this batch cannot run in the compiled {where}{compared}; shapes may change from call "
                          "to call, dtypes and devices may not:\n" + "\n".join(problems))


def _tensors_inside(value, depth: int = 2) -> list[str]:
    """The fields of a batch entry that is neither a tensor nor a container PyTorch's pytree flattens (a dataclass,
    a ``UserDict`` such as transformers' ``BatchEncoding``, an object) that hold tensors.

    Such an entry is one Python value to the program, keyed by its ``repr``: the trace would keep the tensors of
    the batch it was traced on as constants, and a ``repr`` that elides a tensor's values would not tell the
    next batch from it (the step trained on the first batch's data again). Objects nested ``depth`` deep are looked
    into."""
    if depth == 0:
        return []
    if isinstance(value, Mapping):
        fields = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {field.name: getattr(value, field.name, None) for field in dataclasses.fields(value)}
    else:
        fields = vars(value) if hasattr(value, "__dict__") and not isinstance(value, type) else {}
    return [str(name) for name, field in fields.items()
            if any(isinstance(leaf, torch.Tensor) or _tensors_inside(leaf, depth - 1)
                   for leaf in pytree.tree_leaves(field))]


def _object_holding_tensors(name: str, value, held: list[str]) -> str:
    kind = type(value).__name__
    registration = (f"torch.utils._pytree.register_dataclass({kind})" if dataclasses.is_dataclass(value)
                    else f"torch.utils._pytree.register_pytree_node({kind}, ...)")
    return (f"  - {name} is a {kind} holding tensors ({', '.join(held)}): zerocc reads a batch's tensors out of "
            "tensors, tuples, lists, dicts and classes registered with PyTorch's pytree; any other object would be "
            f"traced as a constant, keeping this batch's values for every later batch. Register the class once "
            f"({registration}), or pass its tensors in a dict or tuple")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def python_value_text(value) -> str:
    """A Python value of the batch as a program's key and the ranks' agreement compare it: its ``repr``, except for
    a numpy array, whose values are all in it.

    A numpy array in the batch is a Python value to the program (a model that calls ``torch.as_tensor`` on it traces
    its values as constants), and numpy's ``repr`` is not exact: it elides all but the corners of an array of more
    than 1,000 elements (``array([[1, 1, 1, ..., 0, 0, 0], ...``: a padded batch of token ids whose first and last
    columns are a start token and padding prints the same for every batch) and rounds floats to 8 digits. Keyed by
    that ``repr``, the next batch reused the first one's program and trained on the first batch's values again.
    """
    if _is_ndarray(value):
        kind = f"{value.dtype}{list(value.shape)}"
        if value.dtype.hasobject or value.size <= 16:   # small, or not plain bytes: the values as Python objects
            return f"{kind} {value.tolist()!r}"
        return f"{kind} (values hashed {hashlib.blake2b(value.tobytes(), digest_size=16).hexdigest()})"
    return repr(value)


def _is_ndarray(value) -> bool:
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def with_arrays_copied(batch: Sequence[Any]) -> list[Any]:
    """The batch with each numpy array replaced by a copy, for the trace to read.

    A model that calls ``torch.from_numpy`` on a batch's array traces a constant that shares its memory; a data
    loader that reuses its buffer overwrites it, and the program kept for the first values then ran on the new
    ones when a later batch brought the first values again (its key, ``python_value_text``, matched)."""
    return [value.copy() if _is_ndarray(value) else value for value in batch]


PYTHON_VALUE = "Python "   # how agreement_lines starts a Python value's description


def agreement_lines(batch: Sequence[Any], layout: BatchLayout) -> list[str]:
    """What every rank's batch must have in common at a call: each entry's shape and dtype (not its device).

    Written as ``runtime/failures.agreement_lines`` writes a program's inputs ('input 0: float32[8, 12]'); a
    Python value, which the program holds as a constant, as 'input 2 (num_items_in_batch=): Python int 30'.
    """
    def describe(value):
        if isinstance(value, torch.Tensor):
            return f"{_dtype_name(value.dtype)}{list(value.shape)}"
        return f"{PYTHON_VALUE}{type(value).__name__} {python_value_text(value)}"
    named = layout.spec is not None   # containers: every leaf by its name
    return [f"input {i}{' (' + layout.name_of(i) + ')' if named or i >= layout.positional else ''}: {describe(v)}"
            for i, v in enumerate(batch)]
