"""One keep-alive HTTP/1.1 connection of the stub engine, over a bare asyncio protocol (no
framework): requests framed by Content-Length and answered strictly in order, bounded headers and
bodies, and the bytes of an answer (a streamed one: its head, then its body in chunks)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, cast

import orjson

if TYPE_CHECKING:
    from mrlx_lab.stub_engine.server import StubServer

MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
}


def response(
    status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False
) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        status,
        _REASONS.get(status, "Unknown").encode(),
        content_type,
        len(body),
    )
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


def stream_head(close: bool = False) -> bytes:
    """The head of a 200 answer streamed as server-sent events, its body in chunks (SGLang's)."""
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        b"Transfer-Encoding: chunked\r\n"
    )
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n"


def json_response(data: object, status: int = 200) -> bytes:
    return response(status, orjson.dumps(data))


def error(message: str, status: int = 400) -> bytes:
    return json_response({"error": {"message": message, "code": status}}, status)


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. Requests on it are answered strictly in order: while
    one answer is pending (a delay, a pause, a stall), later requests wait in the buffer."""

    def __init__(self, server: StubServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP server's connection
        self.server.state.stats["connections"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.forget(self)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self.process()

    def send(self, payload: bytes, close: bool = False) -> None:
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        self.transport.write(payload)
        if close:
            self.transport.close()
            self.closed = True

    def resume(self) -> None:
        """The pending answer went out: go on with the requests already buffered."""
        self.busy = False
        if self.buf and not self.closed:
            self.process()

    def process(self) -> None:
        while self.buf and not self.busy and not self.closed:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEADER_BYTES:
                    self.send(error("request headers too large", 431), close=True)
                return
            head = bytes(self.buf[:end]).decode("latin-1")
            lines = head.split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                self.send(
                    error(f"unsupported request line {lines[0][:80]!r}; this server speaks HTTP/1.1", 400),
                    close=True,
                )
                return
            method, target, version = parts
            length = 0
            close = version == "HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    try:
                        length = int(value.strip())
                    except ValueError:
                        self.send(error("bad Content-Length", 400), close=True)
                        return
                elif name == "transfer-encoding" and "chunked" in value.lower():
                    self.send(
                        error("chunked request bodies are not supported; send Content-Length", 501),
                        close=True,
                    )
                    return
                elif name == "connection":
                    v = value.strip().lower()
                    close = v == "close" or (close and v != "keep-alive")
            if length > MAX_BODY_BYTES:
                self.send(error("request body too large", 413), close=True)
                return
            total = end + 4 + length
            if len(self.buf) < total:
                return  # wait for the rest of the body
            body = bytes(self.buf[end + 4 : total])
            del self.buf[:total]
            path = target.split("?", 1)[0]
            self.server.handle(self, method, path, body, close)
