"""How a client and the coordinator prove to each other that they hold the run's token, without
ever sending it.

Two keys are derived from the token: `client_key = HMAC-SHA256(token, "mrlx client")` signs
requests, `server_key = HMAC-SHA256(token, "mrlx server")` signs answers (two keys, so that a
request's signature reflected back never passes for an answer's proof). A signed request carries

    X-Mrlx-Time            the client's Unix time in seconds (the coordinator accepts +-MAX_SKEW_S)
    X-Mrlx-Nonce           16 to 64 hex digits, never used twice (a repeat is refused: a replay).
                           The plugin's client sends 48: its own random id (32) and the count of
                           its requests (16), so that the coordinator remembers a client, not each
                           of its requests (see `ReplayGuard`)
    X-Mrlx-Boot            optional: the id of the coordinator's start the client knows (16 hex
                           digits, taken from an answer's X-Mrlx-Boot), or "-" when it knows none
    X-Mrlx-Content-Sha256  hex SHA-256 of the request body (of b"" when there is none)
    X-Mrlx-Signature       hex HMAC-SHA256(client_key, "mrlx-v1\\n" METHOD "\\n" PATH "\\n" NONCE
                           "\\n" TIME "\\n" CONTENT_SHA256), PATH as on the request line (query
                           included); with X-Mrlx-Boot, "\\n" BOOT is appended to what is signed

and the coordinator answers a request whose signature it verified with

    X-Mrlx-Proof           hex HMAC-SHA256(server_key, "mrlx-v1\\n" NONCE "\\n" STATUS "\\n"
                           SHA256(answer body))

and with X-Mrlx-Boot, the random id the coordinator drew when it started (outside the proof: a
wrong one costs the client one refusal, never a replay, as the coordinator accepts only its own).

A client uses no answer without a valid proof. The coordinator refuses a replay (503, retryable:
the true sender signs again) by these rules. A request that names its current start was signed
after that start, whatever its time says; its nonce is remembered for as long as its time is
inside the skew window (`ReplayGuard`). A request that names another start, or "-", is refused
with the current start's id, which the client names when it signs again, at once. A request that
names no start (`signed_headers`, for tools and tests) is accepted only when its time is after the
start. So a client whose clock is within the skew is refused at most once, never locked out, and a
request the plugin's client signed before a restart is never accepted after it. (One that names no
start can be, when the clock that stamped it ran ahead of the coordinator's past its start.)

Someone who records the requests learns MACs only: testing a guessed token against one costs an
HMAC per guess, so a token must be long and random (the launch scripts make 32 random bytes).
There is no encryption: without TLS the traffic itself (training data included) can be read on
the network.

`mrlx coordinator call METHOD PATH` (see `call_main`) makes one signed request from a shell,
in place of curl.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import hmac
import itertools
import math
import os
import secrets
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping

TIME_HEADER = "X-Mrlx-Time"
NONCE_HEADER = "X-Mrlx-Nonce"
CONTENT_HEADER = "X-Mrlx-Content-Sha256"
SIGNATURE_HEADER = "X-Mrlx-Signature"
PROOF_HEADER = "X-Mrlx-Proof"
BOOT_HEADER = "X-Mrlx-Boot"
NO_BOOT = "-"  # what a client that knows no start of the coordinator yet names
SCHEME = "Mrlx-HMAC-SHA256"
MAX_SKEW_S = 300.0  # clocks of the hosts of a run may differ by this much
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def token_from_env_or_file(env: str | None = "MRLX_TOKEN", file: str | None = None) -> str | None:
    """The bearer token from `file` when given, else from the environment variable `env`; None if neither.

    Raises ValueError when the file is given but missing or empty (a silent fallback to no token
    would turn auth off without anyone noticing).
    """
    if file:
        try:
            with open(file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {file!r}: {exc.strerror}") from None
        if not token:
            raise ValueError(f"the token file {file!r} is empty")
        return token
    if env:
        return os.environ.get(env, "").strip() or None
    return None


def derive_keys(token: str) -> tuple[bytes, bytes]:
    """(client_key, server_key) of a token."""
    raw = token.encode("utf-8", "surrogateescape")  # a token read from the environment may hold any bytes
    return (
        hmac.new(raw, b"mrlx client", hashlib.sha256).digest(),
        hmac.new(raw, b"mrlx server", hashlib.sha256).digest(),
    )


def content_sha256(body: bytes | bytearray | memoryview | None) -> str:
    return EMPTY_SHA256 if not body else hashlib.sha256(body).hexdigest()


def request_mac(
    client_key: bytes, method: str, path: str, nonce: str, stamp: str, content: str, boot: str | None = None
) -> str:
    message = f"mrlx-v1\n{method.upper()}\n{path}\n{nonce}\n{stamp}\n{content}"
    if boot is not None:  # (CONTENT is 64 hex digits: a message with a boot id never reads as one without)
        message += f"\n{boot}"
    return hmac.new(client_key, message.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()


def answer_mac(server_key: bytes, nonce: str, status: int, content: str) -> str:
    message = f"mrlx-v1\n{nonce}\n{int(status)}\n{content}"
    return hmac.new(server_key, message.encode(), hashlib.sha256).hexdigest()


def sign(
    client_key: bytes,
    method: str,
    path: str,
    content: str,
    *,
    now: float | None = None,
    nonce: str | None = None,
    boot: str | None = None,
) -> dict[str, str]:
    """The headers that sign one request (`content`: the body's `content_sha256`; `now`: the
    signer's Unix time, its clock's by default; `nonce`: a random one by default; `boot`: the
    coordinator start it names, none by default)."""
    nonce = secrets.token_hex(16) if nonce is None else nonce
    stamp = f"{time.time() if now is None else now:.3f}"
    headers = {TIME_HEADER: stamp, NONCE_HEADER: nonce, CONTENT_HEADER: content}
    if boot is not None:
        headers[BOOT_HEADER] = boot
    headers[SIGNATURE_HEADER] = request_mac(client_key, method, path, nonce, stamp, content, boot)
    return headers


def signed_headers(token: str, method: str, path: str, body: bytes | None = None) -> dict[str, str]:
    """Headers of one signed request from the token itself (tests, tools): `path` as sent on the
    request line, e.g. "/v1/runs/run1?x=1". They name no coordinator start, so right after one
    the coordinator refuses them while their time is not after it (a `Signer` is refused once)."""
    return sign(derive_keys(token)[0], method, path, content_sha256(body))


def is_boot(text: str) -> bool:
    """Whether `text` is a coordinator start's id (16 hex digits) as X-Mrlx-Boot carries it."""
    return len(text) == 16 and _is_hex(text)


class Signer:
    """How a client signs its requests: each attempt's nonce is this signer's random id and the
    count of the requests it signed, and each names the coordinator start it knows (X-Mrlx-Boot).

    Why: the coordinator then remembers a window of counts per signer instead of every nonce, so a
    burst of requests costs it no memory; and a request that names its current start cannot have
    been signed before that start, so it is accepted whatever the client's clock says (within the
    skew). A signer that knows no start, or an earlier one, is refused once with the current one
    (`learn`), and signs again at once."""

    def __init__(self, client_key: bytes, clock: Callable[[], float] = time.time) -> None:
        self._key = client_key
        self._clock = clock
        self._pid = -1
        self._id = ""
        self._count: itertools.count[int] = itertools.count()
        self.boot: str | None = None  # the coordinator start this signer knows

    def sign(self, method: str, path: str, content: str) -> dict[str, str]:
        if self._pid != os.getpid():  # a forked child counts under an id of its own
            self._pid, self._id, self._count = os.getpid(), secrets.token_hex(16), itertools.count()
        nonce = f"{self._id}{next(self._count):016x}"
        boot = self.boot or NO_BOOT
        return sign(self._key, method, path, content, now=self._clock(), nonce=nonce, boot=boot)

    def learn(self, boot: str | None) -> str | None:
        """Take the X-Mrlx-Boot of a proven answer: the start it names (signed into the requests
        from now on), None when it names none. A 503 to a request that named another start than
        the answer's is the coordinator's refusal of the start it named."""
        boot = None if boot is None else boot.strip()
        if boot is None or not is_boot(boot):
            return None
        self.boot = boot
        return boot


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


def nonce_parts(nonce: str) -> tuple[str, int]:
    """(signer, count) of a nonce: a `Signer`'s 48 hex digits are its id and its count; any other
    nonce is a signer of its own that signs once (count 0)."""
    if len(nonce) == 48:
        return nonce[:32], int(nonce[32:], 16)
    return nonce, 0


class _Remembered:
    """What a `ReplayGuard` keeps of one signer."""

    __slots__ = ("floor", "last", "newest", "seen")

    def __init__(self, count: int, stamp: float, floor: float) -> None:
        self.newest = count  # the highest count accepted
        self.seen = 1  # bit i: count newest - i was accepted
        self.last = stamp  # the latest time of its requests seen
        self.floor = floor  # the guard's floor when this signer was first accepted


class ReplayGuard:
    """The coordinator's memory of the requests it accepted, within one start: a nonce is accepted
    once. Per signer (see `nonce_parts`) it holds the highest count accepted and which of the
    `window` counts below it were; a count further behind is refused as retryable ("behind": the
    signer signs again with a new count, which is the highest). A signer is forgotten once the
    latest time of its requests is out of the skew window, when the coordinator refuses each of
    them for its time anyway.

    Why so: remembering every nonce of the window costs memory in proportion to the rate of
    requests, and forgetting the oldest when full refuses, until their clocks catch up, every
    client whose clock lags behind the times forgotten. Here a burst of one signer's requests
    costs no memory, and no refusal depends on a client's clock. The memory is bounded by the
    number of signers, `capacity`: while it is full, a request of a signer it does not know is
    refused as retryable ("full"), and `floor` rises to its time; from then on a signer's requests
    not later than the floor it met when first accepted are refused too, so a refused request is
    never accepted later. Only more than `capacity` signers within the skew window (tools that sign
    each request with a nonce of its own, at hundreds a second) meet that."""

    def __init__(self, capacity: int = 65536, window: int = 1024, window_s: float = MAX_SKEW_S) -> None:
        self.capacity = capacity
        self.window = window
        self.window_s = window_s
        self.floor = float("-inf")
        self._signers: dict[str, _Remembered] = {}
        self._expiry: list[tuple[float, str]] = []  # a heap of (latest time when pushed, signer)

    def __len__(self) -> int:
        return len(self._signers)

    def admit(self, nonce: str, stamp: float, now: float) -> str | None:
        """None when the request is new (and remember it); else "replay", "behind" or "full"."""
        self._forget(now)
        name, count = nonce_parts(nonce)
        signer = self._signers.get(name)
        if signer is None:
            if stamp <= self.floor:
                return "full"
            if len(self._signers) >= self.capacity:
                self.floor = stamp
                return "full"
            self._signers[name] = _Remembered(count, stamp, self.floor)
            heapq.heappush(self._expiry, (stamp, name))
            return None
        signer.last = max(signer.last, stamp)
        if stamp <= signer.floor:
            return "full"
        behind = signer.newest - count
        if behind < 0:  # the newest count yet
            signer.seen = (
                1 if -behind >= self.window else (signer.seen << -behind | 1) & ((1 << self.window) - 1)
            )
            signer.newest = count
            return None
        if behind >= self.window:
            return "behind"
        if signer.seen >> behind & 1:
            return "replay"
        signer.seen |= 1 << behind
        return None

    def _forget(self, now: float) -> None:
        expiry = self._expiry
        while expiry and expiry[0][0] < now - self.window_s:
            _, name = heapq.heappop(expiry)
            signer = self._signers[name]
            if signer.last < now - self.window_s:
                del self._signers[name]
            else:  # it signed later since: look again then
                heapq.heappush(expiry, (signer.last, name))


def check_request(
    client_key: bytes, method: str, path: str, headers: Mapping[str, str]
) -> tuple[str | None, str | None, float, str | None]:
    """(nonce, problem, stamp, boot) of a request's signature headers: nonce is the request's when
    its MAC matches (then the answer is signed, even a refusal), problem None when it is acceptable
    so far (the time window, the start it names and replays are the caller's to check, the body's
    hash too); boot is the X-Mrlx-Boot it names, None when it names none."""
    names = (TIME_HEADER, NONCE_HEADER, CONTENT_HEADER, SIGNATURE_HEADER)
    given = {name: headers.get(name) for name in names}
    missing = [name for name, value in given.items() if value is None]
    if len(missing) == len(given):
        return None, "the request is not signed", 0.0, None
    if missing:
        return None, f"the request's signature lacks the header(s) {', '.join(missing)}", 0.0, None
    stamp_text, nonce, content, mac = (str(given[name]).strip() for name in given)
    if not (16 <= len(nonce) <= 64 and _is_hex(nonce)):
        return None, f"{NONCE_HEADER} must be 16 to 64 hex digits", 0.0, None
    if not (len(content) == 64 and _is_hex(content)):
        return None, f"{CONTENT_HEADER} must be 64 hex digits (the body's SHA-256)", 0.0, None
    boot = headers.get(BOOT_HEADER)
    if boot is not None:
        boot = boot.strip()
        if not (boot == NO_BOOT or is_boot(boot)):
            return (
                None,
                f"{BOOT_HEADER} must be 16 hex digits (a coordinator start's id) or {NO_BOOT!r}",
                0.0,
                None,
            )
    try:
        stamp = float(stamp_text)
    except ValueError:
        stamp = float("nan")
    if not (math.isfinite(stamp) and abs(stamp) < 1e12):
        return None, f"{TIME_HEADER} must be a Unix time in seconds, got {stamp_text[:40]!r}", 0.0, None
    expected = request_mac(client_key, method, path, nonce, stamp_text, content, boot)
    if not hmac.compare_digest(mac.encode("utf-8", "surrogateescape"), expected.encode()):
        return (
            None,
            (
                f"the request's {SIGNATURE_HEADER} does not match: it was made with another token than the "
                "coordinator's, or the request was changed on the way"
            ),
            0.0,
            None,
        )
    return nonce, None, stamp, boot


def _is_hex(text: str) -> bool:
    return text.isascii() and all(c in "0123456789abcdefABCDEF" for c in text)


# --------------------------------------------------------------------------- from a shell


def call_main(argv: list[str] | None = None) -> int:
    """`mrlx coordinator call METHOD PATH [--data JSON|@FILE]`: one signed request; prints the
    answer's body once its proof checks out."""
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
    signer = None if token is None else Signer(derive_keys(token)[0])
    for _ in range(2):  # a refusal that names the coordinator's start is signed again, at once
        headers = {} if signer is None else signer.sign(method, request_target(url), content_sha256(body))
        if body is not None:  # (a commit's body is read as a frame whatever its type)
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=args.timeout) as response:
                status, answer_headers, answer = response.status, response.headers, response.read()
        except urllib.error.HTTPError as exc:
            status, answer_headers, answer = exc.code, exc.headers, exc.read()
        except (urllib.error.URLError, OSError) as exc:
            print(
                f"mrlx coordinator call: {url} is unreachable: {getattr(exc, 'reason', exc)}", file=sys.stderr
            )
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
        told = None if signer is None else signer.learn(answer_headers.get(BOOT_HEADER))
        if not (status == 503 and told is not None and told != headers.get(BOOT_HEADER)):
            break
    sys.stdout.buffer.write(answer + (b"" if answer.endswith(b"\n") else b"\n"))
    if status >= 400:
        print(f"mrlx coordinator call: HTTP {status}", file=sys.stderr)
        return 1
    return 0
