"""vLLM's automatic prefix cache at block level, for the decode-step model (virtual time)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """vLLM's automatic prefix cache at block level: the KV blocks of finished prompts stay
    cached, least recently used first out, in whatever the running sequences leave free.

    Blocks are keyed by their chained hashes (``engines.blocks``): a block names its whole
    prefix, so a request hits its leading blocks that are cached. A block in use by a
    running sequence is pinned (never evicted, and hit by every request admitted while it
    runs); released, it joins the LRU. The scheduler evicts down to the KV blocks its
    running sequences leave free after every step. Counters are in tokens, as vLLM's
    ``prefix_cache_stats``: ``queries`` (prompt tokens looked up on a first admission),
    ``hits`` (of those, cached), and the same for re-admissions after a preemption.
    """

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._pinned: dict[bytes, int] = {}  # block -> running sequences holding it
        self._free: OrderedDict[bytes, None] = OrderedDict()  # cached, unused: oldest first
        self.requests = self.queries = self.hits = 0
        self.preempted_queries = self.preempted_hits = 0

    def __len__(self) -> int:
        return len(self._pinned) + len(self._free)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` in the cache (pinned or free)."""
        n = 0
        for key in keys:
            if key not in self._pinned and key not in self._free:
                break
            n += 1
        return n

    def admit(self, keys: Sequence[bytes], prompt_tokens: int, *, preempted: bool) -> int:
        """A sequence's prefill: counts its lookup, pins its blocks; returns the tokens it hit."""
        hit = self.lookup(keys) * self.block_size
        if preempted:
            self.preempted_queries += prompt_tokens
            self.preempted_hits += hit
        else:
            self.requests += 1
            self.queries += prompt_tokens
            self.hits += hit
        for key in keys:
            if key in self._free:
                del self._free[key]
            self._pinned[key] = self._pinned.get(key, 0) + 1
        return hit

    def release(self, keys: Sequence[bytes]) -> None:
        """A sequence finished, was aborted or preempted: its blocks stay cached, unpinned."""
        for key in keys:
            n = self._pinned.get(key, 0) - 1
            if n > 0:
                self._pinned[key] = n
            elif n == 0:
                del self._pinned[key]
                self._free[key] = None

    def evict_to(self, free_blocks: int) -> None:
        """Drop least recently used unpinned blocks until at most ``free_blocks`` remain."""
        while len(self._free) > max(0, free_blocks):
            self._free.popitem(last=False)
