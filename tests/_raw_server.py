"""HTTP servers written byte by byte, for testing the engine client against answers no real
server would give (and ones it would): a scripted reply per request, or any bytes at all."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

HANG_UP = b""  # a scripted reply: read the request, answer nothing, close the connection


def answer(status: int, body: bytes, *, extra: bytes = b"") -> bytes:
    """A well-formed HTTP/1.1 JSON answer."""
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


class RawServer:
    """A server on 127.0.0.1 that reads each request (head and Content-Length body) and lets
    `reply(server, writer)` write whatever it likes; a reply returning False closes the
    connection. `requests` holds the request heads, `connections` counts connections and
    `sent` the bytes written through `write`."""

    def __init__(self, reply: Callable[[RawServer, asyncio.StreamWriter], Awaitable[bool | None]]):
        self.reply = reply
        self.requests: list[bytes] = []
        self.connections = 0
        self.sent = 0
        self.handlers: set[asyncio.Task] = set()

    async def __aenter__(self) -> RawServer:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.handlers.add(asyncio.current_task())
            self.connections += 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    await reader.readexactly(length)
                    self.requests.append(head)
                    if await self.reply(self, writer) is False:
                        break
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
                pass  # the client hung up, or the test is over
            finally:
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in self.handlers:
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


class ScriptedServer(RawServer):
    """Answers request i with `script[min(i, len - 1)]` (`HANG_UP`: closing the connection)."""

    def __init__(self, *script: bytes):
        super().__init__(ScriptedServer._next)
        self.script = script

    async def _next(self, writer: asyncio.StreamWriter) -> bool:
        reply = self.script[min(len(self.requests), len(self.script)) - 1]
        if reply == HANG_UP:
            return False
        await self.write(writer, reply)
        return True
