"""A step's batch as the program reads it: positional arguments, then keyword arguments, in one flat list.

``step(ids, mask, labels)`` and ``step(input_ids=ids, attention_mask=mask,
labels=labels)`` both reach the model; the graph has one placeholder per
flat entry. Keyword arguments go to the model, sorted by name so that the
order they are written in does not make a new program; the targets
(``num_targets``) are always the last positional arguments.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """How a flat batch splits back into the call's positional and keyword arguments."""
    positional: int
    keywords: tuple[str, ...] = ()

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: Mapping[str, Any]) -> "BatchLayout":
        return cls(len(args), tuple(sorted(kwargs)))

    def flatten(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        return [*args, *(kwargs[name] for name in self.keywords)]

    def split(self, flat: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
        return list(flat[:self.positional]), dict(zip(self.keywords, flat[self.positional:]))

    def name_of(self, index: int) -> str:
        """How an error names a flat entry: 'argument 2' or 'input_ids='."""
        return f"argument {index}" if index < self.positional else f"{self.keywords[index - self.positional]}="
