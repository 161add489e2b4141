"""Which errors are a storage or network blip worth retrying the whole step for.

Every pipeline step is idempotent and resumable, so the cheapest correct answer to a
connection refused/reset, a timeout, or the object store's own "try again" (a 5xx:
``InternalError``, ``ServiceUnavailable``, ``SlowDown``, as a restarted S3 server answers
until its volumes are back) is to wait and run the step again: finished shards are
skipped, nothing is recomputed, nothing duplicated. Anything else (bad input, access
denied, a missing key, conservation failures, disk full) is not retried.
"""

from __future__ import annotations

import asyncio
from typing import Any

# S3 error codes that AWS documents as "retry the request"; any other 5xx counts too.
_RETRYABLE_S3_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
                                 "RequestTimeTooSkewed", "Throttling", "ThrottlingException"})


def is_transient(exc: BaseException) -> bool:
    """True for connection/timeout errors (builtin, botocore, aiohttp) and an object store's
    5xx "try again", also when chained (s3fs raises ``OSError`` from botocore's ``ClientError``)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        module = type(exc).__module__
        names = {c.__name__ for c in type(exc).__mro__}
        if module.startswith("botocore") and names & {"ConnectionError", "HTTPClientError"}:
            return True
        if module.startswith("botocore") and "ClientError" in names and _server_said_retry(getattr(exc, "response", None)):
            return True
        if module.startswith("aiohttp") and "ClientConnectionError" in names:
            return True
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def _server_said_retry(response: Any) -> bool:
    """A botocore error response whose code or HTTP status means "the server failed, try again"."""
    if not isinstance(response, dict):
        return False
    code = str((response.get("Error") or {}).get("Code") or "")
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in _RETRYABLE_S3_CODES or (isinstance(status, int) and 500 <= status < 600)
