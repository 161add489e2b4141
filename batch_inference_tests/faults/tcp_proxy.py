"""A loopback TCP proxy that can be cut: a storage outage without losing the server's state.

moto keeps its buckets in memory, so stopping the server would lose the data; putting
this proxy between the client and the server and cutting it (listener closed:
connections refused; open connections reset) looks to the client exactly like the
server going away, and ``restore()`` brings it back on the same port.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """``with TcpProxy(port_of_server) as proxy: ... proxy.cut(); proxy.restore()``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = _free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        self.restore()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def restore(self) -> None:
        """Accept connections again (same port)."""
        if self._server is None:
            self._server = self._call(asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True))

    def cut(self) -> None:
        """Refuse new connections and reset every open one."""
        self._call(self._cut())

    async def _cut(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    @property
    def is_up(self) -> bool:
        return self._server is not None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort() if self._server is None else dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.discard(writer)
        self._writers.discard(up_writer)
