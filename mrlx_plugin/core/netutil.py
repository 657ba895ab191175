"""Network plumbing shared by the package's servers (engine, stub engine, coordinator): who may
connect, and how a server started on port 0 tells its parent which port it got."""

from __future__ import annotations

import ipaddress
import os
import socket


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
