"""The shard step: the input resharded once, ids assigned, laid out in prefix order
(``pipeline.resume``), in the caller's task or as a task of its own beside the pool's start.

``ShardStep`` owns the step's task and the ``ShardFeed`` its layout pass fills for round 0
(``pipeline.stream``): round 0 takes the feed once (``take_feed``), and a step that failed
is started afresh with a new feed, so no retry reads a drained one.
"""

from __future__ import annotations

import asyncio

from batch_inference.pipeline.steps.context import RunContext
from batch_inference.pipeline.stream import ShardFeed, ShardStepStart
from batch_inference.pipeline.summaries import ShardSummary


class ShardStep:
    """The shard step of one run; ``stream_round0``: round 0 may start beside its layout pass
    (set where one process drives the whole run, never by a step that runs the shard step alone)."""

    def __init__(self, ctx: RunContext, *, stream_round0: bool = False) -> None:
        self.ctx = ctx
        self.stream_round0 = stream_round0
        self._start: ShardStepStart | None = None

    async def run(self) -> ShardSummary:
        """Join the step running in this process, or run it here, in the caller's task."""
        if (start := self.live()) is not None:
            return await asyncio.shield(start.task)
        self._start = None
        return await self.ctx.resume.shard()

    def live(self) -> ShardStepStart | None:
        """The shard step started in this process, running or finished, unless it failed."""
        start = self._start
        return None if start is None or start.failed else start

    def start(self) -> asyncio.Future[ShardSummary]:
        """Start the step as a task of its own, or join the one started (a new one, with a new
        feed, after it failed)."""
        if (start := self.live()) is not None:
            return start.task
        feed = ShardFeed() if self.may_stream() else None
        self._start = ShardStepStart(asyncio.ensure_future(self._step(feed)), feed)
        return self._start.task

    def may_stream(self) -> bool:
        """Round 0 may start beside the layout pass: a whole run (``stream_round0``), the pass
        on and streaming (``layout.prefix``, ``layout.stream``), a strategy with rounds."""
        s = self.ctx.spec
        return self.stream_round0 and s.layout.prefix and s.layout.stream and s.strategy != "in_place"

    @property
    def streams(self) -> bool:
        """Whether the step in this process feeds round 0 (and round 0 has not taken the feed yet)."""
        return self._start is not None and self._start.feed is not None

    def take_feed(self) -> ShardFeed | None:
        """The running step's feed, to round 0's first attempt only."""
        return self._start.take_feed() if self._start is not None else None

    async def _step(self, feed: ShardFeed | None) -> ShardSummary:
        try:
            summary = await self.ctx.resume.shard(feed)
        except BaseException as exc:
            if feed is not None:
                feed.end(exc)
            raise
        if feed is not None:
            feed.end()
        return summary
