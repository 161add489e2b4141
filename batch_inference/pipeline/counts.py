"""``Counts``: records by outcome (``approved``, ``rejected``, ``ok``, ``error``, ...), the one
value type the pipeline sums them with.

Tasks report their counts as JSON objects; a phase, a step in progress and the report add
them up. ``Counts`` is an immutable mapping whose ``+`` sums key by key (a key missing on
one side counts 0, and a 0 is kept: a phase that approved nothing says ``approved: 0``), so
no caller writes the ``out[k] = out.get(k, 0) + int(v)`` loop again.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any


class Counts(Mapping[str, int]):
    """Counts by outcome; ``a + b`` sums them, ``Counts.total(many)`` sums an iterable."""

    __slots__ = ("_counts",)

    def __init__(self, counts: Mapping[str, Any] | None = None) -> None:
        self._counts: dict[str, int] = {str(k): int(v) for k, v in (counts or {}).items()}

    @classmethod
    def total(cls, many: Iterable[Mapping[str, Any]]) -> Counts:
        """The sum of ``many`` (each a ``Counts`` or a task's JSON counts)."""
        out: dict[str, int] = {}
        for counts in many:
            for k, v in counts.items():
                out[k] = out.get(k, 0) + int(v)
        return cls(out)

    def __add__(self, other: Mapping[str, Any]) -> Counts:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Counts.total((self, other))

    def __radd__(self, other: Any) -> Counts:  # ``sum(counts)`` starts from 0
        if isinstance(other, int) and other == 0:
            return self
        if isinstance(other, Mapping):
            return Counts.total((other, self))
        return NotImplemented

    def __getitem__(self, key: str) -> int:
        return self._counts[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"Counts({self._counts!r})"

    def as_dict(self) -> dict[str, int]:
        """A plain dict (what summaries and the ledger's JSON hold)."""
        return dict(self._counts)
