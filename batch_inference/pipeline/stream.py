"""Round 0 beside the layout pass: shards handed to the infer phase as the pass writes them.

The layout pass ends by merging its sorted runs and rewriting ``sharded/`` in prefix order,
serially, on the driver: at scale that is an hour and more with every GPU held and idle
(docs/pipeline.md). Its shards come out in their final order, each committed whole as it
fills, so round 0's infer phase can start on each one as it lands instead of after the last.
``ShardFeed`` carries them from the pass's writing thread to the event loop; the shard step
(``pipeline.resume``) fills it, ``PipelineRun.infer(0)`` drains it. ``ShardStepStart`` holds
the step's task with its feed, which round 0 takes once: a stream is read once, so round 0
driven again after a failure (``drive_retrying``) reads ``sharded/`` whole instead.

A feed ends when the shard step does: with its summary's count of shards, or with its error,
after which the infer phase dispatches nothing more (what it sent is finished and recorded,
never cancelled: a cancelled task may still write its output behind a restarted run).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FedShard:
    """One rewritten shard of ``sharded/``: its position (the manifest's order), name, records,
    and the blocks every record written so far shares (the final count only when the pass ends)."""

    index: int
    name: str
    records: int
    common: int


class ShardFeed:
    """Shards of the layout pass's rewrite as they commit, for round 0 to dispatch early.

    ``instance`` and ``total_records`` are set by the shard step before it lays anything out;
    ``committed`` may be called from any thread; ``end`` on the loop, once."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[FedShard | None] = asyncio.Queue()
        self._changed = asyncio.Event()
        self.instance = ""
        self.total_records = 0
        self.fed: list[FedShard] = []
        self.ended = False
        self.error: BaseException | None = None
        self.fed_any = False  # the writing thread's own flag: its first shard is recorded first
        self._waiting: list[FedShard] = []  # fed, not yet taken
        self._drained = False  # the end's marker was read from the queue

    def committed(self, name: str, records: int, common: int) -> None:
        """A shard of the rewrite committed (any thread): readable from now on."""
        self._loop.call_soon_threadsafe(self._add, name, records, common)

    def _add(self, name: str, records: int, common: int) -> None:
        if self.ended:
            return
        shard = FedShard(len(self.fed), name, records, common)
        self.fed.append(shard)
        self._queue.put_nowait(shard)
        self._changed.set()

    def end(self, error: BaseException | None = None) -> None:
        """The shard step ended (``error``: how it failed); what was fed stays fed."""
        if self.ended:
            return
        # callbacks the writing thread scheduled before the step returned run first
        self._loop.call_soon(self._end, error)

    def _end(self, error: BaseException | None) -> None:
        if self.ended:
            return
        self.ended, self.error = True, error
        self._queue.put_nowait(None)
        self._changed.set()

    @property
    def streaming(self) -> bool:
        """Whether shards came through the feed (else the step wrote none early: resumed, or
        the pass kept the input's order, or it failed before its rewrite)."""
        return bool(self.fed)

    async def first(self) -> None:
        """Wait until a shard was fed or the step ended."""
        while not self.fed and not self.ended:
            self._changed.clear()
            await self._changed.wait()

    async def take(self, at_least: int) -> list[FedShard]:
        """The shards fed and not yet taken, in order, once ``at_least`` of them are (or the step
        has ended); an empty list when the step has ended and every shard was taken (its error
        ends the stream quietly: the caller reads ``error`` once what it dispatched is done).

        A phase's first wave is taken whole, as a list of shards would give it, so the pool
        places it together (``PoolClient``: load balance first, then each family on its worker)
        instead of one task at a time as shards trickle in."""
        while len(self._waiting) < at_least and not self._drained:
            item = await self._queue.get()
            if item is None:
                self._drained = True
            else:
                self._waiting.append(item)
            while not self._queue.empty() and not self._drained:  # what else is already there
                item = self._queue.get_nowait()
                if item is None:
                    self._drained = True
                else:
                    self._waiting.append(item)
        out, self._waiting = self._waiting, []
        return out


@dataclass
class ShardStepStart:
    """The shard step started in this process (``PipelineRun.start_shard``) and the feed its layout
    pass fills for round 0 (None: round 0 does not stream).

    The feed is round 0's infer phase's to take, once (``take_feed``): what a first attempt
    took from it is gone, so an attempt driven again after a transient error must list
    ``sharded/`` (committed by then: the step is waited for) rather than read what the first
    left in the feed, which lost the shards it had taken and not finished."""

    task: asyncio.Future[Any]
    feed: ShardFeed | None

    @property
    def failed(self) -> bool:
        """The step ended in an error (or was cancelled): a later start runs it again."""
        task = self.task
        return task.done() and (task.cancelled() or task.exception() is not None)

    def take_feed(self) -> ShardFeed | None:
        """The feed, to the first caller only."""
        feed, self.feed = self.feed, None
        return feed
