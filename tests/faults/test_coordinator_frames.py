"""Frames built to cost the coordinator far more than their bytes, each sent with a valid token:

- tens of MiB of tiny items (one-token samples of ~93 bytes each, hundreds of thousands of them);
- tens of MiB of zero-row record batches (no item at all, each batch ~700 bytes);
- a schema message whose frame header is 64 MiB of JSON.

Each is refused with 413 naming the limit it crossed; the coordinator's peak RSS grows by at most
a small multiple of the bytes sent (the body must be held once; the frame must not be unpacked into
a Python object per item or per batch before the limits are checked); a /health call and an
authorised call made while the attack runs are both answered; nothing is written, and an honest
commit goes through afterwards.

Real coordinator processes on 127.0.0.1 (`_coord_procs`), real sockets; every request made with
that module's helper, which sends the credentials the coordinator expects.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from _coord_procs import CoordinatorProcess, error_of, make_items

from mrlx_lab.procstat import memory_mib
from mrlx_plugin.link.wire import (
    CONTENT_TYPE,
    END_OF_STREAM,
    SCHEMA,
    encode_items,
    frame_head,
    schema_with_header,
)

MIB = 1 << 20
# A probe must be answered within this while the attack runs: far more than an idle coordinator
# needs, far less than a coordinator whose event loop is held by one request's decoding.
PROBE_TIMEOUT_S = 10.0
# What the coordinator may grow by beyond twice the body it holds (the bytes themselves, read into
# a growing buffer): the Python and Arrow objects of a request within the limits, allocator slack.
FIXED_ALLOWANCE_MIB = 64
COMMIT = "/v1/runs/run1/queues/patient/commit"


def _list_column(n: int, values: pa.Array) -> pa.ListArray:
    return pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), values)


def tiny_items(target_bytes: int) -> bytes:
    """A valid frame of one-token samples (~93 bytes each), about `target_bytes` long."""
    n = target_bytes // 93
    columns = [
        pa.array([f"t{i}:patient" for i in range(n)], pa.string()),
        pa.array([f"g{i}" for i in range(n)], pa.string()),
        pa.array(np.ones(n, np.int32)),
        pa.array(["doctor"] * n, pa.string()),
        pa.array(np.zeros(n, np.int64)),
        pa.array(np.ones(n, np.int32)),
        _list_column(n, pa.array(np.ones(n, np.int32))),
        _list_column(n, pa.array(np.ones(n, np.uint8))),
        _list_column(n, pa.array(np.full(n, -0.5, np.float32))),
        pa.array(['{"reward":0}'] * n, pa.string()),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=schema_with_header(None))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def zero_row_batches(target_bytes: int) -> bytes:
    """A frame of empty record batches (valid Arrow, no item), as many as fit in `target_bytes`."""
    empty = pa.RecordBatch.from_arrays([pa.array([], f.type) for f in SCHEMA], schema=SCHEMA)
    message = empty.serialize().to_pybytes()
    return frame_head(None) + message * (target_bytes // len(message)) + END_OF_STREAM


def huge_header(target_bytes: int) -> bytes:
    """A frame of one valid item whose header (in the schema message) is `target_bytes` of JSON."""
    items = encode_items(make_items(1, "header-attack", start=900))
    schema_end = 8 + int.from_bytes(items[4:8], "little", signed=True)
    return frame_head({"pad": "x" * target_bytes}) + items[schema_end:]


ATTACKS: dict[str, tuple[Callable[[int], bytes], int, str]] = {
    # name: (frame builder, body size, what the refusal must name)
    "tiny items": (tiny_items, 21 * MIB, "items"),
    "zero-row batches": (zero_row_batches, 48 * MIB, "record batches"),
    "huge header": (huge_header, 64 * MIB, "schema message"),
}


def timed(call: Callable[[], tuple[int, dict[str, str], bytes]]) -> Callable[[], tuple[float, int, bytes]]:
    def run() -> tuple[float, int, bytes]:
        started = time.monotonic()
        status, _, body = call()
        return time.monotonic() - started, status, body

    return run


def queued(coord: CoordinatorProcess) -> int:
    status, _, body = coord.http("GET", "/v1/runs/run1/queues/patient")
    assert status == 200, body
    return json.loads(body)["queued_items"]


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_frame_built_to_unpack_costs_memory_in_proportion_to_its_bytes(tmp_path: Path, attack: str):
    build, size, named = ATTACKS[attack]
    frame = build(size)
    body_mib = len(frame) / MIB
    # the limit just above the frame: the attack is as large as the coordinator lets any request be
    coord = CoordinatorProcess(tmp_path, extra=["--max-request-mb", str(math.ceil(body_mib) + 1)]).start()
    headers = {"Content-Type": CONTENT_TYPE}
    try:
        assert coord.proc is not None
        warm = encode_items(make_items(2, "warm-up"))
        assert coord.http("POST", COMMIT, warm, headers=headers)[0] == 200
        rss_before, _ = memory_mib(coord.proc.pid)
        latencies: list[float] = []
        with ThreadPoolExecutor(3) as pool:
            sent = pool.submit(timed(lambda: coord.http("POST", COMMIT, frame, headers=headers)))
            while True:
                finished = sent.done()  # one more round of probes after the attack's answer
                probes = {
                    "/health": pool.submit(timed(lambda: coord.http("GET", "/health"))),
                    "an authorised call": pool.submit(timed(lambda: coord.http("GET", "/v1/runs/run1"))),
                }
                for what, probe in probes.items():
                    who = f"{attack}: {what}"
                    try:
                        took, status, body = probe.result(timeout=PROBE_TIMEOUT_S)
                    except FutureTimeout:
                        pytest.fail(f"{who} got no answer within {PROBE_TIMEOUT_S:g} s during the attack")
                    assert status == 200, f"{who} answered {status} during the attack: {body[:300]!r}"
                    latencies.append(took)
                if finished:
                    break
                wait([sent], timeout=0.2)  # probe again at once if the answer comes, else in 0.2 s
            took, status, body = sent.result(timeout=300)
        _, peak = memory_mib(coord.proc.pid)
        growth = peak - rss_before
        print(
            f"\n{attack}: {body_mib:.1f} MiB body -> {status} in {took:.2f} s; peak RSS +{growth:.0f} MiB "
            f"(from {rss_before:.0f}); {len(latencies)} probes, slowest {max(latencies):.2f} s"
        )
        bound = 2 * body_mib + FIXED_ALLOWANCE_MIB
        assert growth <= bound, (
            f"{attack}: peak RSS grew by {growth:.0f} MiB for a {body_mib:.1f} MiB body "
            f"(allowed: 2 x body + {FIXED_ALLOWANCE_MIB} MiB = {bound:.0f} MiB); answered {status}"
        )
        assert status == 413, f"{attack}: answered {status}, not 413: {body[:500]!r}"
        assert named in error_of(body), f"{attack}: the refusal does not name the {named}: {error_of(body)}"
        assert queued(coord) == 2, "a refused commit wrote items"
        honest = encode_items(make_items(2, "after", start=10))
        assert coord.http("POST", COMMIT, honest, headers=headers)[0] == 200
        assert queued(coord) == 4
    finally:
        coord.stop()
