"""CheckpointStore: per-sample, per-attempt state for in-place retry (Strategy 2).

State lives as append-only *segments* under one URL: each ``append(states)`` call
writes one small JSONL segment (atomically, like any shard), so a chunk of 2,000
samples costs one object, never 2,000. ``load()`` replays segments in name order and
merges each sample's fields, so the latest attempt wins.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid

from batch_inference.storage import urls
from batch_inference.storage.errors import CorruptShardError, MalformedRecordError
from batch_inference.storage.directory import JsonlDir
from batch_inference.storage.file import JsonlFile

log = logging.getLogger(__name__)
_counter = itertools.count()


class CheckpointStore:
    """Segments ``seg-<time_ns>-<seq>-<rand>.jsonl.zst`` under ``url``; each state needs an ``id``."""

    def __init__(self, url: str, *, storage_options: dict | None = None) -> None:
        self.url = urls.normalize(str(url))
        self.storage_options = storage_options
        self._dir = JsonlDir(self.url, storage_options=storage_options)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def _segment_name(self) -> str:
        # time first so segments from different processes sort in append order;
        # the per-process sequence breaks ties inside one process.
        return f"seg-{time.time_ns():020d}-{next(_counter):08d}-{uuid.uuid4().hex[:8]}.jsonl.zst"

    def segments(self) -> list[JsonlFile]:
        """Committed segments in append order; an empty list when nothing was saved yet."""
        try:
            return [s for s in self._dir.shards() if s.name.startswith("seg-")]
        except FileNotFoundError:
            return []

    async def append(self, states: list[dict]) -> None:
        """Write one segment holding every state of this call (call once per chunk)."""
        if not states:
            return
        for s in states:
            if "id" not in s:
                raise ValueError(f"checkpoint state without an 'id': {s!r}")
        async with JsonlFile(urls.join(self.url, self._segment_name()), storage_options=self.storage_options).writer() as w:
            await w.write_many(states)

    def load_sync(self) -> dict[str, dict]:
        merged: dict[str, dict] = {}
        for seg in self.segments():
            try:
                for state in seg.iter_records_sync():
                    sid = str(state["id"])
                    prev = merged.get(sid)
                    merged[sid] = {**prev, **state} if prev else state
            except (CorruptShardError, MalformedRecordError) as exc:
                # Segments commit atomically, so this is foreign damage: keep what was
                # read (states are replayable: the cost is redoing an attempt).
                log.warning("skipping the rest of damaged checkpoint segment %s: %s", seg.url, exc)
        return merged

    async def load(self) -> dict[str, dict]:
        """id -> latest state, merged field by field over segments in append order."""
        return await asyncio.to_thread(self.load_sync)

    async def compact(self) -> None:
        """Fold all segments into one (named to sort just after the last folded one), then drop them."""
        segs = await asyncio.to_thread(self.segments)
        if len(segs) < 2:
            return
        merged = await self.load()
        last = segs[-1].name.removesuffix(".jsonl.zst")
        async with JsonlFile(urls.join(self.url, f"{last}_c.jsonl.zst"), storage_options=self.storage_options).writer() as w:
            await w.write_many(merged.values())
        fs = self._dir.fs
        await asyncio.to_thread(fs.rm, [s.path for s in segs])
