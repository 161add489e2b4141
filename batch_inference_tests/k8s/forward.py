"""A TCP forwarder across network namespaces: accept on an inherited socket, connect here.

The test process creates the listening socket on 127.0.0.1 in its own namespace and
starts this module inside the cluster's namespace (``ip netns exec``) with the socket's
fd; each accepted connection is relayed to ``--to HOST:PORT`` as seen from inside. A
socket belongs to the namespace it was created in, so nothing is routed between them.
"""

from __future__ import annotations

import argparse
import asyncio
import socket


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(fd: int, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    listener = socket.socket(fileno=fd)
    listener.setblocking(False)
    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--to", required=True)
    args = parser.parse_args()
    host, _, port = args.to.rpartition(":")
    asyncio.run(main(args.fd, host, int(port)))
