"""Which batch's task a model's pool runs next, and when each batch should finish.

A batch's deadline is its ``expires_at`` (``created_at`` + ``completion_window``).
``Admission`` orders the tasks waiting for a slot of the pool (``FairShare``): earliest
deadline first, and the batches whose deadlines lie within ``slack_s``
(``limits.deadline_slack``, default 1h) of the earliest waiting one count as equal; among
those, projects take turns (round-robin, one task each), and within a project its batches
take turns. So a 1h batch created behind a large 24h batch gets every slot that frees,
while two 24h batches of one afternoon (or of two projects) share the pool.

``expected_finish`` is the admission's estimate of when each running batch of a model ends,
from the pool's measured rate (``Throughput``: requests per second of the tasks that
returned lately) and the requests ahead of it in that order. A batch it says will miss its
window is still accepted and run, as OpenAI does; its state says ``expected_finish_at``.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batch_inference.api.config import DEFAULT_PROJECT


@dataclass
class _Waiting:
    deadline: float
    project: str
    tasks: deque[asyncio.Future[None]] = field(default_factory=deque)


class Admission:
    """The tasks waiting for a slot, by batch, and the order they are granted in (``next``)."""

    def __init__(self, slack_s: float = 3600.0) -> None:
        self.slack_s = slack_s
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()  # batch -> its tasks waiting; a batch served goes to the back
        self._turns: OrderedDict[str, None] = OrderedDict()  # projects, the one served last at the back

    def wait(self, batch: str, deadline: float, project: str, fut: asyncio.Future[None]) -> None:
        entry = self.waiting.get(batch)
        if entry is None:
            entry = self.waiting[batch] = _Waiting(deadline, project)
        entry.tasks.append(fut)
        self._turns.setdefault(project, None)

    def forget(self, batch: str, fut: asyncio.Future[None]) -> None:
        """A waiting task was cancelled before its grant."""
        entry = self.waiting.get(batch)
        if entry is not None and fut in entry.tasks:
            entry.tasks.remove(fut)
            if not entry.tasks:
                del self.waiting[batch]

    def outranked_by(self, deadline: float) -> bool:
        """Whether a batch of ``deadline`` goes before every waiting batch (tasks wait, none of equal deadline)."""
        return bool(self.waiting) and all(w.deadline > deadline + self.slack_s for w in self.waiting.values())

    def next(self) -> tuple[str, asyncio.Future[None]] | None:
        """The next task to grant (its batch and future), taken off the queue; None when none waits."""
        if not self.waiting:
            return None
        earliest = min(w.deadline for w in self.waiting.values())
        tied = [b for b, w in self.waiting.items() if w.deadline <= earliest + self.slack_s]  # in batch turn order
        projects = {self.waiting[b].project for b in tied}
        project = next(p for p in self._turns if p in projects)
        self._turns.move_to_end(project)
        batch = next(b for b in tied if self.waiting[b].project == project)
        entry = self.waiting.pop(batch)
        fut = entry.tasks.popleft()
        if entry.tasks:  # its next task goes to the back of its project's line
            self.waiting[batch] = entry
        return batch, fut


class Throughput:
    """Requests per second the pool finished lately: the requests of the tasks that returned in
    the last ``window_s`` over the time from the earliest one's start to the latest one's end."""

    def __init__(self, window_s: float = 120.0) -> None:
        self.window_s = window_s
        self._tasks: deque[tuple[float, float, int]] = deque()  # (start, end, requests), monotonic seconds

    def add(self, requests: int, start: float, end: float) -> None:
        self._tasks.append((start, end, requests))
        while len(self._tasks) > 1 and self._tasks[0][1] < end - self.window_s:
            self._tasks.popleft()

    def rate(self) -> float | None:
        """Requests per second; None before any task has taken measurable time."""
        if not self._tasks:
            return None
        span = max(e for _, e, _ in self._tasks) - min(s for s, _, _ in self._tasks)
        done = sum(n for _, _, n in self._tasks)
        return done / span if span > 0 and done > 0 else None


@dataclass(frozen=True)
class Pending:
    """A running batch as the estimate sees it."""

    batch: str
    deadline: float
    remaining: int  # requests not settled yet


def expected_finish(pending: list[Pending], rate: float | None, now: float, slack_s: float) -> dict[str, int | None]:
    """When each batch of one model's pool should end (epoch seconds), served as ``Admission``
    serves them: groups of equal deadline (within ``slack_s`` of the group's earliest) one
    after another, and the pool shared evenly inside a group, so a batch ends once it and
    each other batch of its group have run as many requests as it had left (or all of theirs).
    None for every batch while the pool has no measured rate."""
    if not rate or rate <= 0:
        return {p.batch: None for p in pending}
    out: dict[str, int | None] = {}
    ahead = 0  # requests of the groups served before
    order = sorted(pending, key=lambda p: p.deadline)
    i = 0
    while i < len(order):
        start = order[i].deadline
        group = [p for p in order[i:] if p.deadline <= start + slack_s]
        for p in group:
            share = sum(min(q.remaining, p.remaining) for q in group)
            out[p.batch] = int(math.ceil(now + (ahead + share) / rate))
        ahead += sum(p.remaining for p in group)
        i += len(group)
    return out


def admission_keys(state: dict[str, Any]) -> dict[str, Any]:
    """What ``FairShare.for_batch`` orders a batch by: its deadline and its project."""
    expires = state.get("expires_at")
    return {"deadline": float(expires) if expires is not None else math.inf,
            "project": str(state.get("project") or DEFAULT_PROJECT)}


def finish_estimates(states: Iterable[dict[str, Any]], rates: dict[str, float | None], now: float,
                     slack_s: float) -> dict[str, int | None]:
    """``expected_finish`` of every running batch (its ``expected_finish_at``), each model's pool on its own rate."""
    by_model: dict[str, list[Pending]] = {}
    for s in states:
        if s.get("status") != "in_progress" or not s.get("run"):
            continue
        counts = s.get("request_counts") or {}
        remaining = int(counts.get("total") or 0) - int(counts.get("completed") or 0) - int(counts.get("failed") or 0)
        by_model.setdefault(s["run"], []).append(Pending(s["id"], admission_keys(s)["deadline"], max(remaining, 0)))
    out: dict[str, int | None] = {}
    for model, pending in by_model.items():
        out.update(expected_finish(pending, rates.get(model), now, slack_s))
    return out


def estimate_moved(old: int | None, new: int | None, least_s: float = 30.0) -> bool:
    """Whether a new estimate is worth saving: it appeared or went, or moved by ``least_s`` or more."""
    if old is None or new is None:
        return old != new
    return abs(new - old) >= least_s
