"""Network policy shared by the package's servers (engine, stub engine, coordinator)."""

from __future__ import annotations

import ipaddress


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
    return (f"refusing to listen on {host!r}: {what} has no authentication, so anyone who can reach it could "
            "use it. Listen on 127.0.0.1 (the default), or pass --allow-remote on a trusted network")
