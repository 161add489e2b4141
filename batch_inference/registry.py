"""A registry of named extensions (stored input formats, record formats, judge kinds): one file
adds its entry by name, and a name two files claim is an error instead of a silent override."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)


class Registry(dict[str, T]):
    """Entries by name, in the order added; ``builtins`` are added first and never removed."""

    def __init__(self, what: str, builtins: Iterable[T] = (), *, keep_builtins: bool = True) -> None:
        super().__init__((item.name, item) for item in builtins)
        self.what = what
        self.kept = frozenset(self) if keep_builtins else frozenset()

    def add(self, item: T) -> T:
        """Add ``item`` (the same object again is a no-op; another under a taken name is an error)."""
        if item.name in self and self[item.name] is not item:
            raise ValueError(f"{self.what} {item.name!r} is registered already")
        self[item.name] = item
        return item

    def remove(self, name: str) -> None:
        """Remove an entry (tests that register one of their own); a kept built-in stays."""
        if name not in self.kept:
            self.pop(name, None)
