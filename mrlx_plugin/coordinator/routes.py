"""The coordinator's routes: for each, the `Coordinator` method that serves it, its request body,
and what /openapi.json says of it (`ROUTES`, the one list both read)."""

from __future__ import annotations

from dataclasses import dataclass

from mrlx_plugin.coordinator.bodies import (
    AckBody,
    AckThroughBody,
    Body,
    EndBody,
    ExtendBody,
    HeartbeatBody,
    LeaseBody,
    RejectBody,
    ReleaseBody,
    SealBody,
    VersionBody,
    WaitBody,
)


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
