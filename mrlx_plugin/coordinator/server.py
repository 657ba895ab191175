"""The coordinator service (aiohttp): durable per-agent sample queues, leases and acks, and the
weight-version registry that keeps two training jobs within a staleness bound.

One coordinator serves one run (`--run-id`) and the agents named at start (`--agents`). Routes,
all under /v1 except health, metrics and the OpenAPI document:

    GET  /health                                       no auth: {"ok": true}; signed: also the status,
                                                       run id, uptime and database path
    GET  /metrics                                      Prometheus text
    GET  /openapi.json                                 no auth: OpenAPI 3 description of all routes (signed:
                                                       with the run id and agents as the path values)
    GET  /v1/runs/{run}                                agents (version, last seen) and queue depths
    POST /v1/runs/{run}/queues/{consumer}/commit       body: a wire frame of items (see `wire`)
    POST /v1/runs/{run}/queues/{consumer}/lease        JSON in, wire frame out (lease id in its header)
    POST /v1/runs/{run}/queues/{consumer}/ack          {"lease_id"}
    POST /v1/runs/{run}/queues/{consumer}/ack_through  {"step"}: every group of that producer step or an
                                                       earlier one is done (a durable watermark)
    POST /v1/runs/{run}/queues/{consumer}/release      {}: hand back the consumer's leases now (its
                                                       restarted process takes a dead one's over)
    POST /v1/runs/{run}/queues/{consumer}/reject       {"group", "reason"}: set a group aside now
    POST /v1/runs/{run}/queues/{consumer}/extend       {"lease_id", "lease_s"}
    POST /v1/runs/{run}/queues/{consumer}/seal         {"group", "size"}
    POST /v1/runs/{run}/queues/{consumer}/end          {}
    GET  /v1/runs/{run}/queues/{consumer}              depth, ready groups, ended
    POST /v1/runs/{run}/agents/{agent}/heartbeat       {"pid"?, "host"?}
    POST /v1/runs/{run}/agents/{agent}/version         {"version"}
    GET  /v1/runs/{run}/agents/{agent}/version
    POST /v1/runs/{run}/agents/{agent}/wait_version    {"min_version", "timeout_s"?} (long poll)

A group leased `--max-deliveries` times and never acknowledged, or rejected by its consumer, is set
aside (dead-lettered): kept in the database, never delivered again, reported in lease answers
(`dead`) so that the consumer can keep its step's shape, and counted in /metrics.

With a token, every call but /health and /openapi.json must be signed with keys derived from it
(the token never travels; `mrlx_plugin.link.auth` has the scheme), and every answer to a signed
request carries a proof that the coordinator holds the token (X-Mrlx-Proof). Clients name
themselves with `X-Mrlx-Agent`, `X-Mrlx-Pid`, `X-Mrlx-Host`; any such call counts as a heartbeat.
Errors are JSON `{"error": message}` with the status saying what kind (401, 404, 409, 413, 422,
429 with Retry-After, 503/507 when the database cannot be written).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import logging
import math
import re
import resource
import secrets
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar, get_args

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    disable_created_metrics,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mrlx_plugin.coordinator.storage import CoordinatorStore, QueueStats, StoreError, StoreOpenError
from mrlx_plugin.core.netutil import BodyLengthError, is_loopback, read_declared, write_port_file
from mrlx_plugin.link.auth import (
    BOOT_HEADER,
    CONTENT_HEADER,
    MAX_SKEW_S,
    NO_BOOT,
    PROOF_HEADER,
    SCHEME,
    ReplayGuard,
    answer_mac,
    check_request,
    content_sha256,
    derive_keys,
)
from mrlx_plugin.link.wire import (
    CONTENT_TYPE,
    END_OF_STREAM,
    MAX_GROUP_SIZE,
    MAX_KEY_CHARS,
    BufferPool,
    FrameLimits,
    FrameTooLarge,
    FrameView,
    WireError,
    encode_frame,
    frame_head,
    scan_frame,
    token_from_env_or_file,
    validate_frame,
)

log = logging.getLogger("mrlx.coordinator")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
INT64_MAX = (1 << 63) - 1
MAX_WAIT_S = 300.0  # longest single long poll; clients loop for longer waits
MAX_LEASE_GROUPS = 4096
# What a commit's frame may hold (413 past it), checked while it is read, before any item is unpacked:
# each item costs ~2 KB of objects however few bytes it takes, each record batch ~4 KB. The client
# sends one batch of at most 1024 items; the per-request item limit is also --max-depth when lower.
MAX_COMMIT_ITEMS = 4096
MAX_FRAME_BATCHES = 1024
MAX_FRAME_MESSAGE_BYTES = 64 << 10  # a message's metadata; the schema's holds the frame header
# Bodies above this size are hashed on a worker thread, so the loop keeps serving other calls.
HASH_ON_THREAD_BYTES = 256 << 10
HEARTBEAT_FLUSH_S = 2.0
RETRY_AFTER_S = 1
AGENT_HEADER, PID_HEADER, HOST_HEADER = "X-Mrlx-Agent", "X-Mrlx-Pid", "X-Mrlx-Host"
LEASE_HEADER = "X-Mrlx-Lease-Id"
NONCE_KEY, CONTENT_KEY = "mrlx_nonce", "mrlx_content"  # on a request: its signature checked out
CHALLENGE = f'{SCHEME} realm="mrlx-coordinator"'  # the WWW-Authenticate of a 401
IDLE_TIMEOUT_S = 30.0  # longer than the client's own keep-alive (15 s), so the client closes first
MAX_CONNECTIONS = 1000
LISTEN_BACKLOG = 128
# Descriptors kept free of connections: the database's files, the log, the listening socket, and
# the sockets in flight. asyncio accepts up to LISTEN_BACKLOG sockets per wake-up of the listener,
# and a socket is counted (and an idle one closed to make room) two loop iterations after its
# accept, its descriptor freed one iteration after that: under a flood of connections, three
# batches are open beyond the counted ones. One more batch is margin.
FD_RESERVE = 64 + 4 * LISTEN_BACKLOG


# --------------------------------------------------------------------------- request bodies


class Body(BaseModel):
    """A JSON request body: strict types (no "1" for 1, no true for 1), no unknown keys, finite
    numbers. Every integer is bounded by SQLite's 64-bit range, so a value that validates is one
    the database can store; the bounds are published in /openapi.json like any other."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


Int64 = Annotated[int, Field(le=INT64_MAX)]


class LeaseBody(Body):
    max_groups: int = Field(1, ge=1, le=MAX_LEASE_GROUPS, description="most complete groups to lease")
    lease_s: float = Field(600.0, ge=0.05, le=7 * 86400.0, description="seconds until the lease expires")
    wait_s: float = Field(0.0, ge=0.0, le=MAX_WAIT_S, description="long-poll for up to this many seconds")
    step: Int64 | None = Field(None, ge=0, description="only groups of this producer step")


class AckBody(Body):
    lease_id: str = Field(min_length=1, max_length=64, description="the lease to ack")


class AckThroughBody(Body):
    step: Int64 = Field(ge=0, description="every group of this producer step or an earlier one is done")


class ReleaseBody(Body):
    pass


class RejectBody(Body):
    group: str = Field(min_length=1, max_length=MAX_KEY_CHARS, description="the group to set aside")
    reason: str = Field(min_length=1, max_length=1000, description="why its consumer cannot train it")


class ExtendBody(Body):
    lease_id: str = Field(min_length=1, max_length=64, description="the lease to keep")
    lease_s: float = Field(ge=0.05, le=7 * 86400.0, description="seconds from now until it expires")


class SealBody(Body):
    group: str = Field(min_length=1, max_length=MAX_KEY_CHARS, description="the group id")
    size: int = Field(ge=1, le=MAX_GROUP_SIZE, description="the group's final size")


class EndBody(Body):
    pass


class HeartbeatBody(Body):
    pid: Int64 | None = Field(None, ge=0, description="process id of the agent")
    host: str | None = Field(None, min_length=1, max_length=256, description="host name of the agent")


class VersionBody(Body):
    version: Int64 = Field(ge=0, description="the agent's weight version (monotonic)")


class WaitBody(Body):
    min_version: Int64 = Field(ge=0, description="wait until the agent has at least this version")
    timeout_s: float = Field(30.0, ge=0.0, le=MAX_WAIT_S, description="long-poll for up to this many seconds")


MAX_DELIVERIES = 3
B = TypeVar("B", bound=Body)


class HttpProblem(Exception):
    """An error answer: status, one clear message, optional headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _problem_text(model: type[Body], error: Any) -> str:
    """One validation error of `model` as a sentence naming the field."""
    name = str(error["loc"][0]) if error["loc"] else ""
    value, kind, ctx = error.get("input"), error["type"], error.get("ctx") or {}
    if kind == "missing":
        return f"field {name!r} is required"
    if value is None:
        return f"field {name!r} must not be null"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        annotation = model.model_fields[name].annotation
        base = next((t for t in get_args(annotation) if t is not type(None)), annotation)
        base = get_args(base)[0] if get_args(base) else base  # Annotated[int, ...] -> int
        return f"field {name!r} must be {_KINDS.get(base, 'of another type')}, got {value!r}"
    if kind == "greater_than_equal":
        return f"field {name!r} must be >= {ctx['ge']}, got {value}"
    if kind == "less_than_equal":
        return f"field {name!r} must be <= {ctx['le']}, got {value}"
    if kind in ("string_too_short", "string_too_long"):
        longest = model.model_fields[name].metadata
        limit = next((m.max_length for m in longest if getattr(m, "max_length", None) is not None), None)
        return f"field {name!r} must be a non-empty string of at most {limit} characters"
    return f"field {name!r}: {error['msg'].lower()}, got {value!r}"


def parse_body(raw: bytes, model: type[B], where: str) -> B:
    """Strictly parse a JSON object body into `model`: unknown fields, missing fields and wrong
    types are 422, with a message naming `where` and the field."""
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        raise HttpProblem(422, f"{where}: the body is not valid JSON ({first['msg']})") from None
    if not first["loc"]:
        raise HttpProblem(422, f"{where}: the body must be a JSON object") from None
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        raise HttpProblem(
            422, f"{where}: unknown fields {unknown}; allowed are {sorted(model.model_fields)}"
        ) from None
    raise HttpProblem(422, f"{where}: {_problem_text(model, first)}") from None


# --------------------------------------------------------------------------- configuration


@dataclass
class CoordinatorConfig:
    db: str
    run_id: str
    agents: list[str]
    host: str = "127.0.0.1"
    port: int = 18888
    token: str | None = field(default=None, repr=False)
    # A second, read-only secret for GET /metrics alone (a Prometheus scraper sends it as a bearer
    # token; it cannot sign requests). It opens nothing else.
    metrics_token: str | None = field(default=None, repr=False)
    max_depth: int = 65536
    max_request_mb: float = 512.0
    port_file: str | None = None
    synchronous: str = "full"
    max_db_mb: float | None = None
    max_deliveries: int = MAX_DELIVERIES
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS


class OneLineBadRequests(logging.Filter):
    """A request that is not valid HTTP is the client's fault: one warning line, not a traceback
    at ERROR (which would read as a fault of the coordinator)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            record.msg, record.args, record.exc_info, record.exc_text = (
                "refused a malformed request: %s",
                (first,),
                None,
                None,
            )
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _seen_phrase(beat: tuple[float, int | None, str | None] | None, now: float) -> str:
    if beat is None:
        return "never seen"
    seen, pid, host = beat
    who = []
    if pid is not None:
        who.append(f"pid {pid}")
    if host:
        who.append(f"on host {host}")
    return f"last seen {max(0.0, now - seen):.1f} s ago" + (f" ({' '.join(who)})" if who else "")


def _sha256_of(pieces: list[bytes]) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def _pulse(events: dict[str, asyncio.Event], name: str) -> None:
    """Wake everyone waiting on `name` and arm a fresh event for the next waiters.

    A waiter takes the current event BEFORE it looks at the state, so a change between its look and
    its wait still wakes it (the event it holds is already set)."""
    event = events.get(name)
    events[name] = asyncio.Event()
    if event is not None:
        event.set()


# --------------------------------------------------------------------------- routes


@dataclass(frozen=True)
class Route:
    """One route: what it serves (`handler`, a `Coordinator` method) and what /openapi.json says of it.

    `body` is the JSON request body model (None: no body, or `frame_in`: a wire frame);
    `frame_out` answers a wire frame instead of JSON; `errors` are the statuses it may answer
    besides 200; `open` routes need no token."""

    method: str
    path: str
    handler: str
    summary: str
    body: type[Body] | None = None
    frame_in: bool = False
    frame_out: bool = False
    errors: tuple[int, ...] = (401, 404)
    open: bool = False


QUEUE = "/v1/runs/{run}/queues/{consumer}"
AGENT = "/v1/runs/{run}/agents/{agent}"
JSON_ERRORS = (400, 401, 404, 413, 415, 422)
WRITE_ERRORS = (503, 507)
ROUTES = (
    Route("GET", "/health", "health", "liveness", errors=(), open=True),
    Route("GET", "/metrics", "metrics_text", "Prometheus text exposition", errors=(401,)),
    Route("GET", "/openapi.json", "openapi", "this document", errors=(), open=True),
    Route("GET", "/v1/runs/{run}", "run_info", "agents and queues"),
    Route(
        "POST",
        QUEUE + "/commit",
        "commit",
        "commit items (all or nothing); duplicates by key are no-ops",
        frame_in=True,
        errors=(400, 401, 404, 409, 413, 422, 429, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/lease",
        "lease",
        "lease complete groups (long poll up to wait_s)",
        LeaseBody,
        frame_out=True,
        errors=(*JSON_ERRORS, *WRITE_ERRORS),
    ),
    Route("POST", QUEUE + "/ack", "ack", "ack a lease", AckBody, errors=(*JSON_ERRORS, 409, *WRITE_ERRORS)),
    Route(
        "POST",
        QUEUE + "/ack_through",
        "ack_through",
        "ack every group of a producer step or an earlier one (a durable watermark; idempotent)",
        AckThroughBody,
        errors=(*JSON_ERRORS, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/release",
        "release",
        "hand back every lease of the consumer now (its restarted process takes them over)",
        ReleaseBody,
        errors=(*JSON_ERRORS, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/reject",
        "reject",
        "set a group aside now (its consumer cannot train it): never delivered again",
        RejectBody,
        errors=(*JSON_ERRORS, 409, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/extend",
        "extend",
        "keep a lease longer",
        ExtendBody,
        errors=(*JSON_ERRORS, 409, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/seal",
        "seal",
        "seal a group at its final size",
        SealBody,
        errors=(*JSON_ERRORS, 409, *WRITE_ERRORS),
    ),
    Route(
        "POST",
        QUEUE + "/end",
        "end",
        "end the queue (no more items)",
        EndBody,
        errors=(*JSON_ERRORS, *WRITE_ERRORS),
    ),
    Route("GET", QUEUE, "queue_info", "queue depth"),
    Route(
        "POST",
        AGENT + "/heartbeat",
        "heartbeat",
        "record the agent as alive",
        HeartbeatBody,
        errors=JSON_ERRORS,
    ),
    Route(
        "POST",
        AGENT + "/version",
        "report_version",
        "report the agent's weight version",
        VersionBody,
        errors=(*JSON_ERRORS, *WRITE_ERRORS),
    ),
    Route("GET", AGENT + "/version", "get_version", "the agent's version and last seen"),
    Route(
        "POST",
        AGENT + "/wait_version",
        "wait_version",
        "long-poll until the agent reaches min_version (reached=false and a message on timeout)",
        WaitBody,
        errors=JSON_ERRORS,
    ),
)
# Names the request counter uses for the endpoints (mrlx_coordinator_requests_total{endpoint=...}).
ENDPOINT_NAMES = {"metrics_text": "metrics", "run_info": "run", "queue_info": "queue"}


class Metrics:
    """The service's Prometheus metrics, in a registry of its own (one per server)."""

    COUNTERS = {
        "mrlx_coordinator_items_enqueued_total": ("items accepted into a queue", ("consumer",)),
        "mrlx_coordinator_items_duplicate_total": (
            "items re-committed under a known key (no-op)",
            ("consumer",),
        ),
        "mrlx_coordinator_items_leased_total": (
            "items handed out under a lease (redeliveries included)",
            ("consumer",),
        ),
        "mrlx_coordinator_items_redelivered_total": (
            "items handed out again after a lease expired",
            ("consumer",),
        ),
        "mrlx_coordinator_items_acked_total": ("items acked (done for good)", ("consumer",)),
        "mrlx_coordinator_items_dead_lettered_total": (
            "items set aside, never delivered again (reason: deliveries, or rejected by the consumer)",
            ("consumer", "reason"),
        ),
        "mrlx_coordinator_wait_timeouts_total": ("long polls that ended without their condition", ("kind",)),
        "mrlx_coordinator_requests_total": ("HTTP requests by endpoint and status", ("endpoint", "status")),
    }
    GAUGES = {
        "mrlx_coordinator_uptime_seconds": ("seconds since the coordinator started", ()),
        "mrlx_coordinator_queue_items": (
            "unacked items per consumer queue: queued (incl. incomplete groups and expired leases) or leased",
            ("consumer", "state"),
        ),
        "mrlx_coordinator_queue_ready_groups": ("complete groups waiting for a lease", ("consumer",)),
        "mrlx_coordinator_queue_dead_items": (
            "items set aside per consumer queue (dead-lettered: never delivered again)",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_incomplete_groups": (
            "groups still waiting for items or a seal",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_oldest_item_age_seconds": (
            "age of the oldest unacked item (0 when empty)",
            ("consumer",),
        ),
        "mrlx_coordinator_queue_ended": ("1 once the producer ended the queue", ("consumer",)),
        "mrlx_coordinator_agent_version": (
            "last weight version reported per agent (-1: none yet)",
            ("agent",),
        ),
        "mrlx_coordinator_agent_last_seen_seconds": (
            "seconds since the agent's last call (-1: never seen)",
            ("agent",),
        ),
        "mrlx_coordinator_waits_in_progress": ("long polls in progress", ("kind",)),
    }

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.counters = {
            name: Counter(name, doc, labels, registry=self.registry)
            for name, (doc, labels) in self.COUNTERS.items()
        }
        self.gauges = {
            name: Gauge(name, doc, labels, registry=self.registry)
            for name, (doc, labels) in self.GAUGES.items()
        }

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        counter = self.counters[name]
        (counter.labels(**labels) if labels else counter).inc(amount)

    def set(self, name: str, value: float, **labels: str) -> None:
        gauge = self.gauges[name]
        (gauge.labels(**labels) if labels else gauge).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# --------------------------------------------------------------------------- the service


class Coordinator:
    """The service's state and handlers; `build_app()` gives the aiohttp application."""

    def __init__(self, config: CoordinatorConfig, store: CoordinatorStore, state: Any) -> None:
        self.config = config
        self.store = store
        self.started = time.time()
        self.agents = list(config.agents)
        self.versions: dict[str, tuple[int, float]] = dict(state.versions)
        self.heartbeats: dict[str, tuple[float, int | None, str | None]] = dict(state.heartbeats)
        self.ended: set[str] = set(state.ended)
        self.producers: dict[str, set[str]] = {k: set(v) for k, v in state.producers.items()}
        self._dirty_beats: dict[str, tuple[float, int | None, str | None]] = {}
        self._queue_events: dict[str, asyncio.Event] = {}
        self._version_events: dict[str, asyncio.Event] = {}
        self._waits: dict[str, int] = {"version": 0, "lease": 0}
        self.metrics = Metrics()
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mrlx-coord-cpu")
        self._buffers = BufferPool(keep=4)
        self._flusher: asyncio.Task[None] | None = None
        # Keys derived from the token: one checks requests, one proves answers (the token is not kept).
        self._keys = derive_keys(config.token) if config.token else None
        # Nonces live in memory, for this start only; a random id of the start (X-Mrlx-Boot) tells
        # the requests signed after it from those its predecessor may have served: a request that
        # names it is new to this start whatever its time, one that names another start (or none
        # yet) is refused once with this one, which the client names when it signs again at once.
        # (Not the start time: a client whose clock lags would be refused until it caught up, and
        # one whose clock leads stamps requests signed before the start with times after it.)
        self.boot = secrets.token_hex(8)
        self._replays = ReplayGuard()

    # ----------------------------------------------------------------- plumbing

    def build_app(self) -> web.Application:
        max_bytes = int(self.config.max_request_mb * (1 << 20))
        app = web.Application(client_max_size=max_bytes, middlewares=[self._errors, self._auth])
        for route in ROUTES:
            name = ENDPOINT_NAMES.get(route.handler, route.handler)
            app.router.add_route(route.method, route.path, getattr(self, route.handler), name=name)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self._flusher = asyncio.create_task(self._flush_heartbeats_forever())

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            try:
                await self._flusher
            except asyncio.CancelledError:
                pass
        await self._flush_heartbeats()
        self._cpu.shutdown(wait=False)

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Every failure becomes a JSON error with one message; every request is counted."""
        route = request.match_info.route
        endpoint = route.name if route is not None and route.name else "unmatched"
        try:
            response = await handler(request)
        except HttpProblem as exc:
            response = self._error_response(exc.status, exc.message, exc.headers)
        except StoreError as exc:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
            if exc.status >= 500:
                log.error("%s %s: %s", request.method, request.path, exc.message)
            response = self._error_response(exc.status, exc.message, headers)
        except web.HTTPException as exc:
            message = exc.text or exc.reason
            if exc.status == 413:
                message = (
                    f"request body is over the coordinator's limit of {self.config.max_request_mb:g} MB "
                    "(--max-request-mb); send fewer items per request"
                )
            elif exc.status == 404:
                message = f"no route {request.method} {request.path}; see /openapi.json"
            elif exc.status == 405:
                message = f"method {request.method} is not allowed on {request.path}; see /openapi.json"
            response = self._error_response(exc.status, message, None)
        except RequestPayloadError as exc:  # a body that cannot be read as sent (bad compression, cut chunks)
            message = str(exc).replace("\n", " ").strip()
            response = self._error_response(
                400, f"{request.method} {request.path}: the request body could not be read: {message}", None
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, not bad input: say so and keep serving
            log.exception("unexpected error on %s %s", request.method, request.path)
            response = self._error_response(500, f"internal error: {type(exc).__name__}: {exc}", None)
        self.metrics.inc("mrlx_coordinator_requests_total", endpoint=endpoint, status=str(response.status))
        if isinstance(response, web.Response) and not response.prepared:
            self._prove(request, response, content_sha256(response.body))  # type: ignore[arg-type]
        return response

    def _prove(self, request: web.Request, response: web.StreamResponse, content: str) -> None:
        """Sign an answer to a request whose signature checked out (errors included), so that its
        client can tell it from one of another process on this port."""
        nonce = request.get(NONCE_KEY)
        if nonce is not None and self._keys is not None:
            response.headers[PROOF_HEADER] = answer_mac(self._keys[1], nonce, response.status, content)
            response.headers[BOOT_HEADER] = self.boot

    @staticmethod
    def _error_response(status: int, message: str, headers: dict[str, str] | None) -> web.Response:
        return web.Response(
            status=status,
            body=orjson.dumps({"error": message}),
            content_type="application/json",
            headers=headers,
        )

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A signed request on everything but /health and /openapi.json; size limit; heartbeats."""
        problem = self._authenticate(request)
        if problem is None and request.method == "GET" and request.get(CONTENT_KEY) is not None:
            # The handlers of GET routes read no body: its hash is checked here (POST handlers check theirs).
            try:
                await self._check_content(request, await request.read())
            except HttpProblem as exc:
                problem = exc.status, exc.message
                del request[CONTENT_KEY]
        if request.path in ("/health", "/openapi.json"):
            return await handler(request)  # open: a signed request gets the details, others do not
        if problem is not None:
            status, message = problem
            raise HttpProblem(
                status,
                message,
                {"Retry-After": "0"} if status == 503 else {"WWW-Authenticate": CHALLENGE},
            )
        for param, what in (("consumer", "consumer"), ("agent", "agent")):
            # an unknown path is 404 whatever the body (checked again by the handler)
            if param in request.match_info and "run" in request.match_info:
                self._check_run(request.match_info["run"])
                self._known_agent(request.match_info[param], what)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Bodies are taken as sent (the server does not decompress): a compressed body could
            # unpack far past the size limit, and the client never compresses.
            raise HttpProblem(
                415,
                f"{request.method} {request.path}: Content-Encoding {encoding!r} is not accepted; send the "
                "body uncompressed",
            )
        length = request.content_length
        if length is not None and length > self.config.max_request_mb * (1 << 20):
            raise web.HTTPRequestEntityTooLarge(
                max_size=int(self.config.max_request_mb * (1 << 20)), actual_size=length
            )
        if "run" in request.match_info:
            self._check_run(request.match_info["run"])
            self._record_identity(request)
        return await handler(request)

    def _authenticate(self, request: web.Request) -> tuple[int, str] | None:
        """Check a request's signature (with a token configured): None when it may go on, else the
        status and message of its refusal. A request whose MAC matches is marked (its nonce kept
        on it), and its answer is signed even when it is refused for its time or as a replay."""
        if self._keys is None:
            return None
        if self._metrics_reader(request):
            return None
        # The path as the request line carries it (query included), as the client signed it.
        nonce, problem, stamp, boot = check_request(
            self._keys[0], request.method, request.raw_path, request.headers
        )
        if nonce is None:
            return 401, (
                f"{problem}: every call but /health and /openapi.json must be signed with keys derived from "
                f"the run's token ({SCHEME}: the headers X-Mrlx-Time, X-Mrlx-Nonce, {CONTENT_HEADER} and "
                "X-Mrlx-Signature, see /openapi.json); the plugin's client signs its calls, and "
                "`mrlx coordinator call METHOD PATH` signs one from a shell"
            )
        request[NONCE_KEY] = nonce
        now = time.time()
        if abs(now - stamp) > MAX_SKEW_S:
            return 401, (
                f"the request's X-Mrlx-Time is {stamp - now:+.0f} s from the coordinator's clock (at most "
                f"{MAX_SKEW_S:.0f} s either way): synchronise the clocks of the client's and the "
                "coordinator's hosts"
            )
        # All refusals below are retryable (503): the request is not done, and its sender signs
        # it afresh. Each is final for the request refused: it is never accepted later.
        if boot is not None and boot != self.boot:
            named = (
                "no start of the coordinator (its client has not heard from it yet)"
                if boot == NO_BOOT
                else f"the coordinator's start {boot} (it restarted since)"
            )
            return 503, (
                f"the request's {BOOT_HEADER} names {named}, not its current start: sign it afresh "
                f"naming {BOOT_HEADER}: {self.boot}"
            )
        if boot is None and stamp <= self.started:
            return 503, (
                f"the request's X-Mrlx-Time is before this coordinator started, and the request names no "
                f"start ({BOOT_HEADER}), so it cannot be told from a replay of one its predecessor served: "
                f"sign it afresh naming its start, {BOOT_HEADER}: {self.boot}"
            )
        seen = self._replays.admit(nonce, stamp, now)
        if seen == "replay":
            # (a copy that went first must not end the true sender's call)
            return 503, (
                "the request's X-Mrlx-Nonce was used before: a replayed request is refused; sign it afresh"
            )
        if seen == "behind":
            return 503, (
                f"the request's X-Mrlx-Nonce counts more than {self._replays.window} requests behind its "
                "client's newest, further than the coordinator tells replays apart: sign it afresh"
            )
        if seen == "full":
            return 503, (
                f"the coordinator remembers the requests of at most {self._replays.capacity} clients "
                f"signed within {MAX_SKEW_S:.0f} s, and refuses a new client's until some are forgotten "
                "(too many requests were signed each with a nonce of its own): sign it afresh, with a "
                "client that numbers its requests (the plugin's client, `mrlx coordinator call`)"
            )
        request[CONTENT_KEY] = request.headers[CONTENT_HEADER].strip().lower()
        return None

    def _metrics_reader(self, request: web.Request) -> bool:
        """A GET /metrics with the bearer --metrics-token-env names (its answer is not signed)."""
        token = self.config.metrics_token
        if not token or request.method != "GET" or request.path != "/metrics":
            return False
        given = request.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode())

    async def _check_content(self, request: web.Request, body: bytes | memoryview) -> None:
        """The body of a signed request must be the one its signature names (hashed on a worker
        thread when large)."""
        expected = request.get(CONTENT_KEY)
        if expected is None:
            return
        if len(body) > HASH_ON_THREAD_BYTES:
            given = await asyncio.get_running_loop().run_in_executor(self._cpu, content_sha256, body)
        else:
            given = content_sha256(body)
        if given != expected:
            raise HttpProblem(
                401,
                f"{request.method} {request.path}: the body is not the one the request's signed "
                f"{CONTENT_HEADER} names (changed or cut on the way); nothing was done",
                {"WWW-Authenticate": CHALLENGE},
            )

    def _check_run(self, run: str) -> None:
        if run != self.config.run_id:
            raise HttpProblem(404, f"this coordinator serves run {self.config.run_id!r}, not {run!r}")

    def _known_agent(self, name: str, what: str) -> str:
        if name not in self.agents:
            raise HttpProblem(
                404,
                f"unknown {what} {name!r}; the agents of run {self.config.run_id!r} are "
                f"{', '.join(self.agents)}",
            )
        return name

    def _record_identity(self, request: web.Request) -> None:
        agent = request.headers.get(AGENT_HEADER)
        if agent is None:
            return
        if agent not in self.agents:
            raise HttpProblem(
                422,
                f"header {AGENT_HEADER} names unknown agent {agent!r}; the agents are "
                f"{', '.join(self.agents)}",
            )
        pid_text = request.headers.get(PID_HEADER)
        pid = None
        if pid_text is not None:
            if not (pid_text.isascii() and pid_text.isdigit() and len(pid_text) <= 10):
                raise HttpProblem(422, f"header {PID_HEADER} must be a process id, got {pid_text!r}")
            pid = int(pid_text)
        host = request.headers.get(HOST_HEADER)
        if host:
            # Header bytes that are not UTF-8 arrive as surrogates; keep the name printable and storable.
            host = host.encode("utf-8", "surrogateescape").decode("utf-8", "replace")[:256]
        self._beat(agent, pid, host or None)

    def _beat(self, agent: str, pid: int | None, host: str | None) -> None:
        previous = self.heartbeats.get(agent)
        if previous is not None:
            pid = pid if pid is not None else previous[1]
            host = host if host is not None else previous[2]
        beat = (time.time(), pid, host)
        self.heartbeats[agent] = beat
        self._dirty_beats[agent] = beat

    async def _flush_heartbeats(self) -> None:
        if not self._dirty_beats:
            return
        beats, self._dirty_beats = self._dirty_beats, {}
        try:
            await self.store.save_heartbeats(beats)
        except StoreError as exc:
            log.warning("heartbeats not saved: %s", exc.message)
            for agent, beat in beats.items():
                self._dirty_beats.setdefault(agent, beat)

    async def _flush_heartbeats_forever(self) -> None:
        """Heartbeats live in memory and reach the file every few seconds: a per-call fsync would
        cost more than losing the last seconds of last-seen times in a crash."""
        while True:
            await asyncio.sleep(HEARTBEAT_FLUSH_S)
            await self._flush_heartbeats()

    async def _read_json(self, request: web.Request, model: type[B]) -> B:
        raw = await request.read()
        await self._check_content(request, raw)
        return parse_body(raw, model, f"{request.method} {request.path}")

    @staticmethod
    def _json(data: Any, status: int = 200) -> web.Response:
        return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")

    def _wait_started(self, kind: str) -> None:
        self._waits[kind] += 1

    def _wait_ended(self, kind: str, timed_out: bool) -> None:
        self._waits[kind] -= 1
        if timed_out:
            self.metrics.inc("mrlx_coordinator_wait_timeouts_total", kind=kind)

    # ----------------------------------------------------------------- unauthenticated

    def _authenticated(self, request: web.Request) -> bool:
        """Signed with the token (or no token is configured): may learn the run's details."""
        return self._keys is None or request.get(CONTENT_KEY) is not None

    async def health(self, request: web.Request) -> web.Response:
        if not self._authenticated(request):
            return self._json({"ok": True})  # alive, and nothing about the run
        return self._json(
            {
                "ok": True,
                "status": "ok",
                "run_id": self.config.run_id,
                "uptime_s": round(time.time() - self.started, 3),
                "db": self.config.db,
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        if not self._authenticated(request):
            return self._json(openapi_document())
        return self._json(openapi_document(self.config.run_id, self.agents))

    # ----------------------------------------------------------------- queues

    async def _read_body(self, request: web.Request) -> tuple[memoryview, bytearray | None]:
        """The request body (give the buffer back after): into a reused buffer when one of its
        Content-Length is at hand, else into one grown as the bytes arrive. Memory follows the bytes
        received, never the length a client declares (which costs it nothing to send)."""
        length = request.content_length
        if length is None:
            return memoryview(await request.read()), None
        kept = self._buffers.take_existing(length)
        buf = bytearray() if kept is None else kept
        try:
            return await read_declared(request.content, length, buf), buf
        except BaseException as exc:
            self._buffers.give(buf)
            if not isinstance(exc, BodyLengthError):
                raise
            if exc.received < length:
                raise HttpProblem(
                    400, f"the request body ended after {exc.received} of its {length} bytes"
                ) from None
            raise HttpProblem(400, f"the request body is longer than its Content-Length {length}") from None

    def _scan(self, body: memoryview, consumer: str) -> FrameView:
        """Read and check a commit's frame, and cut it into the records the store keeps (on a
        worker thread: the arrays are checked and copied here, not on the event loop). The frame's
        limits are checked as its messages are read, so that memory follows the bytes accepted."""
        limits = FrameLimits(
            max_message_bytes=MAX_FRAME_MESSAGE_BYTES,
            max_batches=MAX_FRAME_BATCHES,
            max_items=MAX_COMMIT_ITEMS,
        )
        frame = scan_frame(body, limits)
        for record in frame.records:
            producer = record.meta["producer"]
            if producer not in self.agents:
                raise WireError(
                    f"item {record.meta['key']!r}: producer {producer!r} is not an agent of run "
                    f"{self.config.run_id!r} ({', '.join(self.agents)})"
                )
        validate_frame(frame)
        for record in frame.records:
            record.record()  # the copy SQLite stores; the body's buffer is reused after the commit
        return frame

    async def commit(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body, buf = await self._read_body(request)
        reusable = True
        try:
            await self._check_content(request, body)
            try:
                frame = await asyncio.get_running_loop().run_in_executor(
                    self._cpu, self._scan, body, consumer
                )
            except FrameTooLarge as exc:
                raise HttpProblem(413, f"commit to {consumer!r} rejected, nothing written: {exc}") from None
            except WireError as exc:
                raise HttpProblem(422, f"commit to {consumer!r} rejected, nothing written: {exc}") from None
            outcome = await self.store.commit(consumer, frame.records, time.time(), self.config.max_depth)
        except asyncio.CancelledError:
            reusable = False  # a worker thread may still be reading the buffer
            raise
        finally:
            if buf is not None and reusable:  # SQLite copied what it keeps
                self._buffers.give(buf)
        if outcome.accepted:
            self.metrics.inc("mrlx_coordinator_items_enqueued_total", outcome.accepted, consumer=consumer)
            producers = self.producers.setdefault(consumer, set())
            producers.update(record.meta["producer"] for record in frame.records)
            _pulse(self._queue_events, consumer)
        if outcome.duplicates:
            self.metrics.inc(
                "mrlx_coordinator_items_duplicate_total", len(outcome.duplicates), consumer=consumer
            )
        return self._json(
            {
                "accepted": outcome.accepted,
                "duplicates": len(outcome.duplicates),
                "duplicate_keys": outcome.duplicates,
                # items of steps the consumer acknowledged through: kept by key, never delivered
                **({"stale": outcome.stale} if outcome.stale else {}),
            }
        )

    async def lease(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, LeaseBody)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.wait_s
        waiting = False
        try:
            while True:
                event = self._queue_events.setdefault(consumer, asyncio.Event())
                if request.transport is None or request.transport.is_closing():
                    # The consumer gave up waiting; leasing now would only park groups until expiry.
                    return self._frame_response(
                        {"lease_id": None, "end": False, "groups": [], "message": "client gone"}
                    )
                grant = await self.store.lease(
                    consumer,
                    body.max_groups,
                    body.lease_s,
                    body.step,
                    time.time(),
                    self.config.max_deliveries,
                )
                self._count_dead(consumer, grant.dead, "deliveries")
                if grant.groups:
                    return await self._lease_response(consumer, grant, request)
                if grant.end or grant.dead:
                    return self._frame_response(
                        {
                            "lease_id": None,
                            "end": grant.end,
                            "groups": [],
                            "message": None,
                            "dead": self._dead_json(grant),
                        }
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    message = await self._no_groups_message(consumer, body.wait_s)
                    if waiting:
                        self._wait_ended("lease", True)
                        waiting = False
                    return self._frame_response(
                        {
                            "lease_id": None,
                            "end": False,
                            "groups": [],
                            "message": message,
                            "dead": self._dead_json(grant),
                        }
                    )
                timeout = remaining
                if grant.next_expiry is not None:  # another lease may expire first: look again then
                    timeout = min(timeout, max(0.01, grant.next_expiry - time.time() + 0.01))
                if not waiting:
                    self._wait_started("lease")
                    waiting = True
                try:
                    await asyncio.wait_for(event.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
        finally:
            if waiting:
                self._wait_ended("lease", False)

    async def _lease_response(self, consumer: str, grant: Any, request: web.Request) -> web.StreamResponse:
        records = await self.store.read_groups(consumer, [g.group for g in grant.groups])
        groups = []
        flat: list[bytes] = []
        redelivered = 0
        for granted, group_records in zip(grant.groups, records):
            groups.append(
                {
                    "group": granted.group,
                    "size": len(group_records),
                    "step": granted.step,
                    "producer": granted.producer,
                    "redelivered": granted.redelivered,
                }
            )
            flat.extend(group_records)
            if granted.redelivered:
                redelivered += len(group_records)
        header = {
            "lease_id": grant.lease_id,
            "end": False,
            "groups": groups,
            "message": None,
            "dead": self._dead_json(grant),
        }
        head = frame_head(header)
        self.metrics.inc("mrlx_coordinator_items_leased_total", len(flat), consumer=consumer)
        if redelivered:
            self.metrics.inc("mrlx_coordinator_items_redelivered_total", redelivered, consumer=consumer)
        # The stored records go out as they are, one write each: no frame is assembled in memory.
        response = web.StreamResponse(headers={LEASE_HEADER: grant.lease_id, "Content-Type": CONTENT_TYPE})
        response.content_length = len(head) + sum(len(record) for record in flat) + len(END_OF_STREAM)
        if request.get(NONCE_KEY) is not None:  # the proof covers the body: hashed before it is sent
            pieces = [head, *flat, END_OF_STREAM]
            if response.content_length > HASH_ON_THREAD_BYTES:
                content = await asyncio.get_running_loop().run_in_executor(self._cpu, _sha256_of, pieces)
            else:
                content = _sha256_of(pieces)
            self._prove(request, response, content)
        try:
            await response.prepare(request)
            await response.write(head)
            for record in flat:
                await response.write(record)
            await response.write(END_OF_STREAM)
            await response.write_eof()
        except ConnectionError:
            # The consumer went away; its lease expires and the groups are delivered again.
            log.info("lease %s of %r: the consumer disconnected during the answer", grant.lease_id, consumer)
        return response

    @staticmethod
    def _dead_json(grant: Any) -> list[dict[str, Any]]:
        """The groups set aside that a lease answer reports: those of the step asked for (every one,
        so that a consumer restarted after an earlier report learns them too), else this attempt's."""
        seen: dict[str, Any] = {}
        for dead in [*grant.step_dead, *grant.dead]:
            seen.setdefault(dead.group, dead)
        return [
            {"group": d.group, "size": d.n_items, "step": d.step, "producer": d.producer, "reason": d.reason}
            for d in seen.values()
        ]

    def _count_dead(self, consumer: str, dead: list[Any], reason: str) -> None:
        if not dead:
            return
        items = sum(d.n_items for d in dead)
        self.metrics.inc(
            "mrlx_coordinator_items_dead_lettered_total", items, consumer=consumer, reason=reason
        )
        for d in dead:
            log.warning(
                "group %r of step %s (%d items) for %r set aside, never delivered again: %s",
                d.group,
                d.step,
                d.n_items,
                consumer,
                d.reason,
            )
        _pulse(self._queue_events, consumer)  # room for blocked producers

    def _frame_response(self, header: dict[str, Any]) -> web.Response:
        return web.Response(body=encode_frame([], header), content_type=CONTENT_TYPE)

    async def _no_groups_message(self, consumer: str, waited: float) -> str:
        stats = (await self.store.queue_stats(time.time())).get(consumer, QueueStats())
        now = time.time()
        producers = sorted(
            self.producers.get(consumer) or [a for a in self.agents if a != consumer] or self.agents
        )
        seen = "; ".join(f"{p!r} {_seen_phrase(self.heartbeats.get(p), now)}" for p in producers)
        return (
            f"no complete group for {consumer!r} within {waited:.1f} s "
            f"({stats.queued_items} items queued, {stats.incomplete_groups} incomplete groups, "
            f"{stats.leased_items} items leased); producers: {seen}"
        )

    async def ack(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, AckBody)
        outcome = await self.store.ack(consumer, body.lease_id, time.time())
        if outcome.items:
            self.metrics.inc("mrlx_coordinator_items_acked_total", outcome.items, consumer=consumer)
            _pulse(self._queue_events, consumer)  # room for blocked producers; maybe end-of-stream now
        return self._json(
            {
                "acked_groups": outcome.groups,
                "acked_items": outcome.items,
                "already_acked": outcome.already_acked,
            }
        )

    async def ack_through(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, AckThroughBody)
        outcome = await self.store.ack_through(consumer, body.step, time.time())
        if outcome.items:
            self.metrics.inc("mrlx_coordinator_items_acked_total", outcome.items, consumer=consumer)
            _pulse(self._queue_events, consumer)
        return self._json(
            {
                "through_step": outcome.through_step,
                "acked_groups": outcome.groups,
                "acked_items": outcome.items,
            }
        )

    async def release(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        await self._read_json(request, ReleaseBody)
        released = await self.store.release(consumer, time.time())
        if released:
            log.info(
                "%d leased groups of %r handed back by its consumer (a restarted process)", released, consumer
            )
            _pulse(self._queue_events, consumer)
        return self._json({"released_groups": released})

    async def reject(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, RejectBody)
        dead, already = await self.store.reject(consumer, body.group, body.reason, time.time())
        if not already:
            self._count_dead(consumer, [dead], "rejected")
        return self._json({"group": dead.group, "items": dead.n_items, "step": dead.step, "already": already})

    async def extend(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, ExtendBody)
        groups, expires = await self.store.extend(consumer, body.lease_id, body.lease_s, time.time())
        return self._json(
            {"lease_id": body.lease_id, "groups": groups, "expires_in_s": round(expires - time.time(), 3)}
        )

    async def seal(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        body = await self._read_json(request, SealBody)
        complete = await self.store.seal(consumer, body.group, body.size)
        if complete:
            _pulse(self._queue_events, consumer)
        return self._json({"group": body.group, "size": body.size, "complete": complete})

    async def end(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        await self._read_json(request, EndBody)
        sealed = await self.store.end(consumer, request.headers.get(AGENT_HEADER), time.time())
        self.ended.add(consumer)
        _pulse(self._queue_events, consumer)
        return self._json({"ended": True, "sealed_groups": sealed})

    async def queue_info(self, request: web.Request) -> web.Response:
        consumer = self._known_agent(request.match_info["consumer"], "consumer")
        stats = (await self.store.queue_stats(time.time())).get(consumer, QueueStats())
        return self._json(self._queue_json(consumer, stats))

    def _queue_json(self, consumer: str, stats: QueueStats) -> dict[str, Any]:
        now = time.time()
        return {
            "consumer": consumer,
            "queued_items": stats.queued_items,
            "leased_items": stats.leased_items,
            "ready_groups": stats.ready_groups,
            "incomplete_groups": stats.incomplete_groups,
            "oldest_item_age_s": None
            if stats.oldest_created is None
            else round(now - stats.oldest_created, 3),
            "ended": consumer in self.ended,
            "max_depth": self.config.max_depth,
            "dead_groups": stats.dead_groups,
            "dead_items": stats.dead_items,
            "acked_through": self.store.watermark(consumer),
        }

    # ----------------------------------------------------------------- agents

    def _agent_json(self, agent: str) -> dict[str, Any]:
        now = time.time()
        version = self.versions.get(agent)
        beat = self.heartbeats.get(agent)
        return {
            "agent": agent,
            "version": None if version is None else version[0],
            "version_updated_s_ago": None if version is None else round(now - version[1], 3),
            "last_seen_s_ago": None if beat is None else round(now - beat[0], 3),
            "pid": None if beat is None else beat[1],
            "host": None if beat is None else beat[2],
        }

    async def run_info(self, request: web.Request) -> web.Response:
        stats = await self.store.queue_stats(time.time())
        return self._json(
            {
                "run_id": self.config.run_id,
                "agents": {agent: self._agent_json(agent) for agent in self.agents},
                "queues": {
                    agent: self._queue_json(agent, stats.get(agent, QueueStats())) for agent in self.agents
                },
            }
        )

    async def heartbeat(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, HeartbeatBody)
        self._beat(agent, body.pid, body.host)
        return self._json(self._agent_json(agent))

    async def report_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, VersionBody)
        version = body.version
        current = self.versions.get(agent)
        if current is not None and version <= current[0]:
            # Monotonic: an older (or repeated) report is not an error, it just changes nothing.
            return self._json({"agent": agent, "version": current[0], "accepted": version == current[0]})
        now = time.time()
        self.versions[agent] = (version, now)
        _pulse(self._version_events, agent)  # wake waiters first; the fsync below takes milliseconds
        await self.store.save_version(agent, version, now)
        return self._json({"agent": agent, "version": version, "accepted": True})

    async def get_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        return self._json(self._agent_json(agent))

    async def wait_version(self, request: web.Request) -> web.Response:
        agent = self._known_agent(request.match_info["agent"], "agent")
        body = await self._read_json(request, WaitBody)
        wanted = body.min_version
        loop = asyncio.get_running_loop()
        deadline = loop.time() + body.timeout_s
        self._wait_started("version")
        timed_out = False
        try:
            while True:
                event = self._version_events.setdefault(agent, asyncio.Event())
                current = self.versions.get(agent)
                if current is not None and current[0] >= wanted:
                    return self._json(
                        {"agent": agent, "reached": True, "version": current[0], "message": None}
                    )
                remaining = deadline - loop.time()
                if remaining <= 0:
                    timed_out = True
                    now = time.time()
                    where = (
                        "has reported no version yet" if current is None else f"is at version {current[0]}"
                    )
                    message = (
                        f"agent {agent!r} {where}, waiting for >= {wanted}; "
                        f"{_seen_phrase(self.heartbeats.get(agent), now)}"
                    )
                    return self._json(
                        {
                            "agent": agent,
                            "reached": False,
                            "version": None if current is None else current[0],
                            "message": message,
                            "last_seen_s_ago": self._agent_json(agent)["last_seen_s_ago"],
                        }
                    )
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self._wait_ended("version", timed_out)

    # ----------------------------------------------------------------- metrics

    async def metrics_text(self, request: web.Request) -> web.Response:
        now = time.time()
        stats = await self.store.queue_stats(now)
        put = self.metrics.set
        put("mrlx_coordinator_uptime_seconds", now - self.started)
        for consumer in self.agents:
            queue = stats.get(consumer, QueueStats())
            put("mrlx_coordinator_queue_items", queue.queued_items, consumer=consumer, state="queued")
            put("mrlx_coordinator_queue_items", queue.leased_items, consumer=consumer, state="leased")
            put("mrlx_coordinator_queue_ready_groups", queue.ready_groups, consumer=consumer)
            put("mrlx_coordinator_queue_dead_items", queue.dead_items, consumer=consumer)
            put("mrlx_coordinator_queue_incomplete_groups", queue.incomplete_groups, consumer=consumer)
            oldest = 0.0 if queue.oldest_created is None else max(0.0, now - queue.oldest_created)
            put("mrlx_coordinator_queue_oldest_item_age_seconds", oldest, consumer=consumer)
            put("mrlx_coordinator_queue_ended", 1.0 if consumer in self.ended else 0.0, consumer=consumer)
        for agent in self.agents:
            version = float(self.versions[agent][0]) if agent in self.versions else -1.0
            put("mrlx_coordinator_agent_version", version, agent=agent)
            seen = now - self.heartbeats[agent][0] if agent in self.heartbeats else -1.0
            put("mrlx_coordinator_agent_last_seen_seconds", seen, agent=agent)
        for kind, count in self._waits.items():
            put("mrlx_coordinator_waits_in_progress", float(count), kind=kind)
        return web.Response(
            body=self.metrics.render(),
            headers={"Content-Type": CONTENT_TYPE_LATEST, "X-Content-Type-Options": "nosniff"},
        )


# --------------------------------------------------------------------------- OpenAPI


def _openapi30(schema: Any) -> Any:
    """A pydantic (JSON Schema 2020-12) schema in OpenAPI 3.0's dialect: `X | None` as `nullable`,
    no titles, no null defaults."""
    if isinstance(schema, list):
        return [_openapi30(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _openapi30(value) for key, value in schema.items() if key != "title"}
    options = out.get("anyOf")
    if options is not None and {"type": "null"} in options:
        rest = [option for option in options if option != {"type": "null"}]
        del out["anyOf"]
        out.update(rest[0] if len(rest) == 1 else {"anyOf": rest})
        out["nullable"] = True
    if "default" in out and out["default"] is None:
        del out["default"]
    return out


def body_schema(model: type[Body]) -> dict[str, Any]:
    """The published JSON schema of a request body model."""
    return _openapi30(model.model_json_schema())


SIGNATURE_SCHEME_TEXT = (
    f"{SCHEME}: the token never travels. Keys: client_key = HMAC-SHA256(token, 'mrlx client'), "
    "server_key = HMAC-SHA256(token, 'mrlx server'). A request carries X-Mrlx-Time (Unix seconds, within "
    f"{MAX_SKEW_S:.0f} s of the coordinator's clock), X-Mrlx-Nonce (16 to 64 hex digits, never reused), "
    "X-Mrlx-Content-Sha256 (hex SHA-256 of the body, of nothing when there is none), optionally X-Mrlx-Boot "
    "(the coordinator start's id, from an earlier answer, or '-') and X-Mrlx-Signature = hex HMAC-SHA256("
    "client_key, 'mrlx-v1' LF METHOD LF PATH LF NONCE LF TIME LF CONTENT_SHA256 [LF BOOT]), PATH as on "
    "the request line. Every answer to a request signed so carries X-Mrlx-Proof = hex HMAC-SHA256("
    "server_key, 'mrlx-v1' LF NONCE LF STATUS LF hex SHA-256 of the answer body) and X-Mrlx-Boot; use no "
    "answer without the proof. A request that names another start, or none and a time before the start, "
    "is refused (503): sign it again naming the start. `mrlx coordinator call METHOD PATH` makes one signed "
    "call from a shell; mrlx_plugin.link.auth has the code."
)


def openapi_document(run_id: str | None = None, agents: list[str] | None = None) -> dict[str, Any]:
    """The OpenAPI 3.0 description of every route in `ROUTES` (served auth-free at /openapi.json),
    request bodies from their models.

    Given the run id and agents, path parameters list them as their only valid values, so that a
    schema-driven fuzzer reaches the handlers instead of the 404 for an unknown run or agent."""
    error = {
        "description": "error",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    json_ok = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
    binary = {"schema": {"type": "string", "format": "binary"}}
    frame_ok = {
        "description": "a wire frame: an Arrow IPC stream (see mrlx_plugin.link.wire); the JSON header in "
        "its schema metadata holds lease_id, end, groups, message, dead (groups set aside)",
        "content": {CONTENT_TYPE: binary},
    }
    metrics_ok = {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}
    names = {"run": [run_id] if run_id else None, "consumer": agents, "agent": agents}
    paths: dict[str, Any] = {}
    for route in ROUTES:
        op: dict[str, Any] = {"summary": route.summary}
        if route.open:
            op["security"] = []
        params = re.findall(r"{(\w+)}", route.path)
        if params:
            op["parameters"] = [
                {
                    "name": p,
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", **({"enum": list(names[p])} if names[p] else {})},
                }
                for p in params
            ]
        if route.frame_in:
            # the server reads the body as a frame whatever its declared type
            op["requestBody"] = {
                "required": True,
                "content": {CONTENT_TYPE: binary, "application/octet-stream": binary},
            }
        elif route.body is not None:
            schema = body_schema(route.body)
            op["requestBody"] = {
                "required": bool(schema.get("required")),
                "content": {"application/json": {"schema": schema}},
            }
        ok = frame_ok if route.frame_out else metrics_ok if route.handler == "metrics_text" else json_ok
        op["responses"] = {"200": ok, **{str(code): error for code in route.errors}}
        paths.setdefault(route.path, {})[route.method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": "mrlx coordinator", "version": "1"},
        "components": {
            "securitySchemes": {
                "mrlxSignature": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-Mrlx-Signature",
                    "description": SIGNATURE_SCHEME_TEXT,
                }
            },
            "schemas": {
                "Error": {
                    "type": "object",
                    "properties": {"error": {"type": "string"}},
                    "required": ["error"],
                }
            },
        },
        "security": [{"mrlxSignature": []}],
        "paths": paths,
    }


# --------------------------------------------------------------------------- command line


def add_coordinator_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The coordinator's options, for `mrlx coordinator` and `python -m mrlx_plugin.coordinator.server`."""
    parser.add_argument(
        "--db",
        required=True,
        help="SQLite file on a local disk (created if missing); it and its -wal and -shm files are "
        "owner-only (0600): looser modes found at start are tightened, and the log says so",
    )
    parser.add_argument("--run-id", required=True, help="the run this coordinator serves")
    parser.add_argument("--agents", required=True, help="comma-separated agent names, e.g. doctor,patient")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need a token)"
    )
    parser.add_argument("--port", type=int, default=18888, help="port (0: any free port, see --port-file)")
    parser.add_argument(
        "--token-env",
        default="MRLX_TOKEN",
        help="environment variable holding the run's token (calls are "
        "signed with keys derived from it; the token itself never travels)",
    )
    parser.add_argument(
        "--token-file", default=None, help="file holding the run's token (instead of --token-env)"
    )
    parser.add_argument(
        "--max-depth", type=int, default=65536, help="most unacked items per queue before commits get 429"
    )
    parser.add_argument(
        "--max-request-mb",
        type=float,
        default=512.0,
        help="largest request body in MB (413 above). A commit's frame also gets 413, before any item "
        f"is unpacked, past {MAX_COMMIT_ITEMS} items, {MAX_FRAME_BATCHES} "
        f"record batches, or {MAX_FRAME_MESSAGE_BYTES >> 10} KiB of metadata in one message (the frame "
        "header's included)",
    )
    parser.add_argument("--port-file", default=None, help="write the bound port to this file once ready")
    parser.add_argument(
        "--synchronous",
        choices=("full", "normal"),
        default="full",
        help=(
            "SQLite sync mode: full fsyncs every commit (survives power loss); normal survives process kills"
        ),
    )
    parser.add_argument(
        "--max-db-mb", type=float, default=None, help="cap on the database size; commits past it get 507"
    )
    parser.add_argument(
        "--max-deliveries",
        type=int,
        default=MAX_DELIVERIES,
        help="a group leased this many times and never acknowledged is set aside (dead-lettered: kept, "
        f"counted, never delivered again) (default {MAX_DELIVERIES})",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=IDLE_TIMEOUT_S,
        help="close a connection that has not sent a complete request header for this long, counted "
        f"from its start or from its last answer (default {IDLE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--metrics-token-env",
        default=None,
        help="environment variable holding a second, read-only token that opens GET /metrics alone, sent "
        "as `Authorization: Bearer ...` (for a Prometheus scraper, which cannot sign requests); unset: "
        "/metrics takes signed calls only",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="most open connections; past it the connection idle the longest is closed (default "
        f"{MAX_CONNECTIONS}, lowered to fit the open-file limit RLIMIT_NOFILE)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """A validated config from parsed options; raises ValueError with the option named."""
    agents = [a.strip() for a in str(args.agents).split(",") if a.strip()]
    if not agents:
        raise ValueError("--agents: give at least one agent name, e.g. --agents doctor,patient")
    for name in agents:
        if not NAME_PATTERN.match(name):
            raise ValueError(
                f"--agents: {name!r} is not a valid agent name (letters, digits, _ . -; at most 64)"
            )
    if len(set(agents)) != len(agents):
        raise ValueError(f"--agents: names repeat in {args.agents!r}")
    if not NAME_PATTERN.match(args.run_id):
        raise ValueError(f"--run-id: {args.run_id!r} is not valid (letters, digits, _ . -; at most 64)")
    if args.max_depth < 1:
        raise ValueError("--max-depth must be at least 1")
    if args.max_deliveries < 1:
        raise ValueError("--max-deliveries must be at least 1")
    if not (math.isfinite(args.max_request_mb) and args.max_request_mb > 0):
        raise ValueError("--max-request-mb must be a positive number")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} is not a port number")
    if not (math.isfinite(args.idle_timeout_s) and args.idle_timeout_s > 0):
        raise ValueError("--idle-timeout-s must be a positive number of seconds")
    if args.max_connections < 1:
        raise ValueError("--max-connections must be at least 1")
    token = token_from_env_or_file(args.token_env, args.token_file)
    metrics_token = token_from_env_or_file(args.metrics_token_env, None) if args.metrics_token_env else None
    if args.metrics_token_env and not metrics_token:
        raise ValueError(f"--metrics-token-env: ${args.metrics_token_env} is unset or empty")
    if metrics_token is not None and token is not None and hmac.compare_digest(metrics_token, token):
        raise ValueError(
            "--metrics-token-env: the metrics token must differ from the run's token (it is sent as is)"
        )
    if token is None and not is_loopback(args.host):
        raise ValueError(
            f"refusing to listen on {args.host!r} without a token: anyone who can reach it could inject "
            "training "
            f"data. Set ${args.token_env} (or --token-file), or bind to 127.0.0.1"
        )
    return CoordinatorConfig(
        db=args.db,
        run_id=args.run_id,
        agents=agents,
        host=args.host,
        port=args.port,
        token=token,
        metrics_token=metrics_token,
        max_depth=args.max_depth,
        max_request_mb=args.max_request_mb,
        port_file=args.port_file,
        synchronous=args.synchronous,
        max_db_mb=args.max_db_mb,
        max_deliveries=args.max_deliveries,
        idle_timeout_s=args.idle_timeout_s,
        max_connections=args.max_connections,
    )


def connection_cap(wanted: int) -> int:
    """How many connections may be open at once: `wanted`, with the soft RLIMIT_NOFILE raised (up
    to the hard limit) to hold them and FD_RESERVE more, or lowered to fit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        if target > soft:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError) as exc:
                log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    cap = max(1, soft - FD_RESERVE)
    log.warning(
        "the open-file limit (RLIMIT_NOFILE %d, hard %s) holds %d connections, not %d: serving at most %d",
        soft,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        cap,
        wanted,
        cap,
    )
    return cap


class ConnectionGuard:
    """Bounds what connections that send nothing can hold (file descriptors above all):

    - at most `cap` connections are open; past it, the one idle the longest (no request in
      progress, least recently active) is closed, so that a call coming in is still served (the
      new connection itself is closed only when every other one has a request in progress);
    - a connection that has not sent a complete first request header within `header_timeout_s`
      is closed. (Between requests aiohttp's `keepalive_timeout` does the same; older aiohttp
      versions did not time out a connection's first request.)

    It hooks an aiohttp `web.Server` through the calls that server's connections make to it:
    `connection_made`, `connection_lost` and `request_handler` (wrap it before the site starts).
    """

    REPORT_EVERY_S = 10.0

    def __init__(self, server: web.Server, cap: int, header_timeout_s: float) -> None:
        self.cap = cap
        self.header_timeout_s = header_timeout_s
        self._loop = asyncio.get_running_loop()
        # Open connections, least recently active first -> the timer of their first header (None
        # once a request has started); and the requests in progress per connection.
        self._conns: dict[Any, asyncio.TimerHandle | None] = {}
        self._busy: dict[Any, int] = {}
        self._closed = {"cap": 0, "header": 0}
        self._reported = 0.0
        made, lost, handle = server.connection_made, server.connection_lost, server.request_handler

        def connection_made(protocol: Any, transport: asyncio.Transport) -> None:
            made(protocol, transport)
            self._opened(protocol)

        def connection_lost(protocol: Any, exc: BaseException | None = None) -> None:
            self._forget(protocol)
            lost(protocol, exc)

        async def request_handler(request: Any) -> web.StreamResponse:
            protocol = request.protocol
            self._started(protocol)
            try:
                return await handle(request)
            finally:
                self._finished(protocol)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]
        server.request_handler = request_handler
        log.info(
            "at most %d connections; one without a complete request header for %g s is closed",
            cap,
            header_timeout_s,
        )

    def _opened(self, protocol: Any) -> None:
        self._conns[protocol] = self._loop.call_later(self.header_timeout_s, self._header_due, protocol)
        if len(self._conns) > self.cap:
            # The oldest idle one; the new one (last, never busy yet) when all others are busy.
            self._close(next(p for p in self._conns if p not in self._busy), "cap")

    def _header_due(self, protocol: Any) -> None:
        if self._conns.get(protocol) is not None and protocol not in self._busy:
            self._close(protocol, "header")

    def _started(self, protocol: Any) -> None:
        if protocol in self._conns:
            timer = self._conns.pop(protocol)
            if timer is not None:
                timer.cancel()
            self._conns[protocol] = None  # now the most recently active
        self._busy[protocol] = self._busy.get(protocol, 0) + 1

    def _finished(self, protocol: Any) -> None:
        count = self._busy.pop(protocol, 0) - 1
        if count > 0:
            self._busy[protocol] = count
        if protocol in self._conns:
            self._conns[protocol] = self._conns.pop(protocol)

    def _forget(self, protocol: Any) -> None:
        timer = self._conns.pop(protocol, None)
        if timer is not None:
            timer.cancel()

    def _close(self, protocol: Any, reason: str) -> None:
        self._forget(protocol)
        protocol.force_close()
        self._closed[reason] += 1
        now = time.monotonic()
        if now - self._reported >= self.REPORT_EVERY_S:
            self._reported = now
            log.warning(
                "closed idle connections (so far: %d past the cap of %d open "
                "connections, the longest idle first; %d without a request header within %g s)",
                self._closed["cap"],
                self.cap,
                self._closed["header"],
                self.header_timeout_s,
            )


async def serve(config: CoordinatorConfig, *, stop: asyncio.Event | None = None) -> None:
    """Run the coordinator until SIGINT/SIGTERM (or `stop` is set)."""
    store, state = await CoordinatorStore.open(
        config.db, config.run_id, synchronous=config.synchronous, max_db_mb=config.max_db_mb
    )
    coordinator = Coordinator(config, store, state)
    runner = web.AppRunner(
        coordinator.build_app(),
        access_log=None,
        handle_signals=False,
        auto_decompress=False,
        keepalive_timeout=config.idle_timeout_s,
    )
    try:
        await runner.setup()
        assert runner.server is not None
        ConnectionGuard(runner.server, connection_cap(config.max_connections), config.idle_timeout_s)
        site = web.TCPSite(runner, config.host, config.port, reuse_address=True, backlog=LISTEN_BACKLOG)
        await site.start()
        port = config.port
        for sock in getattr(site._server, "sockets", None) or []:  # the port actually bound (for --port 0)
            port = sock.getsockname()[1]
            break
        if config.port_file:
            write_port_file(config.port_file, port)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        host = f"[{config.host}]" if ":" in config.host else config.host
        print(
            f"mrlx coordinator ready: run {config.run_id!r} at http://{host}:{port} "
            f"(agents {','.join(config.agents)}; db {config.db}; auth {'on' if config.token else 'off'})",
            flush=True,
        )
        await stop.wait()
    finally:
        await runner.cleanup()
        await store.close()


def main(argv: list[str] | None = None) -> int:
    """`mrlx coordinator ...`: parse options, check them, serve until interrupted (`mrlx coordinator
    call METHOD PATH`: one signed request to a running coordinator, see `mrlx_plugin.link.auth`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["call"]:
        from mrlx_plugin.link.auth import call_main

        return call_main(argv[1:])
    parser = add_coordinator_arguments(
        argparse.ArgumentParser(
            prog="mrlx coordinator",
            description="Run the mrlx coordinator for one training run. (`mrlx coordinator call METHOD PATH "
            "--url URL`: send one signed request to a running one and print its answer; see its --help.)",
        )
    )
    args = parser.parse_args(argv)
    # Counters as Prometheus' text format has them (no `_created` twin per series); this process
    # is the coordinator's own, so the switch reaches no other registry.
    disable_created_metrics()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("aiohttp.server").addFilter(OneLineBadRequests())
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"mrlx coordinator: {exc}", file=sys.stderr)
        return 2
    if config.token is None:
        print(
            f"mrlx coordinator: WARNING: no token (${args.token_env} unset, no --token-file); "
            f"any local process can use this coordinator",
            file=sys.stderr,
            flush=True,
        )
    try:
        asyncio.run(serve(config))
    except StoreOpenError as exc:
        print(f"mrlx coordinator: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mrlx coordinator: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
