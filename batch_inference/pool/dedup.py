"""Identical requests computed once: a worker's memo of deterministic requests, per phase.

A batch job carries exact repeats (the same question asked twice, a judge prompt that
repeats for identical results). Two requests are the same computation when their prompt
(the rendered text, or the chat messages the engine renders with its one template) and
their sampling are identical and the outcome is deterministic:

- temperature 0 (greedy): the seed does not matter to an engine whose greedy decoding
  ignores it (``engines.greedy_ignores_seed``), so it is left out of the key;
- temperature > 0 with an explicit seed: the same seed samples the same output
  (vLLM seeds per request). The pipeline derives every record's seed from its id and
  attempt (``derive_seed``), so sampled requests of two records never share one.

Anything else (temperature > 0, no seed) is a fresh sample and never merges. The key also
holds the phase (``TaskSpec.dedup_scope``: run instance, round, kind) and the record's
attempt number, so a retry, in a later round or in place, is always its own computation
and never answered from an earlier attempt's (rejected) result.

The memo lives in the worker's engine host, shared by every task the worker runs: the
first request of a key leads (it goes to the engine), identical ones that arrive while it
runs wait for it, and later ones are answered from a bounded LRU of finished results.
Only a successful completion is shared: a waiter whose leader failed or went away runs its
own request (``Orphaned``), so a record never inherits an error it would not have had.
Across workers nothing is shared; the prefix-aware layout puts identical requests into the
same shard, and affinity dispatch sends a prefix family to one worker.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from batch_inference.engines import ChatPrompt, Completion, EngineDeadError, Prompt, SamplingParams

# Bytes of finished results the memo keeps (text + a fixed overhead per entry).
DEFAULT_MEMO_BYTES = 64 * 2**20
_ENTRY_OVERHEAD = 160


class Orphaned(Exception):
    """The request this one waited on failed or was cancelled: run it on its own."""


def identity_text(prompt: Prompt, params: SamplingParams, *, greedy_ignores_seed: bool) -> str | None:
    """What makes two requests the same computation, as the text both keys hash (the memo's
    and the cross-run cache's, ``pool.result_cache``: the one rule they share), or None when
    the outcome is not deterministic: ``repr(((kind, prompt), sampling))``, the prompt as
    rendered by the builder (text, or chat messages) and the sampling, its seed left out
    where greedy decoding ignores it. Made once per request for both keys; a chunk's requests
    share one ``SamplingParams`` object, whose part is made once (``_params_text``)."""
    if params.temperature > 0 and params.seed is None:
        return None
    body = ("chat", prompt.messages) if isinstance(prompt, ChatPrompt) else ("text", prompt)
    sampling = _params_text(params, params.temperature == 0 and greedy_ignores_seed)  # SamplingParams is hashable
    return f"({body!r}, {sampling})"


@functools.lru_cache(maxsize=256)
def _params_text(params: SamplingParams, drop_seed: bool) -> str:
    return repr(replace(params, seed=None) if drop_seed else params)


def request_key(scope: str, prompt: Prompt, params: SamplingParams, attempt: int, *,
                greedy_ignores_seed: bool) -> bytes | None:
    """The memo key of one request, or None when its outcome is not deterministic."""
    text = identity_text(prompt, params, greedy_ignores_seed=greedy_ignores_seed)
    return None if text is None else memo_key(scope, attempt, text)


def memo_key(scope: str, attempt: int, identity: str) -> bytes:
    """The memo key of a request's ``identity_text`` in the phase ``scope`` at ``attempt`` (a
    worker's own: no stored key depends on its text)."""
    return hashlib.blake2b(f"({scope!r}, {attempt!r}, {identity})".encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class _Flight:
    """A key's leading request while it runs, and everyone waiting for it."""

    engine: asyncio.Future[Completion] | None = None  # attached once the leader is submitted
    waiters: set[asyncio.Future[Completion]] = field(default_factory=set)
    leader: asyncio.Future[Completion] | None = None  # the leading request's own waiter


class RequestMemo:
    """Leaders, waiters and finished results of identical requests (one per worker)."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self._flights: dict[bytes, _Flight] = {}
        self._done: OrderedDict[bytes, Completion] = OrderedDict()
        self._bytes = 0
        self.led = 0  # requests that went to the engine under a key
        self.joined = 0  # answered by a request still running
        self.replayed = 0  # answered from a finished result
        self.orphaned = 0  # waited, then ran on their own (the leader failed or left)

    def answer(self, key: bytes) -> Completion | asyncio.Future[Completion] | None:
        """A finished result, a future on the running leader, or None (this request leads)."""
        if (done := self._done.get(key)) is not None:
            self._done.move_to_end(key)
            self.replayed += 1
            return done
        if (flight := self._flights.get(key)) is not None:
            self.joined += 1
            return self._waiter(key, flight)
        return None

    def lead(self, key: bytes) -> asyncio.Future[Completion]:
        """Register this request as the key's leader; ``attach`` its engine future next."""
        assert key not in self._flights and key not in self._done
        self.led += 1
        flight = self._flights[key] = _Flight()
        flight.leader = self._waiter(key, flight)
        return flight.leader

    def attach(self, key: bytes, engine: asyncio.Future[Completion]) -> None:
        """The leader's engine future: its outcome resolves every waiter."""
        flight = self._flights.get(key)
        if flight is None or not flight.waiters:  # every waiter left while it was being submitted
            engine.cancel()
            return
        flight.engine = engine
        engine.add_done_callback(lambda f: self._settle(key, flight, f))

    def abandon(self, key: bytes) -> None:
        """The leader never reached the engine (its submit failed): waiters run on their own."""
        flight = self._flights.pop(key, None)
        if flight is not None:
            self._orphan(flight)

    def _waiter(self, key: bytes, flight: _Flight) -> asyncio.Future[Completion]:
        waiter: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        flight.waiters.add(waiter)

        def left(w: asyncio.Future[Completion]) -> None:
            flight.waiters.discard(w)
            if w.cancelled() and not flight.waiters and flight.engine is not None and not flight.engine.done():
                flight.engine.cancel()  # nobody wants it any more: abort it in the engine

        waiter.add_done_callback(left)
        return waiter

    def _settle(self, key: bytes, flight: _Flight, engine: asyncio.Future[Completion]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if engine.cancelled():
            self._orphan(flight)
            return
        exc = engine.exception()
        if isinstance(exc, EngineDeadError):  # the same for every request on this engine
            for w in list(flight.waiters):
                if not w.done():
                    w.set_exception(exc)
            return
        result = None if exc is not None else engine.result()
        if exc is not None or result.error is not None:
            # The leader keeps its own failure (a failed batch, an item error); the others
            # run their own request, as they would have without the memo.
            if flight.leader is not None and not flight.leader.done():
                if exc is not None:
                    flight.leader.set_exception(exc)
                else:
                    flight.leader.set_result(result)
            self._orphan(flight)
            return
        assert result is not None
        for w in list(flight.waiters):
            if not w.done():
                w.set_result(result)
        self._remember(key, result)

    def _orphan(self, flight: _Flight) -> None:
        for w in list(flight.waiters):
            if not w.done():
                self.orphaned += 1
                w.set_exception(Orphaned())

    def _remember(self, key: bytes, result: Completion) -> None:
        size = _size(result)
        if size > self.max_bytes:
            return
        self._done[key] = result
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._done.popitem(last=False)
            self._bytes -= _size(old)

    def stats(self) -> dict[str, Any]:
        return {"led": self.led, "joined": self.joined, "replayed": self.replayed, "orphaned": self.orphaned,
                "in_flight": len(self._flights), "results": len(self._done), "bytes": self._bytes}


def _size(result: Completion) -> int:
    """What a remembered result holds, roughly in bytes (an embedding: 8 a float)."""
    return len(result.text) + 8 * len(result.embedding or ()) + _ENTRY_OVERHEAD
