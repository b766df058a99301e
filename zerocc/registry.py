"""Passes users register with ``zerocc.register_pass``: kept here so that the API and the
pipeline can both read them without importing each other (or any pass).
"""
from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class UserPass:
    """A user's ``(gm, ctx) -> gm`` pass and where it goes: right after or right before a named pass."""
    name: str
    run: Callable
    after: str | None = None
    before: str | None = None
    requires: tuple[str, ...] = ()

    @property
    def anchor(self) -> str:
        return self.after if self.after is not None else self.before


_registered: list[UserPass] = []


def registered() -> list[UserPass]:
    """The passes registered so far, in registration order."""
    return list(_registered)


def add(user_pass: UserPass) -> None:
    _registered.append(user_pass)


def remove(name: str) -> bool:
    """Forget the registered pass ``name``; returns whether there was one."""
    before = len(_registered)
    _registered[:] = [p for p in _registered if p.name != name]
    return len(_registered) != before


def clear() -> None:
    _registered.clear()
