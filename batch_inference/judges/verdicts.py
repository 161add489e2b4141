"""The result of judging one record."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Verdict:
    """``approved`` plus a short machine-readable ``reason`` (and a score for score judges)."""

    approved: bool
    reason: str
    score: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
