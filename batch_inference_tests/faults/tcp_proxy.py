"""A loopback TCP proxy that can be cut: a storage outage without losing the server's state.

moto keeps its buckets in memory, so stopping the server would lose the data; putting
this proxy between the client and the server and cutting it (listener closed:
connections refused; open connections reset) looks to the client exactly like the
server going away, and ``restore()`` brings it back on the same port.

``latency_s`` adds that much to every round trip (half each way): each chunk is held until
its own arrival time plus the delay, so latency is added without limiting throughput.
``requests`` counts the HTTP requests that went through, by method (a client chunk that
starts with one); ``max_in_flight`` is the most requests that waited for their answers
at once (a connection carries one at a time: HTTP/1.1 without pipelining).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from typing import Any

METHODS = frozenset({b"GET", b"PUT", b"HEAD", b"POST", b"DELETE"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TcpProxy:
    """``with TcpProxy(port_of_server) as proxy: ... proxy.cut(); proxy.restore()``."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1", *, latency_s: float = 0.0) -> None:
        self.target = (target_host, target_port)
        self.latency_s = latency_s
        self.requests: Counter[str] = Counter()
        self.in_flight = self.max_in_flight = 0
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
        self._call(self._settle())
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

    async def _settle(self) -> None:
        """Let the connections' tasks end (their transports are aborted) before the loop stops."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=2)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

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

        waiting = [False]  # this connection's request is sent, its answer not started

        def count(data: bytes, upstream: bool) -> None:
            if not upstream:
                if waiting[0]:
                    waiting[0] = False
                    self.in_flight -= 1
                return
            method = data[:7].split(b" ", 1)[0]
            if method in METHODS:
                self.requests[method.decode()] += 1
                if not waiting[0]:
                    waiting[0] = True
                    self.in_flight += 1
                    self.max_in_flight = max(self.max_in_flight, self.in_flight)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool = False) -> None:
            try:
                while data := await src.read(65536):
                    count(data, upstream)
                    dst.write(data)
                    await dst.drain()
            except (OSError, asyncio.IncompleteReadError):
                pass
            finally:
                dst.transport.abort() if self._server is None else dst.close()

        async def delayed_pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float, upstream: bool = False) -> None:
            """``pipe``, each chunk delivered ``delay_s`` after it arrived (in order)."""
            loop = asyncio.get_running_loop()
            chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

            async def read() -> None:
                try:
                    while data := await src.read(65536):
                        count(data, upstream)
                        chunks.put_nowait((loop.time() + delay_s, data))
                except (OSError, asyncio.IncompleteReadError):
                    pass
                finally:
                    chunks.put_nowait((loop.time() + delay_s, b""))

            reading = asyncio.create_task(read())
            try:
                while True:
                    due, data = await chunks.get()
                    await asyncio.sleep(max(0.0, due - loop.time()))
                    if not data:
                        break
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                reading.cancel()
                dst.transport.abort() if self._server is None else dst.close()

        try:
            if self.latency_s > 0:
                half = self.latency_s / 2
                await asyncio.gather(delayed_pipe(reader, up_writer, half, upstream=True), delayed_pipe(up_reader, writer, half))
            else:
                await asyncio.gather(pipe(reader, up_writer, upstream=True), pipe(up_reader, writer))
        except asyncio.CancelledError:  # the proxy closing: the connection ends here
            pass
        if waiting[0]:
            self.in_flight -= 1
        self._writers.discard(writer)
        self._writers.discard(up_writer)
