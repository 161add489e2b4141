"""The one loopback test both of our HTTP servers (pool workers, the review page) use:
bound to loopback they may serve without a token; anywhere else they must not."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str | None) -> bool:
    """True for ``localhost`` and any loopback address (127.0.0.0/8, ::1); False for None."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
