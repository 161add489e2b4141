"""Virtual time: an asyncio loop whose clock jumps to the next timer instead of sleeping.

The scale simulation runs the pipeline's real async code (``dispatch_bounded`` and the
round policy) on it, so a 100M-record run takes seconds.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpSelector(selectors.BaseSelector):
    """Never waits: a select with a timeout moves the loop's clock forward by it."""

    def __init__(self) -> None:
        self._map: dict[Any, selectors.SelectorKey] = {}
        self.loop: VirtualClockLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int) else fileobj.fileno(), events, data)
        self._map[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._map.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise RuntimeError("simulation deadlock: every task waits and no timer is set")
        assert self.loop is not None
        self.loop.now += max(0.0, timeout)
        return []

    def get_map(self) -> Any:
        return self._map

    def close(self) -> None:
        self._map.clear()


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock: ``asyncio.sleep(3600)`` returns at once, an hour later.

    Only timers and ready callbacks exist here: no threads, no sockets (a coroutine that
    waits on real I/O is a deadlock and raises).
    """

    def __init__(self) -> None:
        selector = _JumpSelector()
        self.now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


def run_virtual(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` to completion on a fresh ``VirtualClockLoop``."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
