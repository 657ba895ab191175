"""The coordinator's batch frame, and the `QueueItem` it carries.

A frame is an Apache Arrow IPC stream (`CONTENT_TYPE`): a schema message, record batch messages,
the end-of-stream marker. A producer sends one record batch per commit request, one row per item,
with the columns of `SCHEMA`: token ids as list<int32>, loss mask as list<uint8>, log-probs as
list<float32>, the small per-item values as scalars and the sample's other fields as one JSON
text. The frame header (lease id, groups, ...) is a JSON object in the schema's metadata.

The server stores each item as its own one-row record batch message and a lease answer is a
fresh schema message (with its header) followed by the stored messages unchanged: no array is
re-encoded on the way from producer to consumer, and any Arrow reader can read a lease answer.

Log-probs travel (and are stored) as float32: a consumer gets back the float32 value nearest to
what the producer sent, which is all the precision an importance ratio needs. Token ids travel as
int32 (every tokenizer vocabulary fits).
"""

from __future__ import annotations

import array
import struct
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict, TypeVar

import numpy as np
import orjson
import pyarrow as pa

from mrlx_plugin.core.values import JSONObject

WIRE_VERSION = 2
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
HEADER_KEY = b"mrlx.header"
VERSION_KEY = b"mrlx.wire"
# Every IPC message of a stream starts with this marker; a frame also ends with the marker and a
# zero length (end of stream).
CONTINUATION = b"\xff\xff\xff\xff"
END_OF_STREAM = CONTINUATION + b"\x00\x00\x00\x00"

MAX_KEY_CHARS = 256
MAX_GROUP_SIZE = 1 << 16
MAX_TOKENS_PER_ITEM = 1 << 24
SAMPLE_STATUSES = ("pending", "completed", "truncated", "aborted", "failed")

# The columns of a frame, in order; a frame with any other column, or one of another type, is refused.
SCHEMA = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("group", pa.string(), nullable=False),
        pa.field("group_size", pa.int32(), nullable=False),
        pa.field("producer", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),
        pa.field("response_length", pa.int32(), nullable=False),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("rollout_log_probs", pa.list_(pa.float32()), nullable=False),
        pa.field("fields", pa.string(), nullable=False),  # a JSON object
    ]
)
COLUMNS = tuple(SCHEMA.names)
# The keys of a scanned item's metadata (`RecordView.meta`).
META_KEYS = frozenset(
    {
        "key",
        "group",
        "group_size",
        "producer",
        "step",
        "n_tokens",
        "response_length",
        "n_log_probs",
        "n_loss_mask",
    }
)

# The lengths in a scanned item's metadata, each in [0, MAX_TOKENS_PER_ITEM].
_LENGTHS: tuple[Literal["n_tokens", "n_log_probs", "n_loss_mask", "response_length"], ...] = (
    "n_tokens",
    "n_log_probs",
    "n_loss_mask",
    "response_length",
)

# Sample attributes carried in `QueueItem.fields` (when the sample has them and they are not None).
SAMPLE_FIELDS = (
    "group_index",
    "index",
    "rollout_id",
    "prompt",
    "response",
    "label",
    "reward",
    "status",
    "weight_versions",
    "metadata",
    "remove_sample",
    "train_metadata",
)

T = TypeVar("T")

_LITTLE_ENDIAN = sys.byteorder == "little"
assert array.array("i").itemsize == 4 and array.array("f").itemsize == 4
# What pyarrow raises on bytes that are not a valid stream (ArrowInvalid, ArrowIOError, ...).
_ARROW_ERRORS = (pa.ArrowException, OSError, ValueError, EOFError, IndexError, struct.error)


class RecordMeta(TypedDict):
    """A scanned item's metadata (`RecordView.meta`): its scalars and its arrays' lengths."""

    key: str
    group: str
    group_size: int
    producer: str
    step: int
    n_tokens: int
    response_length: int
    n_log_probs: int
    n_loss_mask: int


class LeasedGroup(TypedDict):
    """One leased group as a lease answer's frame header lists it (`Lease.group_info`)."""

    group: str
    size: int
    step: int
    producer: str
    redelivered: bool


class _DeadLetterKeys(TypedDict):
    group: str
    size: int
    step: int | None
    reason: str


class DeadLetter(_DeadLetterKeys, total=False):
    """A group set aside (never delivered again), as a lease answer's frame header reports it."""

    producer: str | None


class WireError(ValueError):
    """A frame or an item in it is malformed; the message names the item key and the field."""


class FrameTooLarge(WireError):
    """A frame past the reader's `FrameLimits` (the coordinator answers 413)."""


@dataclass(frozen=True)
class FrameLimits:
    """What a reader takes of a frame, checked message by message while it reads, before any item is
    unpacked (None: no limit). A frame's arrays cost nothing to read (they are views of its bytes),
    but every message, batch and item costs Python and Arrow objects: a frame of tens of MiB made of
    tiny items, of empty batches or of one huge header would otherwise cost hundreds of MiB."""

    max_message_bytes: int | None = None  # the metadata of each message (the schema's holds the header)
    max_batches: int | None = None
    max_items: int | None = None


@dataclass(slots=True)
class QueueItem:
    """One training sample for the consumer agent, with its place in the queue.

    `key` is the idempotency key (`"{episode_id}:{agent}"`, unique per run); `group` the prompt group
    of the producer's step the episode came from, which will hold `group_size` items; `step` the
    producer's rollout id. `tokens` is the full sequence (prompt then response), `loss_mask` and
    `rollout_log_probs` have one entry per response token. `fields` holds the sample's scalar and
    JSON fields (reward, status, weight_versions, prompt, response, label, metadata, ...).
    The arrays may be lists, `array.array` or numpy arrays when encoding; decoding gives lists.
    """

    key: str
    group: str
    group_size: int
    producer: str
    step: int
    tokens: Sequence[int]
    response_length: int
    loss_mask: Sequence[int]
    rollout_log_probs: Sequence[float]
    fields: JSONObject = field(default_factory=dict)


@dataclass
class RecordView:
    """One item of a scanned frame: its metadata (see `META_KEYS`; no array decoded) and its row."""

    meta: RecordMeta
    batch: pa.RecordBatch
    row: int
    _record: pa.Buffer | None = None

    @property
    def key(self) -> str:
        return self.meta["key"]

    def fields(self) -> JSONObject:
        """The item's `fields`, parsed anew on each call (kept parsed, the fields of a request's
        items could cost many times their text: JSON of small values is many small objects)."""
        column = self.batch.column(9)
        _, offsets, data = column.buffers()
        start, end = np.frombuffer(offsets, dtype="<i4", count=2, offset=4 * (column.offset + self.row))
        text = memoryview(data or b"")[start:end]  # a view of the frame: the text is not copied
        where = f"item {self.meta['key']!r}"
        try:
            fields = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise WireError(f"{where}: 'fields' is not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise WireError(f"{where}: 'fields' must be a JSON object")
        return fields

    def record(self) -> pa.Buffer:
        """The item as a stored record: a one-row record batch message (its arrays copied once,
        on the first call)."""
        if self._record is None:
            self._record = self.batch.slice(self.row, 1).serialize()
        return self._record


@dataclass
class FrameView:
    header: JSONObject
    records: list[RecordView]


class BufferPool:
    """Reusable byte buffers for frames in flight.

    A fresh multi-megabyte buffer per request costs a page fault per 4 KB on first touch, which on
    some machines takes longer than copying the data into it; reusing a few buffers avoids that.
    Thread-safe. Buffers above `max_bytes` are not kept.
    """

    def __init__(self, keep: int = 4, max_bytes: int = 64 << 20) -> None:
        self.keep = keep
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A buffer of at least `size` bytes (its content is garbage)."""
        buf = self.take_existing(size)
        return bytearray(size) if buf is None else buf

    def take_existing(self, size: int) -> bytearray | None:
        """A kept buffer of at least `size` bytes, or None: allocates nothing (for a size that a
        peer declared but whose bytes have not arrived)."""
        with self._lock:
            fitting = [buf for buf in self._free if len(buf) >= size]
            if not fitting:
                return None
            buf = min(fitting, key=len)
            self._free.remove(buf)
            return buf

    def give(self, buf: bytearray) -> None:
        """Hand a buffer back once nothing reads it any more."""
        if len(buf) > self.max_bytes:
            return
        with self._lock:
            self._free.append(buf)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=len))


# --------------------------------------------------------------------------- encoding


def _pack(values: Sequence[float], code: str, dtype: str, out: np.ndarray, offset: int, count: int) -> None:
    """Write `count` int32 (`code` "i") or float32 ("f") values into `out[offset:]`.

    Lists go through struct, about twice as fast as numpy at converting Python numbers, and
    range-checked; numpy arrays and matching array.arrays are copied as memory.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"expected a 1-D array, got shape {values.shape}")
        if code == "i":
            if values.dtype.kind not in "iub":
                raise TypeError(f"expected integer ids, got dtype {values.dtype}")
            if count and (int(values.min()) < -(1 << 31) or int(values.max()) >= 1 << 31):
                raise OverflowError("an id does not fit in int32")
        out[offset : offset + count] = values
    elif isinstance(values, array.array) and values.typecode == code and _LITTLE_ENDIAN:
        out[offset : offset + count] = np.frombuffer(values, dtype=dtype)
    elif count:
        struct.pack_into(f"<{count}{code}", out, offset * 4, *values)


def _mask_bytes(values: Sequence[int]) -> bytes:
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, dtype=np.uint8).tobytes()
    return bytes(values)


def _list_array(lengths: list[int], values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def schema_with_header(header: Mapping[str, object] | None) -> pa.Schema:
    return SCHEMA.with_metadata(
        {VERSION_KEY: str(WIRE_VERSION).encode(), HEADER_KEY: orjson.dumps(header or {})}
    )


def items_batch(items: Sequence[QueueItem], header: Mapping[str, object] | None = None) -> pa.RecordBatch:
    """The record batch of `items` (one row each). Does not check the samples' consistency (the
    server does, and names the item); fails only when a value cannot be packed at all (an id
    beyond int32, a mask value beyond a byte, a field that is not JSON)."""
    n_tokens = [len(item.tokens) if item.tokens is not None else 0 for item in items]
    n_log_probs = [len(item.rollout_log_probs) if item.rollout_log_probs is not None else 0 for item in items]
    tokens = np.empty(sum(n_tokens), dtype="<i4")
    log_probs = np.empty(sum(n_log_probs), dtype="<f4")
    masks, fields = [], []
    t_at = l_at = 0
    for item, n_tok, n_lp in zip(items, n_tokens, n_log_probs):
        try:
            _pack(item.tokens if item.tokens is not None else (), "i", "<i4", tokens, t_at, n_tok)
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise WireError(f"item {item.key!r}: tokens cannot be packed as int32 ids ({exc})") from None
        try:
            _pack(
                item.rollout_log_probs if item.rollout_log_probs is not None else (),
                "f",
                "<f4",
                log_probs,
                l_at,
                n_lp,
            )
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise WireError(
                f"item {item.key!r}: rollout_log_probs cannot be packed as float32 ({exc})"
            ) from None
        try:
            masks.append(_mask_bytes(item.loss_mask if item.loss_mask is not None else ()))
        except (OverflowError, TypeError, ValueError) as exc:
            raise WireError(f"item {item.key!r}: loss_mask must hold 0/1 integers ({exc})") from None
        try:
            fields.append(orjson.dumps(item.fields if item.fields is not None else {}).decode())
        except TypeError as exc:
            raise WireError(f"item {item.key!r}: fields are not JSON-serialisable ({exc})") from None
        t_at, l_at = t_at + n_tok, l_at + n_lp
    try:
        scalars = [
            pa.array([item.key for item in items], pa.string()),
            pa.array([item.group for item in items], pa.string()),
            pa.array([item.group_size for item in items], pa.int32()),
            pa.array([item.producer for item in items], pa.string()),
            pa.array([item.step for item in items], pa.int64()),
            pa.array([item.response_length for item in items], pa.int32()),
        ]
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
        raise WireError(
            f"an item's key, group, group_size, producer, step or response_length has the wrong type ({exc})"
        ) from None
    columns = [
        *scalars,
        _list_array(n_tokens, tokens),
        _list_array([len(m) for m in masks], np.frombuffer(b"".join(masks), dtype=np.uint8)),
        _list_array(n_log_probs, log_probs),
        pa.array(fields, pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=schema_with_header(header))


def encode_items_into(
    items: Iterable[QueueItem], pool: BufferPool | None = None, header: Mapping[str, object] | None = None
) -> tuple[bytearray, memoryview]:
    """Encode a frame into a buffer (from `pool` when given); returns (buffer, view of the frame).

    Give the buffer back to the pool once the view has been sent. Fails as `items_batch` does.
    """
    items = list(items)
    schema = schema_with_header(header)
    batch = items_batch(items, header) if items else None
    size = len(schema.serialize()) + len(END_OF_STREAM)
    if batch is not None:
        size += pa.ipc.get_record_batch_size(batch)
    buf = pool.take(size) if pool is not None else bytearray(size)
    try:
        sink = pa.FixedSizeBufferWriter(pa.py_buffer(buf))
        with pa.ipc.new_stream(sink, schema) as writer:
            if batch is not None:
                writer.write_batch(batch)
        used = sink.tell()
    except BaseException:
        if pool is not None:
            pool.give(buf)
        raise
    return buf, memoryview(buf)[:used]


def encode_items(items: Iterable[QueueItem], header: Mapping[str, object] | None = None) -> bytes:
    """A frame holding `items` (see the module docstring)."""
    _, view = encode_items_into(items, None, header)
    return bytes(view)


def frame_head(header: Mapping[str, object] | None = None) -> bytes:
    """The start of a frame (its schema message, carrying `header`), for stored records after it;
    the frame ends with `END_OF_STREAM`."""
    return schema_with_header(header).serialize().to_pybytes()


def encode_frame(
    records: Sequence[bytes | bytearray | memoryview], header: Mapping[str, object] | None = None
) -> bytes:
    """A frame around stored item records."""
    return b"".join((frame_head(header), *records, END_OF_STREAM))


# --------------------------------------------------------------------------- reading


def _body_compressed(metadata: pa.Buffer) -> bool:
    """Whether a record batch message declares a compressed body (Message.header ->
    RecordBatch.compression in Arrow's flatbuffer metadata). Arrow decompresses on read into
    buffers as large as the sender claims, so a compressed frame could unpack far past the size
    limit; the client never compresses, and the server refuses such frames before reading them."""
    meta = memoryview(metadata)

    def u32(pos: int) -> int:
        if pos < 0 or pos + 4 > len(meta):
            raise WireError("a record batch message has malformed metadata")
        return struct.unpack_from("<I", meta, pos)[0]

    def table_field(table: int, slot: int) -> int | None:
        vtable = table - struct.unpack_from("<i", meta, table)[0] if 0 <= table <= len(meta) - 4 else -1
        if vtable < 0 or vtable + 4 > len(meta):
            raise WireError("a record batch message has malformed metadata")
        vtable_size = struct.unpack_from("<H", meta, vtable)[0]
        at = 4 + 2 * slot
        if at + 2 > vtable_size or vtable + at + 2 > len(meta):
            return None
        offset = struct.unpack_from("<H", meta, vtable + at)[0]
        return table + offset if offset else None

    header = table_field(u32(0), 2)  # Message: version, header_type, header, bodyLength, custom_metadata
    if header is None:
        return False
    # RecordBatch: length, nodes, buffers, compression
    return table_field(header + u32(header), 3) is not None


def _check_schema(schema: pa.Schema) -> JSONObject:
    """The frame header of a frame's schema; `WireError` unless its columns are exactly `SCHEMA`'s."""
    names = schema.names
    unknown = [name for name in names if name not in COLUMNS]
    if unknown:
        raise WireError(f"frame has unknown columns {unknown}; the columns are {list(COLUMNS)}")
    missing = [name for name in COLUMNS if name not in names]
    if missing:
        raise WireError(f"frame lacks the columns {missing}; the columns are {list(COLUMNS)}")
    if names != list(COLUMNS):
        raise WireError(f"frame columns are {names}; they must come in the order {list(COLUMNS)}")
    for got, want in zip(schema, SCHEMA):
        if got.type != want.type:
            raise WireError(f"column {got.name!r} is {got.type}, expected {want.type}")
    metadata = schema.metadata or {}
    version = metadata.get(VERSION_KEY)
    if version != str(WIRE_VERSION).encode():
        raise WireError(
            f"frame wire version {version!r} is not supported (this coordinator speaks {WIRE_VERSION})"
        )
    try:
        header = orjson.loads(metadata.get(HEADER_KEY, b"{}"))
    except orjson.JSONDecodeError as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    return header


def read_frame(
    buf: bytes | bytearray | memoryview, limits: FrameLimits | None = None
) -> tuple[JSONObject, list[pa.RecordBatch]]:
    """The header and record batches of a frame, checked as an Arrow stream of `SCHEMA`
    (uncompressed, no dictionaries, ending with the end-of-stream marker and nothing after it,
    every array valid); raises `WireError`, `FrameTooLarge` past `limits` (checked message by
    message: the schema message's size before it is parsed, each batch's before it is checked).
    Arrays are views of `buf` (nothing is copied)."""
    view = memoryview(buf).cast("B")
    total = len(view)
    if total < 8 or bytes(view[:4]) != CONTINUATION:
        raise WireError(
            f"not a coordinator frame: it starts with {bytes(view[:4])!r}, not the Arrow IPC stream "
            f"magic {CONTINUATION!r} (send an Arrow IPC stream, Content-Type {CONTENT_TYPE})"
        )
    if bytes(view[total - 8 :]) != END_OF_STREAM:
        raise WireError("frame does not end with the Arrow end-of-stream marker (cut short?)")
    limits = limits or FrameLimits()
    most_bytes = limits.max_message_bytes
    declared = struct.unpack_from("<i", view, 4)[0]  # the schema message's metadata, header included
    if most_bytes is not None and most_bytes < declared <= total - 8:
        raise FrameTooLarge(
            f"the frame's schema message (which carries the frame header) is {declared} bytes; at most "
            f"{most_bytes} are accepted: keep the frame header small"
        )
    source = pa.BufferReader(pa.py_buffer(view))
    batches: list[pa.RecordBatch] = []
    items = 0
    try:
        reader = pa.ipc.MessageReader.open_stream(source)
        first = reader.read_next_message()
        if first.type != "schema":
            raise WireError(f"frame starts with a {first.type} message, not a schema")
        schema = pa.ipc.read_schema(first)
        header = _check_schema(schema)
        while True:
            try:
                message = reader.read_next_message()
            except StopIteration:
                break
            if message.type != "record batch":
                raise WireError(
                    f"frame holds a {message.type} message; only record batches may follow the schema"
                )
            if limits.max_batches is not None and len(batches) >= limits.max_batches:
                raise FrameTooLarge(
                    f"frame holds more than {limits.max_batches} record batches; send the items in fewer "
                    "batches (one is enough)"
                )
            if most_bytes is not None and message.metadata.size > most_bytes:
                raise FrameTooLarge(
                    f"record batch {len(batches)} of the frame has {message.metadata.size} bytes of "
                    f"metadata; at most {most_bytes} are accepted"
                )
            if _body_compressed(message.metadata):
                raise WireError("frame holds a compressed record batch; send it uncompressed")
            batch = pa.ipc.read_record_batch(message, schema)  # views of the body: no array is read yet
            items += batch.num_rows
            if limits.max_items is not None and items > limits.max_items:
                raise FrameTooLarge(
                    f"frame holds more than {limits.max_items} items (at least {items}); commit them in "
                    f"requests of at most {limits.max_items} items"
                )
            batch.validate(full=True)
            batches.append(batch)
    except WireError:
        raise
    except StopIteration:
        raise WireError("frame holds no schema message") from None
    except _ARROW_ERRORS as exc:
        raise WireError(f"frame is not a valid Arrow IPC stream: {str(exc).strip()[:300]}") from None
    if source.tell() != total:
        raise WireError(f"frame has {total - source.tell()} bytes after its end-of-stream marker")
    return header, batches


def _lengths(column: pa.ListArray) -> np.ndarray:
    return np.diff(column.offsets.to_numpy()).astype(np.int64)


def scan_frame(buf: bytes | bytearray | memoryview, limits: FrameLimits | None = None) -> FrameView:
    """Read a frame and every item's metadata without converting any array to Python values;
    checks the structure, `limits` (before any item is unpacked), the metadata's types and ranges,
    and that no value is null. The samples themselves, their `fields` included, are checked by
    `item_checks.validate_record` (or `validate_frame`)."""
    header, batches = read_frame(buf, limits)
    records: list[RecordView] = []
    for batch in batches:
        for column in batch.columns:
            if column.null_count or (isinstance(column, pa.ListArray) and column.flatten().null_count):
                raise WireError(
                    f"column {batch.schema.field(batch.columns.index(column)).name!r} holds a null"
                )
        keys = batch.column(0).to_pylist()
        groups = batch.column(1).to_pylist()
        sizes = batch.column(2).to_pylist()
        producers = batch.column(3).to_pylist()
        steps = batch.column(4).to_pylist()
        responses = batch.column(5).to_pylist()
        n_tokens, n_mask, n_log_probs = (_lengths(batch.column(i)).tolist() for i in (6, 7, 8))
        for row, key in enumerate(keys):
            position = len(records)
            if not 0 < len(key) <= MAX_KEY_CHARS:
                raise WireError(
                    f"record {position}: 'key' must be a non-empty string of at most {MAX_KEY_CHARS} "
                    "characters"
                )
            where = f"item {key!r}"
            for name, value in (("group", groups[row]), ("producer", producers[row])):
                if not 0 < len(value) <= MAX_KEY_CHARS:
                    raise WireError(
                        f"{where}: {name!r} must be a non-empty string of at most {MAX_KEY_CHARS} characters"
                    )
            if not 1 <= sizes[row] <= MAX_GROUP_SIZE:
                raise WireError(
                    f"{where}: 'group_size' must be an integer in [1, {MAX_GROUP_SIZE}], got {sizes[row]!r}"
                )
            if steps[row] < 0:
                raise WireError(f"{where}: 'step' must be a non-negative integer, got {steps[row]!r}")
            meta: RecordMeta = {
                "key": key,
                "group": groups[row],
                "group_size": sizes[row],
                "producer": producers[row],
                "step": steps[row],
                "n_tokens": n_tokens[row],
                "response_length": responses[row],
                "n_log_probs": n_log_probs[row],
                "n_loss_mask": n_mask[row],
            }
            for name in _LENGTHS:
                if not 0 <= meta[name] <= MAX_TOKENS_PER_ITEM:
                    raise WireError(
                        f"{where}: {name!r} must be an integer in [0, {MAX_TOKENS_PER_ITEM}], got "
                        f"{meta[name]!r}"
                    )
            records.append(RecordView(meta, batch, row))
    return FrameView(header, records)


def _decode_batch(batch: pa.RecordBatch, out: list[QueueItem]) -> None:
    keys, groups, sizes, producers, steps, responses = (batch.column(i).to_pylist() for i in range(6))
    fields = batch.column(9).to_pylist()
    tokens_col, mask_col, log_probs_col = batch.column(6), batch.column(7), batch.column(8)
    tok_off, tok_values = tokens_col.offsets.to_numpy(), tokens_col.values.to_numpy()
    mask_off, mask_values = mask_col.offsets.to_numpy(), mask_col.values.to_numpy()
    lp_off, lp_values = log_probs_col.offsets.to_numpy(), log_probs_col.values.to_numpy()
    for row, key in enumerate(keys):
        out.append(
            QueueItem(
                key=key,
                group=groups[row],
                group_size=sizes[row],
                producer=producers[row],
                step=steps[row],
                tokens=_int_list(tok_values[tok_off[row] : tok_off[row + 1]]),
                response_length=responses[row],
                loss_mask=mask_values[mask_off[row] : mask_off[row + 1]].tolist(),
                rollout_log_probs=lp_values[lp_off[row] : lp_off[row + 1]].tolist(),
                fields=orjson.loads(fields[row]),
            )
        )


# Token ids come back as Python ints taken from one shared table (ints are immutable, so sharing
# is invisible): a decoded token list then costs 8 bytes per id instead of 40, and no allocation
# per id. The table grows to the largest id seen, up to _MAX_SHARED_INT; larger ids get fresh ints.
_MAX_SHARED_INT = 1 << 20
_shared_ints: np.ndarray = np.arange(0, dtype=np.int64).astype(object)
_shared_ints_lock = threading.Lock()


def _int_list(ids: np.ndarray) -> list[int]:
    global _shared_ints
    if ids.size == 0:
        return []
    high = int(ids.max())
    if int(ids.min()) < 0 or high >= _MAX_SHARED_INT:
        return ids.tolist()
    table = _shared_ints
    if high >= len(table):
        with _shared_ints_lock:
            table = _shared_ints
            if high >= len(table):
                size = min(_MAX_SHARED_INT, max(1 << 16, 1 << high.bit_length()))
                table = np.arange(size, dtype=np.int64).astype(object)
                _shared_ints = table
    return table.take(ids).tolist()


def decode_frame(buf: bytes | bytearray | memoryview) -> tuple[JSONObject, list[QueueItem]]:
    """The frame header and the items of a frame, arrays as Python lists (token ids int,
    log-probs float); the items hold no reference to `buf`."""
    header, batches = read_frame(buf)
    items: list[QueueItem] = []
    for batch in batches:
        _decode_batch(batch, items)
    return header, items


def as_list(values: Sequence[T]) -> list[T]:
    if isinstance(values, list):
        return values
    if isinstance(values, np.ndarray):
        return values.tolist()
    return list(values)
