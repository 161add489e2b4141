"""Which errors are a storage or network blip worth retrying the whole step for.

Every pipeline step is idempotent and resumable, so the cheapest correct answer to a
connection refused/reset or a timeout from the object store is to wait and run the
step again: finished shards are skipped, nothing is recomputed, nothing duplicated.
Anything else (bad input, conservation failures, disk full) is not retried.
"""

from __future__ import annotations

import asyncio


def is_transient(exc: BaseException) -> bool:
    """True for connection and timeout errors (builtin, botocore, aiohttp), also when chained."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        module = type(exc).__module__
        names = {c.__name__ for c in type(exc).__mro__}
        if module.startswith("botocore") and names & {"ConnectionError", "HTTPClientError"}:
            return True
        if module.startswith("aiohttp") and "ClientConnectionError" in names:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False
