"""The coordinator's durable store: one SQLite file in WAL mode holding queues, leases, acks,
weight versions, heartbeats and end-of-stream marks.

Threads, because SQLite calls block: every write runs on ONE writer thread (SQLite admits one
writer at a time anyway, and a single thread makes each request one serial transaction), reads run
on a small pool of reader threads with their own connections (WAL lets them read while the writer
writes), and a checkpointer thread copies the WAL back into the database file so that large commits
never pay for it. The async methods below hand work to those threads; the event loop never touches
SQLite.

Durability: `synchronous=FULL` (the default) fsyncs the WAL at every commit, so an acknowledged
commit survives a process kill AND a power loss. `synchronous=NORMAL` (option) survives a process
kill as well, because in WAL mode a commit's frames are written to the WAL file (the OS page cache)
before the commit returns and SQLite replays them on the next open; it only risks the last commits
on a power loss or kernel crash.

Layout: `items` holds one small row per item ever committed (its key stays forever, so a re-commit
of an acked key is recognised as a duplicate); `records` holds the item's wire record (a one-row Arrow
record batch message, see `wire`) until the item is acked, when it is deleted; `groups` is the
unit of delivery; `leases` remembers which groups each lease took. Lease expiry is wall-clock
time, so leased-but-unacked groups come back after their expiry across a restart too.

Delivery by step: `watermarks` holds, per consumer, the producer step through which the consumer has
acknowledged everything (`ack_through`: every group of that step or an earlier one is done, leased or
not; an item of such a step committed later is remembered by key and dropped, never delivered). A
group leased `max_deliveries` times without an ack, or rejected by its consumer, is set aside
(`groups.dead`, with its reason): kept in the file with its records, never delivered again, not
counted in the queue's depth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from mrlx_plugin.link.wire import RecordView

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: groups.dead/dead_reason and the watermarks table; 3: records are Arrow messages
# Large pages keep a ~50 KB sample in two overflow pages instead of a dozen (about 2x faster
# inserts and reads than the 4 KB default); small rows only cost a little more WAL per write.
PAGE_SIZE = 32768
# The WAL is copied back into the database file once the writer has been idle this long (between
# training steps), or at once when it outgrows CHECKPOINT_WAL_BYTES; a checkpoint in the middle of a
# step's burst of commits would compete with it for the disk and the CPU.
CHECKPOINT_IDLE_S = 1.0
CHECKPOINT_POLL_S = 0.25
CHECKPOINT_WAL_BYTES = 1 << 30
# After a checkpoint the WAL is rewritten from its start; keeping the file (up to this size) lets
# the next step write into pages the OS already holds instead of growing a new file.
JOURNAL_SIZE_LIMIT = CHECKPOINT_WAL_BYTES

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS run_info (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS items (
    seq INTEGER PRIMARY KEY,
    key TEXT NOT NULL UNIQUE,
    consumer TEXT NOT NULL,
    grp TEXT NOT NULL,
    producer TEXT NOT NULL,
    step INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    created REAL NOT NULL,
    acked REAL
);
CREATE INDEX IF NOT EXISTS items_by_group ON items (consumer, grp, seq);
CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    consumer TEXT NOT NULL,
    grp TEXT NOT NULL,
    producer TEXT NOT NULL,
    step INTEGER NOT NULL,
    group_size INTEGER NOT NULL,
    sealed_size INTEGER,
    n_items INTEGER NOT NULL,
    complete INTEGER NOT NULL,
    first_seq INTEGER NOT NULL,
    created REAL NOT NULL,
    lease_id TEXT,
    lease_expires REAL,
    deliveries INTEGER NOT NULL DEFAULT 0,
    acked REAL,
    dead REAL,
    dead_reason TEXT,
    PRIMARY KEY (consumer, grp)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS groups_open ON groups (consumer, first_seq) WHERE acked IS NULL;
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    consumer TEXT NOT NULL,
    groups TEXT NOT NULL,
    created REAL NOT NULL,
    expires REAL NOT NULL,
    acked REAL
);
CREATE TABLE IF NOT EXISTS versions (agent TEXT PRIMARY KEY, version INTEGER NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS agents (agent TEXT PRIMARY KEY, last_seen REAL NOT NULL, pid INTEGER, host TEXT);
CREATE TABLE IF NOT EXISTS ended (consumer TEXT PRIMARY KEY, ended REAL NOT NULL, by_agent TEXT);
CREATE TABLE IF NOT EXISTS watermarks (
    consumer TEXT PRIMARY KEY,
    step INTEGER NOT NULL,
    updated REAL NOT NULL
);
"""


class StoreError(Exception):
    """Base of the store's errors; `status` is the HTTP status the server answers with."""

    status = 500

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class Rejected(StoreError):
    """The request conflicts with the queue's state (unknown lease, group over its size, ...)."""

    status = 422


class QueueFull(StoreError):
    """Accepting the commit would take the queue past its maximum depth; nothing was written."""

    status = 429


class StorageFailure(StoreError):
    """SQLite could not write (disk full, read-only file, I/O error); nothing was written."""

    status = 503


class StoreOpenError(Exception):
    """The database cannot serve this run (another run's file, a newer schema, unreadable)."""


@dataclass
class CommitOutcome:
    accepted: int
    duplicates: list[str]
    completed_groups: int
    stale: int = 0  # new items of steps the consumer acked through: remembered by key, not queued


@dataclass
class GrantedGroup:
    group: str
    n_items: int
    step: int
    producer: str
    redelivered: bool


@dataclass
class DeadGroup:
    """A group set aside (dead-lettered): never delivered again, kept in the file."""

    group: str
    n_items: int
    step: int
    producer: str
    reason: str


@dataclass
class LeaseGrant:
    """The answer of one lease attempt: groups under a new lease, or none (and maybe end-of-stream)."""

    lease_id: str | None
    groups: list[GrantedGroup]
    end: bool
    next_expiry: float | None  # earliest expiry of another lease of this queue, to wake a waiter
    dead: list[DeadGroup] = field(default_factory=list)  # set aside by this attempt
    step_dead: list[DeadGroup] = field(default_factory=list)  # every group set aside of the step asked for


@dataclass
class AckThroughOutcome:
    through_step: int
    groups: int
    items: int


@dataclass
class AckOutcome:
    groups: int
    items: int
    already_acked: bool


@dataclass
class QueueStats:
    queued_items: int = 0
    leased_items: int = 0
    ready_groups: int = 0
    incomplete_groups: int = 0
    oldest_created: float | None = None
    dead_groups: int = 0
    dead_items: int = 0


@dataclass
class LoadedState:
    """What the server keeps in memory, as found in the file at start."""

    versions: dict[str, tuple[int, float]] = field(default_factory=dict)
    heartbeats: dict[str, tuple[float, int | None, str | None]] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    producers: dict[str, set[str]] = field(default_factory=dict)
    unacked: dict[str, int] = field(default_factory=dict)
    watermarks: dict[str, int] = field(default_factory=dict)


def _storage_failure(exc: sqlite3.Error) -> StorageFailure:
    name = getattr(exc, "sqlite_errorname", "") or ""
    status = 507 if name == "SQLITE_FULL" or "full" in str(exc).lower() else 503
    return StorageFailure(
        f"the coordinator's database could not be written: {exc} ({name or 'sqlite error'}); nothing "
        "of this request was stored; reads still work; free space on (or make writable) the disk of "
        "--db and writes resume without a restart",
        status,
    )


DB_FILE_MODE = 0o600  # queued samples are training data: no other local user reads them


def make_owner_only(path: str) -> None:
    """Create the database file owner-only (0600) if it is missing, and tighten it, its -wal and
    its -shm to 0600 where they exist with group or other bits (logged). SQLite creates a missing
    -wal, -shm or journal with the mode of the database file, so they follow."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, DB_FILE_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StoreOpenError(f"cannot create the coordinator database {path!r}: {exc}") from None
    else:
        try:
            os.fchmod(fd, DB_FILE_MODE)  # whatever the umask
        finally:
            os.close(fd)
    for name in (path, path + "-wal", path + "-shm"):
        try:
            mode = stat.S_IMODE(os.stat(name).st_mode)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise StoreOpenError(f"cannot read the mode of {name!r}: {exc}") from None
        if mode & 0o077:
            try:
                os.chmod(name, DB_FILE_MODE)
            except OSError as exc:
                log.warning(
                    "%s is readable or writable by other users (mode %04o) and could not be made "
                    "owner-only: %s; fix its mode or owner",
                    name,
                    mode,
                    exc,
                )
            else:
                log.warning("%s had mode %04o; made it owner-only (0600)", name, mode)


class CoordinatorStore:
    """The SQLite store; create with `await CoordinatorStore.open(...)`, end with `await close()`."""

    def __init__(
        self, path: str, run_id: str, *, synchronous: str = "full", max_db_mb: float | None = None
    ) -> None:
        if synchronous not in ("full", "normal"):
            raise ValueError(f"synchronous must be 'full' or 'normal', got {synchronous!r}")
        self.path = path
        self.run_id = run_id
        self.synchronous = synchronous
        self.max_db_mb = max_db_mb
        self._writer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mrlx-db-write")
        self._reader_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="mrlx-db-read")
        self._reader_local = threading.local()
        self._reader_conns: list[sqlite3.Connection] = []
        self._reader_lock = threading.Lock()
        self._writer: sqlite3.Connection | None = None
        self._next_seq = 1
        # Owned by the writer thread: unacked items per consumer (depth), ended queues.
        self._unacked: dict[str, int] = {}
        self._ended: set[str] = set()
        self._watermarks: dict[str, int] = {}  # consumer -> step acked through (read by any thread)
        self._checkpoint_wanted = threading.Event()
        self._wal_dirty = False
        self._last_write = time.monotonic()
        self._stopping = threading.Event()
        self._checkpointer: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    async def open(
        cls, path: str, run_id: str, *, synchronous: str = "full", max_db_mb: float | None = None
    ) -> tuple[CoordinatorStore, LoadedState]:
        """Open (or create) the file for `run_id` and load the state the server keeps in memory."""
        store = cls(path, run_id, synchronous=synchronous, max_db_mb=max_db_mb)
        try:
            state = await store._in_writer(store._open_sync)
        except BaseException:
            if store._writer is not None:
                store._writer.close()
                store._writer = None
            store._writer_pool.shutdown(wait=False)
            store._reader_pool.shutdown(wait=False)
            raise
        store._checkpointer = threading.Thread(
            target=store._checkpoint_loop, name="mrlx-db-checkpoint", daemon=True
        )
        store._checkpointer.start()
        return store, state

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30.0)
        conn.execute(f"PRAGMA synchronous={self.synchronous.upper()}")
        conn.execute("PRAGMA busy_timeout=30000")
        return conn

    def _connect_writer(self) -> sqlite3.Connection:
        """The writer connection with its per-connection settings (also used to replace a broken one)."""
        conn = self._connect()
        conn.execute("PRAGMA wal_autocheckpoint=0")  # the checkpointer thread does it
        # Some builds default to secure_delete=ON, which rewrites every freed page of an acked record
        # with zeros (doubling the write volume); FAST zeroes only where it costs no extra I/O.
        conn.execute("PRAGMA secure_delete=FAST")
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
        if self.max_db_mb is not None:
            page_size = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count={max(1, int(self.max_db_mb * (1 << 20) / page_size))}")
        return conn

    def _open_sync(self) -> LoadedState:
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise StoreOpenError(f"the directory of --db {self.path!r} does not exist; create it first")
        make_owner_only(self.path)
        try:
            setup = self._connect()
            setup.execute(f"PRAGMA page_size={PAGE_SIZE}")  # only takes effect on a new file
            mode = setup.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreOpenError(
                    f"{self.path!r}: SQLite refused WAL mode (got {mode!r}); use a local disk"
                )
            setup.executescript(_SCHEMA)
            setup.close()
            conn = self._connect_writer()
        except sqlite3.Error as exc:
            raise StoreOpenError(f"cannot open the coordinator database {self.path!r}: {exc}") from None
        self._writer = conn
        rows = dict(conn.execute("SELECT name, value FROM run_info").fetchall())
        if not rows:
            with self._transaction():
                conn.executemany(
                    "INSERT INTO run_info (name, value) VALUES (?, ?)",
                    [
                        ("run_id", self.run_id),
                        ("schema_version", str(SCHEMA_VERSION)),
                        ("created", repr(time.time())),
                    ],
                )
        else:
            if rows.get("run_id") != self.run_id:
                raise StoreOpenError(
                    f"database {self.path!r} belongs to run {rows.get('run_id')!r}, not {self.run_id!r}; "
                    "give each run its own --db file"
                )
            if int(rows.get("schema_version", "0")) > SCHEMA_VERSION:
                raise StoreOpenError(f"database {self.path!r} has a newer schema; upgrade mrlx_plugin")
        self._migrate(conn, int(rows.get("schema_version", SCHEMA_VERSION)))
        state = LoadedState()
        for agent, version, updated in conn.execute("SELECT agent, version, updated FROM versions"):
            state.versions[agent] = (version, updated)
        for agent, last_seen, pid, host in conn.execute("SELECT agent, last_seen, pid, host FROM agents"):
            state.heartbeats[agent] = (last_seen, pid, host)
        state.ended = {row[0] for row in conn.execute("SELECT consumer FROM ended")}
        for consumer, producer in conn.execute("SELECT DISTINCT consumer, producer FROM groups"):
            state.producers.setdefault(consumer, set()).add(producer)
        for consumer, count in conn.execute(
            "SELECT consumer, SUM(n_items) FROM groups WHERE acked IS NULL AND dead IS NULL GROUP BY consumer"
        ):
            state.unacked[consumer] = int(count or 0)
        state.watermarks = {c: int(s) for c, s in conn.execute("SELECT consumer, step FROM watermarks")}
        self._unacked = dict(state.unacked)
        self._ended = set(state.ended)
        self._watermarks = dict(state.watermarks)
        self._next_seq = (conn.execute("SELECT MAX(seq) FROM items").fetchone()[0] or 0) + 1
        return state

    def _migrate(self, conn: sqlite3.Connection, version: int) -> None:
        """Bring a file of an older schema up to this one (columns added; nothing is rewritten).

        Files before schema 3 store records in the earlier binary frame format, which this version
        cannot send; such a file is taken over only when no record is still to be delivered."""
        if version < 3:
            has_dead = any(row[1] == "dead" for row in conn.execute("PRAGMA table_info(groups)"))
            waiting = conn.execute(
                "SELECT COUNT(*) FROM groups WHERE acked IS NULL" + (" AND dead IS NULL" if has_dead else "")
            ).fetchone()[0]
            if waiting:
                raise StoreOpenError(
                    f"database {self.path!r} holds {waiting} undelivered groups stored in the wire format of "
                    f"an older mrlx_plugin (schema {version}); let that version's consumers drain them, or "
                    "start this run on a fresh --db file"
                )
        try:
            columns = {row[1] for row in conn.execute("PRAGMA table_info(groups)")}
            indexed = conn.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'groups_dead'"
            ).fetchone()
            if "dead" in columns and indexed and version >= SCHEMA_VERSION:
                return
            with self._transaction():
                if "dead" not in columns:
                    conn.execute("ALTER TABLE groups ADD COLUMN dead REAL")
                    conn.execute("ALTER TABLE groups ADD COLUMN dead_reason TEXT")
                conn.execute(
                    "CREATE INDEX IF NOT EXISTS groups_dead ON groups (consumer, first_seq) WHERE dead IS "
                    "NOT NULL"
                )
                if version < SCHEMA_VERSION:
                    conn.execute(
                        "UPDATE run_info SET value = ? WHERE name = 'schema_version'", (str(SCHEMA_VERSION),)
                    )
        except (sqlite3.Error, StoreError) as exc:
            raise StoreOpenError(
                f"cannot bring the coordinator database {self.path!r} to schema {SCHEMA_VERSION}: {exc}"
            ) from None

    def watermark(self, consumer: str) -> int | None:
        """The step `consumer` has acknowledged everything through (None: none yet)."""
        return self._watermarks.get(consumer)

    async def close(self) -> None:
        """Checkpoint, close every connection and stop the threads."""
        self._stopping.set()
        self._checkpoint_wanted.set()
        if self._checkpointer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._checkpointer.join, 10.0)
        try:
            await self._in_writer(self._close_writer_sync)
        finally:
            self._writer_pool.shutdown(wait=True)
            self._reader_pool.shutdown(wait=True)
            with self._reader_lock:
                for conn in self._reader_conns:
                    conn.close()
                self._reader_conns.clear()

    def _close_writer_sync(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("final checkpoint of %s failed: %s", self.path, exc)
        self._writer.close()
        self._writer = None

    def _checkpoint_loop(self) -> None:
        """Copy the WAL into the database file when the writer is idle (or the WAL is too big)."""
        conn = self._connect()
        try:
            while not self._stopping.is_set():
                urgent = self._checkpoint_wanted.wait(timeout=CHECKPOINT_POLL_S)
                self._checkpoint_wanted.clear()
                if self._stopping.is_set():
                    break
                if not self._wal_dirty:
                    continue
                if not urgent and time.monotonic() - self._last_write < CHECKPOINT_IDLE_S:
                    continue
                self._wal_dirty = False
                try:
                    busy, wal_frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    if busy or copied < wal_frames:
                        self._wal_dirty = True  # readers held old pages; try again later
                except sqlite3.Error as exc:
                    self._wal_dirty = True
                    log.warning("checkpoint of %s failed: %s", self.path, exc)
        finally:
            conn.close()

    # ----------------------------------------------------------------- thread plumbing

    async def _in_writer(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer_pool, fn, *args)

    async def _in_reader(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._reader_pool, fn, *args)

    def _reader(self) -> sqlite3.Connection:
        conn = getattr(self._reader_local, "conn", None)
        if conn is None:
            conn = self._connect()
            conn.execute("PRAGMA query_only=1")
            self._reader_local.conn = conn
            with self._reader_lock:
                self._reader_conns.append(conn)
        return conn

    def _transaction(self) -> _WriteTransaction:
        assert self._writer is not None, "store is closed"
        return _WriteTransaction(self)

    def _after_write(self) -> None:
        self._last_write = time.monotonic()
        self._wal_dirty = True
        try:
            if os.path.getsize(self.path + "-wal") > CHECKPOINT_WAL_BYTES:
                self._checkpoint_wanted.set()
        except OSError:
            pass

    # ----------------------------------------------------------------- queues

    async def commit(
        self, consumer: str, records: Sequence[RecordView], now: float, max_depth: int
    ) -> CommitOutcome:
        """Store validated records for `consumer`, all or nothing (see `_commit_sync`)."""
        return await self._in_writer(self._commit_sync, consumer, records, now, max_depth)

    def _commit_sync(
        self, consumer: str, records: Sequence[RecordView], now: float, max_depth: int
    ) -> CommitOutcome:
        conn = self._writer
        assert conn is not None
        seq_before = self._next_seq
        try:
            with self._transaction():
                duplicates: list[str] = []
                fresh: list[RecordView] = []
                seen: set[str] = set()
                for record in records:
                    key = record.meta["key"]
                    if key in seen:
                        duplicates.append(key)
                        continue
                    seen.add(key)
                    row = conn.execute("SELECT consumer FROM items WHERE key = ?", (key,)).fetchone()
                    if row is None:
                        fresh.append(record)
                    elif row[0] == consumer:
                        duplicates.append(key)
                    else:
                        raise Rejected(
                            f"item {key!r}: this key was already committed to the queue of {row[0]!r}; "
                            "keys are unique per run (episode id + agent)",
                            409,
                        )
                mark = self._watermarks.get(consumer)
                stale = [] if mark is None else [r for r in fresh if r.meta["step"] <= mark]
                if stale:
                    # The consumer acknowledged these steps through (trained and saved them); it never
                    # asks for them again. Kept by key (a re-commit is a duplicate), never queued.
                    fresh = [r for r in fresh if r.meta["step"] > mark]
                    self._insert_stale(conn, consumer, stale, now)
                if not fresh:
                    if stale:
                        self._after_write()
                    return CommitOutcome(0, duplicates, 0, len(stale))
                if consumer in self._ended:
                    raise Rejected(
                        f"the queue of {consumer!r} was ended by its producer; no new items are accepted "
                        f"(first new item {fresh[0].meta['key']!r})",
                        409,
                    )
                depth = self._unacked.get(consumer, 0)
                if len(fresh) > max_depth:
                    raise Rejected(
                        f"this request holds {len(fresh)} new items but the queue of {consumer!r} holds at "
                        "most "
                        f"{max_depth}; commit in smaller batches (or start the coordinator with a larger "
                        "--max-depth)",
                        413,
                    )
                if depth + len(fresh) > max_depth:
                    raise QueueFull(
                        f"the queue of {consumer!r} holds {depth} unacked items; {len(fresh)} more would "
                        "pass "
                        f"its maximum depth {max_depth}; retry after the consumer acks"
                    )
                by_group: dict[str, list[RecordView]] = {}
                for record in fresh:
                    by_group.setdefault(record.meta["group"], []).append(record)
                group_rows: list[tuple[Any, ...]] = []
                completed = 0
                item_rows = []
                record_rows = []
                seq = self._next_seq
                for group, members in by_group.items():
                    first = members[0].meta
                    size = first["group_size"]
                    for record in members[1:]:
                        if record.meta["group_size"] != size:
                            raise Rejected(
                                f"item {record.meta['key']!r}: group {group!r} announced group_size {size} "
                                f"in this request and {record.meta['group_size']} here"
                            )
                    existing = conn.execute(
                        "SELECT group_size, sealed_size, n_items, acked FROM groups WHERE consumer = ? AND "
                        "grp = ?",
                        (consumer, group),
                    ).fetchone()
                    if existing is None:
                        limit, had, sealed = size, 0, None
                    else:
                        announced, sealed, had, _acked = existing
                        if announced != size:
                            raise Rejected(
                                f"item {first['key']!r}: group {group!r} was announced with group_size "
                                f"{announced}, "
                                f"this item says {size}"
                            )
                        limit = sealed if sealed is not None else announced
                    if had + len(members) > limit:
                        what = f"sealed at {sealed}" if sealed is not None else f"of size {limit}"
                        raise Rejected(
                            f"item {members[0].meta['key']!r}: group {group!r} ({what}) already holds {had} "
                            "items; "
                            f"{len(members)} more would exceed it"
                        )
                    first_seq = seq
                    for record in members:
                        meta = record.meta
                        item_rows.append(
                            (
                                seq,
                                meta["key"],
                                consumer,
                                group,
                                meta["producer"],
                                meta["step"],
                                meta["n_tokens"],
                                now,
                            )
                        )
                        record_rows.append((seq, record.record()))
                        seq += 1
                    n_items = had + len(members)
                    complete = int(n_items >= limit)
                    completed += complete
                    if existing is None:
                        group_rows.append(
                            (
                                "insert",
                                consumer,
                                group,
                                first["producer"],
                                first["step"],
                                size,
                                n_items,
                                complete,
                                first_seq,
                                now,
                            )
                        )
                    else:
                        group_rows.append(("update", n_items, complete, consumer, group))
                conn.executemany(
                    "INSERT INTO items (seq, key, consumer, grp, producer, step, n_tokens, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    item_rows,
                )
                conn.executemany("INSERT INTO records (seq, record) VALUES (?, ?)", record_rows)
                conn.executemany(
                    "INSERT INTO groups (consumer, grp, producer, step, group_size, n_items, complete, "
                    "first_seq, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [row[1:] for row in group_rows if row[0] == "insert"],
                )
                conn.executemany(
                    "UPDATE groups SET n_items = ?, complete = ? WHERE consumer = ? AND grp = ?",
                    [row[1:] for row in group_rows if row[0] == "update"],
                )
                self._next_seq = seq
        except BaseException:
            self._next_seq = seq_before
            raise
        self._unacked[consumer] = self._unacked.get(consumer, 0) + len(fresh)
        self._after_write()
        return CommitOutcome(len(fresh), duplicates, completed, len(stale))

    def _insert_stale(
        self, conn: sqlite3.Connection, consumer: str, stale: Sequence[RecordView], now: float
    ) -> None:
        """Remember the keys of items of already-acknowledged steps, as acked items with no record."""
        seq = self._next_seq
        rows = []
        for record in stale:
            meta = record.meta
            rows.append(
                (
                    seq,
                    meta["key"],
                    consumer,
                    meta["group"],
                    meta["producer"],
                    meta["step"],
                    meta["n_tokens"],
                    now,
                    now,
                )
            )
            seq += 1
        conn.executemany(
            "INSERT INTO items (seq, key, consumer, grp, producer, step, n_tokens, created, acked) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        self._next_seq = seq

    async def seal(self, consumer: str, group: str, size: int) -> bool:
        """Fix the final size of a group that came up short; True when the group is now complete."""
        return await self._in_writer(self._seal_sync, consumer, group, size)

    def _seal_sync(self, consumer: str, group: str, size: int) -> bool:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            row = conn.execute(
                "SELECT group_size, sealed_size, n_items, complete, acked FROM groups WHERE consumer = ? AND "
                "grp = ?",
                (consumer, group),
            ).fetchone()
            if row is None:
                raise Rejected(
                    f"group {group!r} has no items in the queue of {consumer!r}; seal a group after "
                    "committing its items",
                    404,
                )
            announced, sealed, n_items, complete, acked = row
            limit = sealed if sealed is not None else announced
            if size == limit:
                return bool(complete)
            if complete or acked is not None:
                raise Rejected(
                    f"group {group!r} is already complete with {limit} items; it cannot be sealed at {size}",
                    409,
                )
            if size > announced:
                raise Rejected(
                    f"group {group!r} was announced with {announced} items; it cannot be sealed at {size}"
                )
            if size < n_items:
                raise Rejected(
                    f"group {group!r} already holds {n_items} items; it cannot be sealed at {size}"
                )
            now_complete = int(n_items >= size)
            conn.execute(
                "UPDATE groups SET sealed_size = ?, complete = ? WHERE consumer = ? AND grp = ?",
                (size, now_complete, consumer, group),
            )
        self._after_write()
        return bool(now_complete)

    async def end(self, consumer: str, by_agent: str | None, now: float) -> int:
        """Mark the queue ended; every incomplete group is sealed at the items it has (returns how many)."""
        return await self._in_writer(self._end_sync, consumer, by_agent, now)

    def _end_sync(self, consumer: str, by_agent: str | None, now: float) -> int:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            conn.execute(
                "INSERT OR IGNORE INTO ended (consumer, ended, by_agent) VALUES (?, ?, ?)",
                (consumer, now, by_agent),
            )
            sealed = conn.execute(
                "UPDATE groups SET sealed_size = n_items, complete = 1 "
                "WHERE consumer = ? AND complete = 0 AND acked IS NULL AND dead IS NULL",
                (consumer,),
            ).rowcount
        self._ended.add(consumer)
        self._after_write()
        return sealed

    async def lease(
        self,
        consumer: str,
        max_groups: int,
        lease_s: float,
        step: int | None,
        now: float,
        max_deliveries: int | None = None,
    ) -> LeaseGrant:
        """Lease up to `max_groups` complete groups, oldest first, until `now + lease_s`; a group
        already delivered `max_deliveries` times (and never acked) is set aside instead."""
        return await self._in_writer(
            self._lease_sync, consumer, max_groups, lease_s, step, now, max_deliveries
        )

    def _lease_sync(
        self,
        consumer: str,
        max_groups: int,
        lease_s: float,
        step: int | None,
        now: float,
        max_deliveries: int | None = None,
    ) -> LeaseGrant:
        conn = self._writer
        assert conn is not None
        query = (
            "SELECT grp, n_items, step, producer, deliveries FROM groups "
            "WHERE consumer = ? AND acked IS NULL AND dead IS NULL AND complete = 1 "
            "AND (lease_expires IS NULL OR lease_expires <= ?)"
        )
        params: list[Any] = [consumer, now]
        if step is not None:
            query += " AND step = ?"
            params.append(step)
        query += " ORDER BY first_seq LIMIT ?"
        params.append(max_groups)
        dead: list[DeadGroup] = []
        with self._transaction():
            rows = conn.execute(query, params).fetchall()
            if max_deliveries is not None:
                for row in rows:
                    if row[4] >= max_deliveries:
                        dead.append(
                            DeadGroup(
                                row[0],
                                row[1],
                                row[2],
                                row[3],
                                (
                                    f"delivered {row[4]} times and never acknowledged (its consumer failed "
                                    "or died "
                                    f"on it each time; --max-deliveries {max_deliveries})"
                                ),
                            )
                        )
                rows = [row for row in rows if row[4] < max_deliveries]
                conn.executemany(
                    "UPDATE groups SET dead = ?, dead_reason = ?, lease_expires = NULL WHERE consumer = ? "
                    "AND grp = ?",
                    [(now, d.reason, consumer, d.group) for d in dead],
                )
            lease_id = None
            if rows:
                lease_id = secrets.token_hex(12)
                expires = now + lease_s
                conn.executemany(
                    "UPDATE groups SET lease_id = ?, lease_expires = ?, deliveries = deliveries + 1 "
                    "WHERE consumer = ? AND grp = ?",
                    [(lease_id, expires, consumer, row[0]) for row in rows],
                )
                conn.execute(
                    "INSERT INTO leases (lease_id, consumer, groups, created, expires) VALUES (?, ?, ?, ?, "
                    "?)",
                    (lease_id, consumer, orjson.dumps([row[0] for row in rows]).decode(), now, expires),
                )
        if dead:
            self._unacked[consumer] = self._unacked.get(consumer, 0) - sum(d.n_items for d in dead)
        if rows or dead:
            self._after_write()
        end = False
        if not rows and consumer in self._ended:
            end = (
                conn.execute(
                    "SELECT 1 FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL LIMIT 1",
                    (consumer,),
                ).fetchone()
                is None
            )
        next_expiry = conn.execute(
            "SELECT MIN(lease_expires) FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL "
            "AND lease_expires > ?",
            (consumer, now),
        ).fetchone()[0]
        step_dead = []
        if step is not None:
            step_dead = [
                DeadGroup(*row)
                for row in conn.execute(
                    "SELECT grp, n_items, step, producer, dead_reason FROM groups "
                    "WHERE consumer = ? AND dead IS NOT NULL AND step = ? ORDER BY first_seq",
                    (consumer, step),
                )
            ]
        groups = [GrantedGroup(row[0], row[1], row[2], row[3], row[4] > 0) for row in rows]
        return LeaseGrant(lease_id, groups, end, next_expiry, dead, step_dead)

    async def release(self, consumer: str, now: float) -> int:
        """Hand back every lease of `consumer` now (its new process takes over a dead one's leases:
        their groups are leasable at once, as after an expiry). Returns how many groups."""
        return await self._in_writer(self._release_sync, consumer, now)

    def _release_sync(self, consumer: str, now: float) -> int:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            released = conn.execute(
                "UPDATE groups SET lease_expires = ? WHERE consumer = ? AND acked IS NULL AND dead IS NULL "
                "AND lease_expires > ?",
                (now, consumer, now),
            ).rowcount
            conn.execute(
                "UPDATE leases SET expires = ? WHERE consumer = ? AND acked IS NULL AND expires > ?",
                (now, consumer, now),
            )
        if released:
            self._after_write()
        return released

    async def reject(self, consumer: str, group: str, reason: str, now: float) -> tuple[DeadGroup, bool]:
        """Set a group aside now (its consumer cannot train it): (the group, whether it was already)."""
        return await self._in_writer(self._reject_sync, consumer, group, reason, now)

    def _reject_sync(self, consumer: str, group: str, reason: str, now: float) -> tuple[DeadGroup, bool]:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            row = conn.execute(
                "SELECT n_items, step, producer, acked, dead, dead_reason FROM groups WHERE consumer = ? AND "
                "grp = ?",
                (consumer, group),
            ).fetchone()
            if row is None:
                raise Rejected(f"group {group!r} has no items in the queue of {consumer!r}", 404)
            n_items, step, producer, acked, dead, old_reason = row
            if dead is not None:
                return DeadGroup(group, n_items, step, producer, old_reason), True
            if acked is not None:
                raise Rejected(
                    f"group {group!r} was acknowledged already; there is nothing left to set aside", 409
                )
            conn.execute(
                "UPDATE groups SET dead = ?, dead_reason = ?, lease_expires = NULL WHERE consumer = ? AND "
                "grp = ?",
                (now, reason, consumer, group),
            )
        self._unacked[consumer] = self._unacked.get(consumer, 0) - n_items
        self._after_write()
        return DeadGroup(group, n_items, step, producer, reason), False

    async def ack_through(self, consumer: str, step: int, now: float) -> AckThroughOutcome:
        """Mark every group of `consumer` of producer step <= `step` done for good (leased or not)
        and remember the step: idempotent, and a lower step than the one remembered changes nothing."""
        return await self._in_writer(self._ack_through_sync, consumer, step, now)

    def _ack_through_sync(self, consumer: str, step: int, now: float) -> AckThroughOutcome:
        conn = self._writer
        assert conn is not None
        mark = self._watermarks.get(consumer)
        if mark is not None and step <= mark:
            return AckThroughOutcome(mark, 0, 0)
        with self._transaction():
            rows = conn.execute(
                "SELECT grp, n_items FROM groups WHERE consumer = ? AND acked IS NULL AND dead IS NULL AND "
                "step <= ?",
                (consumer, step),
            ).fetchall()
            conn.executemany(
                "UPDATE groups SET acked = ? WHERE consumer = ? AND grp = ?",
                [(now, consumer, g) for g, _ in rows],
            )
            conn.executemany(
                "DELETE FROM records WHERE seq IN (SELECT seq FROM items WHERE consumer = ? AND grp = ?)",
                [(consumer, g) for g, _ in rows],
            )
            conn.executemany(
                "UPDATE items SET acked = ? WHERE consumer = ? AND grp = ? AND acked IS NULL",
                [(now, consumer, g) for g, _ in rows],
            )
            conn.execute(
                "INSERT INTO watermarks (consumer, step, updated) VALUES (?, ?, ?) ON CONFLICT (consumer) "
                "DO UPDATE SET step = excluded.step, updated = excluded.updated WHERE excluded.step > "
                "watermarks.step",
                (consumer, step, now),
            )
        n_items = sum(n for _, n in rows)
        self._watermarks[consumer] = step
        self._unacked[consumer] = self._unacked.get(consumer, 0) - n_items
        self._after_write()
        return AckThroughOutcome(step, len(rows), n_items)

    async def read_groups(self, consumer: str, groups: Sequence[str]) -> list[list[bytes]]:
        """The stored wire records of each group, in commit order (on a reader thread)."""
        return await self._in_reader(self._read_groups_sync, consumer, groups)

    def _read_groups_sync(self, consumer: str, groups: Sequence[str]) -> list[list[bytes]]:
        conn = self._reader()
        out = []
        conn.execute("BEGIN")  # one snapshot for all groups
        try:
            for group in groups:
                rows = conn.execute(
                    "SELECT r.record FROM items i JOIN records r ON r.seq = i.seq "
                    "WHERE i.consumer = ? AND i.grp = ? ORDER BY i.seq",
                    (consumer, group),
                ).fetchall()
                out.append([row[0] for row in rows])
        finally:
            conn.execute("COMMIT")
        return out

    async def ack(self, consumer: str, lease_id: str, now: float) -> AckOutcome:
        """Mark every group of a lease done for good and drop their records."""
        return await self._in_writer(self._ack_sync, consumer, lease_id, now)

    def _ack_sync(self, consumer: str, lease_id: str, now: float) -> AckOutcome:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            groups, expires, acked = _lease_of(conn, consumer, lease_id)
            if acked is not None:
                return AckOutcome(0, 0, True)
            owned = []
            lost = 0
            for group in groups:
                state = conn.execute(
                    "SELECT n_items, lease_id, acked, dead FROM groups WHERE consumer = ? AND grp = ?",
                    (consumer, group),
                ).fetchone()
                if state is None or (state[1] != lease_id and state[2] is None and state[3] is None):
                    lost += 1  # open under another lease
                elif state[2] is None and state[3] is None:
                    owned.append((group, state[0]))
                # else: done already (acked through its step) or set aside: nothing left to do
            if lost:
                raise Rejected(
                    f"lease {lease_id!r} expired {now - expires:.1f} s ago and {lost} of its "
                    f"{len(groups)} groups were delivered again under another lease; nothing was acked "
                    "(ack the newer lease instead, or lease with a longer lease_s)",
                    409,
                )
            conn.executemany(
                "UPDATE groups SET acked = ? WHERE consumer = ? AND grp = ?",
                [(now, consumer, g) for g, _ in owned],
            )
            conn.executemany(
                "DELETE FROM records WHERE seq IN (SELECT seq FROM items WHERE consumer = ? AND grp = ?)",
                [(consumer, g) for g, _ in owned],
            )
            conn.executemany(
                "UPDATE items SET acked = ? WHERE consumer = ? AND grp = ?",
                [(now, consumer, g) for g, _ in owned],
            )
            conn.execute("UPDATE leases SET acked = ? WHERE lease_id = ?", (now, lease_id))
        n_items = sum(n for _, n in owned)
        self._unacked[consumer] = self._unacked.get(consumer, 0) - n_items
        self._after_write()
        return AckOutcome(len(owned), n_items, not owned)

    async def extend(self, consumer: str, lease_id: str, lease_s: float, now: float) -> tuple[int, float]:
        """Keep a lease's groups until `now + lease_s` (a trainer still working on them); returns
        (groups, new expiry). Refused (409) once its groups went to another lease or were acked."""
        return await self._in_writer(self._extend_sync, consumer, lease_id, lease_s, now)

    def _extend_sync(self, consumer: str, lease_id: str, lease_s: float, now: float) -> tuple[int, float]:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            groups, expires, acked = _lease_of(conn, consumer, lease_id)
            if acked is not None:
                raise Rejected(f"lease {lease_id!r} was acked already; there is nothing left to keep", 409)
            new_expiry = now + lease_s
            held = conn.execute(
                "UPDATE groups SET lease_expires = ? WHERE consumer = ? AND lease_id = ? AND acked IS NULL "
                "AND dead IS NULL",
                (new_expiry, consumer, lease_id),
            ).rowcount
            held += conn.execute(  # done through its step, or set aside: nothing to keep, nothing lost
                "SELECT COUNT(*) FROM groups WHERE consumer = ? AND lease_id = ? "
                "AND (acked IS NOT NULL OR dead IS NOT NULL)",
                (consumer, lease_id),
            ).fetchone()[0]
            if held != len(groups):
                raise Rejected(
                    f"lease {lease_id!r} expired {now - expires:.1f} s ago and {len(groups) - held} of its "
                    f"{len(groups)} groups were delivered again under another lease; it cannot be extended",
                    409,
                )
            conn.execute("UPDATE leases SET expires = ? WHERE lease_id = ?", (new_expiry, lease_id))
        self._after_write()
        return len(groups), new_expiry

    async def queue_stats(self, now: float) -> dict[str, QueueStats]:
        """Depth and age per consumer queue (on a reader thread)."""
        return await self._in_reader(self._queue_stats_sync, now)

    def _queue_stats_sync(self, now: float) -> dict[str, QueueStats]:
        conn = self._reader()
        stats: dict[str, QueueStats] = {}
        for consumer, leased, queued, ready, incomplete, oldest in conn.execute(
            "SELECT consumer, "
            "SUM(CASE WHEN lease_expires > :now THEN n_items ELSE 0 END), "
            "SUM(CASE WHEN lease_expires > :now THEN 0 ELSE n_items END), "
            "SUM(CASE WHEN complete = 1 AND (lease_expires IS NULL OR lease_expires <= :now) THEN 1 ELSE 0 "
            "END), "
            "SUM(CASE WHEN complete = 0 THEN 1 ELSE 0 END), "
            "MIN(created) "
            "FROM groups WHERE acked IS NULL AND dead IS NULL GROUP BY consumer",
            {"now": now},
        ):
            stats[consumer] = QueueStats(
                int(queued or 0), int(leased or 0), int(ready or 0), int(incomplete or 0), oldest
            )
        for consumer, groups, items in conn.execute(
            "SELECT consumer, COUNT(*), SUM(n_items) FROM groups WHERE dead IS NOT NULL GROUP BY consumer"
        ):
            entry = stats.setdefault(consumer, QueueStats())
            entry.dead_groups, entry.dead_items = int(groups), int(items or 0)
        return stats

    # ----------------------------------------------------------------- agents

    async def save_version(self, agent: str, version: int, now: float) -> None:
        """Persist an agent's weight version (a lower one than stored is ignored)."""
        await self._in_writer(self._save_version_sync, agent, version, now)

    def _save_version_sync(self, agent: str, version: int, now: float) -> None:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            conn.execute(
                "INSERT INTO versions (agent, version, updated) VALUES (?, ?, ?) "
                "ON CONFLICT (agent) DO UPDATE SET version = excluded.version, updated = excluded.updated "
                "WHERE excluded.version > versions.version",
                (agent, version, now),
            )
        self._after_write()

    async def save_heartbeats(self, beats: dict[str, tuple[float, int | None, str | None]]) -> None:
        """Persist the last-seen time and identity of agents."""
        await self._in_writer(self._save_heartbeats_sync, beats)

    def _save_heartbeats_sync(self, beats: dict[str, tuple[float, int | None, str | None]]) -> None:
        conn = self._writer
        assert conn is not None
        with self._transaction():
            conn.executemany(
                "INSERT INTO agents (agent, last_seen, pid, host) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (agent) DO UPDATE SET last_seen = excluded.last_seen, pid = excluded.pid, host "
                "= excluded.host",
                [(agent, seen, pid, host) for agent, (seen, pid, host) in beats.items()],
            )
        self._after_write()


def _lease_of(
    conn: sqlite3.Connection, consumer: str, lease_id: str
) -> tuple[list[str], float, float | None]:
    """(groups, expiry, acked time) of a lease of `consumer`'s queue; 404 for any other id."""
    row = conn.execute(
        "SELECT consumer, groups, expires, acked FROM leases WHERE lease_id = ?", (lease_id,)
    ).fetchone()
    if row is None or row[0] != consumer:
        raise Rejected(f"unknown lease {lease_id!r} for the queue of {consumer!r}", 404)
    return orjson.loads(row[1]), row[2], row[3]


class _WriteTransaction:
    """BEGIN IMMEDIATE ... COMMIT on the writer connection; any error rolls back and SQLite errors
    become `StorageFailure`, so a failed write (disk full, read-only file) leaves nothing behind and
    the next write starts clean."""

    def __init__(self, store: CoordinatorStore) -> None:
        self.store = store

    def __enter__(self) -> None:
        conn = self.store._writer
        assert conn is not None
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise _storage_failure(exc) from None

    def __exit__(self, exc_type: object, exc: object, tb: object) -> bool:
        conn = self.store._writer
        assert conn is not None
        if exc_type is None:
            try:
                conn.execute("COMMIT")
                return False
            except sqlite3.Error as commit_exc:
                self._rollback(conn)
                raise _storage_failure(commit_exc) from None
        self._rollback(conn)
        if isinstance(exc, sqlite3.Error):
            raise _storage_failure(exc) from None
        return False

    def _rollback(self, conn: sqlite3.Connection) -> None:
        if not conn.in_transaction:
            return
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            # A connection that cannot even roll back is replaced, so the next write starts clean.
            log.warning("rollback on %s failed (%s); reopening the writer connection", self.store.path, exc)
            try:
                conn.close()
            finally:
                self.store._writer = self.store._connect_writer()
