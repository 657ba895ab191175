"""The coordinator's binary batch frame, and the `QueueItem` it carries.

A training sample is mostly three long arrays (token ids, loss mask, log-probs). Encoding them as
JSON costs more than everything else on the path, so a frame carries them packed, little-endian,
and only the small per-item metadata travels as JSON. The server stores each item's record exactly
as it arrived and a lease sends the stored records back unchanged: no array is re-encoded between
producer and consumer.

Frame (all integers little-endian; every section starts on a 4-byte boundary, so the consumer's
array views are aligned):

    offset  size  what
    0       4     magic b"MRLX"
    4       2     wire version (1)
    6       2     flags (0, reserved)
    8       4     number of item records
    12      4     header length H (bytes, multiple of 4)
    16      H     frame header: a UTF-8 JSON object padded with spaces (lease id, groups, ...)
    then, per item record:
            4     metadata length M (multiple of 4)
            4     payload length P (multiple of 4)
            M     item metadata: a UTF-8 JSON object padded with spaces (see `META_KEYS`)
            P     int32 token ids [n_tokens] | float32 log-probs [n_log_probs]
                  | uint8 loss mask [n_loss_mask] | zero padding to a multiple of 4

Log-probs travel (and are stored) as float32: a consumer gets back the float32 value nearest to
what the producer sent, which is all the precision an importance ratio needs. Token ids travel as
int32 (every tokenizer vocabulary fits).
"""

from __future__ import annotations

import array
import math
import os
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

MAGIC = b"MRLX"
WIRE_VERSION = 1
FRAME_HEAD = struct.Struct("<4sHHII")
RECORD_HEAD = struct.Struct("<II")
CONTENT_TYPE = "application/x-mrlx-frame"

# Log-probs must be <= 0; a sampler's float arithmetic can land a hair above zero for a token of
# probability ~1, so values up to this epsilon are accepted as they are (not clamped).
LOG_PROB_EPSILON = 1e-3
MAX_KEY_CHARS = 256
MAX_GROUP_SIZE = 1 << 16
MAX_TOKENS_PER_ITEM = 1 << 24
SAMPLE_STATUSES = ("pending", "completed", "truncated", "aborted", "failed")

# The keys of an item's metadata JSON, all required; any other key is an error.
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
        "fields",
    }
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

_LITTLE_ENDIAN = sys.byteorder == "little"
assert array.array("i").itemsize == 4 and array.array("f").itemsize == 4


class WireError(ValueError):
    """A frame or an item in it is malformed; the message names the item key and the field."""


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
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordView:
    """Where one item record lies in a frame, with its parsed metadata (no array decoded)."""

    meta: dict[str, Any]
    start: int  # first byte of the record (its record head)
    end: int  # one past its last byte
    payload_start: int

    @property
    def key(self) -> str:
        return self.meta["key"]


@dataclass
class FrameView:
    header: dict[str, Any]
    records: list[RecordView]


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _padded_json(obj: Any) -> bytes:
    raw = orjson.dumps(obj)
    extra = _pad4(len(raw)) - len(raw)
    return raw + b" " * extra if extra else raw


def _mask_bytes(values: Any) -> bytes:
    if isinstance(values, np.ndarray):
        return np.ascontiguousarray(values, dtype=np.uint8).tobytes()
    return bytes(values)


def _write_array(values: Any, code: str, dtype: str, buf: bytearray, offset: int, count: int) -> None:
    """Pack `count` int32 (`code` "i") or float32 ("f") values, little-endian, into `buf` at `offset`.

    Lists go through struct, about twice as fast as array.array or numpy at converting Python
    numbers, and range-checked; numpy arrays and matching array.arrays are copied as memory.
    """
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"expected a 1-D array, got shape {values.shape}")
        if code == "i":
            if values.dtype.kind not in "iub":
                raise TypeError(f"expected integer ids, got dtype {values.dtype}")
            if count and (int(values.min()) < -(1 << 31) or int(values.max()) >= 1 << 31):
                raise OverflowError("an id does not fit in int32")
        np.frombuffer(buf, dtype=dtype, count=count, offset=offset)[...] = values
    elif isinstance(values, array.array) and values.typecode == code and _LITTLE_ENDIAN:
        memoryview(buf)[offset : offset + 4 * count] = memoryview(values).cast("B")
    else:
        struct.pack_into(f"<{count}{code}", buf, offset, *values)


@dataclass
class _RecordPlan:
    """One item measured for encoding: its metadata JSON and where its arrays come from."""

    item: QueueItem
    meta: bytes
    n_tokens: int
    n_log_probs: int
    mask: bytes

    @property
    def payload_size(self) -> int:
        return _pad4(4 * self.n_tokens + 4 * self.n_log_probs + len(self.mask))

    @property
    def size(self) -> int:
        return RECORD_HEAD.size + len(self.meta) + self.payload_size

    def write_into(self, buf: bytearray, offset: int) -> int:
        """Write the record at `offset`; returns the offset after it."""
        item = self.item
        RECORD_HEAD.pack_into(buf, offset, len(self.meta), self.payload_size)
        offset += RECORD_HEAD.size
        buf[offset : offset + len(self.meta)] = self.meta
        offset += len(self.meta)
        try:
            _write_array(
                item.tokens if item.tokens is not None else (), "i", "<i4", buf, offset, self.n_tokens
            )
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise WireError(f"item {item.key!r}: tokens cannot be packed as int32 ids ({exc})") from None
        offset += 4 * self.n_tokens
        log_probs = item.rollout_log_probs if item.rollout_log_probs is not None else ()
        try:
            _write_array(log_probs, "f", "<f4", buf, offset, self.n_log_probs)
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise WireError(
                f"item {item.key!r}: rollout_log_probs cannot be packed as float32 ({exc})"
            ) from None
        offset += 4 * self.n_log_probs
        end = offset + self.payload_size - 4 * (self.n_tokens + self.n_log_probs)
        buf[offset : offset + len(self.mask)] = self.mask
        buf[offset + len(self.mask) : end] = bytes(end - offset - len(self.mask))
        return end


def _plan_record(item: QueueItem) -> _RecordPlan:
    tokens = item.tokens if item.tokens is not None else ()
    log_probs = item.rollout_log_probs if item.rollout_log_probs is not None else ()
    mask = item.loss_mask if item.loss_mask is not None else ()
    try:
        mask_bytes = _mask_bytes(mask)
    except (OverflowError, TypeError, ValueError) as exc:
        raise WireError(f"item {item.key!r}: loss_mask must hold 0/1 integers ({exc})") from None
    meta = {
        "key": item.key,
        "group": item.group,
        "group_size": item.group_size,
        "producer": item.producer,
        "step": item.step,
        "n_tokens": len(tokens),
        "response_length": item.response_length,
        "n_log_probs": len(log_probs),
        "n_loss_mask": len(mask_bytes),
        "fields": item.fields if item.fields is not None else {},
    }
    try:
        meta_bytes = _padded_json(meta)
    except TypeError as exc:
        raise WireError(f"item {item.key!r}: metadata or fields are not JSON-serialisable ({exc})") from None
    return _RecordPlan(item, meta_bytes, len(tokens), len(log_probs), mask_bytes)


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


def encode_items_into(
    items: Iterable[QueueItem], pool: BufferPool | None = None, header: dict[str, Any] | None = None
) -> tuple[bytearray, memoryview]:
    """Encode a frame into a buffer (from `pool` when given); returns (buffer, view of the frame).

    Give the buffer back to the pool once the view has been sent. Does not check the samples'
    consistency (the server does, and names the item); fails only when a value cannot be packed
    at all (an id beyond int32, a mask value beyond a byte, a field that is not JSON).
    """
    plans = [_plan_record(item) for item in items]
    header_bytes = _padded_json(header or {})
    total = FRAME_HEAD.size + len(header_bytes) + sum(plan.size for plan in plans)
    buf = pool.take(total) if pool is not None else bytearray(total)
    try:
        FRAME_HEAD.pack_into(buf, 0, MAGIC, WIRE_VERSION, 0, len(plans), len(header_bytes))
        offset = FRAME_HEAD.size
        buf[offset : offset + len(header_bytes)] = header_bytes
        offset += len(header_bytes)
        for plan in plans:
            offset = plan.write_into(buf, offset)
    except BaseException:
        if pool is not None:
            pool.give(buf)
        raise
    return buf, memoryview(buf)[:total]


def encode_items(items: Iterable[QueueItem], header: dict[str, Any] | None = None) -> bytes:
    """A frame holding `items` (see the module docstring for the layout)."""
    buf, view = encode_items_into(items, None, header)
    return bytes(view) if len(view) != len(buf) else bytes(buf)


def frame_head(count: int, header: dict[str, Any] | None = None) -> bytes:
    """The head of a frame of `count` records (frame head and header), for writing records after it."""
    header_bytes = _padded_json(header or {})
    return FRAME_HEAD.pack(MAGIC, WIRE_VERSION, 0, count, len(header_bytes)) + header_bytes


def encode_frame(
    records: Sequence[bytes | bytearray | memoryview], header: dict[str, Any] | None = None
) -> bytes:
    """A frame around already encoded (or stored) item records."""
    return b"".join((frame_head(len(records), header), *records))


def scan_frame(buf: bytes | bytearray | memoryview) -> FrameView:
    """Parse a frame's structure and every item's metadata without decoding any array.

    Checks the framing (magic, version, lengths) and the metadata keys and types, and that each
    payload is exactly as long as its metadata says; raises `WireError` otherwise. The values in
    the arrays are checked by `validate_record`.
    """
    view = memoryview(buf)
    total = len(view)
    if total < FRAME_HEAD.size:
        raise WireError(f"frame too short: {total} bytes, a frame starts with a {FRAME_HEAD.size}-byte head")
    magic, version, _flags, count, header_len = FRAME_HEAD.unpack_from(view, 0)
    if magic != MAGIC:
        raise WireError(f"not a coordinator frame: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != WIRE_VERSION:
        raise WireError(
            f"frame wire version {version} is not supported (this coordinator speaks {WIRE_VERSION})"
        )
    offset = FRAME_HEAD.size
    if header_len % 4 or offset + header_len > total:
        raise WireError(f"frame header length {header_len} is not a multiple of 4 or runs past the frame")
    try:
        header = orjson.loads(view[offset : offset + header_len]) if header_len else {}
    except orjson.JSONDecodeError as exc:
        raise WireError(f"frame header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("frame header must be a JSON object")
    offset += header_len
    records: list[RecordView] = []
    for position in range(count):
        if offset + RECORD_HEAD.size > total:
            raise WireError(f"frame ends inside record {position}: it announces {count} records")
        meta_len, payload_len = RECORD_HEAD.unpack_from(view, offset)
        meta_start = offset + RECORD_HEAD.size
        payload_start = meta_start + meta_len
        end = payload_start + payload_len
        if meta_len % 4 or payload_len % 4 or end > total:
            raise WireError(
                f"record {position}: lengths ({meta_len}, {payload_len}) are not multiples of 4 or run past the frame"
            )
        try:
            meta = orjson.loads(view[meta_start:payload_start])
        except orjson.JSONDecodeError as exc:
            raise WireError(f"record {position}: metadata is not JSON: {exc}") from None
        _check_meta(meta, position, payload_len)
        records.append(RecordView(meta, offset, end, payload_start))
        offset = end
    if offset != total:
        raise WireError(f"frame has {total - offset} bytes after its {count} records")
    return FrameView(header, records)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_meta(meta: Any, position: int, payload_len: int) -> None:
    if not isinstance(meta, dict):
        raise WireError(f"record {position}: metadata must be a JSON object")
    key = meta.get("key")
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        raise WireError(
            f"record {position}: 'key' must be a non-empty string of at most {MAX_KEY_CHARS} characters"
        )
    where = f"item {key!r}"
    unknown = meta.keys() - META_KEYS
    if unknown:
        raise WireError(f"{where}: unknown metadata keys {sorted(unknown)}; allowed are {sorted(META_KEYS)}")
    missing = META_KEYS - meta.keys()
    if missing:
        raise WireError(f"{where}: missing metadata keys {sorted(missing)}")
    for name in ("group", "producer"):
        value = meta[name]
        if not isinstance(value, str) or not 0 < len(value) <= MAX_KEY_CHARS:
            raise WireError(
                f"{where}: {name!r} must be a non-empty string of at most {MAX_KEY_CHARS} characters"
            )
    group_size = meta["group_size"]
    if not _is_int(group_size) or not 1 <= group_size <= MAX_GROUP_SIZE:
        raise WireError(
            f"{where}: 'group_size' must be an integer in [1, {MAX_GROUP_SIZE}], got {group_size!r}"
        )
    step = meta["step"]
    if not _is_int(step) or step < 0:
        raise WireError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    for name in ("n_tokens", "n_log_probs", "n_loss_mask", "response_length"):
        if not _is_int(meta[name]) or not 0 <= meta[name] <= MAX_TOKENS_PER_ITEM:
            raise WireError(
                f"{where}: {name!r} must be an integer in [0, {MAX_TOKENS_PER_ITEM}], got {meta[name]!r}"
            )
    if not isinstance(meta["fields"], dict):
        raise WireError(f"{where}: 'fields' must be a JSON object")
    needed = _pad4(4 * meta["n_tokens"] + 4 * meta["n_log_probs"] + meta["n_loss_mask"])
    if needed != payload_len:
        raise WireError(
            f"{where}: payload is {payload_len} bytes but n_tokens={meta['n_tokens']}, "
            f"n_log_probs={meta['n_log_probs']}, n_loss_mask={meta['n_loss_mask']} need {needed}"
        )


def validate_record(buf: bytes | bytearray | memoryview, record: RecordView) -> None:
    """Check one scanned item as a training sample; raises `WireError` naming the key and field.

    Rules: 0 < response_length <= len(tokens); one loss-mask value (0 or 1) and one log-prob
    (finite, <= LOG_PROB_EPSILON) per response token; token ids >= 0; `fields.reward` a finite
    number (or a JSON object, for hosts that pick a reward key); known sample fields of the right type.
    """
    meta = record.meta
    where = f"item {meta['key']!r}"
    n_tokens = meta["n_tokens"]
    response_length = meta["response_length"]
    if not 0 < response_length <= n_tokens:
        raise WireError(
            f"{where}: response_length must be in [1, len(tokens)={n_tokens}], got {response_length}"
        )
    if meta["n_loss_mask"] != response_length:
        raise WireError(
            f"{where}: loss_mask has {meta['n_loss_mask']} entries but response_length is {response_length}"
            " (one 0/1 per response token)"
        )
    if meta["n_log_probs"] != response_length:
        raise WireError(
            f"{where}: rollout_log_probs has {meta['n_log_probs']} entries but response_length is "
            f"{response_length} (one log-prob per response token)"
        )
    offset = record.payload_start
    tokens = np.frombuffer(buf, dtype="<i4", count=n_tokens, offset=offset)
    if tokens.min() < 0:
        raise WireError(f"{where}: tokens hold a negative id ({int(tokens.min())})")
    offset += 4 * n_tokens
    log_probs = np.frombuffer(buf, dtype="<f4", count=response_length, offset=offset)
    if not np.isfinite(log_probs).all():
        raise WireError(f"{where}: rollout_log_probs hold a NaN or infinite value")
    if log_probs.max() > LOG_PROB_EPSILON:
        raise WireError(
            f"{where}: rollout_log_probs hold a positive value ({float(log_probs.max())}); log-probs are <= 0"
        )
    offset += 4 * response_length
    mask = np.frombuffer(buf, dtype=np.uint8, count=response_length, offset=offset)
    if mask.max() > 1:
        raise WireError(f"{where}: loss_mask holds {int(mask.max())}; only 0 and 1 are allowed")
    _check_fields(meta["fields"], where)


def _check_fields(fields: dict[str, Any], where: str) -> None:
    if "reward" not in fields:
        raise WireError(f"{where}: fields.reward is missing; samples are queued once their reward is known")
    reward = fields["reward"]
    if isinstance(reward, bool) or not (
        (isinstance(reward, (int, float)) and math.isfinite(reward)) or isinstance(reward, dict)
    ):
        raise WireError(
            f"{where}: fields.reward must be a finite number (or a JSON object), got {reward!r}"
            " (NaN and infinity arrive as null)"
        )
    status = fields.get("status")
    if status is not None and status not in SAMPLE_STATUSES:
        raise WireError(f"{where}: fields.status must be one of {list(SAMPLE_STATUSES)}, got {status!r}")
    versions = fields.get("weight_versions")
    if versions is not None and not (
        isinstance(versions, list) and all(isinstance(v, str) for v in versions)
    ):
        raise WireError(f"{where}: fields.weight_versions must be a list of strings")
    for name in ("group_index", "index", "rollout_id"):
        value = fields.get(name)
        if value is not None and not _is_int(value):
            raise WireError(f"{where}: fields.{name} must be an integer or null, got {value!r}")
    prompt = fields.get("prompt")
    if prompt is not None and not isinstance(prompt, (str, list)):
        raise WireError(f"{where}: fields.prompt must be a string or a list of messages")
    response = fields.get("response")
    if response is not None and not isinstance(response, str):
        raise WireError(f"{where}: fields.response must be a string")
    metadata = fields.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise WireError(f"{where}: fields.metadata must be a JSON object")
    remove = fields.get("remove_sample")
    if remove is not None and not isinstance(remove, bool):
        raise WireError(f"{where}: fields.remove_sample must be true or false")


def decode_record(buf: bytes | bytearray | memoryview, record: RecordView) -> QueueItem:
    """The `QueueItem` of one scanned record, arrays as Python lists."""
    meta = record.meta
    offset = record.payload_start
    n_tokens, n_log_probs, n_mask = meta["n_tokens"], meta["n_log_probs"], meta["n_loss_mask"]
    tokens = _int_list(np.frombuffer(buf, dtype="<i4", count=n_tokens, offset=offset))
    offset += 4 * n_tokens
    log_probs = np.frombuffer(buf, dtype="<f4", count=n_log_probs, offset=offset).tolist()
    offset += 4 * n_log_probs
    mask = memoryview(buf)[offset : offset + n_mask].cast("B").tolist()
    return QueueItem(
        key=meta["key"],
        group=meta["group"],
        group_size=meta["group_size"],
        producer=meta["producer"],
        step=meta["step"],
        tokens=tokens,
        response_length=meta["response_length"],
        loss_mask=mask,
        rollout_log_probs=log_probs,
        fields=meta["fields"],
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


def decode_frame(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], list[QueueItem]]:
    """The frame header and the items of a frame."""
    frame = scan_frame(buf)
    return frame.header, [decode_record(buf, record) for record in frame.records]


def decode_items(buf: bytes | bytearray | memoryview) -> list[QueueItem]:
    """The items of a frame, arrays as Python lists (token ids int, log-probs float)."""
    return decode_frame(buf)[1]


def as_list(values: Sequence[Any]) -> list[Any]:
    if isinstance(values, list):
        return values
    if isinstance(values, np.ndarray):
        return values.tolist()
    return list(values)


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
