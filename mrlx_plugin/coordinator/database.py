"""The SQLite file under the coordinator's store: its schema and migrations, the file made
owner-only and opened in WAL mode, the threads that use it, and the write transaction whose
failure leaves nothing behind.

Threads, because SQLite calls block: every write runs on ONE writer thread (SQLite admits one
writer at a time anyway, and a single thread makes each request one serial transaction), reads run
on a small pool of reader threads with their own connections (WAL lets them read while the writer
writes), and a checkpointer thread copies the WAL back into the database file so that large commits
never pay for it. The store's async methods hand work to those threads; the event loop never
touches SQLite.

Durability: `synchronous=FULL` (the default) fsyncs the WAL at every commit, so an acknowledged
commit survives a process kill AND a power loss. `synchronous=NORMAL` (option) survives a process
kill as well, because in WAL mode a commit's frames are written to the WAL file (the OS page cache)
before the commit returns and SQLite replays them on the next open; it only risks the last commits
on a power loss or kernel crash.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

log = logging.getLogger("mrlx_plugin.coordinator.storage")  # one log for the whole store

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


class Database:
    """The file, its connections and its threads (`CoordinatorStore` keeps the queues in it):
    opened by `_open_file_sync` on the writer thread, ended by `await close()`."""

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
        self._checkpoint_wanted = threading.Event()
        self._wal_dirty = False
        self._last_write = time.monotonic()
        self._stopping = threading.Event()
        self._checkpointer: threading.Thread | None = None

    # ----------------------------------------------------------------- lifecycle

    async def _start(self, load: Callable[[], T]) -> T:
        """Open the file (`_open_file_sync`) and run `load` on the writer thread, then start the
        checkpointer; on failure, every connection and thread is let go."""
        try:
            loaded = await self._in_writer(self._open_then, load)
        except BaseException:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self._writer_pool.shutdown(wait=False)
            self._reader_pool.shutdown(wait=False)
            raise
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="mrlx-db-checkpoint", daemon=True
        )
        self._checkpointer.start()
        return loaded

    def _open_then(self, load: Callable[[], T]) -> T:
        self._open_file_sync()
        return load()

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

    def _open_file_sync(self) -> None:
        """Create or open the file of this run (owner-only, WAL, the schema), check that it is this
        run's, and bring it to this schema; the writer connection stays open."""
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

    async def _in_writer(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._writer_pool, fn, *args)

    async def _in_reader(self, fn: Callable[..., T], *args: object) -> T:
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

    def _writing(self) -> sqlite3.Connection:
        """The writer connection (on the writer thread, the store open)."""
        conn = self._writer
        assert conn is not None
        return conn


class _WriteTransaction:
    """BEGIN IMMEDIATE ... COMMIT on the writer connection; any error rolls back and SQLite errors
    become `StorageFailure`, so a failed write (disk full, read-only file) leaves nothing behind and
    the next write starts clean."""

    def __init__(self, store: Database) -> None:
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
