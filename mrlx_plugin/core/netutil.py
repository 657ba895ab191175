"""Network plumbing shared by the package's servers (engine, stub engine, coordinator) and clients:
who may connect, how a server started on port 0 tells its parent which port it got, and how a
body of a declared length is read into a reused buffer (the coordinator's commits, its client's
leases)."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp


def is_loopback(host: str) -> bool:
    """Whether `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def public_bind_refusal(host: str, allow_remote: bool, what: str) -> str | None:
    """The message refusing to serve `what` (which has no authentication) on a non-loopback
    address, or None when that is fine."""
    if allow_remote or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host!r}: {what} has no authentication, so anyone who can reach it could "
        "use it. Listen on 127.0.0.1 (the default), or pass --allow-remote on a trusted network"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (for tools that cannot bind port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_port_file(path: str, port: int) -> None:
    """Write the port a server bound, atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{port}\n")
    os.replace(tmp, path)


class BodyLengthError(ValueError):
    """A body that ended before its declared Content-Length (`received` < `length`), or went past
    it (`received` > `length`)."""

    def __init__(self, received: int, length: int) -> None:
        super().__init__(
            f"the body ended after {received} of its {length} bytes"
            if received < length
            else f"the body is longer than its Content-Length {length}"
        )
        self.received, self.length = received, length


async def read_declared(content: aiohttp.StreamReader, length: int, buf: bytearray) -> memoryview:
    """Read a body of `length` declared bytes from `content` (an aiohttp stream: a request's or an
    answer's) into `buf`, and return the view of its bytes there.

    `buf` is a reused buffer of at least `length` bytes (written in place) or an empty one, grown as
    the bytes arrive: memory follows the bytes received, never the length a peer declares (which
    costs it nothing to send). Raises BodyLengthError when the body ends early or runs past
    `length`; on any failure `buf` is left free to be reused."""
    view = memoryview(buf) if len(buf) >= length else None
    position = 0
    try:
        while position < length:
            chunk = await content.readany()
            end = position + len(chunk)
            if not chunk or end > length:
                raise BodyLengthError(end, length)
            if view is None:
                buf += chunk  # amortised growth (bytearray over-allocates)
            else:
                view[position:end] = chunk
            position = end
    except BaseException:
        if view is not None:
            view.release()  # the traceback keeps this frame: without it `buf` could not be resized
        raise
    return (memoryview(buf) if view is None else view)[:length]
