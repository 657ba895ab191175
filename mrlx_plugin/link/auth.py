"""How a client and the coordinator prove to each other that they hold the run's token, without
ever sending it.

Two keys are derived from the token: `client_key = HMAC-SHA256(token, "mrlx client")` signs
requests, `server_key = HMAC-SHA256(token, "mrlx server")` signs answers (two keys, so that a
request's signature reflected back never passes for an answer's proof). A signed request carries

    X-Mrlx-Time            the client's Unix time in seconds (the coordinator accepts +-MAX_SKEW_S)
    X-Mrlx-Nonce           32 hex digits, fresh for every attempt (a repeat is refused: a replay)
    X-Mrlx-Content-Sha256  hex SHA-256 of the request body (of b"" when there is none)
    X-Mrlx-Signature       hex HMAC-SHA256(client_key, "mrlx-v1\\n" METHOD "\\n" PATH "\\n" NONCE
                           "\\n" TIME "\\n" CONTENT_SHA256), PATH as on the request line (query included)

and the coordinator answers a request whose signature it verified with

    X-Mrlx-Proof           hex HMAC-SHA256(server_key, "mrlx-v1\\n" NONCE "\\n" STATUS "\\n"
                           SHA256(answer body))

A client uses no answer without a valid proof. Someone who records the requests learns MACs only:
testing a guessed token against one costs an HMAC per guess, so a token must be long and random
(the launch scripts make 32 random bytes). There is no encryption: without TLS the traffic itself
(training data included) can be read on the network.

`mrlx coordinator call METHOD PATH` (see `call_main`) makes one signed request from a shell,
in place of curl.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import hmac
import math
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

TIME_HEADER = "X-Mrlx-Time"
NONCE_HEADER = "X-Mrlx-Nonce"
CONTENT_HEADER = "X-Mrlx-Content-Sha256"
SIGNATURE_HEADER = "X-Mrlx-Signature"
PROOF_HEADER = "X-Mrlx-Proof"
SCHEME = "Mrlx-HMAC-SHA256"
MAX_SKEW_S = 300.0  # clocks of the hosts of a run may differ by this much
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def derive_keys(token: str) -> tuple[bytes, bytes]:
    """(client_key, server_key) of a token."""
    raw = token.encode("utf-8", "surrogateescape")  # a token read from the environment may hold any bytes
    return (
        hmac.new(raw, b"mrlx client", hashlib.sha256).digest(),
        hmac.new(raw, b"mrlx server", hashlib.sha256).digest(),
    )


def content_sha256(body: bytes | bytearray | memoryview | None) -> str:
    return EMPTY_SHA256 if not body else hashlib.sha256(body).hexdigest()


def request_mac(client_key: bytes, method: str, path: str, nonce: str, stamp: str, content: str) -> str:
    message = f"mrlx-v1\n{method.upper()}\n{path}\n{nonce}\n{stamp}\n{content}"
    return hmac.new(client_key, message.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def answer_mac(server_key: bytes, nonce: str, status: int, content: str) -> str:
    message = f"mrlx-v1\n{nonce}\n{int(status)}\n{content}"
    return hmac.new(server_key, message.encode(), hashlib.sha256).hexdigest()


def sign(client_key: bytes, method: str, path: str, content: str) -> dict[str, str]:
    """The headers that sign one request (`content`: the body's `content_sha256`)."""
    nonce, stamp = secrets.token_hex(16), f"{time.time():.3f}"
    return {
        TIME_HEADER: stamp,
        NONCE_HEADER: nonce,
        CONTENT_HEADER: content,
        SIGNATURE_HEADER: request_mac(client_key, method, path, nonce, stamp, content),
    }


def signed_headers(token: str, method: str, path: str, body: bytes | None = None) -> dict[str, str]:
    """Headers of one signed request from the token itself (tests, tools): `path` as sent on the
    request line, e.g. "/v1/runs/run1?x=1"."""
    return sign(derive_keys(token)[0], method, path, content_sha256(body))


def request_target(url: str) -> str:
    """The path and query of `url` as a request line carries them (what a signature covers)."""
    parts = urllib.parse.urlsplit(url)
    return (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def proven(server_key: bytes, nonce: str, status: int, content: str, proof: str | None) -> bool:
    """Whether `proof` (an answer's X-Mrlx-Proof) shows the answer came from a holder of the token."""
    if not proof:
        return False
    expected = answer_mac(server_key, nonce, status, content)
    return hmac.compare_digest(proof.strip().encode("utf-8", "surrogateescape"), expected.encode())


class ReplayGuard:
    """The coordinator's memory of recent nonces: a nonce is accepted once. Bounded to `capacity`
    entries: when full, the entries with the oldest times are forgotten, and from then on a request
    stamped at or before the newest time forgotten (`floor`) cannot be told from a replay; it is
    refused as retryable (its client signs afresh). Requests are stamped when sent, so only one
    that spent longer on the way than the remembered span of requests meets that."""

    def __init__(self, capacity: int = 16384, window_s: float = MAX_SKEW_S) -> None:
        self.capacity = capacity
        self.window_s = window_s
        self.floor = float("-inf")
        self._seen: dict[str, float] = {}
        self._order: list[tuple[float, str]] = []  # a heap of (time, nonce)

    def admit(self, nonce: str, stamp: float, now: float) -> str | None:
        """None when the request is fresh (and remember it); else "replay" or "forgotten"."""
        order = self._order
        while order and order[0][0] < now - self.window_s:  # outside the window: refused anyway
            self._seen.pop(heapq.heappop(order)[1], None)
        if nonce in self._seen:
            return "replay"
        if stamp <= self.floor:
            return "forgotten"
        if len(order) >= self.capacity:
            if stamp <= order[0][0]:
                return "forgotten"
            old, forgotten = heapq.heappop(order)
            self._seen.pop(forgotten, None)
            self.floor = max(self.floor, old)
        self._seen[nonce] = stamp
        heapq.heappush(order, (stamp, nonce))
        return None


def check_request(
    client_key: bytes, method: str, path: str, headers: Mapping[str, str]
) -> tuple[str | None, str | None, float]:
    """(nonce, problem, stamp) of a request's signature headers: nonce is the request's when its
    MAC matches (then the answer is signed, even a refusal), problem None when it is acceptable
    so far (the time window and replays are the caller's to check, the body's hash too)."""
    names = (TIME_HEADER, NONCE_HEADER, CONTENT_HEADER, SIGNATURE_HEADER)
    given = {name: headers.get(name) for name in names}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(given):
        return None, "the request is not signed", 0.0
    if missing:
        return None, f"the request's signature lacks the header(s) {', '.join(missing)}", 0.0
    stamp_text, nonce, content, mac = (str(given[name]).strip() for name in given)
    if not (16 <= len(nonce) <= 64 and _is_hex(nonce)):
        return None, f"{NONCE_HEADER} must be 16 to 64 hex digits", 0.0
    if not (len(content) == 64 and _is_hex(content)):
        return None, f"{CONTENT_HEADER} must be 64 hex digits (the body's SHA-256)", 0.0
    try:
        stamp = float(stamp_text)
    except ValueError:
        stamp = float("nan")
    if not (math.isfinite(stamp) and abs(stamp) < 1e12):
        return None, f"{TIME_HEADER} must be a Unix time in seconds, got {stamp_text[:40]!r}", 0.0
    expected = request_mac(client_key, method, path, nonce, stamp_text, content)
    if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected.encode()):
        return (
            None,
            (
                f"the request's {SIGNATURE_HEADER} does not match: it was made with another token than the "
                "coordinator's, or the request was changed on the way"
            ),
            0.0,
        )
    return nonce, None, stamp


def _is_hex(text: str) -> bool:
    return text.isascii() and all(c in "0123456789abcdefABCDEF" for c in text)


# --------------------------------------------------------------------------- from a shell


def call_main(argv: list[str] | None = None) -> int:
    """`mrlx coordinator call METHOD PATH [--data JSON|@FILE]`: one signed request; prints the
    answer's body once its proof checks out."""
    from mrlx_plugin.link.wire import token_from_env_or_file

    parser = argparse.ArgumentParser(
        prog="mrlx coordinator call",
        description="Send one signed request to the coordinator (the token never travels) and print "
        "its answer, once the answer proves it came from a holder of the token. In place of curl: "
        "the coordinator takes no bearer token.",
    )
    parser.add_argument("method", help="GET or POST")
    parser.add_argument("path", help="e.g. /metrics, /health, /v1/runs/RUN, /v1/runs/RUN/queues/AGENT")
    parser.add_argument("--url", default="http://127.0.0.1:18888", help="the coordinator's base URL")
    parser.add_argument("--data", default=None, help="the request body: JSON text, or @FILE")
    parser.add_argument("--token-env", default="MRLX_TOKEN", help="environment variable holding the token")
    parser.add_argument("--token-file", default=None, help="file holding the token (instead of --token-env)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the answer")
    args = parser.parse_args(argv)
    try:
        token = token_from_env_or_file(args.token_env, args.token_file)
        body = None
        if args.data is not None:
            if args.data.startswith("@"):
                with open(args.data[1:], "rb") as handle:
                    body = handle.read()
            else:
                body = args.data.encode()
    except (ValueError, OSError) as exc:
        print(f"mrlx coordinator call: {exc}", file=sys.stderr)
        return 2
    if token is None:
        print(
            f"mrlx coordinator call: no token (${args.token_env} unset, no --token-file); the call is "
            "not signed and its answer not checked",
            file=sys.stderr,
        )
    method = args.method.upper()
    url = args.url.rstrip("/") + (args.path if args.path.startswith("/") else "/" + args.path)
    headers = {} if token is None else signed_headers(token, method, request_target(url), body)
    if body is not None:
        headers["Content-Type"] = "application/json"  # (a commit's body is read as a frame whatever its type)
    request = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            status, answer_headers, answer = response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        status, answer_headers, answer = exc.code, exc.headers, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        print(f"mrlx coordinator call: {url} is unreachable: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    proof = answer_headers.get(PROOF_HEADER)
    if token is not None and not proven(
        derive_keys(token)[1], headers[NONCE_HEADER], status, content_sha256(answer), proof
    ):
        print(
            f"mrlx coordinator call: the coordinator at {args.url} could not prove it holds the run's "
            f"token (HTTP {status} without a valid {PROOF_HEADER}): is another process on its port, or "
            "does it run with another token? Its answer is not shown.",
            file=sys.stderr,
        )
        return 1
    sys.stdout.buffer.write(answer + (b"" if answer.endswith(b"\n") else b"\n"))
    if status >= 400:
        print(f"mrlx coordinator call: HTTP {status}", file=sys.stderr)
        return 1
    return 0
