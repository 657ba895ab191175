"""Property-based fuzzing of every coordinator endpoint, against one real coordinator process.

One coordinator (a subprocess on 127.0.0.1) serves the whole module; the tests talk to it over one
keep-alive HTTP connection, with requests that hypothesis generates (derandomized: CI sends the same
requests every run). At least MIN_REQUESTS generated requests are sent in all; the module's server
fixture counts them when it stops the server, after the module's last test. Every generated request
must get:

- never a 5xx, and the process never dies (checked after every example; at the end the process
  must also exit cleanly with no traceback in its log, which is where a background task that died
  on bad input, such as the heartbeat writer, would show);
- for bad input, a 4xx whose body is JSON `{"error": "<message>"}`;
- for a refused request, no change at all: queue depths, incomplete groups, end marks, weight
  versions and the item counters, read through /metrics before and after, are equal;
- for an accepted commit, exactly the change it reports (its `accepted` items, no more, no less).

JSON bodies are judged against the server's own published /openapi.json: a body the document allows
is never refused as invalid (422), and one it forbids always is. Frames start from valid ones made
by `wire.encode_items` and are cut, flipped, given lying lengths, columns, values and headers. Path
parameters, methods, signatures and identity headers, oversized bodies and malformed HTTP get their
own tests. Every request is signed with the run's token as the client signs (mrlx_plugin.link.auth)
unless a test says otherwise.
"""

from __future__ import annotations

import gzip
import http.client
import itertools
import json
import math
import socket
import struct
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import numpy as np
import pyarrow as pa
import pytest
from _coord_procs import CoordinatorProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mrlx_plugin.link.auth import derive_keys, request_mac, signed_headers
from mrlx_plugin.link.wire import (
    CONTENT_TYPE,
    HEADER_KEY,
    SAMPLE_STATUSES,
    VERSION_KEY,
    QueueItem,
    encode_items,
    items_batch,
)

# About a minute of generated requests: the full suite's; test_coordinator.py covers the service in
# the fast tier.
pytestmark = pytest.mark.slow

RUN = "fuzz-run"
AGENTS = ("doctor", "patient", "nurse")
OPEN_QUEUE = "patient"  # the fuzzer never ends this queue, so valid commits to it are accepted
TOKEN = "fuzz-token-7f3a"
MAX_REQUEST_MB = 0.25
LIMIT = int(MAX_REQUEST_MB * (1 << 20))
MIN_REQUESTS = 1000
INT64_MAX = (1 << 63) - 1

FUZZ = settings(
    deadline=None,
    derandomize=True,  # a fixed seed per test: CI sees the same requests every run
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)

# Generated requests per test (what the last test adds up), and which tests ran.
SENT: Counter[str] = Counter()
_unique = itertools.count()


# --------------------------------------------------------------------------- the wire to the server


@dataclass
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def describe(self) -> str:
        return f"HTTP {self.status} {self.headers.get('Content-Type')} {self.body[:300]!r}"


@dataclass
class Api:
    """Keep-alive HTTP/1.1 to the coordinator (reconnecting when the server closed the connection)."""

    coord: CoordinatorProcess
    conn: http.client.HTTPConnection | None = None
    test: str = "setup"
    openapi: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Sequence[tuple[str, str | bytes]] = (),
        *,
        auth: bool = True,
        chunked: bool = False,
        count: bool = True,
    ) -> Answer:
        if count:
            SENT[self.test] += 1
        signature = list(signed_headers(TOKEN, method, path, body).items()) if auth else []
        all_headers = [*signature, *headers]
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.coord.port, timeout=30)
            conn = self.conn
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
                for name, value in all_headers:
                    conn.putheader(name, value)
                if chunked:
                    conn.putheader("Transfer-Encoding", "chunked")
                    conn.endheaders()
                    data = body or b""
                    for start in range(0, len(data), 65536):
                        piece = data[start : start + 65536]
                        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                    conn.send(b"0\r\n\r\n")
                else:
                    if body is not None:
                        conn.putheader("Content-Length", str(len(body)))
                    conn.endheaders(body)
                response = conn.getresponse()
                data = response.read()
                if response.will_close:
                    self.close()
                return Answer(response.status, response.headers, data)
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # The server closed a kept-alive connection (after a 413, say): once more, afresh.
                self.close()
                if attempt:
                    raise
            except BaseException:
                self.close()  # never reuse a connection left in the middle of an exchange
                raise
        raise AssertionError("unreachable")

    def alive(self) -> None:
        assert self.coord.proc is not None and self.coord.proc.poll() is None, (
            f"the coordinator died:\n{self.coord.log_tail()}"
        )

    def snapshot(self) -> dict[str, float]:
        """Everything a request could write, as /metrics shows it (times and request counts left out)."""
        answer = self.send("GET", "/metrics", count=False)
        assert answer.status == 200, answer.describe()
        state: dict[str, float] = {}
        for line in answer.body.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            name = series.split("{", 1)[0]
            if name == "mrlx_coordinator_queue_items":
                # Lease expiry moves items between queued and leased; their sum is what was written.
                consumer = series.split('consumer="', 1)[1].split('"', 1)[0]
                key = f"unacked{{{consumer}}}"
                state[key] = state.get(key, 0.0) + float(value)
            elif name in STATE_SERIES:
                state[series] = float(value)
        return state


STATE_SERIES = {
    "mrlx_coordinator_queue_incomplete_groups",
    "mrlx_coordinator_queue_ended",
    "mrlx_coordinator_agent_version",
    "mrlx_coordinator_items_enqueued_total",
    "mrlx_coordinator_items_duplicate_total",
    "mrlx_coordinator_items_leased_total",
    "mrlx_coordinator_items_redelivered_total",
    "mrlx_coordinator_items_acked_total",
}


def same_state(before: dict[str, float], after: dict[str, float]) -> list[str]:
    return [
        f"{key}: {before.get(key, 0.0)} -> {after.get(key, 0.0)}"
        for key in sorted(set(before) | set(after))
        if before.get(key, 0.0) != after.get(key, 0.0)
    ]


def exchange(
    api: Api,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str | bytes]] = (),
    **kwargs: Any,
) -> tuple[Answer, dict[str, float], dict[str, float]]:
    """One generated request with the checks every request gets; returns (answer, state before, after).
    The one 5xx answer allowed: 503 to a signed request the coordinator cannot tell from a replay
    (its nonce was seen, or it was signed before the coordinator started), retryable: the true
    sender signs it afresh."""
    before = api.snapshot()
    answer = api.send(method, path, body, headers, **kwargs)
    api.alive()
    where = f"{method} {path[:200]} body {(body or b'')[:200]!r} headers {list(headers)[:6]!r}"
    afresh = answer.status == 503 and "sign it afresh" in (answer.json().get("error") or "")
    assert answer.status < 500 or afresh, f"{where}: {answer.describe()}\n{api.coord.log_tail(15)}"
    after = api.snapshot()
    if answer.status >= 400:
        assert answer.headers.get("Content-Type", "").startswith("application/json"), (
            f"{where}: {answer.describe()}"
        )
        message = answer.json().get("error")
        assert isinstance(message, str) and message.strip(), f"{where}: {answer.describe()}"
        changed = same_state(before, after)
        assert not changed, f"{where}: refused with {answer.describe()} but wrote {changed}"
    return answer, before, after


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    coord = CoordinatorProcess(
        tmp_path_factory.mktemp("fuzz"),
        run_id=RUN,
        agents=AGENTS,
        token=TOKEN,
        # "normal": no fsync per commit; durability is not what this module tests
        extra=["--max-request-mb", str(MAX_REQUEST_MB), "--synchronous", "normal"],
    ).start()
    client = Api(coord)
    client.openapi = client.send("GET", "/openapi.json", auth=False, count=False).json()
    yield client
    # After every test of the module that used it, whatever order they ran in.
    enough_requests_were_sent_and_the_server_exits_cleanly(client)


@pytest.fixture
def fuzz_api(api, request):
    """The module's connection, counting requests under the running test's name."""
    api.test = request.node.originalname
    yield api
    api.alive()


# --------------------------------------------------------------------------- the routes


@dataclass(frozen=True)
class Route:
    method: str
    template: str  # as in /openapi.json
    kind: str  # "open" (no auth), "get", "json" (JSON body), "frame" (wire frame body)

    def path(self, run: str = RUN, agent: str = OPEN_QUEUE) -> str:
        return self.template.replace("{run}", run).replace("{consumer}", agent).replace("{agent}", agent)


QUEUE = "/v1/runs/{run}/queues/{consumer}"
AGENT = "/v1/runs/{run}/agents/{agent}"
ROUTES = [
    Route("GET", "/health", "open"),
    Route("GET", "/openapi.json", "open"),
    Route("GET", "/metrics", "get"),
    Route("GET", "/v1/runs/{run}", "get"),
    Route("GET", QUEUE, "get"),
    Route("POST", QUEUE + "/commit", "frame"),
    Route("POST", QUEUE + "/lease", "json"),
    Route("POST", QUEUE + "/ack", "json"),
    Route("POST", QUEUE + "/ack_through", "json"),
    Route("POST", QUEUE + "/release", "json"),
    Route("POST", QUEUE + "/reject", "json"),
    Route("POST", QUEUE + "/extend", "json"),
    Route("POST", QUEUE + "/seal", "json"),
    Route("POST", QUEUE + "/end", "json"),
    Route("POST", AGENT + "/heartbeat", "json"),
    Route("POST", AGENT + "/version", "json"),
    Route("GET", AGENT + "/version", "get"),
    Route("POST", AGENT + "/wait_version", "json"),
]
JSON_ROUTES = [r for r in ROUTES if r.kind == "json"]
AUTHED_ROUTES = [r for r in ROUTES if r.kind != "open"]
COMMIT = next(r for r in ROUTES if r.kind == "frame")
# Answers to a body the schema allows, at the path the route names (404: no such lease or group).
ALWAYS_OK = {"lease", "end", "heartbeat", "version", "wait_version", "ack_through", "release"}


def route_name(route: Route) -> str:
    return route.template.rstrip("/").rsplit("/", 1)[-1]


def agent_for(route: Route, agent: str) -> str:
    """The fuzzer ends queues it is allowed to end, never the open one; nor does it acknowledge the
    open one through a step (a watermark drops later items of the steps it covers)."""
    if route_name(route) in ("end", "ack_through") and agent == OPEN_QUEUE:
        return "nurse"
    return agent


def test_openapi_is_served_and_every_route_is_fuzzed(fuzz_api):
    answer = fuzz_api.send("GET", "/openapi.json", auth=False)
    assert answer.status == 200 and answer.json()["openapi"].startswith("3.")
    documented = {(m.upper(), p) for p, ops in answer.json()["paths"].items() for m in ops}
    assert documented == {(r.method, r.template) for r in ROUTES}, "a route is not fuzzed (or not documented)"


# --------------------------------------------------------------------------- JSON values and the oracle

WEIRD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    -(1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
    1 << 64,
    1 << 200,
    0.5,
    -0.0,
    1e-320,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
    "",
    "1",
    "0.5",
    "true",
    "null",
    "x" * 300,
    "\u0000",
    "\u202e\ufeff",
    [],
    [1],
    {},
    {"a": 1},
]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def value_strategy(prop: dict[str, Any], *, valid_only: bool = False) -> st.SearchStrategy[Any]:
    """Values for one body field: valid ones, its bounds and just past them, and anything at all."""
    kind = prop["type"]
    low, high = prop.get("minimum"), prop.get("maximum")
    if kind == "integer":
        lo = -(1 << 64) if low is None else math.ceil(low)
        hi = (1 << 64) - 1 if high is None else math.floor(high)
        good = st.integers(lo, hi) | st.sampled_from([lo, hi])
        edges = st.sampled_from([lo - 1, hi + 1])
    elif kind == "number":
        lo = -1e300 if low is None else float(low)
        hi = 1e300 if high is None else float(high)
        good = st.floats(lo, hi) | st.sampled_from([lo, hi, int(hi)])
        edges = st.sampled_from([math.nextafter(lo, -math.inf), math.nextafter(hi, math.inf), int(hi) + 1])
    else:
        longest = prop.get("maxLength", 64)
        good = st.text(min_size=1, max_size=min(longest, 40)) | st.just("y" * longest)
        edges = st.sampled_from(["", "y" * (longest + 1)])
    if prop.get("nullable"):
        good = good | st.none()
    if valid_only:
        return good
    return st.one_of(good, good, edges, st.sampled_from(WEIRD_VALUES), json_values)


def schema_allows(schema: dict[str, Any], body: Any) -> bool:
    """Whether `body` (the Python value sent as JSON) satisfies the published request schema."""
    if not isinstance(body, dict):
        return False
    properties = schema.get("properties", {})
    if schema.get("additionalProperties") is False and set(body) - set(properties):
        return False
    if set(schema.get("required", [])) - set(body):
        return False
    for name, value in body.items():
        prop = properties[name]
        if value is None:
            if not prop.get("nullable"):
                return False
            continue
        kind = prop["type"]
        if kind == "integer":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "number":
            ok = (isinstance(value, int) and not isinstance(value, bool)) or (
                isinstance(value, float) and math.isfinite(value)
            )
        else:
            ok = isinstance(value, str)
        if not ok:
            return False
        if kind == "string":
            if len(value) < prop.get("minLength", 0) or len(value) > prop.get("maxLength", math.inf):
                return False
        elif not prop.get("minimum", -math.inf) <= value <= prop.get("maximum", math.inf):
            return False
    return True


def has_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(has_non_finite(v) for v in value)
    return False


def tame_waits(body: Any) -> Any:
    """Long polls the schema allows (up to 300 s) shortened, so valid requests answer at once."""
    if isinstance(body, dict):
        for name in ("wait_s", "timeout_s"):
            value = body.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.02 < value <= 300:
                body[name] = 0.0
        if "min_version" in body and "timeout_s" not in body:
            body["timeout_s"] = 0.0  # the default long poll (30 s) would outlast the fuzzer's patience
    return body


RAW_BODIES = [
    b"",
    b" \n\t",
    b"{",
    b"}",
    b"null",
    b"[]",
    b'"text"',
    b"0",
    b"\xef\xbb\xbf{}",
    b'{"a":1}{"b":2}',
    b'{"version": 1e999}',
    b'{"version": NaN}',
    b'{"version": 01}',
    b'{"version": 1,}',
    b'{"version": 1, "version": 2}',
    b'{"lease_id": "\\ud800"}',
    b"\xff\xfe\x00{",
    b"[" * 3000 + b"]" * 3000,
    b'{"a":' * 2000 + b"1" + b"}" * 2000,
    b"MRLX\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00",
]
CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=latin-1",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=xyz",
    CONTENT_TYPE,
    "application/octet-stream",
    ";;;",
]


def content_type_headers(content_type: str | None) -> list[tuple[str, str]]:
    return [] if content_type is None else [("Content-Type", content_type)]


# --------------------------------------------------------------------------- JSON endpoints


@settings(FUZZ, max_examples=450)
@given(data=st.data())
def test_json_endpoints_refuse_bad_bodies_and_write_nothing(fuzz_api, data):
    route = data.draw(st.sampled_from(JSON_ROUTES), label="route")
    op = fuzz_api.openapi["paths"][route.template]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    props = schema.get("properties", {})
    near_valid = st.fixed_dictionaries(
        {},
        optional={
            **{name: value_strategy(prop) for name, prop in props.items()},
            "surprise": json_values,
            "": st.just(1),
        },
    )
    required = set(schema.get("required", []))
    valid = st.fixed_dictionaries(
        {n: value_strategy(p, valid_only=True) for n, p in props.items() if n in required},
        optional={n: value_strategy(p, valid_only=True) for n, p in props.items() if n not in required},
    )
    body_value = data.draw(
        st.one_of(near_valid, valid, json_values, st.sampled_from(RAW_BODIES).map(lambda raw: ("raw", raw))),
        label="body",
    )
    content_type = data.draw(st.sampled_from(CONTENT_TYPES), label="content type")
    agent = agent_for(route, data.draw(st.sampled_from(AGENTS), label="agent"))
    if isinstance(body_value, tuple):
        raw, expect_valid = body_value[1], None
    else:
        body_value = tame_waits(body_value)
        raw = json.dumps(body_value, allow_nan=True).encode()
        expect_valid = schema_allows(schema, body_value) and not has_non_finite(body_value)
    answer, _, _ = exchange(
        fuzz_api, "POST", route.path(agent=agent), raw, content_type_headers(content_type)
    )
    what = f"{route.template} {raw[:200]!r}: {answer.describe()}"
    if expect_valid is True:
        assert answer.status != 422, f"a body the schema allows was refused: {what}"
        if route_name(route) in ALWAYS_OK:
            assert answer.status == 200, what
    elif expect_valid is False:
        assert answer.status == 422, f"a body the schema forbids was not refused: {what}"
        assert route.path(agent=agent) in answer.json()["error"], "the message names where"


# --------------------------------------------------------------------------- path parameters and methods

# Decoded values that are no run and no agent; sent percent-encoded.
odd_names = st.one_of(
    st.sampled_from(
        ["ghost", "Doctor", "patient ", "doctor\u0000", "\u00e9", "\U0001f600", "a" * 3000, "-", "%"]
    ),
    st.text(min_size=1, max_size=30),
).filter(lambda s: s not in AGENTS and s != RUN and s not in (".", ".."))
# Raw path segments whose decoding is odd (bad escapes, dot segments, encoded slashes), sent as they are.
RAW_SEGMENTS = ["%zz", "%ff", "%", "%2e%2e", "..", ".", "a%2Fb", "%00", "%E2%80%AE", ";x", "@", ""]
path_params = st.one_of(odd_names.map(lambda name: quote(name, safe="")), st.sampled_from(RAW_SEGMENTS))

# A body each JSON route accepts as valid, and the answer it gets (no such lease or group: 404).
VALID_BODY = {
    "lease": (b"{}", 200),
    "ack": (b'{"lease_id": "no-such-lease"}', 404),
    "ack_through": (b'{"step": 0}', 200),
    "release": (b"{}", 200),
    "reject": (b'{"group": "no-such-group", "reason": "x"}', 404),
    "extend": (b'{"lease_id": "no-such-lease", "lease_s": 1}', 404),
    "seal": (b'{"group": "no-such-group", "size": 1}', 404),
    "end": (b"{}", 200),
    "heartbeat": (b"{}", 200),
    "version": (b'{"version": 0}', 200),
    "wait_version": (
        b'{"min_version": 0, "timeout_s": 0}',
        200,
    ),  # no 30 s long poll racing the socket timeout
}


def plain_body(route: Route) -> bytes | None:
    """A body the route accepts (an empty frame for commit, none for a GET)."""
    if route.kind == "json":
        return VALID_BODY[route_name(route)][0]
    return encode_items([]) if route.kind == "frame" else None


@settings(FUZZ, max_examples=200)
@given(data=st.data())
def test_path_parameters_and_methods_get_json_errors(fuzz_api, data):
    route = data.draw(st.sampled_from(ROUTES), label="route")
    odd = data.draw(st.sampled_from(["run", "agent", "both", "method", "none"]), label="what is odd")
    run, agent, method = RUN, agent_for(route, data.draw(st.sampled_from(AGENTS))), route.method
    expect = {VALID_BODY[route_name(route)][1] if route.kind == "json" else 200}
    if odd in ("run", "both") and "{run}" in route.template:
        run = data.draw(path_params, label="run")
        expect = {404}
    if odd in ("agent", "both") and "{run}/" in route.template:
        agent = data.draw(path_params, label="agent")
        expect = {404}
    if odd == "method":
        method = data.draw(st.sampled_from(["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "POST", "GET"]))
        if method in {r.method for r in ROUTES if r.template == route.template}:  # a route of its own
            method = "DELETE"
        expect = {405}
    answer, _, _ = exchange(fuzz_api, method, route.path(run, agent), plain_body(route))
    assert answer.status in expect, f"{method} {route.path(run, agent)[:200]}: {answer.describe()}"


# --------------------------------------------------------------------------- frames


def make_queue_items(
    uid: int, n: int, seed: int, *, consumer: str = OPEN_QUEUE, producer: str = "doctor", key_prefix: str = ""
) -> list[QueueItem]:
    """`n` valid items of one fresh group (random lengths, ids, masks and log-probs)."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        n_tokens = int(rng.integers(1, 24))
        response = int(rng.integers(1, n_tokens + 1))
        items.append(
            QueueItem(
                key=f"{key_prefix}fz{uid}.{i}:{consumer}",
                group=f"grp{uid}",
                group_size=n,
                producer=producer,
                step=int(rng.integers(0, 1000)),
                tokens=rng.integers(0, 2**31 - 1, n_tokens).tolist(),
                response_length=response,
                loss_mask=rng.integers(0, 2, response).tolist(),
                rollout_log_probs=(-rng.random(response) * 20).tolist(),
                fields={
                    "reward": float(rng.normal()),
                    "status": SAMPLE_STATUSES[int(rng.integers(0, len(SAMPLE_STATUSES)))],
                    "weight_versions": [str(uid)],
                    "metadata": {"i": i, "deep": [[[{"x": None}]]]},
                },
            )
        )
    return items


def write_stream(batch: pa.RecordBatch, schema: pa.Schema | None = None, **options: Any) -> bytes:
    """An Arrow IPC stream of one batch (the frame format), written as the test says."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema or batch.schema, options=pa.ipc.IpcWriteOptions(**options)) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def with_column(
    batch: pa.RecordBatch, name: str, array: pa.Array | None, field: pa.Field | None = None
) -> pa.RecordBatch:
    """The batch with column `name` replaced by `array` (None: dropped; a new name: appended)."""
    arrays, fields = list(batch.columns), list(batch.schema)
    names = batch.schema.names
    if name in names:
        at = names.index(name)
        if array is None:
            del arrays[at], fields[at]
        else:
            arrays[at], fields[at] = array, field or pa.field(name, array.type, nullable=False)
    else:
        arrays.append(array)
        fields.append(field or pa.field(name, array.type))
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields, metadata=batch.schema.metadata))


def first_value_is(batch: pa.RecordBatch, name: str, value: Any) -> pa.RecordBatch:
    """The batch with the first item's `name` replaced by `value` (same column type)."""
    column = batch.column(batch.schema.get_field_index(name))
    return with_column(batch, name, pa.array([value, *column.to_pylist()[1:]], column.type))


COLUMN_LIES: list[tuple[str, Any]] = [
    ("response_length", 0),
    ("response_length", 1 << 20),
    ("response_length", (1 << 24) + 1),
    ("response_length", -1),
    ("step", -1),
    ("group_size", 0),
    ("group_size", 1 << 20),
    ("key", ""),
    ("key", "k" * 257),
    ("group", ""),
    ("producer", "ghost"),
    ("producer", ""),
    ("fields", "[]"),
    ("fields", "{"),
    ("fields", "null"),
    ("fields", '{"reward": null}'),
    ("fields", '{"reward": "1"}'),
    ("fields", '{"reward": 1, "status": "bogus"}'),
    ("fields", '{"reward": 1, "weight_versions": [1]}'),
    ("fields", '{"reward": 1, "index": 1.5}'),
    ("fields", '{"reward": 1, "prompt": 5}'),
    ("fields", '{"reward": 1, "metadata": []}'),
    ("fields", '{"reward": 1, "remove_sample": "yes"}'),
    (
        "fields",
        '{"reward": 18446744073709551615, "index": 9223372036854775808, "metadata": {"big": '
        "9223372036854775808}}",
    ),
]
# Lies that are still samples (a reward or index beyond 64 bits is a number): no refusal owed.
ALLOWED_LIES = [COLUMN_LIES[-1]]
WRONG_TYPES: list[tuple[str, pa.DataType]] = [
    ("step", pa.string()),
    ("group_size", pa.int64()),
    ("key", pa.large_string()),
    ("tokens", pa.list_(pa.int64())),
    ("loss_mask", pa.list_(pa.int32())),
    ("rollout_log_probs", pa.list_(pa.float64())),
    ("fields", pa.binary()),
]

MUTATIONS = [
    "valid",
    "duplicate record",
    "truncate",
    "flip bytes",
    "lying offsets",
    "lying schema length",
    "lying message lengths",
    "bad header JSON",
    "column lie",
    "unknown column",
    "missing column",
    "wrong column type",
    "null value",
    "dictionary column",
    "compressed batch",
    "wrong magic",
    "wrong version",
    "trailing bytes",
    "two frames",
    "random bytes",
    "empty",
    "JSON instead",
    "compressed",
]


@settings(FUZZ, max_examples=420)
@given(data=st.data())
def test_commit_frames_mutated_are_refused_whole_or_accepted_exactly(fuzz_api, data):
    n = data.draw(st.integers(1, 3), label="items")
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    mutation = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    consumer = data.draw(st.sampled_from([OPEN_QUEUE] * 6 + ["doctor", "ghost"]), label="consumer")
    producer = data.draw(st.sampled_from(AGENTS), label="producer")
    uid = next(_unique)
    items = make_queue_items(uid, n, seed, consumer=consumer, producer=producer)
    header = data.draw(st.sampled_from([None, {"note": "x"}]))
    frame = encode_items(items, header=header)
    batch = items_batch(items, header)
    headers = content_type_headers(data.draw(st.sampled_from([CONTENT_TYPE] * 4 + CONTENT_TYPES)))
    expected_accepted: int | None = None
    body = frame
    schema_end = 8 + struct.unpack_from("<i", frame, 4)[0]  # the schema message: marker, length, metadata
    if mutation == "valid":
        expected_accepted = n
    elif mutation == "duplicate record":
        body = encode_items([*items, items[0]])
        expected_accepted = n
    elif mutation == "truncate":
        body = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif mutation == "flip bytes":
        flipped = bytearray(frame)
        for _ in range(data.draw(st.integers(1, 4))):
            flipped[data.draw(st.integers(0, len(frame) - 1))] ^= data.draw(st.integers(1, 255))
        body = bytes(flipped)
    elif mutation == "lying offsets":
        # list offsets that point past the values or run backwards, patched into the written bytes
        name = data.draw(st.sampled_from(["tokens", "loss_mask", "rollout_log_probs"]))
        offsets = batch.column(batch.schema.get_field_index(name)).offsets.to_pylist()
        packed = struct.pack(f"<{len(offsets)}i", *offsets)
        at = data.draw(st.integers(1, len(offsets) - 1))
        offsets[at] = data.draw(st.sampled_from([offsets[-1] + 1, offsets[at - 1] - 1, 2**31 - 1, -5]))
        where = frame.index(packed, schema_end)
        body = frame[:where] + struct.pack(f"<{len(offsets)}i", *offsets) + frame[where + len(packed) :]
    elif mutation == "lying schema length":
        lie = data.draw(
            st.sampled_from([0, 1, 3, 8, len(frame), 2**31 - 1, -8]) | st.integers(-(2**31), 2**31 - 1)
        )
        body = frame[:4] + struct.pack("<i", lie) + frame[8:]
    elif mutation == "lying message lengths":
        at = schema_end + data.draw(st.sampled_from([0, 4]))
        old = struct.unpack_from("<i", frame, at)[0]
        lie = data.draw(
            st.sampled_from([old + 8, old - 8, old + 1, 0, 2**31 - 1]) | st.integers(-(2**31), 2**31 - 1)
        )
        body = frame[:at] + struct.pack("<i", lie) + frame[at + 4 :]
    elif mutation == "bad header JSON":
        junk = data.draw(
            st.sampled_from([b"[]", b"null", b"{", b"\xff\xfe", b'"x"', b"1"]) | st.binary(max_size=40)
        )
        body = write_stream(batch, batch.schema.with_metadata({**batch.schema.metadata, HEADER_KEY: junk}))
    elif mutation == "column lie":
        lie = data.draw(st.sampled_from(COLUMN_LIES))
        body = write_stream(first_value_is(batch, *lie))
    elif mutation == "unknown column":
        name = data.draw(st.sampled_from(["extra", "KEY", " key", "n_tokens"]))
        body = write_stream(with_column(batch, name, pa.array([1] * n, pa.int64())))
    elif mutation == "missing column":
        body = write_stream(with_column(batch, data.draw(st.sampled_from(batch.schema.names)), None))
    elif mutation == "wrong column type":
        name, kind = data.draw(st.sampled_from(WRONG_TYPES))
        column = batch.column(batch.schema.get_field_index(name))
        body = write_stream(with_column(batch, name, column.cast(kind)))
    elif mutation == "null value":
        name = data.draw(st.sampled_from(batch.schema.names))
        column = batch.column(batch.schema.get_field_index(name))
        nulled = pa.array([None, *column.to_pylist()[1:]], column.type)
        body = write_stream(with_column(batch, name, nulled, pa.field(name, column.type, nullable=True)))
    elif mutation == "dictionary column":
        name = data.draw(st.sampled_from(["key", "group", "producer", "fields"]))
        column = batch.column(batch.schema.get_field_index(name))
        body = write_stream(with_column(batch, name, column.dictionary_encode()))
    elif mutation == "compressed batch":
        # Arrow unpacks a compressed body into buffers as large as the frame claims: refused unread
        body = write_stream(batch, compression=data.draw(st.sampled_from(["zstd", "lz4"])))
    elif mutation == "wrong magic":
        body = (
            data.draw(st.sampled_from([b"MRLX", b"ARRO", b"\x00\x00\x00\x00", b"\xff\xff\xff\xfe"]))
            + frame[4:]
        )
    elif mutation == "wrong version":
        version = data.draw(st.sampled_from([b"1", b"3", b"", b"two"]))
        body = write_stream(
            batch, batch.schema.with_metadata({**batch.schema.metadata, VERSION_KEY: version})
        )
    elif mutation == "trailing bytes":
        body = frame + data.draw(st.binary(min_size=1, max_size=12))
    elif mutation == "two frames":
        body = frame + frame
    elif mutation == "random bytes":
        body = data.draw(st.binary(max_size=300))
    elif mutation == "empty":
        body = b""
    elif mutation == "JSON instead":
        body = json.dumps({"items": [{"key": items[0].key, "tokens": [1, 2]}]}).encode()
        headers = [("Content-Type", "application/json")]
    elif mutation == "compressed":
        # A body that declares an encoding: the server must not take it for a frame as it is.
        how = data.draw(st.sampled_from(["gzip", "deflate", "br", "gzip-lie"]))
        if how == "gzip":
            body = gzip.compress(frame)
        elif how == "deflate":
            body = zlib.compress(frame)
        else:
            body = frame
        headers = [*headers, ("Content-Encoding", "gzip" if how == "gzip-lie" else how)]
    path = COMMIT.path(agent=consumer)
    answer, before, after = exchange(fuzz_api, "POST", path, body, headers)
    what = f"{mutation} to {consumer}: {answer.describe()}"
    if consumer == "ghost":
        assert answer.status == 404, what
        return
    if expected_accepted is not None and consumer == OPEN_QUEUE:
        assert answer.status == 200 and answer.json()["accepted"] == expected_accepted, what
    if mutation in (
        "column lie",
        "unknown column",
        "missing column",
        "wrong column type",
        "null value",
        "dictionary column",
        "compressed batch",
        "wrong version",
        "bad header JSON",
    ):
        # never a sample as the format or the rules define one: refused whole
        allowed = (mutation == "bad header JSON" and _json_object(junk)) or (
            mutation == "column lie" and lie in ALLOWED_LIES
        )
        if not allowed:
            assert answer.status == 422, what
    if answer.status == 200:
        got = answer.json()
        expected = dict(before)
        for name, amount in (
            (f'mrlx_coordinator_items_enqueued_total{{consumer="{consumer}"}}', got["accepted"]),
            (f"unacked{{{consumer}}}", got["accepted"]),
            (f'mrlx_coordinator_items_duplicate_total{{consumer="{consumer}"}}', got["duplicates"]),
        ):
            expected[name] = expected.get(name, 0.0) + amount
        incomplete = f'mrlx_coordinator_queue_incomplete_groups{{consumer="{consumer}"}}'
        expected[incomplete] = after.get(incomplete, 0.0)  # a new group may be incomplete
        changed = same_state(expected, after)
        assert not changed, f"{what}: accepted {got} but the state changed otherwise: {changed}"


def _json_object(raw: bytes) -> bool:
    try:
        return isinstance(json.loads(raw), dict)
    except ValueError:
        return False


# --------------------------------------------------------------------------- items that are not samples

ITEM_FAULTS = [
    "loss_mask short",
    "loss_mask long",
    "rollout_log_probs short",
    "rollout_log_probs long",
    "rollout_log_probs NaN",
    "rollout_log_probs infinite",
    "rollout_log_probs positive",
    "loss_mask value",
]
key_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=24)


@settings(FUZZ, max_examples=130)
@given(
    fault=st.sampled_from(ITEM_FAULTS),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
    victim_at=st.integers(0, 3),
    prefix=key_text,
    amount=st.integers(1, 5),
    positive=st.floats(0.002, 1e30),
)
def test_items_with_misaligned_masks_or_log_probs_are_422_naming_key_and_field(
    fuzz_api, fault, n, seed, victim_at, prefix, amount, positive
):
    uid = next(_unique)
    items = make_queue_items(uid, n, seed, key_prefix=prefix)
    victim = items[victim_at % n]
    field_name = fault.split()[0]
    values = list(getattr(victim, field_name))
    at = seed % len(values)
    if fault.endswith("short"):
        values = values[: max(0, len(values) - amount)]
    elif fault.endswith("long"):
        values = values + values[:1] * amount
    elif fault.endswith("NaN"):
        values[at] = float("nan")
    elif fault.endswith("infinite"):
        values[at] = -math.inf if amount % 2 else math.inf
    elif fault.endswith("positive"):
        values[at] = positive
    else:
        values[at] = 1 + amount
    setattr(victim, field_name, values)
    answer, _, _ = exchange(
        fuzz_api, "POST", COMMIT.path(), encode_items(items), [("Content-Type", CONTENT_TYPE)]
    )
    message = answer.json().get("error", "") if answer.status >= 400 else ""
    assert answer.status == 422, f"{fault}: {answer.describe()}"
    assert repr(victim.key) in message and field_name in message and "nothing written" in message, message
    # Nothing half-written: the other items of the refused request were not stored either.
    rest = [item for item in items if item is not victim]
    if rest:
        answer, _, _ = exchange(fuzz_api, "POST", COMMIT.path(), encode_items(rest))
        assert answer.status == 200 and answer.json() == {
            "accepted": len(rest),
            "duplicates": 0,
            "duplicate_keys": [],
        }, answer.describe()


@settings(FUZZ, max_examples=90)
@given(
    where=st.sampled_from(["run", "consumer", "producer"]),
    name=odd_names,
    n=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_items_for_an_unknown_run_or_agent_are_rejected_and_never_queued(fuzz_api, where, name, n, seed):
    uid = next(_unique)
    producer = name if where == "producer" else "doctor"
    items = make_queue_items(uid, n, seed, producer=producer)
    run = quote(name, safe="") if where == "run" else RUN
    consumer = quote(name, safe="") if where == "consumer" else OPEN_QUEUE
    answer, _, _ = exchange(fuzz_api, "POST", COMMIT.path(run, consumer), encode_items(items))
    assert answer.status == (422 if where == "producer" else 404), answer.describe()
    assert repr(name) in answer.json()["error"], answer.describe()
    # The keys were not recorded: the same items, sent where they belong, are all new.
    for item in items:
        item.producer = "doctor"
    answer, _, _ = exchange(fuzz_api, "POST", COMMIT.path(), encode_items(items))
    assert answer.status == 200 and answer.json()["accepted"] == n, answer.describe()


# --------------------------------------------------------------------------- headers


def signature(
    method: str,
    path: str,
    body: bytes | None,
    *,
    token: str = TOKEN,
    stamp: str | None = None,
    nonce: str | None = None,
    **replace: str | bytes | None,
) -> list[tuple[str, str | bytes]]:
    """Signature headers of a request, made with `token` (at `stamp`, with `nonce` when given), then
    with the headers named in `replace` (X_Mrlx_Time=...) replaced or, for None, left out."""
    headers: dict[str, str | bytes] = dict(signed_headers(token, method, path, body))
    if stamp is not None or nonce is not None:
        stamp = stamp or str(headers["X-Mrlx-Time"])
        nonce = nonce or str(headers["X-Mrlx-Nonce"])
        content = str(headers["X-Mrlx-Content-Sha256"])
        mac = request_mac(derive_keys(token)[0], method, path, nonce, stamp, content)
        headers.update({"X-Mrlx-Time": stamp, "X-Mrlx-Nonce": nonce, "X-Mrlx-Signature": mac})
    for name, value in replace.items():
        headers[name.replace("_", "-")] = value  # type: ignore[assignment]
    return [(name, value) for name, value in headers.items() if value is not None]


def _now(offset: float) -> str:
    import time

    return f"{time.time() + offset:.3f}"


# (what, headers of a request (method, path, body), valid)
AUTH_VARIANTS: list[tuple[str, Any, bool]] = [
    ("unsigned", lambda m, p, b: [], False),
    ("the token as a bearer token", lambda m, p, b: [("Authorization", f"Bearer {TOKEN}")], False),
    ("the token itself as the signature", lambda m, p, b: signature(m, p, b, X_Mrlx_Signature=TOKEN), False),
    ("signed with another token", lambda m, p, b: signature(m, p, b, token=TOKEN + "x"), False),
    ("signed with a prefix of the token", lambda m, p, b: signature(m, p, b, token=TOKEN[:-1]), False),
    ("signed for another path", lambda m, p, b: signature(m, p + "x", b), False),
    ("signed for another method", lambda m, p, b: signature("PUT", p, b), False),
    ("signed for another body", lambda m, p, b: signature(m, p, (b or b"") + b" "), False),
    ("another body's hash", lambda m, p, b: signature(m, p, b, X_Mrlx_Content_Sha256="0" * 64), False),
    ("no signature", lambda m, p, b: signature(m, p, b, X_Mrlx_Signature=None), False),
    ("no time", lambda m, p, b: signature(m, p, b, X_Mrlx_Time=None), False),
    ("no nonce", lambda m, p, b: signature(m, p, b, X_Mrlx_Nonce=None), False),
    ("no body hash", lambda m, p, b: signature(m, p, b, X_Mrlx_Content_Sha256=None), False),
    (
        "signature cut short",
        lambda m, p, b: [(k, v[:-1] if k == "X-Mrlx-Signature" else v) for k, v in signature(m, p, b)],
        False,
    ),
    (
        "signature in upper case",
        lambda m, p, b: [(k, v.upper() if k == "X-Mrlx-Signature" else v) for k, v in signature(m, p, b)],
        False,
    ),
    (
        "signature with bytes past it",
        lambda m, p, b: [(k, v + "\xe9" if k == "X-Mrlx-Signature" else v) for k, v in signature(m, p, b)],
        False,
    ),
    ("signed 10 minutes ago", lambda m, p, b: signature(m, p, b, stamp=_now(-600)), False),
    ("signed 10 minutes ahead", lambda m, p, b: signature(m, p, b, stamp=_now(600)), False),
    ("a time that is no number", lambda m, p, b: signature(m, p, b, stamp="soon"), False),
    ("a time that is not finite", lambda m, p, b: signature(m, p, b, stamp="inf"), False),
    ("a short nonce", lambda m, p, b: signature(m, p, b, nonce="abc123"), False),
    ("a nonce that is not hex", lambda m, p, b: signature(m, p, b, nonce="z" * 32), False),
    ("a huge header", lambda m, p, b: signature(m, p, b, X_Mrlx_Signature="y" * 4000), False),
    ("replayed", lambda m, p, b: signature(m, p, b), False),  # sent once before the exchange
    ("signed", lambda m, p, b: signature(m, p, b), True),
    (
        "signed, with spaces around the signature",
        lambda m, p, b: [(k, f"  {v} " if k == "X-Mrlx-Signature" else v) for k, v in signature(m, p, b)],
        True,
    ),
    ("signed a minute ago", lambda m, p, b: signature(m, p, b, stamp=_now(-60)), True),
]
header_bytes = st.binary(max_size=60).map(
    lambda raw: bytes(b for b in raw if b >= 0x20 and b != 0x7F)  # no control bytes: that is malformed HTTP
)


@settings(FUZZ, max_examples=160)
@given(
    route=st.sampled_from(AUTHED_ROUTES),
    variant=st.sampled_from(AUTH_VARIANTS)
    | header_bytes.map(
        lambda raw: ("random signature", lambda m, p, b: signature(m, p, b, X_Mrlx_Signature=raw), False)
    ),
    agent=st.sampled_from(AGENTS),
)
def test_missing_or_wrong_token_is_401_and_health_stays_open(fuzz_api, route, variant, agent):
    what, make, valid = variant
    body = plain_body(route)
    path = route.path(agent=agent_for(route, agent))
    headers = make(route.method, path, body)
    if what == "replayed":  # the same signed request once more: refused
        first = fuzz_api.send(route.method, path, body, headers, auth=False)
        assert first.status != 401, f"{what}: the first time: {first.describe()}"
    answer, _, _ = exchange(fuzz_api, route.method, path, body, headers, auth=False)
    if what == "replayed":  # retryable (the true sender signs again), and nothing is done twice
        assert answer.status == 503 and "used before" in answer.json()["error"], answer.describe()
    elif valid:
        assert answer.status != 401, f"{what}: {answer.describe()}"
    else:
        assert answer.status == 401, f"{what} {headers!r}: {answer.describe()}"
        assert "X-Mrlx-" in answer.json()["error"] and "Mrlx-HMAC" in answer.headers["WWW-Authenticate"]
    for open_path in ("/health", "/openapi.json"):
        answer = fuzz_api.send("GET", open_path, None, headers, auth=False)
        assert answer.status == 200 and answer.headers["Content-Type"].startswith("application/json")
        # signed for another request, so not a signed one: nothing about the run
        assert RUN not in answer.body.decode() and "doctor" not in answer.body.decode(), answer.describe()


@settings(FUZZ, max_examples=100)
@given(
    agent=st.none() | st.sampled_from([*AGENTS, "ghost", "", "DOCTOR"]) | header_bytes,
    pid=st.none()
    | st.sampled_from(["1", "123", "-1", "abc", "99999999999", "\uff11".encode(), "1.5", "", " 7"])
    | header_bytes,
    host=st.none() | st.sampled_from(["node-1", "x" * 300, "h\tost", "\u00e9".encode()]) | header_bytes,
    route=st.sampled_from([r for r in AUTHED_ROUTES if "{run}" in r.template]),
)
def test_identity_headers_never_break_the_service(fuzz_api, agent, pid, host, route):
    headers = [
        (name, value)
        for name, value in (("X-Mrlx-Agent", agent), ("X-Mrlx-Pid", pid), ("X-Mrlx-Host", host))
        if value is not None
    ]
    body = plain_body(route)
    answer, _, _ = exchange(
        fuzz_api, route.method, route.path(agent=agent_for(route, "doctor")), body, headers
    )
    agent_text = agent.decode("latin-1") if isinstance(agent, bytes) else agent
    if agent is not None and agent_text not in AGENTS:
        assert answer.status == 422 and "X-Mrlx-Agent" in answer.json()["error"], answer.describe()
    # Whatever the headers held, every answer that shows identities still renders.
    for path in (f"/v1/runs/{RUN}", f"/v1/runs/{RUN}/agents/doctor/version", "/metrics"):
        answer = fuzz_api.send("GET", path)
        assert answer.status == 200, f"{path} after identity headers {headers!r}: {answer.describe()}"


# --------------------------------------------------------------------------- size limit


@settings(FUZZ, max_examples=24)
@given(
    route=st.sampled_from([COMMIT, *JSON_ROUTES]),
    extra=st.sampled_from([0, 1, 2, 4096]),
    chunked=st.booleans(),
)
def test_body_over_the_size_limit_is_413_and_writes_nothing(fuzz_api, route, extra, chunked):
    body = b" " * (LIMIT + extra)
    answer, _, _ = exchange(
        fuzz_api, "POST", route.path(agent=agent_for(route, OPEN_QUEUE)), body, chunked=chunked
    )
    if extra:
        assert answer.status == 413 and "--max-request-mb" in answer.json()["error"], answer.describe()
    else:
        assert answer.status != 413, f"a body exactly at the limit is not over it: {answer.describe()}"


# --------------------------------------------------------------------------- malformed HTTP

MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/runs/"
    + RUN.encode()
    + b"/queues/patient/commit HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/runs/"
    + RUN.encode()
    + b"/queues/patient/commit HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/runs/" + RUN.encode() + b"/queues/patient/commit HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/runs/" + RUN.encode() + b"/queues/patient/commit HTTP/1.1\r\nHost: x\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Long: " + b"b" * 9000 + b"\r\n\r\n",
]


@pytest.mark.parametrize("raw", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_http_is_refused_and_the_service_stays_up(fuzz_api, raw):
    before = fuzz_api.snapshot()
    SENT[fuzz_api.test] += 1
    with socket.create_connection(("127.0.0.1", fuzz_api.coord.port), timeout=10) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else None
    # Refused: a 4xx, or (for bytes that are not HTTP at all) the connection closed unanswered.
    assert answer == b"" or (status is not None and 400 <= status < 500), answer[:300]
    fuzz_api.alive()
    assert fuzz_api.send("GET", "/health", auth=False, count=False).status == 200
    assert same_state(before, fuzz_api.snapshot()) == []


# --------------------------------------------------------------------------- schemathesis, when present


def test_schemathesis_against_the_published_document(fuzz_api):
    """An independent, schema-driven fuzzer over /openapi.json (only where schemathesis is installed)."""
    schemathesis = pytest.importorskip(
        "schemathesis",
        reason="schemathesis is not installed (optional; pip install schemathesis to run this)",
    )
    import requests
    from hypothesis import given as given_

    class Sign(requests.auth.AuthBase):
        """Every request signed as the plugin's client signs it (the path as its request line has it)."""

        def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
            body = r.body.encode() if isinstance(r.body, str) else r.body
            r.headers.update(signed_headers(TOKEN, str(r.method), r.path_url, body))
            return r

    url = f"{fuzz_api.coord.url}/openapi.json"
    signed = signed_headers(TOKEN, "GET", "/openapi.json")  # the document with the run's names
    if hasattr(schemathesis, "openapi") and hasattr(schemathesis.openapi, "from_url"):
        schema = schemathesis.openapi.from_url(url, headers=signed)
    else:  # schemathesis 3.x
        schema = schemathesis.from_uri(url, base_url=fuzz_api.coord.url, headers=signed)
    session = requests.Session()
    session.auth = Sign()
    from schemathesis.checks import not_a_server_error

    checks = [not_a_server_error]
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.endswith("/end"):
            continue  # ending queues would only make later commits 409
        operations += 1

        @settings(FUZZ, max_examples=15)
        @given_(case=operation.as_strategy())
        def run(case: Any) -> None:
            body = getattr(case, "body", None)
            if isinstance(body, dict):
                tame_waits(body)
            SENT["schemathesis"] += 1
            try:
                case.call_and_validate(session=session, checks=checks)
            except Exception as exc:  # collected, so every operation is tried
                # run() is called below, within this iteration: `operation` is this one
                failures.append(f"{operation.method.upper()} {operation.path}: {exc}"[:2000])  # noqa: B023
                raise

        try:
            run()
        except Exception:
            pass
        fuzz_api.alive()
    assert operations >= len(ROUTES) - 2  # all but /end (skipped) and the document itself
    assert not failures, "\n".join(failures[:5])


# --------------------------------------------------------------------------- the count, and a clean exit

FUZZ_TESTS = [
    "test_json_endpoints_refuse_bad_bodies_and_write_nothing",
    "test_path_parameters_and_methods_get_json_errors",
    "test_commit_frames_mutated_are_refused_whole_or_accepted_exactly",
    "test_items_with_misaligned_masks_or_log_probs_are_422_naming_key_and_field",
    "test_items_for_an_unknown_run_or_agent_are_rejected_and_never_queued",
    "test_missing_or_wrong_token_is_401_and_health_stays_open",
    "test_identity_headers_never_break_the_service",
    "test_body_over_the_size_limit_is_413_and_writes_nothing",
    "test_malformed_http_is_refused_and_the_service_stays_up",
]


def enough_requests_were_sent_and_the_server_exits_cleanly(api: Api) -> None:
    """The module's closing check (the `api` fixture's teardown): the server exits cleanly, and,
    when every fuzz test ran, they sent at least MIN_REQUESTS generated requests in all."""
    api.alive()
    coord = api.coord
    api.close()
    coord.stop()
    log = coord.log_tail(10_000)
    assert coord.proc is not None and coord.proc.returncode == 0, log[-3000:]
    assert "Traceback" not in log and "unexpected error" not in log, log[-3000:]
    ran = [name for name in FUZZ_TESTS if SENT[name]]
    total = sum(SENT.values())
    print(f"generated requests: {total} ({dict(SENT)})")
    if len(ran) < len(FUZZ_TESTS):
        # A selection (-k, a failed test's rerun): the count is the whole module's.
        print(
            f"only {len(ran)} of the {len(FUZZ_TESTS)} fuzz tests ran ({total} requests); the count needs all"
        )
        return
    assert total >= MIN_REQUESTS, dict(SENT)


def test_the_request_count_covers_every_fuzz_test():
    """The closing count adds up the tests named in FUZZ_TESTS: each must be a test of this module
    (a renamed test would otherwise turn the count off, as if it had not run)."""
    tests = {name for name, fn in globals().items() if name.startswith("test_") and callable(fn)}
    assert set(FUZZ_TESTS) <= tests, (
        f"FUZZ_TESTS names no test of this module: {sorted(set(FUZZ_TESTS) - tests)}"
    )
